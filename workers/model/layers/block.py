"""One pre-norm residual block: `x + residual_multiplier · mixer(norm(x))` — or, built with `post_norm`,
`x + residual_multiplier · post_norm(mixer(x))` (OLMo 2/3 attention layers; `norm` then passes x through).

The mixer is Mamba2, Gated DeltaNet, attention, a dense MLP or a MoE. The model's blocks and an MTP head's layers are
built from it, so both read the same checkpoint layouts into the same modules.
"""

from __future__ import annotations

from torch import nn

from workers.model.checkpoint.config import (
    ATTENTION,
    GDN,
    KDA,
    MAMBA,
    MAMBA1,
    MLP,
    PARALLEL,
    SHARED_ATTENTION,
    SHORT_CONV,
    AttentionConfig,
    HybridConfig,
)
from workers.model.distributed.layout import SINGLE_TP, TensorParallel
from workers.model.layers.attention import Attention
from workers.model.layers.feed_forward import MLP as DenseMLP
from workers.model.layers.gdn import GatedDeltaNetMixer
from workers.model.layers.kda import KimiDeltaAttentionMixer
from workers.model.layers.mamba1 import Mamba1Mixer
from workers.model.layers.mamba2 import Mamba2Mixer
from workers.model.layers.mla import MultiHeadLatentAttention
from workers.model.layers.moe import MoE
from workers.model.layers.norm import PassThroughNorm, RMSNorm
from workers.model.layers.parallel import ParallelMixer
from workers.model.layers.shared_block import SharedBlockUse
from workers.model.layers.short_conv import ShortConvMixer


class Block(nn.Module):
    """x + residual_multiplier · mixer(norm(x)), the mixer being Mamba2, Gated DeltaNet, attention, an MLP or a MoE."""

    def __init__(
        self,
        config: HybridConfig,
        kind: str,
        post_norm: bool = False,
        attention: AttentionConfig | None = None,
        tp: TensorParallel = SINGLE_TP,
    ):
        """`post_norm`: the norm follows the mixer instead of preceding it (OLMo). `attention`: this block's attention
        config where it differs from the model's (LFM3's layer types). `config` is the rank's local config and `tp`
        its place in the tensor-parallel group: the mixer returns a partial sum that the model all-reduces."""
        super().__init__()
        self.kind = kind
        self.norm: nn.Module = PassThroughNorm() if post_norm else RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Sandwich norms (LFM3): the mixer's output is normed too, after the pre-norm and mixer.
        with_post_norm = post_norm or config.sandwich_norms
        self.post_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if with_post_norm else None
        ff = config.feed_forward
        if kind == MAMBA:
            self.mixer: nn.Module = Mamba2Mixer(config, tp=tp)
        elif kind == GDN:
            self.mixer = GatedDeltaNetMixer(config, tp=tp)
        elif kind == MAMBA1:
            self.mixer = Mamba1Mixer(config, tp=tp)
        elif kind == KDA:
            self.mixer = KimiDeltaAttentionMixer(config, tp=tp)
        elif kind == ATTENTION and config.mla is not None:
            self.mixer = MultiHeadLatentAttention(config, tp=tp)
        elif kind == ATTENTION:
            self.mixer = Attention(config, attention, tp=tp)
        elif kind == SHORT_CONV:
            self.mixer = ShortConvMixer(config, tp=tp)
        elif kind == PARALLEL:
            self.mixer = ParallelMixer(config, tp=tp)
        elif kind == MLP:
            self.mixer = DenseMLP(config.hidden_size, ff.intermediate_size, ff.gated, ff.bias, tp=tp)
        elif kind == SHARED_ATTENTION:  # a use of a Zamba2 shared block; it normalises its own input
            self.norm = PassThroughNorm()
            self.mixer = SharedBlockUse(config, tp=tp)
        else:
            self.mixer = MoE(config, tp=tp)
