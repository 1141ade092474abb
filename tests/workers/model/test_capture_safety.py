"""The steps a CUDA graph captures — a plain decode step, a verification step and its state shift — contain no host
synchronisation, no data-dependent shape and no host↔device copy (checked under FakeTensorMode on CPU), and the
static-shape form they use computes what the default path computes."""

from __future__ import annotations

import pytest
import torch

from tests.workers.model.test_cuda_graph import OTHER_DENSE, OTHER_MOE
from workers.model import ForwardBatch, StatePool, load_checkpoint
from workers.model.steps.capture_safety import find_capture_hazards

FAMILIES = ["granite_dense", "bamba", "nemotron_dense", "qwen3_5", *OTHER_DENSE]  # Mamba2, Gated DeltaNet and the rest
MOE = ["granite_moe", "nemotron_moe", "qwen3_next", "qwen3_5_moe", *OTHER_MOE]
ACCEPTED = [1, 3, 4]  # num_accepted_tokens per row after verifying 4 tokens


class Step:
    """A model with a filled pool and the static inputs of a decode and a verification step for 3 rows."""

    def __init__(self, path: str, kernel: str = "torch", dtype: str = "float32"):
        self.model = load_checkpoint(path, dtype=dtype, decode_kernel=kernel, linear_backend="torch").model
        self.pool = StatePool(self.model.config, 4, 32, torch.device("cpu"), getattr(torch, dtype))
        generator = torch.Generator().manual_seed(0)
        for buffer in (self.pool.conv, self.pool.ssm, self.pool.key, self.pool.value):
            buffer.copy_(torch.randn(buffer.shape, generator=generator))
        b, self.slots = 3, torch.arange(3)
        cache_lens = torch.tensor([3, 9, 17])
        self.decode_ids = torch.randint(0, 128, (b, 1), generator=generator)
        self.verify_ids = torch.randint(0, 128, (b, 4), generator=generator)
        self.one = ForwardBatch(self.slots, cache_lens, torch.ones(b, dtype=torch.long), True, True)
        self.four = ForwardBatch(self.slots, cache_lens, torch.full((b,), 4), True)
        self.accepted = torch.tensor(ACCEPTED)

    def decode(self, static: bool) -> torch.Tensor:
        states = self.pool.prefix(3)
        out = self.model(self.decode_ids, self.one, states, self.pool.kv_caches(), in_place=True, static_shapes=static)
        return self.model.logits(out.hidden[:, 0])

    def verify(self, static: bool) -> torch.Tensor:
        states = self.pool.read(self.slots)
        out = self.model(self.verify_ids, self.four, states, self.pool.kv_caches(), True, static_shapes=static)
        self.pool.write(self.slots, self.model.states_after(states, out.scan_inputs, self.accepted, static))
        return self.model.logits(out.hidden)


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_static_decode_and_verification_steps_are_capture_safe(checkpoint_dir, family):
    step = Step(str(checkpoint_dir(family)))
    step.decode(static=True)  # warm-up, as before a capture: fills caches (RoPE frequencies) with real tensors
    before = [t.clone() for t in (step.pool.conv, step.pool.ssm, step.pool.key)]
    assert find_capture_hazards(lambda: step.decode(static=True)) == []
    assert find_capture_hazards(lambda: step.verify(static=True)) == []
    after = (step.pool.conv, step.pool.ssm, step.pool.key)
    assert all(torch.equal(x, y) for x, y in zip(before, after))  # fake tensors: nothing real was written
    # The default eager path is not capture-safe (the check can fail): attention reads its span on the host.
    assert any("data-dependent" in h for h in find_capture_hazards(lambda: step.decode(static=False)))


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_static_steps_compute_what_the_default_path_computes(checkpoint_dir, family):
    default, static = Step(str(checkpoint_dir(family))), Step(str(checkpoint_dir(family)))
    for name in ("decode", "verify", "decode"):  # verify shifts the states the next decode reads
        expected, got = getattr(default, name)(static=False), getattr(static, name)(static=True)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        for buffer in ("conv", "ssm", "key", "value"):  # attention rounds differently: so do the states after it
            torch.testing.assert_close(
                getattr(static.pool, buffer), getattr(default.pool, buffer), atol=1e-5, rtol=1e-5
            )


def test_the_check_names_each_kind_of_hazard():
    x = torch.arange(6.0)
    assert find_capture_hazards(lambda: x + 1) == []
    assert "device→host" in find_capture_hazards(lambda: x.sum().item())[0]
    assert "data-dependent" in find_capture_hazards(lambda: x[x > 2])[0]
    assert "host data" in find_capture_hazards(lambda: x + torch.tensor([1.0] * 6))[0]
    assert "host↔device copy" in find_capture_hazards(lambda: x.to("meta"))[0]


@pytest.mark.parametrize("family", MOE)
@torch.inference_mode()
def test_moe_steps_are_capture_safe_in_bfloat16(checkpoint_dir, family):
    """MoE steps route on the device and run their experts as grouped GEMMs, which take bfloat16 (as on CUDA: the
    float32 form is refused by torch's own shape check, so the lint runs the bfloat16 model)."""
    step = Step(str(checkpoint_dir(family)), dtype="bfloat16")
    step.decode(static=True)
    assert find_capture_hazards(lambda: step.decode(static=True)) == []
    assert find_capture_hazards(lambda: step.verify(static=True)) == []
    # The MoE block alone: its static form is safe, its eager form reads which experts are used on the host.
    block = next(block for block in step.model.blocks if block.kind == "moe")
    x = torch.randn(3, step.model.config.hidden_size, dtype=torch.bfloat16)
    assert find_capture_hazards(lambda: block.mixer(x, static_shapes=True)) == []
    eager = find_capture_hazards(lambda: block.mixer(x, static_shapes=False))
    assert eager and all("device→host" in h or "data-dependent" in h for h in eager), eager


@pytest.mark.parametrize("family", MOE)
@torch.inference_mode()
def test_static_moe_steps_compute_what_the_default_path_computes(checkpoint_dir, family):
    default, static = Step(str(checkpoint_dir(family))), Step(str(checkpoint_dir(family)))
    for name in ("decode", "verify", "decode"):
        expected, got = getattr(default, name)(static=False), getattr(static, name)(static=True)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
