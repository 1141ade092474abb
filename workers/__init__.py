"""The GPU side of hybridgen: the model runner, sampling, speculative decoding and the Ray actor."""

from workers.config import EngineConfig
from workers.requests import GenerationResult, ScoreResult
from workers.runner import ModelRunner
from workers.samples import sample_seed
from workers.sampling import SamplingParams
from workers.spec_decode import SpeculativeConfig
from workers.structured_outputs import StructuredOutputsParams

__all__ = [
    "EngineConfig",
    "GenerationResult",
    "ModelRunner",
    "SamplingParams",
    "ScoreResult",
    "sample_seed",
    "SpeculativeConfig",
    "StructuredOutputsParams",
]
