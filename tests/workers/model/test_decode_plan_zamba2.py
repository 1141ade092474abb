"""Zamba2's shared transformer blocks in a decode plan: steps, verification and keep equal the native module path
bit for bit (both layouts, and the checkpoint layout with a copy of the shared weights under every use); forced
acceptance patterns leave every slot as a fresh prefill of its kept tokens; greedy generation and greedy speculation
(n-gram, draft, hybrid draft) through plans equal plain greedy decoding. Transformers checks the outputs themselves
in test_family_zamba2.py, whose runners use the plan."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tests.workers.model.plan_checks import (
    NGRAM,
    assert_forced_acceptance_keeps_prefill_states,
    assert_plan_steps_equal_module_steps,
    assert_sixteen_rows_keep_their_own_counts,
    assert_speculation_equals,
    assert_verification_and_keep_equal_module_steps,
    generate,
    random_pool,
)
from tests.zamba2_models import copy_shared_weights_to_every_use
from workers import SpeculativeConfig
from workers.model import load_checkpoint
from workers.model.checkpoint.config import SHARED_ATTENTION
from workers.model.kernels import native
from workers.model.steps.decode_plan import DecodePlan, unsupported_reason
from workers.model.steps.plan_records import Op

LAYOUTS = ["zamba2_abab", "zamba2_lora", "zamba2_lora_copies"]


@pytest.fixture(scope="module")
def paths(checkpoint_dir, tmp_path_factory):
    """layout → checkpoint directory; "zamba2_lora_copies" stores the shared weights under every use."""
    built = {name: checkpoint_dir(name) for name in LAYOUTS[:2]}
    copies = shutil.copytree(built["zamba2_lora"], tmp_path_factory.mktemp("copies") / "zamba2_lora_copies")
    copy_shared_weights_to_every_use(copies / "model.safetensors")
    return {**built, "zamba2_lora_copies": copies}


def _uses(model) -> list:
    return [block.mixer for block in model.blocks if block.kind == SHARED_ATTENTION]


def _gelu_mul(lib, h: torch.Tensor) -> torch.Tensor:
    """gelu(gate) · up for h [rows, 2n] through the library `lib` (one instruction-set variant's build)."""
    rows, n = h.shape[0], h.shape[1] // 2
    out = torch.empty(rows, n)
    lib.gelu_mul(h.data_ptr(), out.data_ptr(), rows, n, torch.get_num_threads())
    return out


@pytest.mark.parametrize("isa", native.cpu_isas() if native.available() else [])
def test_native_gelu_mul_is_the_erf_gelu_and_independent_of_the_row_count(isa):
    """gelu(gate) · up against torch's erf-form F.gelu and a float64 reference, into both tails, on every
    instruction-set variant this CPU runs; a row's result does not depend on how many rows a call has (a plan's
    verification runs more rows than a module step)."""
    lib = native.load(isa)
    g = torch.Generator().manual_seed(0)
    for rows, n in [(1, 64), (3, 37), (200, 512)]:  # widths off every vector width; the last on the thread pool
        fused = torch.randn(rows, 2 * n, generator=g) * 6
        gate, up = fused.chunk(2, dim=-1)
        got = _gelu_mul(lib, fused)
        reference = F.gelu(gate) * up
        torch.testing.assert_close(got, reference)
        exact = F.gelu(gate.double()) * up.double()  # about as far from it as torch's own float32 result
        assert (got.double() - exact).abs().max() <= 1.5 * (reference.double() - exact).abs().max()
        assert torch.equal(torch.cat([_gelu_mul(lib, row[None]) for row in fused]), got)
    x = torch.linspace(-20, 20, 40001)  # the whole curve: both tails, erfc past float32's range, every lane
    got, exact = _gelu_mul(lib, torch.cat([x, torch.ones_like(x)])[None])[0], F.gelu(x.double())
    assert (got.double() - exact).abs().max() <= (F.gelu(x).double() - exact).abs().max()
    assert torch.equal(got[x < -14], torch.zeros_like(got[x < -14]))  # -0.0 == 0.0: gelu underflows to zero


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_use_records_the_shared_blocks_packed_panels(paths, name):
    """The linears of uses of one shared block are one packed module, and the records of every use point at it:
    as many distinct q_proj / down_proj panels among the records as there are shared blocks."""
    model = load_checkpoint(str(paths[name])).model
    assert unsupported_reason(model) is None
    uses, num_blocks = _uses(model), model.config.shared_block.num_blocks
    assert uses[0].attention.q_proj.base is uses[2].attention.q_proj.base is not uses[1].attention.q_proj.base
    plan = DecodePlan(model, random_pool(model, slots=2, capacity=8, seed=0))
    records = plan.records(2, 1)
    panels = {int(r[2]) for r in records if int(r[0]) == Op.LINEAR}  # word 2: a LINEAR record's weight panels
    for shared in ("q_proj", "k_proj", "v_proj", "gate_up_proj"):
        bases = [getattr(use.attention if shared != "gate_up_proj" else use, shared).base for use in uses]
        assert len({base.panels.data_ptr() for base in bases}) == num_blocks
        assert {base.panels.data_ptr() for base in bases} <= panels
    assert {use.down_proj.panels.data_ptr() for use in uses} <= panels
    assert len({use.down_proj.panels.data_ptr() for use in uses}) == num_blocks
    assert {use.linear.panels.data_ptr() for use in uses} <= panels  # each use's own projection
    assert int(records[:, 0].eq(Op.GELU_MUL).sum()) == len(uses)


def test_shared_blocks_outside_the_native_kernels_say_why_and_bad_input_is_refused(paths):
    path = str(paths["zamba2_lora"])
    torch_steps = load_checkpoint(path, decode_kernel="torch").model
    assert unsupported_reason(torch_steps) == "Zamba2's shared blocks do not run through the native kernels"
    torch_linears = load_checkpoint(path, linear_backend="torch").model
    assert unsupported_reason(torch_linears) == "a Zamba2 shared block has linears outside the native kernel"
    model = load_checkpoint(path).model
    plan = DecodePlan(model, random_pool(model, slots=2, capacity=8, seed=0))
    with pytest.raises(ValueError, match="position outside the KV cache"):  # refused by the first use's attention
        plan.run([1, 2], [3, 8])
    with pytest.raises(ValueError, match=r"token id outside \[0, "):
        plan.run([model.config.vocab_size], [0])
    model.config = replace(model.config, residual_multiplier=0.5)
    assert "residual multiplier" in unsupported_reason(model)


@pytest.mark.parametrize(
    "name, options",
    [
        *((name, {}) for name in LAYOUTS),
        ("zamba2_lora", {"quantization": "int8"}),
        ("zamba2_abab", {"dtype": "bfloat16"}),
    ],
)  # int8 and bfloat16 panels: every shared linear and adapter records the kernel its module calls
def test_plan_steps_equal_the_module_path_bit_for_bit(paths, name, options):
    model = load_checkpoint(str(paths[name]), **options).model
    assert unsupported_reason(model) is None
    reference = random_pool(model, slots=4, capacity=24, seed=0, ssm_scale=0.3)
    # Batch sizes change between steps (requests finish); rows sit at unrelated positions, row 0 past the first KV
    # block of 16 positions; slots are reused; every use's own KV layer is compared.
    assert_plan_steps_equal_module_steps(model, reference, [3, 3, 4, 2, 1, 4, 4], 24, lambda step: min(step + 17, 23))


@pytest.mark.parametrize("accepted", [[1, 1, 1], [4, 4, 4], [2, 4, 1]], ids=["none", "all", "mixed"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_verification_and_keep_leave_the_states_of_plain_module_steps(paths, name, accepted):
    """num_accepted_tokens per row: 1 (every draft rejected), 4 (all three accepted), or a mix across rows."""
    model = load_checkpoint(str(paths[name])).model
    stepped = random_pool(model, slots=3, capacity=16, seed=2, ssm_scale=0.3)
    assert_verification_and_keep_equal_module_steps(model, stepped, accepted, [5, 0, 11])


def test_sixteen_ragged_rows_verify_and_keep_each_its_own_count(paths):
    """16 rows of 5 tokens from unrelated positions (crossing KV blocks), every count 1 … 5 among them."""
    model = load_checkpoint(str(paths["zamba2_lora"])).model
    assert_sixteen_rows_keep_their_own_counts(model, ssm_scale=0.3)


@pytest.mark.parametrize("name", LAYOUTS[:2])
def test_forced_acceptance_patterns_through_the_plan_keep_prefill_states(paths, name):
    """Scripted drafts (0 drafts, none, all or some accepted, mixed across rows and steps) verified and shifted by
    the plan: after every step each slot holds the recurrent states and every use's KV entries of a fresh prefill
    of its kept tokens, and the output is plain greedy decoding's."""
    assert_forced_acceptance_keeps_prefill_states(paths[name])


@pytest.mark.parametrize("name", LAYOUTS[:2])
def test_greedy_generation_and_speculation_through_plans_equal_plain(paths, checkpoint_dir, name):
    """Plain, n-gram, draft (the other Zamba2 layout, itself planned) and hybrid draft (a Bamba model)."""
    path = str(paths[name])
    expected, _ = generate(path, decode_plan=False)
    plain, runner = generate(path)
    assert plain == expected and isinstance(runner._scheduler.workspace.plan, DecodePlan)
    other = "zamba2_lora" if name == "zamba2_abab" else "zamba2_abab"
    methods = [
        NGRAM,
        SpeculativeConfig("draft", 3, draft_model=str(paths[other]), policy="fixed"),
        SpeculativeConfig("draft", 3, draft_model=str(checkpoint_dir("draft_hybrid")), policy="fixed"),
    ]
    for speculative in methods:
        assert_speculation_equals(path, speculative, expected)
