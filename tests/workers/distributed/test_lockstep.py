"""Lockstep at T = 2 in the test-only replicated mode (every rank holds the whole model; the follower process, the
control channel and the leader's decisions run for real) against T = 1 on the same tiny checkpoint: greedy,
speculative (n-gram, draft model, MTP), prefix caching, n samples, seeded sampling, structured outputs, logprobs and
scoring equal the one-rank runner's output exactly; a follower that diverges or dies fails the leader within seconds.

Each T = 2 runner spawns one follower (~3 s of imports on 2 cores), so each configuration is started once per module.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from workers import ModelRunner, SamplingParams, SpeculativeConfig, StructuredOutputsParams
from workers.config import EngineConfig, ParallelConfig
from workers.distributed.channel import RankDivergence
from workers.model.distributed.group import RankFailure

LONG = [(7 * i) % 120 + 4 for i in range(80)]  # two prompts share 75 tokens: a prefix-cache checkpoint at 64
PROMPTS = [[5, 6, 7, 8, 9] * 4, [11, 12, 13], LONG[:75] + [20, 21, 22, 23], LONG]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
FAILURE_WAIT_S = 10.0

# name → (family, engine options); "ngram" also runs without prefix caching (on == off is checked against T = 1's on).
CONFIGS = {
    "plain": ("granite_dense", {}),
    "ngram": (
        "granite_dense",
        dict(
            speculative=SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3, policy="fixed"),
            enable_prefix_caching=False,
        ),
    ),
    "draft": ("granite_dense", dict(speculative="draft")),
    "mtp": ("nemotron_dense", dict(speculative=SpeculativeConfig("mtp", 2, policy="fixed"))),
}


@pytest.fixture(scope="module")
def runners(checkpoint_dir):
    """name → (the T = 1 runner, the T = 2 runner) of `CONFIGS[name]`, each started once; closed at the end."""
    started: dict[str, tuple[ModelRunner, ModelRunner]] = {}

    def get(name: str) -> tuple[ModelRunner, ModelRunner]:
        if name not in started:
            family, options = CONFIGS[name]
            if options.get("speculative") == "draft":
                draft = str(checkpoint_dir(family))  # the target as its own draft: every draft accepted
                options = {**options, "speculative": SpeculativeConfig("draft", 3, draft_model=draft, policy="fixed")}
            path = str(checkpoint_dir(family))
            one = ModelRunner.from_pretrained(path, max_num_seqs=3, **options)
            two = ModelRunner.from_pretrained(
                path, max_num_seqs=3, tensor_parallel_size=2, replicate_model=True, **options
            )
            started[name] = (one, two)
        return started[name]

    yield get
    for _, two in started.values():
        two.close()


def tokens(results) -> list[list[int]]:
    return [r.token_ids for r in results]


def test_parallel_config_is_validated():
    assert EngineConfig().replace(tensor_parallel_size=2).parallel.tensor_parallel_size == 2
    assert EngineConfig().replace(enable_expert_parallel=True).parallel.enable_expert_parallel
    for field, value in [("tensor_parallel_size", 0), ("tensor_parallel_size", 1.5), ("enable_expert_parallel", 1)]:
        with pytest.raises(ValueError, match=f"ParallelConfig.{field}"):
            ParallelConfig(**{field: value})
    with pytest.raises(ValueError, match="ParallelConfig.rank_timeout_s"):
        ParallelConfig(rank_timeout_s=0)


def test_one_rank_has_no_followers(runners):
    one, _ = runners("plain")
    one.watch_ranks(lambda why: None)  # nothing to watch
    with pytest.raises(ValueError, match="no follower ranks"):
        one.kill_rank(1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs the rank processes"):
        ModelRunner(one.model, tensor_parallel_size=2)


def test_greedy_sampled_samples_and_logprobs_equal_one_rank(runners):
    one, two = runners("plain")
    assert tokens(two.generate(PROMPTS, GREEDY)) == tokens(one.generate(PROMPTS, GREEDY))
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True, logprobs=3)
    ours, reference = two.generate(PROMPTS, seeded), one.generate(PROMPTS, seeded)
    assert tokens(ours) == tokens(reference)
    assert [r.logprobs for r in ours] == [r.logprobs for r in reference]
    samples = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=10, ignore_eos=True)
    ours, reference = two.generate(PROMPTS[:2], samples), one.generate(PROMPTS[:2], samples)
    assert len(ours) == 6 and tokens(ours) == tokens(reference)
    assert len({tuple(t) for t in tokens(ours)[:3]}) > 1  # the samples differ from one another
    # The prefix cache served the repeated prompts on both ranks alike (a hit on the leader alone would diverge).
    assert two.scheduler_stats()["prefix_cache_hit_tokens"] > 0


def test_structured_output_and_stop_rows_equal_one_rank(runners):
    """Grammar masks, stop tokens and stop strings are the leader's alone; the follower takes its finishes."""
    one, two = runners("plain")
    constrained = SamplingParams(
        temperature=0.7, seed=1, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[a-c]{3}")
    )
    plain = one.generate(PROMPTS[1:3], GREEDY)
    stop_text = SamplingParams(temperature=0.0, max_tokens=16, stop=[plain[0].text.split()[-1]])
    stop_token = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[plain[1].token_ids[3]])
    params = [constrained, stop_text, stop_token, constrained]
    ours, reference = two.generate(PROMPTS, params), one.generate(PROMPTS, params)
    assert tokens(ours) == tokens(reference)
    assert [(r.finish_reason, r.text) for r in ours] == [(r.finish_reason, r.text) for r in reference]
    assert ours[1].finish_reason == ours[2].finish_reason == "stop" and len(ours[2].token_ids) < 16
    assert ours[0].error is None and ours[0].finish_reason == "stop"


