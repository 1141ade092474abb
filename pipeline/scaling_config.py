"""The scaling section of a job's config: how many workers, of how many ranks, where they go, how rows are cut into
shards and how failures are retried (`--num-workers`, `--tensor-parallel-size`, `--max-shard-retries`, …)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.fields import doc, fail
from pipeline.liveness import MIN_STALL_TIMEOUT_S, STALL_FACTOR

RESERVED_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


@dataclass(frozen=True)
class ScalingConfig:
    """How many workers, where they go, how rows are cut into shards, how failures are retried."""

    num_workers: int | None = doc("fixed number of workers (default: autoscale between min and max)", default=None)
    min_workers: int = doc(
        "autoscaling: fewest workers asked of the cluster (fewer only when there are fewer "
        "shards); work starts as soon as one is ready",
        default=1,
    )
    max_workers: int = doc("autoscaling: workers to ask the cluster for at most", default=4)
    cpus_per_worker: int | None = doc(
        "CPUs per worker (per rank with --tensor-parallel-size: a worker asks for T times this); a CPU worker (rank) "
        "also runs this many torch threads (default: GPU workers 1; CPU workers the most that lets every worker fit "
        "on the nodes that can hold one, or 1 when no such node is up yet)",
        default=None,
    )
    worker_resources: dict[str, float] | None = doc(
        "extra Ray resources per worker as JSON, e.g. '{\"spot_node\": 1}' (a custom resource of a node type); "
        "asked of the autoscaler too",
        default=None,
    )
    accelerator_type: str | None = doc(
        "place workers on nodes with this accelerator (Ray's accelerator_type:NAME resource, e.g. L4, A100, H100); "
        "asked of the autoscaler too",
        default=None,
    )
    tensor_parallel_size: int = doc(
        "ranks per worker (vLLM's name): each worker splits the model over this many GPUs of one node (one Ray "
        "bundle {GPU: T, CPU: T × --cpus-per-worker}), or on CPU workers over this many processes (T × "
        "--cpus-per-worker CPUs, --cpus-per-worker threads each); the driver still sees one worker",
        default=1,
    )
    enable_expert_parallel: bool = doc(
        "MoE models with --tensor-parallel-size > 1 (vLLM's name): each rank holds whole experts (num_experts / T) "
        "instead of a slice of every expert",
        default=False,
    )
    rows_per_shard: int | None = doc("rows per output file (default: from the dataset size)", default=None)
    max_shard_retries: int = doc(
        "times a shard is retried after it failed (its worker raised, died or passed the shard's deadline)", default=3
    )
    shard_timeout_s: float | None = doc(
        "seconds a shard may take before its worker is stopped (whatever its progress) and the shard retried; 0 = "
        "never stop a worker. Default (auto): a worker is stopped when it makes no progress (it reports the forwards "
        f"its engine finishes) for {STALL_FACTOR:g} times its longest forward, at least {MIN_STALL_TIMEOUT_S:g} s, "
        "however long its shards take",
        default=None,
    )
    max_worker_start_failures: int = doc(
        "fail the job once this many workers failed to start (each is printed)", default=3
    )
    ray_address: str = doc(
        "Ray cluster: 'auto' (the submitting cluster, else one running here, else a new local "
        "Ray), 'local' (always a new local Ray) or an address",
        default="auto",
    )
    worker_startup_timeout_s: float = doc(
        "fail when no worker has started after this many seconds, naming what the pending workers wait for",
        default=1800.0,
    )

    def __post_init__(self) -> None:
        if self.num_workers is not None and (not isinstance(self.num_workers, int) or self.num_workers < 1):
            fail("ScalingConfig", "num_workers", self.num_workers, "must be an integer ≥ 1")
        if not isinstance(self.min_workers, int) or self.min_workers < 1:
            fail("ScalingConfig", "min_workers", self.min_workers, "must be an integer ≥ 1")
        if not isinstance(self.max_workers, int) or self.max_workers < self.min_workers:
            fail(
                "ScalingConfig",
                "max_workers",
                self.max_workers,
                f"must be an integer ≥ min_workers ({self.min_workers})",
            )
        if self.cpus_per_worker is not None and (not isinstance(self.cpus_per_worker, int) or self.cpus_per_worker < 1):
            fail("ScalingConfig", "cpus_per_worker", self.cpus_per_worker, "must be an integer ≥ 1")
        size = self.tensor_parallel_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            fail("ScalingConfig", "tensor_parallel_size", size, "must be an integer ≥ 1")
        if not isinstance(self.enable_expert_parallel, bool):
            fail("ScalingConfig", "enable_expert_parallel", self.enable_expert_parallel, "must be true or false")
        self._check_resources()
        if self.rows_per_shard is not None and (not isinstance(self.rows_per_shard, int) or self.rows_per_shard < 1):
            fail("ScalingConfig", "rows_per_shard", self.rows_per_shard, "must be an integer ≥ 1")
        if not isinstance(self.max_shard_retries, int) or self.max_shard_retries < 0:
            fail("ScalingConfig", "max_shard_retries", self.max_shard_retries, "must be an integer ≥ 0")
        if self.shard_timeout_s is not None and (
            not isinstance(self.shard_timeout_s, (int, float))
            or isinstance(self.shard_timeout_s, bool)
            or self.shard_timeout_s < 0
        ):
            fail("ScalingConfig", "shard_timeout_s", self.shard_timeout_s, "must be a number ≥ 0 (0 = no deadline)")
        if not isinstance(self.max_worker_start_failures, int) or self.max_worker_start_failures < 1:
            fail("ScalingConfig", "max_worker_start_failures", self.max_worker_start_failures, "must be an integer ≥ 1")
        if not isinstance(self.worker_startup_timeout_s, (int, float)) or self.worker_startup_timeout_s <= 0:
            fail("ScalingConfig", "worker_startup_timeout_s", self.worker_startup_timeout_s, "must be a number > 0")

    def _check_resources(self) -> None:
        resources = self.worker_resources
        if resources is not None:
            if not isinstance(resources, dict) or not all(
                isinstance(k, str) and k and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                for k, v in resources.items()
            ):
                fail(
                    "ScalingConfig",
                    "worker_resources",
                    resources,
                    'must be a JSON object of resource names to positive amounts, e.g. {"spot_node": 1}',
                )
            reserved = sorted(set(resources) & set(RESERVED_RESOURCES))
            if reserved or any(k.startswith("accelerator_type:") for k in resources):
                fail(
                    "ScalingConfig",
                    "worker_resources",
                    resources,
                    f"{', '.join(RESERVED_RESOURCES)} and accelerator_type:* are set by --cpus-per-worker, "
                    "--device and --accelerator-type",
                )
        accelerator = self.accelerator_type
        if accelerator is not None and (
            not isinstance(accelerator, str) or not accelerator or " " in accelerator or ":" in accelerator
        ):
            fail("ScalingConfig", "accelerator_type", accelerator, "must be an accelerator name such as L4 or A100")

    @property
    def worker_range(self) -> tuple[int, int]:
        """(fewest, most) workers the job runs with."""
        return (self.num_workers, self.num_workers) if self.num_workers else (self.min_workers, self.max_workers)
