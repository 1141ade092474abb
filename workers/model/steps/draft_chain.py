"""Greedy draft chains through a decode plan: a draft model's steps, each feeding the previous step's argmax, as
one native call.

At batch 1 a planned step of the demo draft model costs ~0.14 ms, but the Python around each step — its inputs,
one argmax per row, a copy of every layer's state for the draft-side shift — cost about as much again. A chain
follows each step's records with an OP_ARGMAX_FEED record (per row the argmax of the logits — torch.argmax's first
maximal index, NaN largest — written as the next step's token id and into `drafts`; positions advance by one) and
OP_COPY records that snapshot the recurrent states after the step, so n steps are one `decode_plan_run`. Every
step replays the records a single planned step runs, so drafts and states are bit for bit the step-by-step ones.

The snapshots serve the draft-side shift (`keep`): after verification each row keeps the state after its last
accepted draft. Steps 0 … n-2 are snapshotted; the last step's states are those left in the pool.
"""

from __future__ import annotations

import torch

from workers.model.steps.decode_plan import DecodePlan
from workers.model.steps.plan_records import Op, Recorder


class DraftChain:
    """Greedy chains of up to `max_steps` one-token steps of `plan` for rows 0 … b-1 of its pool, and the recurrent
    states after each step for the draft-side shift."""

    def __init__(self, plan: DecodePlan, max_steps: int):
        """Allocate the drafts and snapshot buffers for every slot of the plan's pool."""
        pool = plan.pool
        self.plan, self.pool, self.max_steps = plan, pool, max_steps
        # [max_steps, slots] int64: the token each step chose for each row
        self.drafts = torch.zeros(max_steps, pool.num_slots, dtype=torch.int64)
        # [max_steps - 1, layers, slots, ...]: the recurrent states after steps 0 … max_steps-2
        self.conv = torch.empty(max(max_steps - 1, 0), *pool.conv.shape, dtype=pool.conv.dtype)
        self.ssm = torch.empty(max(max_steps - 1, 0), *pool.ssm.shape, dtype=pool.ssm.dtype)
        self._records: dict[tuple[int, int, int], torch.Tensor] = {}

    def run(self, token_ids: list[int], positions: list[int], first: int, num_steps: int) -> torch.Tensor:
        """Steps `first` … num_steps-1 of a greedy chain: step `first` feeds `token_ids` (one per row) at `positions`,
        every later step the previous step's argmax one position on. States are updated in place and snapshotted
        after every step but the last. Returns the drafts [num_steps - first, b] (a view the next chain overwrites).
        """
        b = len(token_ids)
        if not (1 <= b <= self.plan.max_rows and len(positions) == b and 0 <= first < num_steps <= self.max_steps):
            raise ValueError(
                f"a chain runs 1 … {self.plan.max_rows} rows with one position each for steps within "
                f"0 … {self.max_steps - 1}, got {b} rows, {len(positions)} positions, steps {first} … {num_steps - 1}"
            )
        self.plan.token_ids.numpy()[:b] = token_ids
        self.plan.positions.numpy()[0, :b] = positions
        records = self._records.get((b, first, num_steps))
        if records is None:
            records = self._records[(b, first, num_steps)] = self._record(b, first, num_steps)
        self.plan.replay(records)
        return self.drafts[first:num_steps, :b]

    def snapshot(self, step: int, b: int) -> None:
        """Copy the recurrent states of rows 0 … b-1 into step `step`'s snapshot (a step run outside the chain)."""
        self.conv[step, :, :b] = self.pool.conv[:, :b]
        self.ssm[step, :, :b] = self.pool.ssm[:, :b]

    def keep(self, keep_steps: list[int], num_steps: int) -> None:
        """After a chain of `num_steps` steps: row r of 0 … b-1 keeps its states after step keep_steps[r] (the pool
        holds those after the last step; earlier ones come back from the snapshots)."""
        rows = [row for row, step in enumerate(keep_steps) if step < num_steps - 1]
        if not rows or not self.pool.conv.shape[0]:
            return
        steps, rows = torch.tensor([keep_steps[row] for row in rows]), torch.tensor(rows)
        # Advanced indices around a slice put the rows first: [n, layers, ...] → [layers, n, ...].
        self.pool.conv[:, rows] = self.conv[steps, :, rows].transpose(0, 1)
        self.pool.ssm[:, rows] = self.ssm[steps, :, rows].transpose(0, 1)

    def _record(self, b: int, first: int, num_steps: int) -> torch.Tensor:
        """Each step's plan records, then its argmax-and-feed record and (but the last) its snapshot copies."""
        plan, pool, config = self.plan, self.pool, self.plan.model.config
        pieces = []
        for step in range(first, num_steps):
            pieces.append(plan.records(b, 1))
            rec = Recorder(b, 1)
            rec.emit(
                Op.ARGMAX_FEED,
                [plan.logits, b, config.vocab_size, plan.token_ids, self.drafts[step], plan.positions[0]],
                (config.logits_divisor,),
            )
            if step < num_steps - 1:
                for layer in range(pool.conv.shape[0]):
                    for snapshot, state in ((self.conv, pool.conv), (self.ssm, pool.ssm)):
                        rec.emit(Op.COPY, [snapshot[step, layer, :b], state[layer, :b], state[layer, :b].numel()])
            pieces.append(rec.tensor())
        return torch.cat(pieces)
