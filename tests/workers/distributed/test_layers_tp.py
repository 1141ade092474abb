"""The recurrent and dense layers split over two ranks (gloo) against the unsplit layer on the same weights.

Each case builds the full layer from a seed on both ranks, builds the rank's layer from the local config
(`shard_config`) with its `TensorParallel`, loads `cut_state_dict(layer, full_state_dict, rank)` and runs what the
engine runs: a ragged prefill (l = 5), an in-place decode step and a verification of k = 3 drafts with
`state_after`. The ranks' partial outputs are all-reduced and compared with the full layer's, and each rank's state
with its cut of the full layer's state (so the ranks' states together are the full state). Whole models made of
these kinds compare their logits at T = 2 with T = 1. One follower process serves the module (spawned once,
`layer_ranks.Ranks`): every case runs on both ranks, rank 0 being the pytest process.

Falcon-H1's parallel mixer: while `Attention` takes no `tp` (slice S2b adds it with its shard rules), its attention
branch is built from the local config and cut by this file's `_attention_rules`; afterwards by its own rules.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from tests.workers.distributed.layer_ranks import Ranks, assert_close, difference
from workers.model.checkpoint.config import (
    MAMBA,
    MAMBA1,
    MLP,
    PARALLEL,
    SHORT_CONV,
    AttentionConfig,
    FeedForwardConfig,
    HybridConfig,
    Mamba1Config,
    MambaConfig,
    ShortConvConfig,
)
from workers.model.distributed.layout import SINGLE_TP, TensorParallel, shard_config, vocab_rows
from workers.model.distributed.slices import Cut, ShardRule, columns, cut_state_dict, qualified_rules, rows
from workers.model.kernels import native
from workers.model.layers.attention import Attention
from workers.model.layers.feed_forward import MLP as DenseMLP
from workers.model.layers.hybrid import HybridModel
from workers.model.layers.mamba1 import Mamba1Mixer
from workers.model.layers.mamba2 import Mamba2Mixer
from workers.model.layers.parallel import ParallelMixer
from workers.model.layers.short_conv import ShortConvMixer
from workers.model.layers.vocabulary import VocabParallelEmbedding, gather_logits, vocab_rule
from workers.model.state import ForwardBatch, RecurrentState, StatePool

WIDTH, VOCAB = 12, 37  # d; V odd: the last rank's shard is padded
PREFILL_TOKENS = torch.tensor([5, 3, 1])  # ragged rows of the l = 5 prefill
ACCEPTED = torch.tensor([1, 3, 4])  # inputs kept after the k = 3 verification (k + 1 = 4 ran)
LAYER_TOLERANCE, MODEL_TOLERANCE = 1e-5, 1e-4


def _config(kinds: tuple[str, ...], **changes) -> HybridConfig:
    """A tiny model of `kinds` (every split count even); `changes` replace its fields or its Mamba2 config's."""
    mamba_fields = {f.name for f in dataclasses.fields(MambaConfig)}
    mamba = MambaConfig(4, 4, 6, 1, 4, 4, True, True, 0.001, 0.5, out_proj_bias=True)
    mamba = dataclasses.replace(mamba, **{k: v for k, v in changes.items() if k in mamba_fields})
    config = HybridConfig(
        model_type="tp_test",
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        block_kinds=kinds,
        mamba=mamba,
        attention=AttentionConfig(4, 2, 4, 0.5, bias=True, rope_theta=10000.0, rotary_dim=4),
        feed_forward=FeedForwardConfig(intermediate_size=10, gated=True, bias=True),
        rms_norm_eps=1e-5,
        mamba1=Mamba1Config(16, 5, 4, dt_rank=3, conv_bias=True, proj_bias=True, chunk_size=2),
        short_conv=ShortConvConfig(conv_kernel=3, bias=True),
    )
    return dataclasses.replace(config, **{k: v for k, v in changes.items() if k not in mamba_fields})


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Large random weights (as tests/tiny_models.py's): decays in (0, 1), norms near 1, biases non-zero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("A_log"):
                param.copy_(torch.log(1 + 7 * torch.rand(param.shape, generator=generator)))
            elif "norm" in name:
                param.copy_(1 + 0.2 * noise)
            else:
                param.copy_(noise * (0.5 if "conv1d" in name or name.endswith(("D", "dt_bias")) else 0.3))


ATTENTION_TAKES_TP = "tp" in inspect.signature(Attention).parameters  # slice S2b adds it


def _mixer(kind: str, config: HybridConfig, tp: TensorParallel) -> torch.nn.Module:
    builders = {MAMBA: Mamba2Mixer, MAMBA1: Mamba1Mixer, SHORT_CONV: ShortConvMixer, PARALLEL: ParallelMixer}
    if kind == PARALLEL and tp.parallel and not ATTENTION_TAKES_TP:
        # Until the attention branch takes `tp`: an attention built from the local config (its local shapes are
        # all it needs), cut by `_attention_rules`, beside the split Mamba2 branch.
        mixer = ParallelMixer(shard_config(config, tp))
        mixer.mamba = Mamba2Mixer(shard_config(config, tp), tp=tp)
        return mixer
    return builders[kind](shard_config(config, tp), tp=tp)


def _attention_rules(tp: TensorParallel) -> dict[str, ShardRule]:
    """The attention branch's cuts for `_config`'s attention (4 heads, 2 KV heads of 4 dims, biases)."""
    q, kv = rows((tp.rank * 8, 8)), rows((tp.rank * 4, 4))
    names = {"q_proj": q, "k_proj": kv, "v_proj": kv}
    rules = {f"self_attn.{n}.{p}": rule for n, rule in names.items() for p in ("weight", "bias")}
    return rules | {
        "self_attn.o_proj.weight": columns((tp.rank * 8, 8)),
        "self_attn.o_proj.bias": ShardRule(rank0_only=True),
    }


def _cut(local: torch.nn.Module, full: dict[str, torch.Tensor], tp: TensorParallel) -> dict[str, torch.Tensor]:
    """`cut_state_dict`, plus the attention branch's cuts while the attention states none."""
    if not (isinstance(local, ParallelMixer) and tp.parallel and not ATTENTION_TAKES_TP):
        return cut_state_dict(local, full, tp.rank)
    rules = qualified_rules(local) | _attention_rules(tp)
    return {name: rules.get(name, ShardRule()).apply(tensor, tp.rank) for name, tensor in full.items()}


def _state_rules(local: torch.nn.Module) -> tuple[ShardRule, ShardRule | None]:
    """Cuts of a full recurrent state's channel dim (conv window) and head / channel dim (SSM state) for this rank:
    those of the conv weight's rows and of A_log's (none for the short conv's empty matrix state)."""
    rules = qualified_rules(local)
    conv = next(rule for name, rule in rules.items() if name.endswith("conv1d.weight"))
    ssm = next((rule for name, rule in rules.items() if name.endswith("A_log")), None)
    return [None if rule is None else ShardRule((Cut(1, rule.cuts[0].pieces),)) for rule in (conv, ssm)]


class _Run:
    """Calls a recurrent mixer as the model does; a Falcon-H1 parallel mixer also gets a batch and its KV cache."""

    def __init__(self, mixer: torch.nn.Module, config: HybridConfig) -> None:
        self.mixer = mixer
        if isinstance(mixer, ParallelMixer):
            self.cache = StatePool(config, 3, 16, torch.device("cpu"), torch.float32).kv_caches()

    def __call__(self, x, state, num_tokens, in_place, cache_lens):
        if not isinstance(self.mixer, ParallelMixer):
            return self.mixer(x, state, num_tokens, in_place)
        batch = ForwardBatch(torch.arange(3), cache_lens, num_tokens, slots_are_prefix=True)
        return self.mixer(x, state, num_tokens, in_place, batch, self.cache[0])


def _clone(state: RecurrentState) -> RecurrentState:
    return RecurrentState(state.conv.clone(), state.ssm.clone())


def recurrent_case(tp: TensorParallel, kind: str, changes: dict, kernel: str) -> dict[str, float]:
    """Max |full − split| of outputs and states over prefill, in-place decode, verification and state_after."""
    config = _config((kind,), **changes)
    full, local = _mixer(kind, config, SINGLE_TP), _mixer(kind, config, tp)
    _randomise(full, seed=3)
    local.load_state_dict(_cut(local, full.state_dict(), tp))
    for mixer in (full, local):
        (mixer.mamba if kind == PARALLEL else mixer).decode_kernel = kernel
    conv_rule, ssm_rule = _state_rules(local)
    runs = _Run(full, config), _Run(local, shard_config(config, tp))
    generator = torch.Generator().manual_seed(11)
    prompt, step, drafts = (torch.randn(3, n, WIDTH, generator=generator) for n in (5, 1, 4))
    errors: dict[str, float] = {}

    def compare(name, outs, states):
        errors[name] = difference(outs[0], tp.group.all_reduce_(outs[1].clone()))
        errors[f"{name} conv"] = difference(conv_rule.apply(states[0].conv, tp.rank), states[1].conv)
        ssm = states[0].ssm if ssm_rule is None else ssm_rule.apply(states[0].ssm, tp.rank)
        errors[f"{name} ssm"] = difference(ssm, states[1].ssm)

    zeros, ones, lens = torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.long), PREFILL_TOKENS
    prefill = [run(prompt, None, PREFILL_TOKENS, False, zeros) for run in runs]
    compare("prefill", [p[0] for p in prefill], [p[1] for p in prefill])
    decoded = [_clone(p[1]) for p in prefill]
    outs = [run(step, state, ones, True, lens)[0] for run, state in zip(runs, decoded)]
    compare("decode", outs, decoded)
    four = torch.full((3,), 4, dtype=torch.long)
    verified = [run(drafts, state, four, False, lens + 1) for run, state in zip(runs, decoded)]
    compare("verify", [v[0] for v in verified], [v[1] for v in verified])
    kept = [run.mixer.state_after(s, v[2], ACCEPTED) for run, s, v in zip(runs, decoded, verified)]
    compare("state_after", [v[0] for v in verified], kept)
    return errors


