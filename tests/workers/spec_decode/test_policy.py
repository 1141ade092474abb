"""The speculation policy against a scripted cost model and scripted acceptance (no model, no clock)."""

from __future__ import annotations

import copy
import random
from collections import Counter
from collections.abc import Callable

import pytest

from workers.spec_decode.policy import AdaptivePolicy, FixedPolicy, batch_bucket, make_policy

K = 4


def _run(
    policy,
    steps: int,
    cost: Callable[[int], float],
    acceptance: Callable[[int], list[float]],
    batch: int = 8,
    seed: int = 0,
) -> list[int]:
    """Drive the policy for `steps` steps; acceptance(step)[j] is the chance draft j is accepted once reached."""
    rng, ids, chosen = random.Random(seed), list(range(batch)), []
    for step in range(steps):
        num_drafts = policy.num_drafts(ids, [K] * batch)
        rates = acceptance(step)
        accepted = []
        for k in num_drafts:
            n = 0
            while n < k and rng.random() < rates[n]:
                n += 1
            accepted.append(n)
        width = max(num_drafts)
        policy.observe(ids, num_drafts, accepted, cost(width) * rng.uniform(0.95, 1.05))  # timing noise
        chosen.append(width)
    return chosen


def _expected_throughput(rates: list[float], cost: Callable[[int], float], k: int) -> float:
    tokens, reach = 1.0, 1.0
    for j in range(k):
        reach *= rates[j]
        tokens += reach
    return tokens / cost(k)


def test_picks_no_drafts_when_verification_cannot_pay():
    cost = lambda k: 1.0 + 1.0 * k  # noqa: E731 — a busy large batch: k + 1 tokens cost k + 1 steps
    chosen = _run(AdaptivePolicy(K), 300, cost, lambda step: [0.5] * K)
    assert Counter(chosen[-100:])[0] >= 90  # the rest are the periodic re-tries


@pytest.mark.parametrize(
    "rates,slope",
    [([0.95, 0.95, 0.1, 0.1], 0.1), ([0.9] * K, 0.05), ([0.8, 0.3, 0.3, 0.3], 0.35)],
    ids=["interior", "all", "one"],
)
def test_picks_the_best_fixed_k_when_speculation_pays(rates, slope):
    cost = lambda k: 1.0 + slope * k  # noqa: E731
    best = max(range(K + 1), key=lambda k: _expected_throughput(rates, cost, k))
    assert best > 0
    chosen = _run(AdaptivePolicy(K), 300, cost, lambda step: rates)
    assert Counter(chosen[-100:])[best] >= 85, Counter(chosen[-100:])


def test_reacts_when_acceptance_changes_mid_run():
    cost = lambda k: 1.0 + 0.1 * k  # noqa: E731
    low, high = [0.02] * K, [0.95] * K
    chosen = _run(AdaptivePolicy(K), 600, cost, lambda step: low if step < 300 else high)
    assert Counter(chosen[250:300])[0] >= 45  # drafts are rejected: plain steps
    assert Counter(chosen[-100:])[K] >= 90  # drafts are accepted again: the full width
    switched = next(i for i in range(300, 600) if all(k == K for k in chosen[i : i + 10]))
    assert switched - 300 < 80
    chosen = _run(AdaptivePolicy(K), 600, cost, lambda step: high if step < 300 else low)
    assert Counter(chosen[250:300])[K] >= 45 and Counter(chosen[-100:])[0] >= 90


def test_measures_each_batch_size_bucket_on_its_own():
    policy = AdaptivePolicy(K)
    _run(policy, 100, lambda k: 1.0 + 0.05 * k, lambda step: [0.9] * K, batch=1)
    _run(policy, 100, lambda k: 1.0 + 1.0 * k, lambda step: [0.9] * K, batch=32)
    assert policy.num_drafts([0], [K]) == [K]
    assert policy.num_drafts(list(range(32)), [K] * 32) == [0] * 32
    assert [batch_bucket(b) for b in (1, 2, 3, 5, 8, 9, 64)] == [1, 2, 4, 8, 8, 16, 64]


