"""How many drafts each step verifies: a fixed k, or the k that this run's own measurements say pays best.

Speculation pays when the tokens a verification step produces outweigh what it costs over a plain step. Both
sides move with the batch: a plain step at batch 64 is already busy, so a k + 1 wide verification costs nearly
k + 1 times as much, while at batch 1 it costs about one step. The adaptive policy measures, in this run:
- the seconds of a whole step (propose + verify + accept, or a plain step for k = 0) per batch-size bucket and k;
- per draft position j, the chance that draft j is accepted once drafts 1 … j-1 were (per request, pulled towards
  the batch's rate while the request has few observations).
Each step it picks the k that maximises expected tokens per second,

    Σ_r E_r(k) / seconds(bucket(b), k),   E_r(k) = 1 + Σ_{j ≤ min(k, budget_r)} Π_{i ≤ j} α_{r,i},

verifying unmeasured widths once and re-trying speculation now and then after choosing 0, so that it notices
when acceptance rises. The choice never changes what greedy decoding produces, and rejection sampling keeps the
sampled distribution exact for any k chosen before the drafts are drawn.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

POLICIES = ("adaptive", "fixed")
MAX_EXPLORE_EVERY = 256


def batch_bucket(batch_size: int) -> int:
    """Batch sizes measured together: 1, 2, 4, 8, … (the power of two at or above)."""
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass
class _Acceptance:
    """Per draft position: how often it was reached (drafts before it all accepted) and accepted."""

    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted_drafts: int) -> None:
        while len(self.reached) < num_drafts:
            self.reached.append(0)
            self.accepted.append(0)
        for j in range(min(num_drafts, num_accepted_drafts + 1)):
            self.reached[j] += 1
            self.accepted[j] += j < num_accepted_drafts

    def decay(self, factor: float) -> None:
        """Let older observations weigh less (acceptance drifts as the text moves on)."""
        self.reached = [n * factor for n in self.reached]
        self.accepted = [n * factor for n in self.accepted]

    def rate(self, j: int, prior: float, prior_weight: float) -> float:
        """Smoothed chance that draft j is accepted once reached."""
        reached = self.reached[j] if j < len(self.reached) else 0
        accepted = self.accepted[j] if j < len(self.accepted) else 0
        return (accepted + prior * prior_weight) / (reached + prior_weight)


class FixedPolicy:
    """Always as many drafts as allowed (`--speculative-policy fixed`)."""

    def __init__(self) -> None:
        self.chosen: Counter[int] = Counter()

    def num_drafts(self, request_ids: list[int], budgets: list[int]) -> list[int]:
        """Every request gets its full budget."""
        self.chosen[max(budgets, default=0)] += 1
        return list(budgets)

    def observe(self, request_ids: list[int], num_drafts: list[int], num_accepted_drafts: list[int],
                seconds: float) -> None:  # fmt: skip
        """Nothing to learn."""

    def observe_acceptance(self, request_ids: list[int], num_drafts: list[int], num_accepted_drafts: list[int]) -> None:
        """Nothing to learn."""

    def forget(self, request_id: int) -> None:
        """Nothing kept per request."""


class AdaptivePolicy:
    """Chooses k per step from measured step times and observed acceptance (see the module docstring)."""

    def __init__(self, max_drafts: int, explore_every: int = 16, prior_weight: float = 4.0, smoothing: float = 0.3,
                 decay: float = 0.95):  # fmt: skip
        """`explore_every`: after this many steps at k = 0, verify once at the best k seen so far (or 1).
        `prior_weight`: observations a request needs before its own rate outweighs the batch's. `smoothing`: weight
        of a new step time. `decay`: per step, the weight left to older acceptance counts (batch and request)."""
        self.max_drafts = max_drafts
        self.explore_every, self.prior_weight, self.smoothing = explore_every, prior_weight, smoothing
        self.decay = decay
        self.seconds: dict[tuple[int, int], float] = {}  # (batch bucket, k) → smoothed step seconds
        self.tried: Counter[tuple[int, int]] = Counter()  # widths asked for to measure them
        self.samples: Counter[tuple[int, int]] = Counter()  # steps measured per (bucket, width)
        self.batch = _Acceptance()
        self.requests: dict[int, _Acceptance] = {}
        self.steps_without_drafts = 0
        self.explore_interval = (
            explore_every  # grows after re-tries that did not pay, back to explore_every after one that did
        )
        self.best: dict[int, int] = {}  # batch bucket → the k last chosen there on the estimates
        self.last_useful_k = 1
        self.chosen: Counter[int] = Counter()  # k → steps (the "chosen k distribution" of the spec stats)

    # ------------------------------------------------------------------------------------------------ decide
    def num_drafts(self, request_ids: list[int], budgets: list[int]) -> list[int]:
        """Drafts per request for this step: min(k, budget) with one k for the batch."""
        k, probe = self._choose(request_ids, budgets)
        self.chosen[k] += 1
        if k == 0:
            self.steps_without_drafts += 1
        elif self.steps_without_drafts >= self.explore_interval:  # a re-try: if it does not pay, wait longer
            self.steps_without_drafts, self.explore_interval = 0, min(2 * self.explore_interval, MAX_EXPLORE_EVERY)
        else:  # speculation was chosen on its merits
            self.steps_without_drafts, self.explore_interval = 0, self.explore_every
        if probe:  # drafts for one request only: the verification still runs k + 1 wide for every row (what is
            # measured), while a draft model catches up on the tokens it skipped for that one request alone
            row = max(range(len(budgets)), key=lambda i: budgets[i])
            return [min(k, budget) if i == row else 0 for i, budget in enumerate(budgets)]
        return [min(k, budget) for budget in budgets]

    def _choose(self, request_ids: list[int], budgets: list[int]) -> tuple[int, bool]:
        """(k, whether this step only probes: measures a width or re-checks acceptance)."""
        top = min(self.max_drafts, max(budgets, default=0))
        if top == 0:
            return 0, False
        bucket = batch_bucket(len(request_ids))
        # 1. Measure first: the plain step, then the widest — unless a batch no larger already found speculation
        #    unprofitable (a verification costs relatively more at larger batches), so that each new batch size
        #    does not pay for a costly measurement (a draft model catching up on every token it skipped). A
        #    proposer may return fewer drafts than asked: the step is then measured at the width it ran.
        for k in (0, top):
            if self.samples[(bucket, k)] < 2 and self.tried[(bucket, k)] < 2:  # twice: see `observe`
                if k and self._unprofitable_at_or_below(bucket):
                    break
                self.tried[(bucket, k)] += 1
                return k, k > 0
        # 2. Look again now and then (less often after each re-try that did not pay): acceptance may have risen.
        if self.steps_without_drafts >= self.explore_interval:
            return min(self.last_useful_k, top), True
        # 3. The best expected throughput.
        batch_rates = [self.batch.rate(j, 0.5, 1.0) for j in range(self.max_drafts)]  # once per step, not per request
        rates = [self._rates(rid, batch_rates) for rid in request_ids]
        best_k, best = 0, -1.0
        for k in range(top + 1):
            tokens = sum(_expected_tokens(r, min(k, b)) for r, b in zip(rates, budgets))
            throughput = tokens / self._seconds(bucket, k)
            if throughput > best * 1.0001:  # ties go to fewer drafts
                best_k, best = k, throughput
        if best_k:
            self.last_useful_k = best_k
        self.best[bucket] = best_k
        return best_k, False

    def _unprofitable_at_or_below(self, bucket: int) -> bool:
        """Whether the last choice at some batch bucket no larger than this one was no drafts at all."""
        return any(b <= bucket and k == 0 for b, k in self.best.items())

    def _nearest_profiled(self, bucket: int) -> int | None:
        """The measured bucket closest in size (ties: the larger) with the plain step and a verification known."""
        profiled = {b for (b, j) in self.seconds if j > 0 and (b, 0) in self.seconds}
        return min(profiled, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), -b), default=None)

    def _rates(self, request_id: int, batch_rates: list[float]) -> list[float]:
        mine = self.requests.get(request_id, _Acceptance())
        return [mine.rate(j, batch_rates[j], self.prior_weight) for j in range(self.max_drafts)]

    def _seconds(self, bucket: int, k: int) -> float:
        """Measured, else linear in k through the nearest measured widths of this bucket (beyond them: the line
        through the two closest). With only the plain step measured here, the nearest bucket's cost ratios scale
        it; with nothing else known, every width looks alike (which invites a try)."""
        points = sorted((j, t) for (b, j), t in self.seconds.items() if b == bucket)
        if not points:
            return 1.0  # nothing measured at this size yet: every width looks alike
        measured = dict(points)
        if k in measured:
            return measured[k]
        if len(points) == 1:
            other = self._nearest_profiled(bucket)
            if other is None or 0 not in measured:
                return points[0][1]
            return measured[0] * self._seconds(other, k) / self._seconds(other, 0)
        below = [p for p in points if p[0] < k][-1:]
        above = [p for p in points if p[0] > k][:1]
        (k0, t0), (k1, t1) = (below + above) if below and above else (points[:2] if not below else points[-2:])
        return max(t0 + (t1 - t0) * (k - k0) / (k1 - k0), min(t for _, t in points) * 0.5)

    # ------------------------------------------------------------------------------------------------- learn
    def observe(self, request_ids: list[int], num_drafts: list[int], num_accepted_drafts: list[int],
                seconds: float) -> None:  # fmt: skip
        """One step's outcome: drafts verified and accepted per request, and the step's wall time."""
        key = (batch_bucket(len(request_ids)), max(num_drafts, default=0))
        self.samples[key] += 1
        old = self.seconds.get(key)
        # The first step at a width carries one-off costs (a draft model catching up on a whole prompt, buffers
        # sized for the first time): the second measurement replaces it, later ones are averaged in.
        self.seconds[key] = seconds if self.samples[key] <= 2 else old + self.smoothing * (seconds - old)
        self.batch.decay(self.decay)
        for rid, k, accepted in zip(request_ids, num_drafts, num_accepted_drafts):
            mine = self.requests.get(rid)
            if mine is not None:  # every step, drafted or not: old evidence fades, so a lull gets re-tried
                mine.decay(self.decay)
            if k:
                self.batch.record(k, accepted)
                self.requests.setdefault(rid, _Acceptance()).record(k, accepted)

    def observe_acceptance(self, request_ids: list[int], num_drafts: list[int], num_accepted_drafts: list[int]) -> None:
        """Acceptance seen without a verification (a free proposer's shadow drafts checked against the tokens a
        plain step produced): counts like verified drafts, no step time."""
        for rid, k, accepted in zip(request_ids, num_drafts, num_accepted_drafts):
            self.batch.record(k, accepted)
            self.requests.setdefault(rid, _Acceptance()).record(k, accepted)

    def forget(self, request_id: int) -> None:
        """A request finished: drop its own counts (the batch's stay)."""
        self.requests.pop(request_id, None)


def _expected_tokens(rates: list[float], k: int) -> float:
    """1 + Σ_{j ≤ k} Π_{i ≤ j} α_i: the expected tokens of a step with k drafts."""
    total, reach = 1.0, 1.0
    for j in range(k):
        reach *= rates[j]
        total += reach
    return total


def make_policy(name: str, max_drafts: int) -> FixedPolicy | AdaptivePolicy:
    """The policy named by `SpeculativeConfig.policy`."""
    if name == "fixed":
        return FixedPolicy()
    if name == "adaptive":
        return AdaptivePolicy(max_drafts)
    raise ValueError(f"speculative policy {name!r} is invalid: must be one of {', '.join(POLICIES)}")
