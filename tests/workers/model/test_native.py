"""The native C decode kernel against the PyTorch reference path; the build cache and fallbacks; denormals."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from workers import ModelRunner, SamplingParams
from workers.model import load_checkpoint
from workers.model.kernels import heap, native, native_recurrent
from workers.model.kv_blocks import BlockTable
from workers.model.layers.attention import Attention, inverse_frequencies, rotary
from workers.model.layers.linear import NativeLinear
from workers.model.layers.mamba2 import Mamba2Mixer
from workers.model.state import ForwardBatch, KVCache, MambaState


def _first_mixer(path: str, kernel: str) -> Mamba2Mixer:
    model = load_checkpoint(path, decode_kernel=kernel).model
    return next(m for m in model.modules() if isinstance(m, Mamba2Mixer))


def _random_state(mixer: Mamba2Mixer, batch: int, seed: int) -> MambaState:
    m = mixer.config
    g = torch.Generator().manual_seed(seed)
    return MambaState(
        torch.randn(batch, m.conv_dim, m.conv_kernel - 1, generator=g),
        torch.randn(batch, m.num_heads, m.head_dim, m.state_size, generator=g),
    )


@pytest.mark.parametrize(
    "family, variant",
    [("granite_dense", "as built"), ("nemotron_dense", "as built"), ("nemotron_dense", "no conv bias, dt limits")],
)
def test_native_decode_steps_equal_the_torch_path(checkpoint_dir, family, variant):
    path = str(checkpoint_dir(family))
    mixers = {kernel: _first_mixer(path, kernel) for kernel in ("torch", "native")}
    assert mixers["native"].decode_kernel == "native"
    if variant != "as built":
        for mixer in mixers.values():
            mixer.conv1d.bias = None
            mixer.config = dataclasses.replace(mixer.config, dt_min=0.05, dt_max=0.3)
    with torch.no_grad():
        for mixer in mixers.values():  # make dt_bias, A_log, D and the norm weight matter
            g = torch.Generator().manual_seed(1)
            for param in (mixer.dt_bias, mixer.A_log, mixer.D, mixer.norm.weight):
                param.copy_(torch.randn(param.shape, generator=g))
    batch = 3
    states = {kernel: _random_state(mixers["torch"], batch, seed=2) for kernel in mixers}
    hidden_size = mixers["torch"].in_proj.in_features
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for _ in range(6):  # several steps: the updated windows and states feed the next one
            hidden = torch.randn(batch, 1, hidden_size, generator=g)
            outs = {
                k: m(hidden, states[k], torch.ones(batch, dtype=torch.long), in_place=True)[0]
                for k, m in mixers.items()
            }
            torch.testing.assert_close(outs["native"], outs["torch"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(states["native"].conv, states["torch"].conv, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(states["native"].ssm, states["torch"].ssm, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["granite_moe", "bamba", "nemotron_moe"])
def test_greedy_generation_is_the_same_with_either_kernel(checkpoint_dir, family):
    path = str(checkpoint_dir(family))
    runners = {k: ModelRunner.from_pretrained(path, decode_kernel=k, max_num_seqs=2) for k in ("torch", "native")}
    prompts = [[5, 9, 30, 31, 4, 77, 12], [8, 8, 8], [100, 3, 17, 250]]  # 3 prompts, 2 slots: admission mid-run
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = {k: [r.token_ids for r in runner.generate(prompts, params)] for k, runner in runners.items()}
    assert outputs["native"] == outputs["torch"]


def test_kernel_inputs_are_checked(checkpoint_dir):
    mixer = _first_mixer(str(checkpoint_dir("bamba")), "native")
    state = _random_state(mixer, 2, seed=0)
    m = mixer.config
    proj = torch.randn(2, mixer.in_proj.out_features, dtype=torch.float64)
    with pytest.raises(ValueError, match="contiguous float32 CPU tensors, got torch.float64"):
        native_recurrent.mamba2_decode_step(
            proj,
            state.conv,
            mixer.conv1d.weight.squeeze(1),
            mixer.conv1d.bias,
            mixer.dt_bias,
            mixer.A_log,
            mixer.D,
            (m.dt_min, m.dt_max),
            state.ssm,
            mixer.norm.weight,
            mixer.norm.num_groups,
            mixer.norm.eps,
            m.num_groups,
        )
    with pytest.raises(ValueError, match="shape mismatch"):
        native_recurrent.mamba2_decode_step(
            proj.float()[:, :-1].contiguous(),
            state.conv,
            mixer.conv1d.weight.squeeze(1),
            mixer.conv1d.bias,
            mixer.dt_bias,
            mixer.A_log,
            mixer.D,
            (m.dt_min, m.dt_max),
            state.ssm,
            mixer.norm.weight,
            mixer.norm.num_groups,
            mixer.norm.eps,
            m.num_groups,
        )


def test_kernel_choice_is_validated(checkpoint_dir):
    path = str(checkpoint_dir("bamba"))
    with pytest.raises(
        ValueError, match="decode_kernel='cuda' is invalid: must be one of auto, torch, compile, native"
    ):
        load_checkpoint(path, decode_kernel="cuda")
    with pytest.raises(ValueError, match="decode_kernel='native' needs a CPU and float32 weights"):
        load_checkpoint(path, dtype="float16", decode_kernel="native")
    assert _first_mixer(path, "auto").decode_kernel == "native"  # CPU, float32, a compiler on this machine
    model = load_checkpoint(path, dtype="bfloat16", linear_backend="torch").model  # the all-PyTorch bf16 model
    assert {m.decode_kernel for m in model.modules() if isinstance(m, Mamba2Mixer)} == {"torch"}
    model = load_checkpoint(path, dtype="bfloat16", decode_kernel="native").model  # bf16 linears, float32 else
    assert {m.decode_kernel for m in model.modules() if isinstance(m, Mamba2Mixer)} == {"native"}


def test_without_a_compiler_auto_falls_back_and_native_says_why(checkpoint_dir, monkeypatch):
    monkeypatch.setattr(native, "_LIBRARIES", {})
    monkeypatch.setattr(native, "_LOAD_ERRORS", {})
    monkeypatch.setattr(native, "_compiler", lambda: None)
    path = str(checkpoint_dir("bamba"))
    model = load_checkpoint(path).model
    assert {m.decode_kernel for m in model.modules() if isinstance(m, Mamba2Mixer)} == {"torch"}
    assert not any(isinstance(m, NativeLinear) for m in model.modules())  # oneDNN (or torch) linears instead
    with pytest.raises(native.NativeKernelError, match="no C compiler found"):
        load_checkpoint(path, decode_kernel="native")
    with pytest.raises(native.NativeKernelError, match="no C compiler found"):
        load_checkpoint(path, linear_backend="native")


def test_denormals_are_flushed_on_every_thread():
    assert native.flush_denormals()
    tiny = torch.full((1 << 20,), 1e-39)  # a denormal float32; the multiply runs on the thread pool
    assert torch.count_nonzero(tiny * 1.0) == 0


_REUSE_PROBE = """
import resource, sys, torch
from workers.model.kernels import heap
applied = heap.keep_freed_memory_mapped()
def faults_filling_a_fresh_buffer():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(16 << 20).fill_(1.0)  # 64 MiB, freed at once
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
for _ in range(3):  # the heap grows to hold one such buffer
    faults_filling_a_fresh_buffer()
