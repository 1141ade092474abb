"""Falcon-H1's parallel blocks in a decode plan: steps, verification and keep equal the module path bit for bit
(generation through the plan is checked against transformers in test_family_falcon_h1.py, where the runner uses it
by default); the mixer-norm variants the native kernels do not compute say why and stay on the module path."""

from __future__ import annotations

import pytest
import torch

from tests.falcon_h1_models import build_falcon_h1
from tests.workers.model.plan_checks import (
    assert_plan_steps_equal_module_steps,
    assert_verification_and_keep_equal_plan_steps,
    clone,
    random_pool,
)
from workers.model import load_checkpoint
from workers.model.steps.decode_plan import DecodePlan, unsupported_reason


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {name: build_falcon_h1(name, tmp_path_factory.mktemp(name)) for name in ("falcon_h1", "falcon_h1_no_norm")}


def test_plan_steps_verification_and_keep_equal_the_module_path(paths):
    model = load_checkpoint(str(paths["falcon_h1"])).model
    assert unsupported_reason(model) is None
    reference = random_pool(model, slots=4, capacity=16, seed=0)
    # Batch sizes change between steps: records per size.
    plan, planned = assert_plan_steps_equal_module_steps(model, reference, [3, 4, 1, 4], 12, hidden=False)
    # Verification of [x_last, d_1, d_2, d_3] per row == four plain steps; keep(n) == the state after n steps.
    verify_plan = DecodePlan(model, clone(planned), tokens_per_row=4)
    tokens = torch.randint(0, model.config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(2)).tolist()
    assert_verification_and_keep_equal_plan_steps(plan, verify_plan, tokens, [5, 0, 11], [2, 4, 1])


def test_mixer_norm_variants_without_a_native_kernel_say_why(paths):
    model = load_checkpoint(str(paths["falcon_h1_no_norm"])).model
    assert model.blocks[0].mixer.mamba.decode_kernel == "torch"  # "auto" chose native, which this norm lacks
    assert model.blocks[0].mixer.self_attn.native  # the rest of the step still runs native
    assert "norm variant (no norm, or norm before the gate) has no native kernel" in unsupported_reason(model)
