"""Decode plans of Jamba (Mamba1 + attention + MoE / MLP) against the module-by-module native path, bit for bit:
steps with changing batch sizes and reused slots, verification + keep under forced acceptance patterns, greedy
speculation (n-gram, a Mamba1 draft, a Mamba2 hybrid draft) equal to plain greedy with the plan on. Layouts: the two
of tests/tiny_jamba.py and an odd one (d_inner 35, state size 5, dt rank 3, a 2-tap conv)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import JambaConfig, JambaForCausalLM

from tests.tiny_jamba import _COMMON, build_jamba_checkpoint, randomise_jamba
from tests.tiny_models import BOS, EOS, make_tokenizer
from tests.workers.model.plan_checks import (
    assert_forced_acceptance_keeps_prefill_states,
    assert_plan_steps_equal_module_steps,
    assert_sixteen_rows_keep_their_own_counts,
    assert_speculation_equals,
    assert_verification_and_keep_equal_module_steps,
    generate,
    random_pool,
)
from workers import SpeculativeConfig
from workers.model import load_checkpoint
from workers.model.layers.mamba1 import Mamba1Mixer
from workers.model.steps.decode_plan import DecodePlan, unsupported_reason

LAYOUTS = ["jamba_moe", "jamba_dense", "jamba_odd"]
# An odd Jamba layout: width 35, d_inner 35 (expand 1), state 5, dt_rank 3, a 2-tap conv, a 2-expert MoE.
MIXER = dict(mamba_expand=1, mamba_d_state=5, mamba_dt_rank=3, mamba_d_conv=2)
LAYERS = dict(num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=1, expert_layer_period=2)
EXPERTS = dict(expert_layer_offset=1, num_experts=2, num_experts_per_tok=1)
ODD = dict(hidden_size=35, num_attention_heads=5, num_key_value_heads=1, **MIXER, **LAYERS, **EXPERTS)


def _build_odd(directory):
    torch.manual_seed(0)
    model = JambaForCausalLM(JambaConfig(**{**_COMMON, **ODD}))
    randomise_jamba(model, 0)
    model.save_pretrained(directory)
    make_tokenizer().save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": BOS}))
    return directory


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """layout → its checkpoint directory, built once per module ("+near": a perturbed copy, a partial drafter)."""
    built = {}

    def get(name: str) -> str:
        if name not in built:
            directory = tmp_path_factory.mktemp(name.replace("+", "_"))
            layout, _, flavour = name.partition("+")
            if layout == "jamba_odd":
                built[name] = _build_odd(directory)
            else:
                built[name] = build_jamba_checkpoint(layout, directory, perturb=0.003 if flavour else 0.0)
        return str(built[name])

    return get


def test_the_odd_layout_has_the_odd_shapes(paths):
    model = load_checkpoint(paths("jamba_odd")).model
    m = next(mod for mod in model.modules() if isinstance(mod, Mamba1Mixer)).config
    assert (m.intermediate_size, m.state_size, m.dt_rank, m.conv_kernel) == (35, 5, 3, 2)
    assert unsupported_reason(model) is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plan_steps_equal_the_module_path_bit_for_bit(paths, layout):
    model = load_checkpoint(paths(layout)).model
    reference = random_pool(model, slots=4, capacity=40, seed=0, ssm_scale=0.3)
    # Batch sizes change (requests finish, slots are reused).
    assert_plan_steps_equal_module_steps(model, reference, [3, 3, 4, 2, 1, 4, 4], 40, hidden=False)


@pytest.mark.parametrize("accepted", [[1, 1, 1], [4, 4, 4], [2, 4, 1]], ids=["none", "all", "mixed"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_verification_and_keep_leave_the_states_of_plain_module_steps(paths, layout, accepted):
    model = load_checkpoint(paths(layout)).model
    stepped = random_pool(model, slots=3, capacity=16, seed=2, ssm_scale=0.3)
    assert_verification_and_keep_equal_module_steps(model, stepped, accepted, [5, 0, 11], hidden=False)


def test_sixteen_rows_keep_each_their_own_count(paths):
    """16 rows of 5 tokens, every count 1 … 5 among them, against 5 plain plan steps (the MoE layout)."""
    model = load_checkpoint(paths("jamba_moe")).model
    assert_sixteen_rows_keep_their_own_counts(model)


@pytest.mark.parametrize("layout", ["jamba_dense", "jamba_odd"])
def test_forced_acceptance_patterns_through_the_plan_keep_plain_states(paths, layout):
    """Scripted drafts (0 drafts, none, all or some accepted, mixed across rows and steps) verified and shifted by
    the plan: every slot holds the states and KV of a fresh prefill of its kept tokens, and the output is plain
    greedy decoding's."""
    assert_forced_acceptance_keeps_prefill_states(paths(layout))


@pytest.mark.parametrize(
    "method, draft", [("ngram", None), ("draft", "jamba_moe+near"), ("draft", "draft_hybrid")], ids=str
)
def test_greedy_speculation_through_plans_equals_plain_greedy(paths, checkpoint_dir, method, draft):
    path = paths("jamba_moe")
    expected, _ = generate(path, decode_plan=False)
    plain, runner = generate(path)
    assert plain == expected and isinstance(runner._scheduler.workspace.plan, DecodePlan)
    draft_path = None if draft is None else paths(draft) if draft.startswith("jamba") else str(checkpoint_dir(draft))
    spec = SpeculativeConfig(
        method, 3, prompt_lookup_min=1, prompt_lookup_max=2, draft_model=draft_path, policy="fixed"
    )
    assert_speculation_equals(path, spec, expected)
