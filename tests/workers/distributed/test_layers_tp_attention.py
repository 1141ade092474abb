"""Attention-like mixers, MoE (inside the experts and expert parallel) and Zamba2's shared use at T = 2 against T = 1.

One pair of spawned ranks (gloo) runs every case of `tp_layer_cases.CONFIGS`: each rank builds the unsplit layer and
its own from the same seeded weights, runs prefill (ragged rows), decode and a k = 3 verification (with
`state_after` for the recurrent ones), all-reduces its partial output and compares it, its states and its KV cache
with the unsplit layer's (see `tp_layer_cases`). The native paths run too where the kernels build.
"""

from __future__ import annotations

import os
import tempfile
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from tests.workers.distributed import tp_layer_cases as cases
from workers.model.distributed.group import make_group
from workers.model.distributed.layout import TensorParallel
from workers.model.distributed.slices import cut_state_dict
from workers.model.kernels import native
from workers.model.layers.gdn import GatedDeltaNetMixer
from workers.model.layers.kda import KimiDeltaAttentionMixer
from workers.model.layers.linear import prepare_linears
from workers.model.layers.mla import MultiHeadLatentAttention
from workers.model.layers.moe import MoE, grouped_gemm_fits
from workers.model.layers.mtp import MtpHead
from workers.model.layers.shared_block import SharedBlockUse
from workers.model.state import RecurrentState

SIZE = 2