print(applied, faults_filling_a_fresh_buffer())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")
@pytest.mark.parametrize("setting", ["default", "off"])
def test_freed_buffers_are_reused_without_page_faults(setting):
    """A runner's process keeps freed buffers mapped: once the heap holds one, a new 64 MiB buffer (a Gated DeltaNet
    layer's states for 64 rows of Qwen3.5-0.8B) costs no page faults. glibc alone maps anything above 32 MiB
    afresh: 16384 faults of 4 KiB each time (HYBRIDGEN_MALLOC_TUNING=0 leaves it so)."""
    env = dict(os.environ, **({heap.MALLOC_TUNING_ENV: "0"} if setting == "off" else {}))
    out = subprocess.run([sys.executable, "-c", _REUSE_PROBE], env=env, capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    if setting == "off":
        assert applied == "False" and int(faults) > 10000
    else:
        assert applied == "True" and int(faults) < 100


def test_elementwise_kernels_equal_their_torch_references():
    g = torch.Generator().manual_seed(0)
    for rows, d in [(1, 64), (3, 37), (200, 512)]:  # the last one runs on the thread pool
        x, delta = torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g)
        weight = torch.randn(d, generator=g)
        torch.testing.assert_close(native.rms_norm(x, weight, 1e-5), F.rms_norm(x, (d,), weight, 1e-5))
        for alpha in (1.0, 0.5):
            hidden = x.clone()
            normed = native.add_rms_norm(hidden, delta, alpha, weight, 1e-5)
            torch.testing.assert_close(hidden, x + alpha * delta)  # updated in place
            torch.testing.assert_close(normed, F.rms_norm(x + alpha * delta, (d,), weight, 1e-5))
        fused = torch.randn(rows, 2 * d, generator=g) * 20  # far into both tails of silu
        gate, up = fused.chunk(2, dim=-1)
        torch.testing.assert_close(native.silu_mul(fused), F.silu(gate) * up)
        # Gated attention's output gate, far into both tails of the sigmoid (the kernel clamps exp's argument).
        gate = gate.contiguous()
        torch.testing.assert_close(native.sigmoid_mul(x, gate), x * torch.sigmoid(gate), atol=1e-7, rtol=1e-6)
    with pytest.raises(ValueError, match="same shape"):
        native.sigmoid_mul(torch.zeros(2, 3), torch.zeros(2, 4))