def mlp_case(tp: TensorParallel, gated: bool, use_native: bool) -> dict[str, float]:
    """Max |full − split| of a dense MLP's output (gated SwiGLU or relu²)."""
    ff = FeedForwardConfig(intermediate_size=10, gated=gated, bias=True)
    local_size = shard_config(_config((MLP,), feed_forward=ff), tp).feed_forward.intermediate_size
    full, local = DenseMLP(WIDTH, 10, gated, True), DenseMLP(WIDTH, local_size, gated, True, tp=tp)
    _randomise(full, seed=5)
    local.load_state_dict(cut_state_dict(local, full.state_dict(), tp.rank))
    full.native = local.native = use_native
    x = torch.randn(3, 5, WIDTH, generator=torch.Generator().manual_seed(2))
    return {"out": difference(full(x), tp.group.all_reduce_(local(x)))}


def vocabulary_case(tp: TensorParallel) -> dict[str, float]:
    """Max |full − split| of embedding rows (every id, the shard edges included) and of the gathered logits."""
    full, local = VocabParallelEmbedding(VOCAB, WIDTH), VocabParallelEmbedding(VOCAB, WIDTH, tp)
    _randomise(full, seed=9)
    local.load_state_dict(cut_state_dict(local, full.state_dict(), tp.rank))
    head = torch.randn(VOCAB, WIDTH, generator=torch.Generator().manual_seed(4))
    local_head = vocab_rule(VOCAB, tp).apply(head, tp.rank)
    ids = torch.arange(VOCAB).flip(0).view(1, VOCAB)
    hidden = torch.randn(2, 3, WIDTH, generator=torch.Generator().manual_seed(6))
    logits = gather_logits(hidden @ local_head.T, VOCAB, tp)
    present = vocab_rows(VOCAB, tp)[1]
    return {
        "embed": difference(full(ids), local(ids)),
        "logits": difference(hidden @ head.T, logits),
        "logits shape": float(logits.shape != (2, 3, VOCAB)),
        "pad rows": local.weight[present:].abs().sum().item(),
        "rows": float(local.weight.shape[0] != 19),
    }