def _kv_pieces(mine) -> list[tuple[int, int]]:
    """The KV heads of the full cache this rank holds (MLA: the whole latent cache)."""
    if isinstance(mine, MultiHeadLatentAttention):
        return [(0, 1)]
    attention = mine.attention if isinstance(mine, SharedBlockUse) else mine
    first, rows = attention._kv_share()
    return [(first // attention.config.head_dim, rows // attention.config.head_dim)]


def _attend(layer, hidden, embeddings, batch, cache):
    if isinstance(layer, SharedBlockUse):
        return layer(hidden, embeddings, batch, cache)
    return layer(hidden, batch, cache)


def run_attention(config, full, mine, tp: TensorParallel, use_native: bool) -> list[tuple[str, float]]:
    """Prefill, decode and verification through an attention-like layer (its KV cache kept between steps)."""
    for layer in (full, mine):
        layer.native = use_native
    heads = 1 if config.mla is not None else config.attention.num_kv_heads
    width, value_width = config.attention.cache_widths
    full_cache = cases.caches(heads, width, value_width)
    local_heads = 1 if config.mla is not None else mine_heads(mine)
    mine_cache = cases.caches(local_heads, width, value_width)
    g = torch.Generator().manual_seed(1)
    checks = []
    for step, (batch, length) in enumerate(cases.batches()):
        hidden, embeddings = torch.randn(3, length, cases.D, generator=g), torch.randn(3, length, cases.D, generator=g)
        expected = _attend(full, hidden, embeddings, batch, full_cache)
        got = _attend(mine, hidden, embeddings, batch, mine_cache)
        if not isinstance(mine, SharedBlockUse):  # a shared use all-reduces inside and returns the whole T
            got = tp.group.all_reduce_(got.contiguous())
        valid = torch.arange(length)[None, :] < batch.num_tokens[:, None]
        checks.append((f"step {step} output", cases.error(expected[valid], got[valid])))
    pieces = _kv_pieces(mine)
    checks.append(("keys", cases.error(cases.narrow(full_cache.key, 0, pieces), mine_cache.key)))
    checks.append(("values", cases.error(cases.narrow(full_cache.value, 0, pieces), mine_cache.value)))
    return checks


def mine_heads(mine) -> int:
    """KV heads of this rank's cache."""
    attention = mine.attention if isinstance(mine, SharedBlockUse) else mine
    return attention.config.num_kv_heads


def _state_checks(name: str, full_state: RecurrentState, state: RecurrentState, mine) -> list[tuple[str, float]]:
    conv_pieces = mine.shard_rules()["conv1d.weight"].cuts[0].pieces
    heads = state.ssm.shape[1]
    return [
        (f"{name} conv", cases.error(cases.narrow(full_state.conv, 1, conv_pieces), state.conv)),
        (f"{name} ssm", cases.error(full_state.ssm.narrow(1, mine.tp.rank * heads, heads), state.ssm)),
    ]


def _clone(state: RecurrentState) -> RecurrentState:
    return RecurrentState(state.conv.clone(), state.ssm.clone())


def run_recurrent(config, full, mine, tp: TensorParallel, kernel: str) -> list[tuple[str, float]]:
    """Prefill from the zero state, an in-place decode step, a k = 3 verification and `state_after`."""
    for layer in (full, mine):
        layer.decode_kernel = kernel
    g = torch.Generator().manual_seed(2)
    checks, states = [], [None, None]
    for step, (batch, length) in enumerate(cases.batches()):
        hidden = torch.randn(3, length, cases.D, generator=g)
        decode = step == 1
        starts = [None if s is None else _clone(s) for s in states]
        runs = [layer(hidden, s, batch.num_tokens, in_place=decode) for layer, s in zip((full, mine), starts)]
        (expected, full_state, full_scan), (got, state, scan) = runs
        got = tp.group.all_reduce_(got.contiguous())
        valid = torch.arange(length)[None, :] < batch.num_tokens[:, None]
        checks.append((f"step {step} output", cases.error(expected[valid], got[valid])))
        checks += _state_checks(f"step {step}", full_state, state, mine)
        if step == 2:
            accepted = torch.tensor([1, 4, 2])
            after = [
                layer.state_after(s, sc, accepted) for layer, s, sc in zip((full, mine), states, (full_scan, scan))
            ]
            checks += _state_checks("state_after", after[0], after[1], mine)
        states = [full_state, state]
    return checks


def router_margin(layer: MoE, tokens: torch.Tensor) -> float:
    """The smallest gap, over the tokens, between the last chosen and the first unchosen score (and, for grouped
    routers, between the last kept and the first dropped group): no near-tie decides a route."""
    ff, logits = layer.router.ff, layer.router.logits(tokens)
    k, margins = ff.experts_per_token, []
    choice = logits if ff.router == "softmax" else logits.sigmoid() + layer.router.bias.float()
    if ff.num_expert_groups > 1:
        grouped = choice.view(-1, ff.num_expert_groups, ff.num_experts // ff.num_expert_groups)
        scores = grouped.sort(-1, descending=True).values[..., :2].sum(-1)  # [t, groups]
        ranked, order = scores.sort(-1, descending=True)
        margins.append(float((ranked[:, ff.topk_groups - 1] - ranked[:, ff.topk_groups]).min()))
        dropped = torch.ones_like(scores, dtype=torch.bool).scatter(1, order[:, : ff.topk_groups], False)
        choice = grouped.masked_fill(dropped[..., None], -torch.inf).view_as(choice)
    ranked = choice.sort(-1, descending=True).values
    margins.append(float((ranked[:, k - 1] - ranked[:, k]).min()))
    return min(margins)


def run_moe(config, full, mine, tp: TensorParallel, packed: bool) -> list[tuple[str, float]]:
    """A batch of tokens through the block (torch or packed native experts); expert parallel: a row alone gives
    the same bits as inside the batch, before and after the all-reduce."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 3, cases.D, generator=g)
    if packed:  # every linear on the native panels and the experts packed, as the loader prepares a CPU model
        for layer in (full, mine):
            prepare_linears(layer, "native", torch.device("cpu"), torch.float32)
        assert mine.packed is not None
    checks = [
        ("router margin shortfall", max(0.0, cases.MIN_ROUTER_MARGIN - router_margin(full, hidden.view(-1, cases.D))))
    ]
    expected = full(hidden)
    partial = mine(hidden)
    checks.append(("output", cases.error(expected, tp.group.all_reduce_(partial.clone()))))
    if not packed and grouped_gemm_fits(hidden.device, hidden.dtype):  # the static (CUDA graph) form, on the CPU
        static = tp.group.all_reduce_(mine(hidden, static_shapes=True).clone())
        checks.append(("static form output", cases.error(expected, static)))
    if tp.expert_parallel:  # bitwise on the native path (the torch path's GEMMs round by batch size even at T = 1)
        alone = mine(hidden[1:2, 2:3])[0, 0]
        summed = tp.group.all_reduce_(mine(hidden[1:2, 2:3]).clone())[0, 0]
        whole = tp.group.all_reduce_(partial.clone())[1, 2]
        for check, one, batch in (("partial", alone, partial[1, 2]), ("summed", summed, whole)):
            gap = (0.0 if torch.equal(one, batch) else 1.0) if packed else cases.error(batch, one)
            checks.append((f"row alone vs in the batch, {check}", gap))
    return checks


def run_mtp(config, full, mine, tp: TensorParallel, use_native: bool) -> list[tuple[str, float]]:
    """The MTP head (its blocks' partials all-reduced inside) over prefill, decode and verification, with a
    replicated embedding (the vocabulary-parallel one is the model's); the MoE's routing margin on the oracle."""
    for head in (full, mine):
        head.blocks[0].mixer.native = use_native
    g = torch.Generator().manual_seed(4)
    embed = nn.Embedding(config.vocab_size, cases.D)
    embed.weight.copy_(torch.randn(embed.weight.shape, generator=g))
    heads, local_heads = config.attention.num_kv_heads, mine.blocks[0].mixer.config.num_kv_heads
    full_cache, mine_cache = cases.caches(heads, 8, 8), cases.caches(local_heads, 8, 8)
    moe_inputs = []
    full.blocks[1].mixer.register_forward_pre_hook(lambda _, args: moe_inputs.append(args[0]))
    checks = []
    for step, (batch, length) in enumerate(cases.batches()):
        tokens = torch.randint(0, config.vocab_size, (3, length), generator=g)
        hidden = torch.randn(3, length, cases.D, generator=g)
        expected = full(tokens, hidden, embed, batch, [full_cache])
        got = mine(tokens, hidden, embed, batch, [mine_cache])
        valid = torch.arange(length)[None, :] < batch.num_tokens[:, None]
        checks.append((f"step {step} output", cases.error(expected[valid], got[valid])))
        margin = router_margin(full.blocks[1].mixer, moe_inputs[-1].reshape(-1, cases.D)[valid.reshape(-1)])
        checks.append((f"step {step} router margin shortfall", max(0.0, cases.MIN_ROUTER_MARGIN - margin)))
    pieces = _kv_pieces(mine.blocks[0].mixer)
    checks.append(("keys", cases.error(cases.narrow(full_cache.key, 0, pieces), mine_cache.key)))
    return checks


def run_case(name: str, tp: TensorParallel) -> dict[str, list[tuple[str, float]]]:
    """Every path of one case on this rank: {path: checks}."""
    config, ep = cases.CONFIGS[name]
    tp = TensorParallel(tp.rank, tp.size, ep, tp.group)
    kinds = [False, True] if native.available() else [False]
    out = {}
    with torch.inference_mode():
        for use_native in kinds:
            full, mine = cases.pair(config, tp)
            path = "native" if use_native else "torch"
            if isinstance(mine, MtpHead):
                out[path] = run_mtp(config, full, mine, tp, use_native)
            elif isinstance(mine, MoE):
                out[path] = run_moe(config, full, mine, tp, use_native)
            elif isinstance(mine, (GatedDeltaNetMixer, KimiDeltaAttentionMixer)):
                out[path] = run_recurrent(config, full, mine, tp, "native" if use_native else "torch")
            else:
                out[path] = run_attention(config, full, mine, tp, use_native)
    return out


MODEL_TOLERANCE = 1e-4  # logits: float32 sums over many layers
FAMILY_MODELS = {  # (tiny family, expert parallel): every mixer of this slice in a real checkpoint, via the loader
    "qwen3_next": False,  # GDN, gated attention with q/k norms, MoE with a gated shared expert
    "qwen3_5_moe": True,  # the same under expert parallelism (fused expert tensors)
    "kimi_linear": False,  # KDA, MLA, sigmoid grouped MoE with score bias
    "olmo_hybrid": False,  # GDN with negative eigenvalues, attention with the full-width q/k norm
    "zamba2_lora": False,  # Zamba2's shared uses with adapters (beside S2a's Mamba2)
}


def _model_logits(model, ids: torch.Tensor, next_ids: torch.Tensor) -> list[torch.Tensor]:
    """Logits of a ragged prefill, then of one in-place decode step after it."""
    from workers.model.state import ForwardBatch, StatePool

    pool = StatePool(model.config, 3, 16, torch.device("cpu"), torch.float32)
    rows, zeros, counts = torch.arange(3), torch.zeros(3, dtype=torch.long), torch.tensor([5, 3, 4])
    prefill = model(ids, ForwardBatch(rows, zeros, counts, True), None, pool.kv_caches())
    decode_batch = ForwardBatch(rows, counts, torch.ones(3, dtype=torch.long), True, one_token_each=True)
    decode = model(next_ids, decode_batch, prefill.mamba_states, pool.kv_caches(), in_place=True)
    valid = torch.arange(5)[None, :] < counts[:, None]
    return [model.logits(prefill.hidden)[valid], model.logits(decode.hidden)]


def run_model(path: str, tp: TensorParallel) -> dict[str, list[tuple[str, float]]]:
    """A tiny family checkpoint loaded whole and as this rank's share (the loader cutting by the layers' rules):
    the logits of a prefill and a decode step, on the default (native where it builds) kernels."""
    from workers.model.loader import load_checkpoint

    full = load_checkpoint(path, dtype="float32").model
    mine = load_checkpoint(path, dtype="float32", tp=tp).model
    g = torch.Generator().manual_seed(5)
    vocab = full.config.vocab_size
    ids, next_ids = torch.randint(0, vocab, (3, 5), generator=g), torch.randint(0, vocab, (3, 1), generator=g)
    with torch.inference_mode():
        expected, got = _model_logits(full, ids, next_ids), _model_logits(mine, ids, next_ids)
    return {
        "model": [(f"{step} logits", cases.error(e, g)) for step, e, g in zip(("prefill", "decode"), expected, got)]
    }


def _rank_main(rank: int, store: str, size: int, queue, paths: dict[str, str]) -> None:
    group = make_group(store, rank, size, timeout_s=60.0)
    torch.set_num_threads(1)
    results = {}
    for name in cases.CONFIGS:
        try:
            results[name] = run_case(name, TensorParallel(rank, size, False, group))
        except Exception:  # reported per case; a collective left unmatched makes the peer time out
            results[name] = traceback.format_exc()
    for family, path in paths.items():
        try:
            results[family] = run_model(path, TensorParallel(rank, size, FAMILY_MODELS[family], group))
        except Exception:
            results[family] = traceback.format_exc()
    queue.put((rank, results))
    group.barrier()
    group.close()


@pytest.fixture(scope="module")
def rank_results(checkpoint_dir) -> dict[int, dict]:
    """Both ranks' results: {rank: {case or family: {path: checks} or a traceback}}."""
    paths = {family: str(checkpoint_dir(family)) for family in FAMILY_MODELS}
    context = mp.get_context("spawn")
    queue = context.Queue()
    store = os.path.join(tempfile.mkdtemp(), "store")
    processes = [context.Process(target=_rank_main, args=(r, store, SIZE, queue, paths)) for r in range(SIZE)]
    for process in processes:
        process.start()
    items = dict(queue.get(timeout=240) for _ in range(SIZE))
    for process in processes:
        process.join(timeout=30)
    return items


def _assert_within(rank_results: dict, name: str, tolerance: float) -> None:
    for rank in range(SIZE):
        result = rank_results[rank][name]
        assert not isinstance(result, str), f"rank {rank} failed:\n{result}"
        for path, checks in result.items():
            bad = [(check, err) for check, err in checks if not err <= tolerance]
            assert not bad, f"rank {rank}, {path}: {bad}"


@pytest.mark.parametrize("name", list(cases.CONFIGS))
def test_split_layer_matches_the_whole(rank_results, name: str) -> None:
    _assert_within(rank_results, name, cases.TOLERANCE)


@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_split_family_model_matches_the_whole(rank_results, family: str) -> None:
    """Loaded by the loader at T = 2 (each rank reading its share), the model's logits equal T = 1's."""
    _assert_within(rank_results, family, MODEL_TOLERANCE)


def _my_mixers(config, tp: TensorParallel) -> list[torch.nn.Module]:
    """This slice's mixers (attention, MLA, GDN, KDA, MoE, Zamba2 uses, the MTP blocks') of every block of `config`,
    built for `tp` from its local config."""
    from workers.model.checkpoint.config import ATTENTION, GDN, KDA, MOE, SHARED_ATTENTION
    from workers.model.distributed.layout import shard_config
    from workers.model.layers.block import Block
    from workers.model.layers.shared_block import SharedTransformer

    local = shard_config(config, tp)
    mine = (ATTENTION, GDN, KDA, MOE, SHARED_ATTENTION)
    kinds = [(kind, local.attention_of(i)) for i, kind in enumerate(local.block_kinds) if kind in mine]
    kinds += [(kind, None) for kind in local.mtp_block_kinds if kind in mine]
    mixers = [Block(local, kind, attention=attention, tp=tp).mixer for kind, attention in kinds]
    for mixer in mixers:
        if isinstance(mixer, SharedBlockUse):
            mixer.bind(SharedTransformer(local), 0)
    return mixers


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "kimi_linear", "olmo_hybrid", "lfm3", "zamba2_lora"])
def test_every_familys_mixers_cut_to_their_local_shapes(checkpoint_dir, family: str) -> None:
    """The real layouts (GQA with v ≠ k heads, the MoE and MTP of Qwen, Kimi's KDA and MLA, LFM3's layer types,
    Zamba2's adapters): the full mixers' state dicts cut by the local mixers' rules have the local shapes, on both
    ranks, with and without expert parallelism; no parameter has two rules."""
    from tests.workers.distributed.test_layout import config_of

    config = config_of(checkpoint_dir, family)
    for ep in (False, True) if config.feed_forward.num_experts else (False,):
        with torch.device("meta"):
            full = _my_mixers(config, TensorParallel())
            ranks = [_my_mixers(config, TensorParallel(rank, SIZE, ep)) for rank in range(SIZE)]
        assert full, f"{family} has no mixer of this slice"
        for rank, mixers in enumerate(ranks):
            for whole, mixer in zip(full, mixers, strict=True):
                cut = cut_state_dict(mixer, whole.state_dict(), rank)
                assert {k: v.shape for k, v in cut.items()} == {k: v.shape for k, v in mixer.state_dict().items()}
