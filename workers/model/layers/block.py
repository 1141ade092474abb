"""One pre-norm residual block: `x + residual_multiplier · mixer(norm(x))`.

The mixer is Mamba2, Gated DeltaNet, attention, a dense MLP or a MoE. The model's blocks and an MTP head's layers are
built from it, so both read the same checkpoint layouts into the same modules.
"""

from __future__ import annotations

from torch import nn

from workers.model.checkpoint.config import ATTENTION, GDN, MAMBA, MLP, PARALLEL, HybridConfig
from workers.model.layers.attention import Attention
from workers.model.layers.feed_forward import MLP as DenseMLP
from workers.model.layers.feed_forward import MoE
from workers.model.layers.gdn import GatedDeltaNetMixer
from workers.model.layers.mamba2 import Mamba2Mixer
from workers.model.layers.norm import RMSNorm
from workers.model.layers.parallel import ParallelMixer


class Block(nn.Module):
    """x + residual_multiplier · mixer(norm(x)), the mixer being Mamba2, Gated DeltaNet, attention, an MLP or a MoE."""

    def __init__(self, config: HybridConfig, kind: str):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        ff = config.feed_forward
        if kind == MAMBA:
            self.mixer: nn.Module = Mamba2Mixer(config)
        elif kind == GDN:
            self.mixer = GatedDeltaNetMixer(config)
        elif kind == ATTENTION:
            self.mixer = Attention(config)
        elif kind == PARALLEL:
            self.mixer = ParallelMixer(config)
        elif kind == MLP:
            self.mixer = DenseMLP(config.hidden_size, ff.intermediate_size, ff.gated, ff.bias)
        else:
            self.mixer = MoE(config)
