"""Where workers go: the Ray resources one worker asks for, how many CPUs and how much memory it gets, what a pending
worker waits for.

Pure functions over plain values (each alive node's resource totals as a dict), so they are tested without a
cluster; `pipeline/driver.py` feeds them `ray.nodes()` and turns the result into actor options.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pipeline.config import ScalingConfig

ACCELERATOR_AMOUNT = 0.001  # what Ray's own `accelerator_type=` option asks of an `accelerator_type:NAME` resource


@dataclass(frozen=True)
class Placement:
    """What each worker asks of the cluster and which device it computes on."""

    device: str  # "cuda" | "cpu"
    num_cpus: int
    num_gpus: int
    resources: dict[str, float] = field(default_factory=dict)  # custom ones, accelerator_type:NAME included
    num_threads: int | None = None  # torch threads of a CPU worker (of each of its ranks)
    memory: int | None = None  # CPU workers: bytes asked of Ray's `memory` resource, and the worker's memory budget
    num_ranks: int = 1  # tensor-parallel ranks of the worker (processes on one node, GPUs on CUDA)

    @property
    def rank_memory(self) -> int | None:
        """Each rank's share of a CPU worker's memory budget (the engine's `max_memory`: every rank plans its own)."""
        return None if self.memory is None else self.memory // self.num_ranks

    @property
    def bundle(self) -> dict[str, float]:
        """One worker's resources, as the autoscaler is asked for them."""
        return {
            "CPU": self.num_cpus,
            **({"GPU": self.num_gpus} if self.num_gpus else {}),
            **({"memory": self.memory} if self.memory else {}),
            **self.resources,
        }

    def actor_options(self) -> dict[str, object]:
        """Options for `ray.remote(...).options(...)`."""
        options: dict[str, object] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory:
            options["memory"] = self.memory
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


def plan_placement(
    device: str, scaling: ScalingConfig, nodes: list[dict[str, float]], num_workers: int, max_memory: str | None = None
) -> Placement:
    """The placement of `num_workers` workers for `--device` on a cluster whose alive nodes have `nodes` resources.

    `auto` means GPU workers when some node has a GPU. CPU workers get `--cpus-per-worker`, or by default the most
    CPUs that let every worker fit on the nodes able to hold one (never more than one such node has; 1 when none is
    up yet, e.g. on an autoscaling cluster that starts with no worker node). A CPU worker's memory budget is
    `max_memory` (`--max-memory`), else its share of a node's Ray `memory` (see `memory_share`); it asks Ray for
    that much `memory`, so Ray places no more workers on a node than its memory holds.

    With `--tensor-parallel-size` T a worker is still one actor, asking for one bundle of T ranks: {GPU: T, CPU: T·c}
    on GPUs, {CPU: T·c, memory} on CPUs, where c is the CPUs (and threads) of one rank. A bundle never spans nodes,
    so the ranks share a node (STRICT_PACK with one bundle; docs/tensor_parallel.md). A CPU worker's `memory` covers
    all its ranks; each plans within `rank_memory`.
    """
    size = scaling.tensor_parallel_size
    resources = dict(scaling.worker_resources or {})
    if scaling.accelerator_type:
        resources[f"accelerator_type:{scaling.accelerator_type}"] = ACCELERATOR_AMOUNT
    use_gpu = device == "cuda" or (device == "auto" and any(node.get("GPU", 0) > 0 for node in nodes))
    if use_gpu:
        return Placement("cuda", size * (scaling.cpus_per_worker or 1), size, resources, num_ranks=size)
    eligible = [node.get("CPU", 0) / size for node in nodes if _holds(node, resources)]
    cpus = scaling.cpus_per_worker or fitting_cpus(eligible, num_workers)  # per rank
    if max_memory is not None:
        from workers.memory import parse_memory_size  # the workers' own rule

        memory = parse_memory_size(max_memory)
    else:
        memory = memory_share([node for node in nodes if _holds(node, resources)], size * cpus, num_workers)
    return Placement("cpu", size * cpus, 0, resources, num_threads=cpus, memory=memory, num_ranks=size)


def fitting_cpus(node_cpus: list[float], num_workers: int) -> int:
    """The largest whole CPU count c such that `num_workers` workers of c CPUs fit on nodes with `node_cpus`; 1 if none.

    Two 8-CPU nodes and one worker → 8 (not the 16 a cluster-wide division gives, which no node has).
    """
    for cpus in range(int(max(node_cpus, default=0)), 0, -1):
        if sum(int(n // cpus) for n in node_cpus) >= num_workers:
            return cpus
    return 1


def memory_share(nodes: list[dict[str, float]], cpus: int, num_workers: int) -> int | None:
    """Bytes of Ray `memory` per CPU worker of `cpus` CPUs: on each node that holds one, its `memory` divided among
    the workers its CPUs hold (at most `num_workers`); the smallest such share, so that it fits on every node. None
    when no node that holds a worker reports its memory (none is up yet).

    One 16 GiB node of 8 CPUs, 2 workers of 4 CPUs → 8 GiB each (not 80 % of the node each, which oversubscribes it).
    """
    shares = [
        int(node["memory"] // min(int(node.get("CPU", 0) // cpus), num_workers))
        for node in nodes
        if node.get("memory", 0) > 0 and node.get("CPU", 0) >= cpus
    ]
    return min(shares, default=None)


def _holds(node: dict[str, float], resources: dict[str, float]) -> bool:
    return all(node.get(name, 0) >= amount for name, amount in resources.items())


def _amount(name: str, value: float) -> str:
    return f"{value / 2**30:.3g} GiB" if name in ("memory", "object_store_memory") else f"{value:g}"


def describe_bundle(bundle: dict[str, float]) -> str:
    """{CPU: 1, GPU: 1} as the messages show it (memory in GiB)."""
    return "{" + ", ".join(f"{name}: {_amount(name, value)}" for name, value in bundle.items()) + "}"


def pending_message(num_pending: int, bundle: dict[str, float], nodes: list[dict[str, float]], autoscaler: bool) -> str:
    """Why `num_pending` workers wait: which resource no node has, and whether an autoscaler can add nodes.

    E.g. "2 workers need {CPU: 1, GPU: 1}: no node has GPU ≥ 1 (cluster total 0), and no autoscaler is running".
    """
    needs = f"{num_pending} worker{'s' if num_pending != 1 else ''} need{'s' if num_pending == 1 else ''}"
    lacking = [
        f"no node has {name} ≥ {_amount(name, amount)} (cluster total "
        f"{_amount(name, sum(n.get(name, 0) for n in nodes))})"
        for name, amount in bundle.items()
        if not any(node.get(name, 0) >= amount for node in nodes)
    ]
    if not lacking and not any(_holds(node, bundle) for node in nodes):
        lacking = ["no single node has all of it"]
    why = ", ".join(lacking) if lacking else "the nodes that can hold one are busy"
    scaler = "the autoscaler has been asked for nodes" if autoscaler else "no autoscaler is running to add nodes"
    return f"{needs} {describe_bundle(bundle)}: {why}, and {scaler}"


def autoscaler_in_status(status: bytes | str | None) -> bool:
    """Whether Ray's autoscaling status (the monitor's JSON report) comes from an autoscaler with node types.

    Without an autoscaling config Ray's monitor still reports, through a read-only stand-in whose node types are
    named "node_<id>": that one cannot add nodes.
    """
    try:
        report = json.loads(status or "{}").get("autoscaler_report") or {}
    except (ValueError, TypeError, AttributeError):
        return False
    node_types = set(report.get("active_nodes") or {}) | set(report.get("pending_launches") or {})
    node_types |= {entry[1] for entry in report.get("pending_nodes") or [] if len(entry) > 1}
    return any(not name.startswith("node_") for name in node_types)