def test_score_equals_one_rank(runners):
    one, two = runners("plain")
    ours, reference = two.score(PROMPTS + [[]]), one.score(PROMPTS + [[]])
    assert [r.token_logprobs for r in ours] == [r.token_logprobs for r in reference]
    assert ours[-1].error == reference[-1].error is not None


@pytest.mark.parametrize("name", ["ngram", "draft", "mtp"])
def test_speculative_equals_one_rank(runners, name):
    """T = 2 speculative equals T = 1 with the same method; granite's also equals plain decoding at T = 1."""
    one, two = runners(name)
    ours = tokens(two.generate(PROMPTS, GREEDY))
    assert ours == tokens(one.generate(PROMPTS, GREEDY))
    if name != "mtp":
        assert ours == tokens(runners("plain")[0].generate(PROMPTS, GREEDY))
        assert two.spec_stats()["num_accepted_draft_tokens"] > 0
    assert two.spec_stats()["num_drafts"] > 0  # the leader drafted and the follower verified with it
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)  # the follower's MTP samples
    assert tokens(two.generate(PROMPTS, sampled)) == tokens(one.generate(PROMPTS, sampled))


def _fail_sampling_once(runner: ModelRunner) -> None:
    apply, sampled = runner._scheduler.apply, runner._scheduler.apply.sampled

    def fail(*args) -> None:
        apply.sampled = sampled
        raise RuntimeError("sampling failed")

    apply.sampled = fail


def test_a_failed_step_resets_every_rank(runners):
    one, two = runners("ngram")
    two.generate(PROMPTS[:1], GREEDY)  # the scheduler exists
    _fail_sampling_once(two)  # on the leader only: the follower replays a step the leader abandons
    with pytest.raises(RuntimeError, match="sampling failed"):
        two.generate(PROMPTS, GREEDY)
    two.reset()
    assert tokens(two.generate(PROMPTS, GREEDY)) == tokens(one.generate(PROMPTS, GREEDY))


def _skip_lowest_slot(runner: ModelRunner) -> None:
    """On the follower: its next admission loses the lowest free slot (a request lands off by one slot)."""
    scheduler = runner._scheduler
    admit = scheduler._admit

    def skewed() -> None:
        scheduler._admit = admit
        scheduler.free_slots.pop()
        admit()

    scheduler._admit = skewed


def _generate_until_failure(runner: ModelRunner) -> BaseException | None:
    deadline = time.monotonic() + FAILURE_WAIT_S
    while time.monotonic() < deadline:
        try:
            runner.generate(PROMPTS, GREEDY)
        except RankFailure as error:
            return error
    return None


def test_a_diverging_follower_fails_the_leader(runners):
    _, two = runners("ngram")
    two.generate(PROMPTS[:1], GREEDY)  # the follower's scheduler exists
    two._rank_group.channel.send("call", _skip_lowest_slot)
    start = time.monotonic()
    error = _generate_until_failure(two)
    assert isinstance(error, RankDivergence), error
    assert "diverged" in str(error) and time.monotonic() - start < FAILURE_WAIT_S


def test_a_killed_follower_fails_the_leader_and_fires_the_watchdog(runners):
    _, two = runners("draft")
    fired, reasons = threading.Event(), []
    two.watch_ranks(lambda why: (reasons.append(why), fired.set()))
    two.kill_rank(1)
    error = _generate_until_failure(two)
    assert isinstance(error, RankFailure) and not isinstance(error, RankDivergence), error
    assert fired.wait(FAILURE_WAIT_S) and "rank 1 of 2 exited" in reasons[0]


def test_close_stops_the_followers(runners):
    _, two = runners("mtp")
    processes, reasons = two._rank_group.processes, []
    two.watch_ranks(reasons.append)
    two.close()
    assert [p.exitcode for p in processes] == [0]
    time.sleep(0.2)
    assert reasons == []  # a follower stopped by close() is no failure
    two.close()  # idempotent


LEADER_SCRIPT = """
import os
import sys

from workers import ModelRunner

if __name__ == "__main__":
    runner = ModelRunner.from_pretrained(sys.argv[1], tensor_parallel_size=2, replicate_model=True, max_num_seqs=1)
    print(runner._rank_group.processes[0].pid, flush=True)
    os._exit(0)  # no close(), no atexit: the follower must notice on its own
"""


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie nobody reaped yet counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.slow
def test_a_follower_dies_with_its_leader(checkpoint_dir, tmp_path):
    script = tmp_path / "leader.py"
    script.write_text(textwrap.dedent(LEADER_SCRIPT))
    path = str(checkpoint_dir("granite_dense"))
    done = subprocess.run([sys.executable, str(script), path], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[-1])
    deadline = time.monotonic() + FAILURE_WAIT_S
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(pid)
