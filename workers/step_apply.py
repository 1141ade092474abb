"""The apply part of a step: sample or accept, shift state, append tokens (retiring is the scheduler's).

Sampling and acceptance read the step's per-row sampling state as one value (`SamplingBatch`); the states are
shifted by the executor that ran the step (`keep`); a proposer that drafts from the target's hidden states is handed
them after every target forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from workers.executors import ModuleExecutor, Verification
from workers.grammar_masks import step_masks
from workers.logits_processors import apply_options, step_options
from workers.logprobs import PROCESSED, RAW, step_logprobs
from workers.requests import Request, sampling_batch
from workers.sampling import PLACEHOLDER_TOKEN_ID, SamplingBatch, apply_masks, sample
from workers.spec_decode.policy import AdaptivePolicy, FixedPolicy, observe_shadow_drafts
from workers.spec_decode.proposal import Proposal, Proposer
from workers.spec_decode.rejection_sampler import RejectionSampler, num_accepted_tokens


def with_options(
    batch: SamplingBatch, requests: list[Request], drafts: torch.Tensor | None, logits: torch.Tensor
) -> SamplingBatch:
    """The batch with the step's logits options (`workers/logits_processors.py`) when any row has one."""
    options = step_options(requests, drafts, logits.shape[-1], logits.device)
    return batch if options is None else replace(batch, options=options)


class StepApplier:
    """Turns a step's logits into tokens on its requests (and its drafts into accepted tokens)."""

    def __init__(
        self,
        tokenizer: Any | None,
        proposer: Proposer | None,
        policy: AdaptivePolicy | FixedPolicy,
        rejection_sampler: RejectionSampler,
        logprobs_mode: str = RAW,
        publish: Callable[[str, Any], None] | None = None,
    ):
        """`logprobs_mode`: which distribution the rows that ask for logprobs get them from (`workers/logprobs.py`).
        `publish`: the leader of a tensor-parallel group sends each step's outcome through it (tokens and finishes,
        accepted counts) for its followers to replay (`workers/distributed/lockstep.py`)."""
        self.tokenizer, self.proposer, self.policy = tokenizer, proposer, policy
        self.rejection_sampler, self.logprobs_mode = rejection_sampler, logprobs_mode
        self.publish = publish
        self.drafts_from_hidden = proposer is not None and proposer.drafts_from_hidden

    def observe(
        self, requests: list[Request], hidden: torch.Tensor | None, cache_lens: list[int], kept: list[int]
    ) -> None:
        """Hand the target's final hidden states to a proposer that drafts from them (MTP)."""
        if self.drafts_from_hidden:
            self.proposer.observe_target(requests, hidden, cache_lens, kept)

    def sampled(self, requests: list[Request], logits: torch.Tensor) -> None:
        """One sampled token appended to every request (logits [b, v]), masked by its grammar, with its logprobs
        where asked."""
        masks = step_masks(requests)
        batch = sampling_batch(requests, None if masks is None else masks[:, 0])
        batch = with_options(batch, requests, None, logits)
        processed = apply_options(logits[:, None], batch)  # [b, 1, v]: the logits themselves without options
        tokens = sample(processed[:, 0], batch)
        logprobs = None
        if batch.logprob_rows:
            taken = torch.tensor(tokens, device=logits.device)[:, None]  # [b, 1]
            logprobs = step_logprobs(self._logprob_logits(logits[:, None], processed), taken, batch, self.logprobs_mode)
        for row, (request, token) in enumerate(zip(requests, tokens)):
            request.append(token, self.tokenizer)
            if logprobs is not None:
                logprobs.record(request, row, 1)
        if self.publish is not None:
            self.publish("sampled", [(token, r.finish_reason) for token, r in zip(tokens, requests)])

    def decoded(self, requests: list[Request], logits: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """A plain decode step's output: the hidden states to the proposer, then a sampled token each."""
        self.observe(requests, hidden, [r.num_tokens - 1 for r in requests], [1] * len(requests))
        self.sampled(requests, logits)

    def verified(
        self, requests: list[Request], proposal: Proposal, verification: Verification, executor: ModuleExecutor
    ) -> list[int]:
        """Accept → shift → append for a verification step; returns num_accepted_tokens per request."""
        # 1. Accept: the count of valid tokens drives everything that follows (one device→host copy, the rows).
        drafts = proposal.token_ids.to(executor.device)  # [num_reqs, max_k]
        batch = sampling_batch(requests, step_masks(requests, proposal))
        batch = with_options(batch, requests, proposal.token_ids, verification.logits)
        # Each row's grammar and options at every position, the drafts before it counted as generated.
        target_logits = apply_options(apply_masks(verification.logits, batch), batch)
        output_token_ids = self.rejection_sampler(
            drafts, target_logits, proposal.probs, batch.params, batch.generators
        )  # [num_reqs, max_k + 1], on the device
        rows = output_token_ids.tolist()
        accepted = [sum(t != PLACEHOLDER_TOKEN_ID for t in row) for row in rows]  # num_accepted_tokens
        # The target's own logprobs at every position, read before the shift (a plan's logits are a view of a buffer
        # its later calls overwrite).
        logprobs = step_logprobs(
            self._logprob_logits(verification.logits, target_logits), output_token_ids, batch, self.logprobs_mode
        )
        # 2. Shift: keep each layer's state after input num_accepted_tokens − 1; KV length follows the token count.
        counts = num_accepted_tokens(output_token_ids) if verification.old_states is not None else None
        hidden = executor.keep(requests, verification, accepted, counts)
        self.observe(requests, hidden, verification.cache_lens, accepted)
        # 3. Append: the proposer shifts its own state; each request takes its valid tokens.
        self.proposer.accepted(requests, accepted)
        appended = []
        for i, (request, row, k) in enumerate(zip(requests, rows, proposal.num_draft_tokens)):
            num_before = len(request.output)
            request.append_verified(row, k, self.tokenizer)
            if logprobs is not None:  # only for the tokens appended: a stop inside the accepted run drops the rest
                logprobs.record(request, i, len(request.output) - num_before)
            if self.publish is not None:
                appended.append((request.output[num_before:], request.finish_reason))
        if self.publish is not None:
            self.publish("verified", (accepted, appended))
        return accepted

    def _logprob_logits(self, raw: torch.Tensor, with_options: torch.Tensor) -> torch.Tensor:
        """What logprobs are read from: the raw logits, or in processed mode the logits with the options applied
        (vLLM's processed logprobs come after every logits processor; `step_logprobs` then applies the grammar mask
        again — idempotent — and the sampling transforms)."""
        return with_options if self.logprobs_mode == PROCESSED else raw

    def shadow_drafts(self, requests: list[Request], shadow: dict[int, tuple[int, int]]) -> None:
        """Tell the policy whether the step's tokens confirm the looked-up drafts it did not verify."""
        observe_shadow_drafts(self.policy, requests, shadow)