def test_budgets_cap_the_choice_and_fixed_policy_takes_them_whole():
    policy = AdaptivePolicy(K)
    assert policy.num_drafts([0, 1], [0, 0]) == [0, 0]
    # Measured first, three times each (the first step at a width carries one-off costs and is not kept): the
    # plain step, then the two narrowest verifications with every request drafting. Later re-tries of a costly proposer
    # give drafts to one request only, and their time is not kept (it is not what the batch would cost).
    for free, retry in ((False, [1, 0]), (True, [1, 1])):
        policy, chosen = AdaptivePolicy(K, free_drafts=free, explore_every=2), []
        for _ in range(9):
            chosen.append(policy.num_drafts([0, 1], [2, 1]))
            policy.observe([0, 1], chosen[-1], [0, 0], 1.0 + 0.3 * sum(chosen[-1]))
        assert chosen == [[0, 0]] * 3 + [[1, 1]] * 3 + [[2, 1]] * 3
        chosen.append([0, 0])
        while not any(chosen[-1]):  # nothing accepted: plain steps until a re-try
            chosen.append(policy.num_drafts([0, 1], [2, 1]))
            policy.observe([0, 1], chosen[-1], [0, 0], 1.0 + 0.3 * sum(chosen[-1]))
        assert chosen[-1] == retry and policy.samples[(2, 1)] == (3 if not free else 4)  # a one-row re-try: untimed
    assert FixedPolicy().num_drafts([0, 1, 2], [4, 0, 2]) == [4, 0, 2]
    with pytest.raises(ValueError, match="policy 'greedy' is invalid: must be one of adaptive, fixed"):
        make_policy("greedy", K)


