"""Speculative decoding on Jamba (Mamba1 state shifting): forced acceptance patterns leave every state equal to a
fresh prefill of the kept tokens; a Jamba draft's own Mamba1 states follow what it has seen; greedy speculative ==
greedy plain with n-gram drafts and with draft models (attention-only, Mamba2 hybrid, Mamba1 hybrid, itself)."""

from __future__ import annotations

import pytest

from tests.tiny_jamba import build_jamba_checkpoint
from tests.tiny_models import engine_config
from tests.workers.spec_decode import test_greedy_exactness as exactness
from tests.workers.spec_decode import test_state_shifting as shifting
from tests.workers.spec_decode.test_state_shifting import assert_forced_acceptance_exact
from workers import ModelRunner, SamplingParams, SpeculativeConfig
from workers.scheduler import Scheduler
from workers.spec_decode.draft_model import DraftModelProposer

TARGET = "jamba_moe"
NEAR_DRAFT = "jamba_moe+near"  # a Mamba1 hybrid draft that accepts partially
# The state checks run a reference prefill per request and step: on the MoE-free layout (3-tap conv), cheaper; the
# MoE layout (4-tap conv) is the target of the greedy exactness runs.
SHIFT_TARGET, SHIFT_DRAFT = "jamba_dense", "jamba_dense+near"
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def jamba_dir(tmp_path_factory):
    """layout name → its tiny checkpoint directory (built once per module)."""
    built = {}

    def get(name: str):
        if name not in built:
            layout, _, flavour = name.partition("+")  # "+near": perturbed, a draft that agrees often, not always
            directory = tmp_path_factory.mktemp(name.replace("+", "_"))
            built[name] = build_jamba_checkpoint(layout, directory, perturb=0.003 if flavour == "near" else 0.0)
        return built[name]

    return get


def test_forced_acceptance_patterns_keep_states_exact(jamba_dir):
    assert_forced_acceptance_exact(ModelRunner.from_pretrained(str(jamba_dir(SHIFT_TARGET)), max_num_seqs=4))


def test_a_jamba_draft_state_is_shifted_to_what_it_has_seen(jamba_dir):
    # The reference linear path: this test is about the shifting logic, compared at float32 rounding level.
    target = ModelRunner.from_pretrained(str(jamba_dir(SHIFT_TARGET)), max_num_seqs=3, linear_backend="torch")
    draft_runner = ModelRunner.from_pretrained(str(jamba_dir(SHIFT_DRAFT)), linear_backend="torch")
    prompts = shifting._prompts(seed=3)
    reference = {i: r.token_ids for i, r in enumerate(target.generate(prompts, shifting.PARAMS))}
    proposer = DraftModelProposer(draft_runner.model)
    scheduler = Scheduler(target.model, engine_config(3, 3), shifting._requests(prompts), proposer)
    steps_checked = 0
    while scheduler.has_work():
        scheduler.step()
        for request in scheduler.running:
            covered = proposer.covered[request.slot]
            if covered:
                tokens = (request.prompt + request.output)[:covered]
                shifting._assert_slot_matches(proposer.pool, request.slot, draft_runner.model, tokens)
                steps_checked += 1
            tokens = (request.prompt + request.output)[:-1]
            shifting._assert_slot_matches(scheduler.pool, request.slot, target.model, tokens)
    assert steps_checked > 10
    assert {r.index: r.output for r in scheduler.finished} == reference


@pytest.fixture(scope="module")
def plain_outputs(jamba_dir):
    cache: dict[int, list[list[int]]] = {}

    def get(batch: int) -> list[list[int]]:
        if batch not in cache:
            runner = ModelRunner.from_pretrained(str(jamba_dir(TARGET)), max_num_seqs=8)
            outputs = runner.generate(exactness._prompts(batch, batch), PARAMS)
            cache[batch] = [r.token_ids for r in outputs]
        return cache[batch]

    return get


def _speculative(method: str, jamba_dir, checkpoint_dir) -> SpeculativeConfig:
    """`ngram` or a draft model, always asking for k drafts (every step verifies)."""
    if method == "ngram":
        return SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3, policy="fixed")
    drafts = {"self": lambda: jamba_dir(TARGET), "mamba1": lambda: jamba_dir(NEAR_DRAFT),
              "attention": lambda: checkpoint_dir("draft_attention"), "mamba2": lambda: checkpoint_dir("draft_hybrid")}  # fmt: skip
    return SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=str(drafts[method]()), policy="fixed")


@pytest.mark.parametrize(
    "method, batch",
    [
        ("ngram", 1),
        ("ngram", 5),
        ("ngram", 16),
        ("mamba1", 1),
        ("mamba1", 5),
        ("mamba1", 16),
        ("attention", 5),
        ("mamba2", 5),
        ("self", 5),
    ],
)
def test_greedy_speculative_equals_greedy_plain(method, batch, jamba_dir, checkpoint_dir, plain_outputs):
    speculative = _speculative(method, jamba_dir, checkpoint_dir)
    runner = ModelRunner.from_pretrained(str(jamba_dir(TARGET)), max_num_seqs=8, speculative=speculative)
    results = runner.generate(exactness._prompts(batch, batch), PARAMS)
    assert [r.token_ids for r in results] == plain_outputs(batch)
    stats = runner.spec_stats()
    assert stats["num_drafts"] > 0  # drafts were proposed and verified
    if method == "self":
        assert stats["acceptance_rate"] == 1.0  # a model drafting for itself is always right under greedy
    if method == "mamba1":
        assert 0.0 < stats["acceptance_rate"] < 1.0  # partial acceptance: both sides' states were shifted back