def _model_logits(model: HybridModel, ids: torch.Tensor, next_ids: torch.Tensor) -> list[torch.Tensor]:
    """Logits of a ragged prefill and of one in-place decode step after it."""
    pool = StatePool(model.config, 3, 16, torch.device("cpu"), torch.float32)
    rows, zeros = torch.arange(3), torch.zeros(3, dtype=torch.long)
    prefill = model(ids, ForwardBatch(rows, zeros, PREFILL_TOKENS, True), None, pool.kv_caches())
    decode_batch = ForwardBatch(rows, PREFILL_TOKENS, torch.ones(3, dtype=torch.long), True, one_token_each=True)
    decode = model(next_ids, decode_batch, prefill.mamba_states, pool.kv_caches(), in_place=True)
    return [model.logits(prefill.hidden), model.logits(decode.hidden)]


def model_case(tp: TensorParallel, kinds: tuple[str, ...], changes: dict) -> dict[str, float]:
    """Max |T=1 − T=2| of a whole model's logits (prefill, then a decode step) on the same weights."""
    config = _config(kinds, **changes)
    full, local = HybridModel(config), HybridModel(config, tp=tp)
    _randomise(full, seed=1)
    local.load_state_dict(cut_state_dict(local, full.state_dict(), tp.rank))
    generator = torch.Generator().manual_seed(8)
    ids, next_ids = (
        torch.randint(0, VOCAB, (3, 5), generator=generator),
        torch.randint(0, VOCAB, (3, 1), generator=generator),
    )
    expected, got = _model_logits(full, ids, next_ids), _model_logits(local, ids, next_ids)
    return {name: difference(e, g) for name, e, g in zip(("prefill", "decode"), expected, got)}