def test_argmax_matches_torch_on_ties_and_nan():
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = logits[1, 9] = 100.0  # a tie: the first index wins
    logits[2, 3] = logits[2, 500] = float("nan")  # NaN counts as the largest
    logits[3, 0] = float("nan")
    logits[4] = -float("inf")
    assert native.argmax(logits).tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("n", [1, 5, 16, 17, 31, 32, 1000, 32003])
def test_argmax_lanes_ties_and_tails_match_torch(n):
    """The one-pass kernel keeps a maximum per 16-lane slot: ties within a lane, across lanes, between the vector part
    and the tail, -inf and NaN placed anywhere must still give torch's first maximal index."""
    g = torch.Generator().manual_seed(n)
    rows = [torch.randn(n, generator=g) for _ in range(4)]
    rows.append(torch.randint(0, 3, (n,), generator=g).float())  # many ties everywhere
    for position in {0, n // 2, n - 1}:
        row = torch.full((n,), -float("inf"))
        row[position] = 0.0
        rows.append(row)  # one finite value among -inf
        row = torch.randn(n, generator=g)
        row[position] = float("nan")
        rows.append(row)
        row = torch.zeros(n)
        row[position:] = 1.0  # the maximum first at `position`, then repeated through the tail
        rows.append(row)
    rows.append(torch.full((n,), -float("inf")))
    logits = torch.stack(rows)
    assert native.argmax(logits).tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("family", ["granite_dense", "nemotron_dense"])
def test_native_short_inputs_equal_the_chunked_scan(checkpoint_dir, family):
    # Speculative verification runs k + 1 tokens per row from a kept state, a draft model one; rows may carry
    # fewer (right padding).
    path = str(checkpoint_dir(family))
    mixers = {kernel: _first_mixer(path, kernel) for kernel in ("torch", "native")}
    state = _random_state(mixers["torch"], 3, seed=4)
    full = torch.randn(3, 5, mixers["torch"].in_proj.in_features, generator=torch.Generator().manual_seed(5))
    for num_tokens in ([5, 5, 5], [5, 2, 1], [1, 1, 1], [1, 0, 1]):  # one token: a draft model's step
        counts = torch.tensor(num_tokens)
        length = max(num_tokens)
        hidden = full[:, :length]
        with torch.inference_mode():
            results = {
                k: m(hidden, MambaState(state.conv.clone(), state.ssm.clone()), counts) for k, m in mixers.items()
            }
        (out_t, state_t, scan_t), (out_n, state_n, scan_n) = results["torch"], results["native"]
        valid = torch.arange(length)[None, :] < counts[:, None]
        torch.testing.assert_close(out_n[valid], out_t[valid], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(state_n.conv, state_t.conv, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(state_n.ssm, state_t.ssm, atol=1e-5, rtol=1e-4)
        for name in ("conv_in", "x", "B", "dt"):
            a, b = getattr(scan_n, name), getattr(scan_t, name)
            torch.testing.assert_close(a[valid], b[valid], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(state.ssm, _random_state(mixers["torch"], 3, seed=4).ssm)  # the input state is kept


@pytest.mark.parametrize("rotary_dim", [16, 8])  # full and partial
def test_native_rope_equals_the_torch_rotary(rotary_dim):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 4, 16, generator=g)
    positions = torch.tensor([0, 17, 100_000])
    inv_freq = inverse_frequencies(10000.0, rotary_dim, x.device)
    expected = rotary(x[:, :, None], positions[:, None], 10000.0, rotary_dim)[:, :, 0]
    native.rope(x, positions, inv_freq, rotary_dim)  # in place
    torch.testing.assert_close(x, expected, atol=1e-5, rtol=1e-5)


# NoPE, RoPE, partial RoPE; Qwen3.5's output gate with per-head q/k norms and partial RoPE 0.25
@pytest.mark.parametrize("family", ["granite_dense", "granite_moe", "bamba", "qwen3_5"])
def test_native_attention_decode_equals_the_torch_path(checkpoint_dir, family):
    path = str(checkpoint_dir(family))
    layers = {}
    for kernel in ("torch", "native"):
        model = load_checkpoint(path, decode_kernel=kernel).model
        layers[kernel] = next(m for m in model.modules() if isinstance(m, Attention))
    assert layers["native"].native and not layers["torch"].native
    a = layers["torch"].config
    g = torch.Generator().manual_seed(6)
    # Paged: 5 slots of 16 positions in blocks of 4, handed out round-robin so no slot's blocks are consecutive.
    blocks = BlockTable(5, 16, 1 + 5 * 4, 4, torch.device("cpu"))
    for length in (4, 8, 12, 16):
        for slot in range(5):
            blocks.ensure(slot, length)
    tokens = blocks.num_blocks * blocks.block_size
    cache = KVCache(
        torch.randn(a.num_kv_heads, tokens, a.head_dim, generator=g),
        torch.randn(a.num_kv_heads, tokens, a.head_dim, generator=g),
        blocks,
    )
    hidden = torch.randn(3, 1, layers["torch"].q_proj.in_features, generator=g)
    for slot_ids, prefix in (([0, 1, 2], True), ([4, 0, 2], False)):
        batch = ForwardBatch(
            torch.tensor(slot_ids),
            torch.tensor([0, 7, 15]),
            torch.ones(3, dtype=torch.long),
            slots_are_prefix=prefix,
            one_token_each=True,
        )
        caches = {k: KVCache(cache.key.clone(), cache.value.clone(), blocks) for k in layers}
        with torch.inference_mode():
            outs = {k: layer(hidden, batch, caches[k]) for k, layer in layers.items()}
        torch.testing.assert_close(outs["native"], outs["torch"], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(caches["native"].key, caches["torch"].key)
        torch.testing.assert_close(caches["native"].value, caches["torch"].value)


@pytest.mark.parametrize("family", ["granite_dense", "nemotron_dense", "bamba"])  # nemotron: 2 groups, 2 norm groups
def test_native_prefill_equals_the_chunked_scan(checkpoint_dir, family):
    path = str(checkpoint_dir(family))
    mixers = {kernel: _first_mixer(path, kernel) for kernel in ("torch", "native")}
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(3, 21, mixers["torch"].in_proj.in_features, generator=g)  # 21 > chunk size 16
    num_tokens = torch.tensor([21, 7, 1])  # right padding after 7 and 1 tokens
    with torch.inference_mode():
        outs = {k: m(hidden, None, num_tokens) for k, m in mixers.items()}
    (native_out, native_state, scan), (torch_out, torch_state, _) = outs["native"], outs["torch"]
    assert scan is None
    for row, n in enumerate(num_tokens.tolist()):
        torch.testing.assert_close(native_out[row, :n], torch_out[row, :n], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(native_state.conv, torch_state.conv, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(native_state.ssm, torch_state.ssm, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["granite_dense", "nemotron_dense"])
def test_native_prefill_continues_a_state_like_the_chunked_scan(checkpoint_dir, family):
    """A chunked prefill's next chunk (longer than the stepwise path takes) from a kept state: outputs, states and
    the scan inputs (for a later state shift) equal the PyTorch path's."""
    path = str(checkpoint_dir(family))
    mixers = {kernel: _first_mixer(path, kernel) for kernel in ("torch", "native")}
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(3, 19, mixers["torch"].in_proj.in_features, generator=g)  # 19 > NATIVE_STEPWISE_MAX_TOKENS
    num_tokens = torch.tensor([19, 12, 2])
    state = _random_state(mixers["torch"], 3, seed=10)
    with torch.inference_mode():
        outs = {k: m(hidden, MambaState(state.conv.clone(), state.ssm.clone()), num_tokens) for k, m in mixers.items()}
    (native_out, native_state, native_scan), (torch_out, torch_state, torch_scan) = outs["native"], outs["torch"]
    for row, n in enumerate(num_tokens.tolist()):
        torch.testing.assert_close(native_out[row, :n], torch_out[row, :n], atol=2e-5, rtol=1e-5)
        for field in ("conv_in", "x", "B", "dt"):
            torch.testing.assert_close(
                getattr(native_scan, field)[row, :n], getattr(torch_scan, field)[row, :n], atol=1e-5, rtol=1e-5
            )
    torch.testing.assert_close(native_state.conv, torch_state.conv, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(native_state.ssm, torch_state.ssm, atol=2e-5, rtol=1e-5)
