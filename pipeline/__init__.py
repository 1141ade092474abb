"""The driver side of hybridgen: job configs, input, sharding, scheduling over Ray, Parquet output; and the Ray Data
stage (`build_processor`, `HybridgenProcessorConfig`), imported on first use so that the job entry points do not
load the workers' modules to parse their flags."""

from __future__ import annotations

from typing import Any

__all__ = ["HybridgenProcessorConfig", "Processor", "build_processor"]


def __getattr__(name: str) -> Any:
    """`pipeline.build_processor` and the other names of `pipeline.ray_data`, loaded when first asked for."""
    if name in __all__:
        from pipeline import ray_data

        return getattr(ray_data, name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