@pytest.fixture(scope="module")
def ranks():
    pair = Ranks(2)
    yield pair
    pair.close()


NATIVE = "native" if native.available() else "torch"
RECURRENT_CASES = {
    "mamba2 g=1 spanning norm": (MAMBA, {"num_groups": 1}, "torch"),
    "mamba2 g=2 local norm": (MAMBA, {"num_groups": 2}, "torch"),
    "mamba2 g=2 local norm native": (MAMBA, {"num_groups": 2}, NATIVE),
    "mamba2 norm before gate (spanning)": (MAMBA, {"num_groups": 1, "norm_before_gate": True}, "torch"),
    "mamba2 no norm": (MAMBA, {"num_groups": 2, "rms_norm": False}, "torch"),
    "mamba1": (MAMBA1, {}, "torch"),
    "mamba1 native": (MAMBA1, {}, NATIVE),
    "short conv": (SHORT_CONV, {}, "torch"),
    "short conv native": (SHORT_CONV, {}, NATIVE),
    "falcon parallel": (PARALLEL, {"num_groups": 1}, "torch"),
}


@pytest.mark.parametrize("case", list(RECURRENT_CASES))
def test_recurrent_layer_matches_unsplit(ranks: Ranks, case: str) -> None:
    assert_close(ranks.run(recurrent_case, *RECURRENT_CASES[case]), LAYER_TOLERANCE)


@pytest.mark.parametrize("gated, use_native", [(True, False), (False, False), (True, True)])
def test_mlp_matches_unsplit(ranks: Ranks, gated: bool, use_native: bool) -> None:
    assert_close(ranks.run(mlp_case, gated, use_native and native.available()), LAYER_TOLERANCE)


def test_vocabulary_parallel_embedding_and_head(ranks: Ranks) -> None:
    results = ranks.run(vocabulary_case)
    assert all(r["embed"] == 0.0 and r["pad rows"] == 0.0 and r["logits shape"] == 0.0 for r in results)
    assert_close(results, LAYER_TOLERANCE)


MODELS = {
    "mamba2 spanning + relu² MLP, tied, multipliers": (
        (MAMBA, MLP, MAMBA, MLP),
        {
            "tie_word_embeddings": True,
            "embedding_multiplier": 2.0,
            "logits_divisor": 1.5,
            "num_groups": 1,
            "feed_forward": FeedForwardConfig(intermediate_size=10, gated=False, bias=True),
        },
    ),
    "short conv + gated MLP": ((SHORT_CONV, MLP, SHORT_CONV, MLP), {}),
    "mamba1 + MLP": ((MAMBA1, MLP, MAMBA1), {"residual_multiplier": 0.5}),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_whole_model_logits_match_unsplit(ranks: Ranks, name: str) -> None:
    assert_close(ranks.run(model_case, *MODELS[name]), MODEL_TOLERANCE)


def test_spanning_norm_keeps_the_fused_kernels_off() -> None:
    """The native / Triton Mamba2 kernels norm locally, so a norm spanning ranks must take the torch path."""
    config = _config((MAMBA,), num_groups=1)
    assert config.mamba.fused_kernels_fit
    assert not shard_config(config, TensorParallel(0, 2)).mamba.fused_kernels_fit
    assert shard_config(_config((MAMBA,), num_groups=2), TensorParallel(1, 2)).mamba.fused_kernels_fit


@pytest.mark.slow
def test_four_ranks_replicated_groups_and_ordered_sums() -> None:
    """T = 4 (two B/C groups, each replicated on two ranks; the spanning norm's [t, g] sums with zeros in the other
    group; ordered all-reduces over four parts) and a whole model."""
    four = Ranks(4)
    try:
        assert_close(four.run(recurrent_case, MAMBA, {"num_groups": 2, "num_heads": 8}, "torch"), LAYER_TOLERANCE)
        kinds, changes = MODELS["mamba2 spanning + relu² MLP, tied, multipliers"]
        wider = {"num_groups": 2, "num_heads": 8, "feed_forward": FeedForwardConfig(12, gated=False, bias=True)}
        assert_close(four.run(model_case, kinds, changes | wider), MODEL_TOLERANCE)
    finally:
        four.close()