def test_re_tries_back_off_and_larger_batches_skip_a_measurement_that_cannot_pay():
    policy = AdaptivePolicy(K)
    costly = lambda k: 1.0 + 0.6 * k  # noqa: E731 — pays only with acceptance near 1
    chosen = _run(policy, 400, costly, lambda step: [0.5] * K, batch=2)
    retries = [i for i, k in enumerate(chosen) if k and i > 2]
    gaps = [b - a for a, b in zip(retries, retries[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > 2 * gaps[0]  # 16, 32, 64, … plain steps between re-tries
    # A larger batch: verification costs relatively more there, so the widest width is not measured again.
    assert _run(policy, 10, costly, lambda step: [0.5] * K, batch=16) == [0] * 10
    assert (16, K) not in policy.seconds


def test_shadow_acceptance_brings_speculation_back_before_the_next_re_try():
    """A free proposer's drafts checked against plain steps' tokens (no verification) count as acceptance: when the
    text turns predictable, the policy speculates again within a few steps instead of at its next re-try."""
    cost = lambda k: 1.0 + 0.1 * k  # noqa: E731 — batch 1: verification is cheap
    ids = [0]

    def steps(policy: AdaptivePolicy, n: int, rate: float, shadow: bool) -> list[int]:
        chosen = []
        for _ in range(n):
            k = policy.num_drafts(ids, [K])[0]
            accepted = k if rate == 1.0 else 0
            policy.observe(ids, [k], [accepted], cost(k))
            if k == 0 and shadow:
                policy.observe_acceptance(ids, [1], [int(rate == 1.0)])
            chosen.append(k)
        return chosen

    start = AdaptivePolicy(K, explore_every=16)
    steps(start, 200, 0.0, True)  # nothing is accepted: the policy settles at k = 0 and backs off re-tries
    start.steps_without_drafts, start.explore_interval = 0, 256  # the next scheduled re-try is far off
    results = {}
    for shadow in (False, True):  # from the same state, then everything would be accepted
        after = steps(copy.deepcopy(start), 40, 1.0, shadow)
        results[shadow] = next((i for i, k in enumerate(after) if k > 0), len(after))
    assert results[True] < results[False] and results[True] <= 8, results


def test_step_times_are_a_line_per_bucket_robust_to_slow_steps():
    """A width measured fast by chance does not look cheaper than a narrower one (one least-squares line with a
    slope of at least 0), and a step that waited for the CPU does not move the estimate (median of recent steps)."""
    policy = AdaptivePolicy(K)
    for k, seconds in ((0, 1.0), (1, 2.0), (2, 1.5), (4, 5.0)):
        for _ in range(4):
            policy.observe([0, 1], [k, k], [0, 0], seconds)
    estimates = [policy._seconds(2, k) for k in range(K + 1)]
    assert estimates == sorted(estimates) and estimates[2] > estimates[1] * 0.99
    before = policy._seconds(2, 1)
    policy.observe([0, 1], [1, 1], [0, 0], 100.0)  # one slow step
    assert policy._seconds(2, 1) == pytest.approx(before, rel=0.05)


def test_first_step_at_a_width_is_not_kept_and_prefill_steps_teach_only_acceptance():
    policy = AdaptivePolicy(K)
    policy.observe([0], [1], [1], 50.0)  # the first verification at width 1: one-off costs
    assert (1, 1) not in policy.seconds
    policy.observe([0], [1], [1], 2.0)
    assert policy.seconds[(1, 1)] == 2.0
    reached = policy.batch.reached[0]
    policy.observe([0], [1], [1], None)  # a step that also prefilled: acceptance counts, time does not
    assert policy.samples[(1, 1)] == 2 and policy.batch.reached[0] > reached


def test_drafts_the_proposer_could_not_make_count_as_rejected():
    """The scheduler reports the drafts it asked for: a request whose n-gram lookup finds nothing lowers the
    acceptance the policy plans with, as a rejected draft would (the verification costs the same either way)."""
    found, missing = AdaptivePolicy(K), AdaptivePolicy(K)
    for _ in range(20):
        found.observe([0], [2], [2], 1.0, width=2)
        missing.observe([0], [2], [0], 1.0, width=0)  # asked for 2, none made: a plain step
    assert found._rates(0, [0.5] * K)[0] > 0.8 and missing._rates(0, [0.5] * K)[0] < 0.2
    assert (1, 0) in missing.seconds and (1, 2) not in missing.seconds  # timed as the plain step it was


def test_a_clearly_unprofitable_batch_settles_on_plain_steps_until_the_next_re_try():
    """Where speculation is far from paying (every draft rejected, though perfect acceptance would pay), the policy
    stops deciding for a few steps, so the scheduler skips the per-request work of deciding (and n-gram lookups);
    re-tries still come."""
    policy = AdaptivePolicy(K, free_drafts=True)
    chosen = _run(policy, 200, lambda k: 1.0 + 0.7 * k, lambda step: [0.0] * K, batch=32)
    settled = [policy.settled_plain(32)]
    for _ in range(20):
        policy.num_drafts(list(range(32)), [K] * 32)
        policy.observe(list(range(32)), [0] * 32, [0] * 32, 1.0)
        settled.append(policy.settled_plain(32))
    assert sum(settled) >= 10 and not all(settled)  # mostly settled, deciding again now and then
    assert Counter(chosen[-100:])[0] >= 95 and any(chosen[100:])  # plain steps, with re-tries
    assert not FixedPolicy().settled_plain(32)


def test_no_re_tries_where_even_perfect_acceptance_would_not_pay():
    """A verification of k drafts costing k + 1 plain steps (a compute-bound batch) cannot pay whatever is accepted:
    after measuring, the bucket stays plain without re-tries, while a bucket where verification is cheap still
    speculates."""
    policy = AdaptivePolicy(K, free_drafts=True)
    chosen = _run(policy, 400, lambda k: 1.0 + 1.0 * k, lambda step: [0.95] * K, batch=32)
    assert chosen[:9] == [0, 0, 0, 1, 1, 1, 2, 2, 2] and not any(chosen[9:])  # measured once, never re-tried
    assert policy.hopeless[32] and policy.settled_plain(32)
    assert not any(_run(policy, 50, lambda k: 1.0 + 1.0 * k, lambda step: [0.95] * K, batch=64))  # found below
    # The batch shrinks as requests finish: the bucket below a hopeless one is not measured (its plain step is).
    assert not any(_run(policy, 20, lambda k: 1.0 + 1.0 * k, lambda step: [0.95] * K, batch=16))
    assert (16, 0) in policy.seconds and (16, 1) not in policy.seconds
    # A bucket whose measuring steps all went untimed (they also prefilled) decides on the nearest line, not on
    # "every width costs the same" (which would pick the widest).
    policy.tried[(4, 0)] = policy.tried[(4, 1)] = policy.tried[(4, 2)] = 3
    assert policy.num_drafts(list(range(4)), [K] * 4) == [0] * 4
    cheap = _run(policy, 100, lambda k: 1.0 + 0.05 * k, lambda step: [0.95] * K, batch=1)
    assert Counter(cheap[-50:])[K] >= 45 and not policy.hopeless[1]


def test_a_verification_overhead_whatever_k_does_not_make_wider_widths_look_dear():
    """A draft model or MTP head costs a call per step whatever k: k = 1 costs 1.8 plain steps, each further draft
    only 0.05 more. A line through the plain step and k = 1 would price k = 4 at 4.2 steps and never speculate;
    the line through the verification widths finds that k = 4 pays (4.5 tokens for 2 steps)."""
    cost = lambda k: 1.0 if k == 0 else 1.75 + 0.05 * k  # noqa: E731
    chosen = _run(AdaptivePolicy(K), 200, cost, lambda step: [0.95] * K, batch=1)
    assert Counter(chosen[-100:])[K] >= 90, Counter(chosen[-100:])
