"""Falcon-H1's parallel blocks in a decode plan: steps, verification and keep equal the module path bit for bit
(generation through the plan is checked against transformers in test_family_falcon_h1.py, where the runner uses it
by default); the mixer-norm variants the native kernels do not compute say why and stay on the module path."""

from __future__ import annotations

import pytest
import torch

from tests.falcon_h1_models import build_falcon_h1
from tests.workers.model.test_decode_plan import _clone, _module_step, _random_pool
from workers.model import load_checkpoint
from workers.model.steps.decode_plan import DecodePlan, unsupported_reason


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {name: build_falcon_h1(name, tmp_path_factory.mktemp(name)) for name in ("falcon_h1", "falcon_h1_no_norm")}


def test_plan_steps_verification_and_keep_equal_the_module_path(paths):
    model = load_checkpoint(str(paths["falcon_h1"])).model
    assert unsupported_reason(model) is None
    reference = _random_pool(model, slots=4, capacity=16, seed=0)
    planned = _clone(reference)
    plan = DecodePlan(model, planned)
    g = torch.Generator().manual_seed(1)
    for step, b in enumerate([3, 4, 1, 4]):  # batch sizes change between steps: records per size
        token_ids = torch.randint(0, model.config.vocab_size, (b,), generator=g).tolist()
        positions = torch.randint(0, 12, (b,), generator=g).tolist()
        assert torch.equal(plan.run(token_ids, positions), _module_step(model, reference, token_ids, positions))
        for name in ("conv", "ssm", "key", "value"):
            assert torch.equal(getattr(planned, name), getattr(reference, name)), f"{name} after step {step}"
    # Verification of [x_last, d_1, d_2, d_3] per row == four plain steps; keep(n) == the state after n steps.
    verified = _clone(planned)
    verify_plan = DecodePlan(model, verified, tokens_per_row=4)
    tokens = torch.randint(0, model.config.vocab_size, (3, 4), generator=g).tolist()
    positions = [5, 0, 11]
    step_logits, snapshots = [], [(planned.conv.clone(), planned.ssm.clone())]
    for t in range(4):
        step_logits.append(plan.run([row[t] for row in tokens], [p + t for p in positions]).clone())
        snapshots.append((planned.conv.clone(), planned.ssm.clone()))
    logits = verify_plan.verify(tokens, positions)
    for t in range(4):
        assert torch.equal(logits[:, t], step_logits[t]), f"token {t}"
    assert torch.equal(verified.key, planned.key) and torch.equal(verified.value, planned.value)
    accepted = [2, 4, 1]
    verify_plan.keep(accepted)
    for row, n in enumerate(accepted):
        assert torch.equal(verified.conv[:, row], snapshots[n][0][:, row]), f"conv window of row {row}"
        assert torch.equal(verified.ssm[:, row], snapshots[n][1][:, row]), f"SSM state of row {row}"


def test_mixer_norm_variants_without_a_native_kernel_say_why(paths):
    model = load_checkpoint(str(paths["falcon_h1_no_norm"])).model
    assert model.blocks[0].mixer.mamba.decode_kernel == "torch"  # "auto" chose native, which this norm lacks
    assert model.blocks[0].mixer.self_attn.native  # the rest of the step still runs native
    assert "norm variant (no norm, or norm before the gate) has no native kernel" in unsupported_reason(model)
