"""Speculative decoding: proposers (n-gram, draft model — attention-only or hybrid), rejection sampling, metrics.

Modules: config (SpeculativeConfig), proposal (Proposal, Proposer), ngram, draft_model, rejection_sampler, metrics.
"""

from workers.spec_decode.config import SpeculativeConfig
from workers.spec_decode.metrics import SpecStats
from workers.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, num_accepted_tokens, rejection_sample

__all__ = ["PLACEHOLDER_TOKEN_ID", "SpecStats", "SpeculativeConfig", "num_accepted_tokens", "rejection_sample"]
