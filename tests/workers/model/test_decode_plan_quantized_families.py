"""The new families' decode plans with int8 and bfloat16 weights: every linear a plan records (Mamba1's x_proj and
dt_proj, KDA's f_b / g_b, latent attention's projections, the short conv's, OLMo's post-norm attention) takes the
panel kernel its module calls, so plan steps equal the module path bit for bit there too."""

from __future__ import annotations

import pytest

from tests.workers.model.plan_checks import assert_plan_steps_equal_module_steps, random_pool
from workers.model import load_checkpoint
from workers.model.steps.decode_plan import unsupported_reason
from workers.model.steps.plan_records import Op

FAMILIES = ["jamba_moe", "kimi_linear", "kimi_linear_qlora", "lfm2_moe", "lfm3", "olmo_hybrid"]


@pytest.mark.parametrize(
    ("options", "panels"),
    [({"quantization": "int8"}, Op.LINEAR_INT8), ({"dtype": "bfloat16"}, Op.LINEAR_BF16)],
    ids=["int8", "bfloat16"],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_plan_steps_equal_the_module_path_bit_for_bit(checkpoint_dir, family, options, panels):
    model = load_checkpoint(str(checkpoint_dir(family)), **options).model
    assert unsupported_reason(model) is None
    reference = random_pool(model, slots=4, capacity=24, seed=0, ssm_scale=0.3)
    # Batch sizes change between steps; row 0 crosses the first KV block of 16 positions (and LFM3's window of 8).
    plan, _ = assert_plan_steps_equal_module_steps(
        model, reference, [3, 4, 2, 1, 4], 24, lambda step: min(step + 15, 23)
    )
    codes = plan.records(4, 1)[:, 0].tolist()
    assert codes.count(panels) >= 4, "the block linears run the quantized panels"
