"""How many drafts each step verifies: a fixed k, or the k that this run's own measurements say pays best.

Speculation pays when the tokens a verification step produces outweigh what it costs over a plain step. Both
sides move with the batch: a plain step at batch 64 is already busy, so a k + 1 wide verification costs nearly
k + 1 times as much, while at batch 1 it costs about one step. The adaptive policy measures, in this run:
- the seconds of a whole scheduler step (propose + verify + accept + bookkeeping, or a plain step for k = 0) per
  batch-size bucket and k, steps that also prefilled left out; per bucket the plain step, and a least-squares line
  a + s·k through the measured verification widths stands for every width (a verification has costs of its own
  whatever k, so the plain step is not on that line; the plain step, k = 1 and k = 2 are measured first, wider
  widths when chosen);
- per draft position j, the chance that draft j is accepted once drafts 1 … j-1 were (per request, pulled towards
  the batch's rate while the request has few observations).
Each step it picks the k that maximises expected tokens per second,

    Σ_r E_r(k) / seconds(bucket(b), k),   E_r(k) = 1 + Σ_{j ≤ min(k, budget_r)} Π_{i ≤ j} α_{r,i},

speculating only when that beats the plain step by a margin, and re-trying speculation now and then after
choosing 0, so that it notices when acceptance rises (a free proposer — n-gram — reports acceptance on plain steps
through shadow drafts instead). Where even perfect acceptance would not pay — a verification costs about as many
plain steps as it has tokens, as in a large batch on a CPU — it does not re-try at all. This is the goodput rule of
SmartSpec (Liu et al., 2024, "Optimizing Speculative Decoding for Serving Large Language Models Using Goodput")
with the cost model measured in the run instead of profiled beforehand. The choice never changes what greedy
decoding produces, and rejection sampling keeps the sampled distribution exact for any k chosen before the drafts
are drawn.
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from dataclasses import dataclass, field

POLICIES = ("adaptive", "fixed")
MAX_EXPLORE_EVERY = 256
TIMING_WINDOW = 9  # step times kept per (bucket, width); their median is the estimate
SETTLE_BELOW, SETTLE_STEPS = 0.8, 8  # see `AdaptivePolicy.settled_plain`
HOPELESS_STEPS = 64  # steps a batch bucket where no acceptance could pay stays plain before deciding again


def batch_bucket(batch_size: int) -> int:
    """Batch sizes measured together: 1, 2, 4, 8, … (the power of two at or above)."""
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass
class _Acceptance:
    """Per draft position: how often it was reached (drafts before it all accepted) and accepted, counts fading by
    a factor per step (acceptance drifts as the text moves on). The fading is applied when the counts are next
    touched, so an idle request costs nothing per step."""

    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    step: int = 0  # the step the counts are faded to

    def fade_to(self, step: int, factor: float) -> None:
        """Fade the counts from their step to `step`."""
        if step != self.step:
            scale = factor ** (step - self.step)
            self.reached = [n * scale for n in self.reached]
            self.accepted = [n * scale for n in self.accepted]
            self.step = step

    def record(self, num_drafts: int, num_accepted_drafts: int) -> None:
        while len(self.reached) < num_drafts:
            self.reached.append(0)
            self.accepted.append(0)
        for j in range(min(num_drafts, num_accepted_drafts + 1)):
            self.reached[j] += 1
            self.accepted[j] += j < num_accepted_drafts

    def rates(self, priors: list[float], prior_weight: float, scale: float = 1.0) -> list[float]:
        """Smoothed chance that draft j is accepted once reached, for every position j of `priors`, with the
        counts scaled by `scale` (the fading since they were last touched)."""
        reached, accepted = self.reached, self.accepted
        return [
            ((accepted[j] * scale if j < len(accepted) else 0) + prior * prior_weight)
            / ((reached[j] * scale if j < len(reached) else 0) + prior_weight)
            for j, prior in enumerate(priors)
        ]


class FixedPolicy:
    """Always as many drafts as allowed (`--speculative-policy fixed`)."""

    def __init__(self) -> None:
        self.chosen: Counter[int] = Counter()

    def settled_plain(self, batch_size: int) -> bool:
        """Never: every step drafts."""
        return False

    def num_drafts(self, request_ids: list[int], budgets: list[int]) -> list[int]:
        """Every request gets its full budget."""
        self.chosen[max(budgets, default=0)] += 1
        return list(budgets)

    def observe(
        self,
        request_ids: list[int],
        num_drafts: list[int],
        num_accepted_drafts: list[int],
        seconds: float | None,
        width: int | None = None,
    ) -> None:
        """Nothing to learn."""

    def observe_acceptance(self, request_ids: list[int], num_drafts: list[int], num_accepted_drafts: list[int]) -> None:
        """Nothing to learn."""

    def forget(self, request_id: int) -> None:
        """Nothing kept per request."""


class AdaptivePolicy:
    """Chooses k per step from measured step times and observed acceptance (see the module docstring)."""

    def __init__(
        self,
        max_drafts: int,
        explore_every: int = 16,
        prior_weight: float = 4.0,
        decay: float = 0.95,
        free_drafts: bool = False,
        margin: float = 1.15,
    ):
        """`explore_every`: after this many steps at k = 0, verify one draft (then twice as many steps, and so on).
        `prior_weight`: observations a request needs before its own rate outweighs the batch's. `decay`: per step,
        the weight left to older acceptance counts (batch and request). `free_drafts`: the proposer costs nothing and
        reports acceptance on steps without drafts (n-gram shadow drafts), so a probe drafts for every request.
        `margin`: how much more throughput speculation must promise than a plain step before it is chosen: step
        times on a shared CPU move by ~10% from run to run, so a smaller promised gain is not reliably a gain, and
        a wrong choice for speculation costs throughput while a wrong one against it only leaves a gain unused."""
        self.max_drafts = max_drafts
        self.explore_every, self.prior_weight = explore_every, prior_weight
        self.decay, self.free_drafts, self.margin = decay, free_drafts, margin
        self.seconds: dict[tuple[int, int], float] = {}  # (batch bucket, k) → median of the recent step seconds
        self.times: dict[tuple[int, int], deque[float]] = {}  # (batch bucket, k) → recent step seconds
        self._lines: dict[int, tuple[float, float] | None] = {}  # batch bucket → `_line`, until its times change
        self.tried: Counter[tuple[int, int]] = Counter()  # widths asked for to measure them
        self.samples: Counter[tuple[int, int]] = Counter()  # steps measured per (bucket, width)
        self.batch = _Acceptance()
        self.requests: dict[int, _Acceptance] = {}
        self.steps = 0  # steps observed (the clock acceptance counts fade by)
        self.probing = False  # the last step's drafts went to one request only (see `num_drafts`)
        self.plain_until: dict[int, int] = {}  # batch bucket → step until which its steps are plain undecided
        self.steps_without_drafts = 0
        self.explore_interval = (
            explore_every  # grows after re-tries that did not pay, back to explore_every after one that did
        )
        self.best: dict[int, int] = {}  # batch bucket → the k last chosen there on the estimates
        self.hopeless: dict[int, bool] = {}  # batch bucket → whether even perfect acceptance would not pay there
        self.chosen: Counter[int] = Counter()  # k → steps (the "chosen k distribution" of the spec stats)

    # ------------------------------------------------------------------------------------------------ decide
    def num_drafts(self, request_ids: list[int], budgets: list[int]) -> list[int]:
        """Drafts per request for this step: min(k, budget) with one k for the batch."""
        k, probe = self._choose(request_ids, budgets)
        self.chosen[k] += 1
        self.probing = probe and not self.free_drafts  # one request drafts: its time is not the batch's
        if not any(budgets):  # nothing to choose (no draft allowed or, for n-gram, none found): not a lull
            return [0] * len(budgets)
        if k == 0:  # a lull in speculation — not at a hopeless bucket, where plain steps say nothing of acceptance
            self.steps_without_drafts += not self.hopeless.get(batch_bucket(len(request_ids)), False)
        elif self.steps_without_drafts >= self.explore_interval:  # a re-try: if it does not pay, wait longer
            self.steps_without_drafts, self.explore_interval = 0, min(2 * self.explore_interval, MAX_EXPLORE_EVERY)
        else:  # speculation was chosen on its merits
            self.steps_without_drafts, self.explore_interval = 0, self.explore_every
        if self.probing:  # a re-try of a costly proposer: drafts for one request only (a draft model or MTP head
            # catches up on the tokens it skipped for that one alone), so the step's time is not kept
            row = max(range(len(budgets)), key=lambda i: budgets[i])
            return [min(k, budget) if i == row else 0 for i, budget in enumerate(budgets)]
        return [min(k, budget) for budget in budgets]

    def _choose(self, request_ids: list[int], budgets: list[int]) -> tuple[int, bool]:
        """(k, whether this step is a re-try that only re-checks acceptance)."""
        top = min(self.max_drafts, max(budgets, default=0))
        if top == 0 or self.settled_plain(len(request_ids)):
            return 0, False
        bucket = batch_bucket(len(request_ids))
        # 1. Measure first, three times each (the first is not kept, see `observe`): the plain step, then the two
        #    narrowest verifications with every request drafting — the cheapest ones, and they give the line that
        #    wider widths are extrapolated on (they are measured when chosen); the second is skipped when even the
        #    widest could not pay at the first one's cost. Verification is skipped when a batch no larger already
        #    found speculation unprofitable (a verification costs relatively more at larger batches), or the next
        #    larger one found it hopeless (a batch shrinking as its requests finish: the
        #    first verification would catch a costly proposer up on every request's whole context for the few
        #    tokens left): the line then comes from the nearest bucket.
        for k in (0, 1, 2):
            if self.samples[(bucket, k)] < 3 and self.tried[(bucket, k)] < 3:
                if k and (self._unprofitable_at_or_below(bucket) or self.hopeless.get(2 * bucket, False)):
                    break
                if k == 2 and not self._could_pay_at_k1_cost(bucket):
                    break
                self.tried[(bucket, k)] += 1
                return k, False
        # 2. Look again now and then (less often after each re-try that did not pay): acceptance may have risen.
        #    One draft: the cheapest verification, and the first position's acceptance is what rises first. Not
        #    where no acceptance could make speculation pay: a re-try there only costs.
        hopeless = self._hopeless(bucket)
        if self.steps_without_drafts >= self.explore_interval and not hopeless:
            return 1, True
        # 3. The best expected throughput.
        batch_rates = self.batch.rates([0.5] * self.max_drafts, 1.0)  # once per step, not per request
        tokens = [0.0] * (top + 1)  # expected tokens of the step at each k, summed over the requests
        for rid, budget in zip(request_ids, budgets):
            rates, total, reach = self._rates(rid, batch_rates), 1.0, 1.0
            for k in range(top + 1):
                if 0 < k <= budget:
                    reach *= rates[k - 1]
                    total += reach
                tokens[k] += total
        plain = len(request_ids) / self._seconds(bucket, 0)
        best_k, best, best_drafting = 0, plain * self.margin, 0.0
        for k in range(1, top + 1):
            throughput = tokens[k] / self._seconds(bucket, k)
            best_drafting = max(best_drafting, throughput)
            if throughput > best * 1.0001:  # ties go to fewer drafts
                best_k, best = k, throughput
        self.best[bucket], self.hopeless[bucket] = best_k, hopeless
        if hopeless or best_drafting < SETTLE_BELOW * plain:  # clearly plain: skip deciding (and n-gram lookups)
            self.plain_until[bucket] = self.steps + (HOPELESS_STEPS if hopeless else SETTLE_STEPS)
        return best_k, False

    def settled_plain(self, batch_size: int) -> bool:
        """Whether steps at this batch size are plain for now without deciding: the last decision found
        speculation clearly unprofitable (below `SETTLE_BELOW` of a plain step's throughput) fewer than
        `SETTLE_STEPS` steps ago and no re-try is due, or found it hopeless (`_hopeless`) fewer than
        `HOPELESS_STEPS` ago. Spares a large batch the per-request work of deciding."""
        bucket = batch_bucket(batch_size)
        settled = self.plain_until.get(bucket, -1) > self.steps
        return settled and (self.hopeless.get(bucket, False) or self.steps_without_drafts < self.explore_interval)

    def _hopeless(self, bucket: int) -> bool:
        """Whether no acceptance could make speculation pay at this bucket: with every draft accepted, each width's
        k + 1 tokens per request would still come slower than the plain step's one, by the margin — a verification
        there costs about as many plain steps as it has tokens (a busy CPU batch: its linears are compute-bound).
        Decided on the measured cost line (this bucket's, or the nearest one scaled to this bucket's plain step)."""
        if (bucket, 0) not in self.seconds:
            return False
        if not any(k and b == bucket for b, k in self.seconds) and not self._unprofitable_at_or_below(bucket):
            return False  # verification not measured here yet (it is measured unless a smaller batch found no gain)
        plain = self._seconds(bucket, 0)
        return all((k + 1) * plain <= self.margin * self._seconds(bucket, k) for k in range(1, self.max_drafts + 1))

    def _could_pay_at_k1_cost(self, bucket: int) -> bool:
        """Whether the widest verification could pay if it cost no more than the measured k = 1 step (every draft
        accepted): else measuring a second width is not worth its steps."""
        plain, one = self.seconds.get((bucket, 0)), self.seconds.get((bucket, 1))
        return plain is None or one is None or (self.max_drafts + 1) * plain > self.margin * one

    def _unprofitable_at_or_below(self, bucket: int) -> bool:
        """Whether the last choice at some batch bucket no larger than this one was no drafts at all."""
        return any(b <= bucket and k == 0 for b, k in self.best.items())

    def _rates(self, request_id: int, batch_rates: list[float]) -> list[float]:
        """A request's smoothed per-position rates (the batch's until it has its own observations)."""
        mine = self.requests.get(request_id)
        if mine is None:
            return batch_rates
        return mine.rates(batch_rates, self.prior_weight, self.decay ** (self.steps - mine.step))

    def _line(self, bucket: int) -> tuple[float, float] | None:
        """(a, s) of a verification's seconds ≈ a + s·k at this bucket, or None with too little measured. Through
        the verification widths (k ≥ 1) when two are measured: a verification step has costs of its own whatever k
        (the proposer's call, acceptance, the shift), so the plain step is not on its line. Through the plain step
        and the one measured width otherwise. Least squares (weights: `_weight`), the slope at least 0: a width
        measured a little fast by chance must not look cheaper than a narrower one. Cached until the bucket's step
        times change (every decision asks for it several times)."""
        if bucket not in self._lines:
            self._lines[bucket] = self._fit_line(bucket)
        return self._lines[bucket]

    def _fit_line(self, bucket: int) -> tuple[float, float] | None:
        points = [(k, t, self._weight(bucket, k)) for (b, k), t in self.seconds.items() if b == bucket and k]
        if len(points) < 2:
            plain = self.seconds.get((bucket, 0))
            if plain is None or not points:
                return None
            points.append((0, plain, self._weight(bucket, 0)))
        weight = sum(w for _, _, w in points)
        mean_k = sum(w * k for k, _, w in points) / weight
        mean_t = sum(w * t for _, t, w in points) / weight
        spread = sum(w * (k - mean_k) ** 2 for k, _, w in points)
        slope = max(0.0, sum(w * (k - mean_k) * (t - mean_t) for k, t, w in points) / spread)
        return mean_t - slope * mean_k, slope

    def _weight(self, bucket: int, k: int) -> int:
        """A width's weight on its bucket's line: its kept samples, up to 3 (a median of 3 is already robust; more
        must not let one slow step, which leaves the median alone, tilt the line)."""
        return min(len(self.times[(bucket, k)]), 3)

    def _own_seconds(self, bucket: int, k: int) -> float | None:
        """This bucket's own estimate of a step with k drafts (the measured plain step; a verification on its
        line), or None."""
        if k == 0:
            return self.seconds.get((bucket, 0))
        line = self._line(bucket)
        return None if line is None else max(line[0] + line[1] * k, 1e-9)

    def _seconds(self, bucket: int, k: int) -> float:
        """Estimated seconds of a step with k drafts at this bucket: its own estimate when it has one; otherwise
        the nearest bucket's estimate relative to its plain step, times this bucket's plain step when that is
        measured (what matters is a width's cost relative to the plain step); with nothing measured anywhere, every
        width costs the plain step (which invites a try)."""
        own = self._own_seconds(bucket, k)
        if own is not None:
            return own
        plain = self.seconds.get((bucket, 0))
        measured = {b for b, _ in self.seconds if (b, 0) in self.seconds and self._line(b) is not None}
        other = min(measured, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), -b), default=None)
        if other is None:
            return 1.0 if plain is None else plain
        relative = self._own_seconds(other, k) / self.seconds[(other, 0)]
        return (self.seconds[(other, 0)] if plain is None else plain) * relative

    # ------------------------------------------------------------------------------------------------- learn
    def observe(
        self,
        request_ids: list[int],
        num_drafts: list[int],
        num_accepted_drafts: list[int],
        seconds: float | None,
        width: int | None = None,
    ) -> None:
        """One step's outcome: drafts asked for and accepted per request (a draft the proposer could not make counts
        as rejected), the step's wall time (None when the step also did other work, a prefill chunk: its acceptance
        counts, its time does not) and the drafts per row it verified (default: the most asked for)."""
        if seconds is not None and not self.probing:
            key = (batch_bucket(len(request_ids)), max(num_drafts, default=0) if width is None else width)
            self.samples[key] += 1
            # The first step at a width carries one-off costs (a draft model catching up on a whole prompt, buffers
            # sized for the first time): it is not kept. The median of the rest shrugs off a step that waited for
            # the CPU.
            if self.samples[key] > 1:
                times = self.times.setdefault(key, deque(maxlen=TIMING_WINDOW))
                times.append(seconds)
                self.seconds[key] = statistics.median(times)
                self._lines.pop(key[0], None)
        self.steps += 1  # every step, drafted or not, old evidence fades, so a lull gets re-tried
        self.batch.fade_to(self.steps, self.decay)
        for rid, k, accepted in zip(request_ids, num_drafts, num_accepted_drafts):
            if k:
                self._record(rid, k, accepted)

    def observe_acceptance(self, request_ids: list[int], num_drafts: list[int], num_accepted_drafts: list[int]) -> None:
        """Acceptance seen without a verification (a free proposer's shadow drafts checked against the tokens a
        plain step produced): counts like verified drafts, no step time."""
        for rid, k, accepted in zip(request_ids, num_drafts, num_accepted_drafts):
            self._record(rid, k, accepted)

    def _record(self, request_id: int, num_drafts: int, num_accepted_drafts: int) -> None:
        self.batch.record(num_drafts, num_accepted_drafts)
        mine = self.requests.get(request_id)
        if mine is None:
            mine = self.requests[request_id] = _Acceptance(step=self.steps)
        mine.fade_to(self.steps, self.decay)
        mine.record(num_drafts, num_accepted_drafts)

    def forget(self, request_id: int) -> None:
        """A request finished: drop its own counts (the batch's stay)."""
        self.requests.pop(request_id, None)


def observe_shadow_drafts(policy: FixedPolicy | AdaptivePolicy, requests: list, shadow: dict[int, tuple]) -> None:
    """Shadow drafts (`shadow`: row → (position, draft), a draft looked up for a row the step ran plain) that the
    step's token at that position confirms or refutes: acceptance evidence for the policy."""
    rows = [i for i, (position, _) in shadow.items() if requests[i].num_tokens > position]
    if rows:
        accepted = [int(requests[i].token_at(shadow[i][0]) == shadow[i][1]) for i in rows]
        policy.observe_acceptance([requests[i].index for i in rows], [1] * len(rows), accepted)


def make_policy(name: str, max_drafts: int, free_drafts: bool = False) -> FixedPolicy | AdaptivePolicy:
    """The policy named by `SpeculativeConfig.policy` (`free_drafts`: see `AdaptivePolicy`)."""
    if name == "fixed":
        return FixedPolicy()
    if name == "adaptive":
        return AdaptivePolicy(max_drafts, free_drafts=free_drafts)
    raise ValueError(f"speculative policy {name!r} is invalid: must be one of {', '.join(POLICIES)}")
