"""Speculative decoding: proposers (n-gram, draft model — attention-only or hybrid), rejection sampling, metrics.

Modules: config (SpeculativeConfig), proposal (Proposal, Proposer), registry (the methods, by name), ngram,
draft_model, mtp, policy, rejection_sampler. The acceptance counters are `workers/spec_stats.py`.
"""

from workers.spec_decode.config import SpeculativeConfig
from workers.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, num_accepted_tokens, rejection_sample
from workers.spec_stats import SpecStats

__all__ = ["PLACEHOLDER_TOKEN_ID", "SpecStats", "SpeculativeConfig", "num_accepted_tokens", "rejection_sample"]
