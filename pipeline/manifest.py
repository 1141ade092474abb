"""Resume and bookkeeping: `_manifest.json` (config, model, shard plan, per-shard stats, totals) and `_SUCCESS`."""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import time
from dataclasses import dataclass
from typing import Any

from pipeline.job import Job
from pipeline.lock import OutputLock
from pipeline.output import MANIFEST, SUCCESS, OutputDir, OutputRefused


def _plan(job: Job) -> list[dict[str, Any]]:
    return [{"shard": s.index, "start": s.start, "stop": s.stop, "file": s.file_name} for s in job.plan]


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    keys = sorted(set(old) | set(new))
    out = []
    for key in keys:
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {_short(a)} → {_short(b)}")
    return out


@dataclass(frozen=True)
class Resume:
    """What a run starts from: the shards already complete, and the sampling seed its rows use."""

    done: set[int]
    seed: int | None  # generate jobs: row i samples with seed + i (the flag's, or drawn once per job); else None


def _sampling_seed(job: Job, old: dict[str, Any] | None) -> int | None:
    """`--seed` when given; else the seed this job drew in an earlier run (resume); else fresh entropy."""
    if job.worker.sampling is None:
        return None  # not a sampling job
    given = job.worker.sampling.seed
    if given is not None:
        return given
    if old is not None and isinstance(old.get("sampling_seed"), int):
        return old["sampling_seed"]
    return secrets.randbits(63)


@dataclass(frozen=True)
class OutputCheck:
    """What an output directory holds, read without touching it: the manifest of the job it holds (None: none), its
    shard files, and how that job differs from this one."""

    manifest: dict[str, Any] | None
    parts: list[str]
    differences: list[str]
    fingerprint: dict[str, Any]


def check_output(out: OutputDir, job: Job, overwrite: bool) -> OutputCheck:
    """Read the output directory and compare it with this job; nothing in it is created or removed. `OutputRefused`
    when `--output` is a file, or holds a different job (listing what differs) and `overwrite` is off."""
    out.check_directory()
    # The plan by its hash: the manifest lists it once, and comparing two 100,000-shard plans is one string compare.
    plan_sha256 = hashlib.sha256(json.dumps(_plan(job)).encode()).hexdigest()
    fingerprint = json.loads(json.dumps({**job.fingerprint, "plan_sha256": plan_sha256}))
    parts = [n for n in out.names() if n.startswith("part-") and n.endswith(".parquet")]
    old = None
    try:
        old = out.read_json(MANIFEST) if out.exists(MANIFEST) else None
    except OutputRefused:
        if not overwrite:
            raise
        differences = [f"an unreadable {MANIFEST}"]
    else:
        if old is not None:
            differences = _differences(old.get("fingerprint", {}), fingerprint)
        else:
            differences = [f"{len(parts)} part files without a {MANIFEST}"] if parts else []
    if differences and not overwrite:
        shown = "; ".join(differences[:5]) + (f"; and {len(differences) - 5} more" if len(differences) > 5 else "")
        raise OutputRefused(f"output {out.uri} holds a different job ({shown}); use --overwrite to replace it")
    return OutputCheck(old, parts, differences, fingerprint)


def prepare_output(out: OutputDir, job: Job, overwrite: bool) -> Resume:
    """Check the output directory against this job (`check_output`), then make it this run's: return the shards
    already complete and the sampling seed.

    Same job (flags, model and draft weights, tokenizer, input contents) → finished shard files are kept as they
    are. A different job (or shard files without a manifest) → `OutputRefused` listing what differs, unless
    `overwrite`, which clears the directory's hybridgen files first. Only then is anything written or removed, and
    only this code's files (its leftover temporaries, its shard files, manifest and marker).
    """
    check = check_output(out, job, overwrite)
    out.create()
    out.remove_temporaries()
    parts, old = check.parts, check.manifest
    if check.differences:
        for name in parts + [MANIFEST, SUCCESS]:
            out.delete(name)
        parts, old = [], None
    finished = set(parts)
    done = {s.index for s in job.plan if s.file_name in finished}
    seed = _sampling_seed(job, old)
    runs = (old or {}).get("runs", [])
    runs.append({"started_at": _now(), "finished_at": None, "shards_already_done": len(done)})
    manifest = {
        "job": job.name,
        "status": "running",
        "config": job.config,
        "model": job.fingerprint.get("model_identity"),
        # The hub commits this run's workers load (None: a local directory); not compared on resume.
        "model_revision": job.worker.revision,
        "draft_model_revision": getattr(job.worker.speculative, "draft_revision", None),
        "fingerprint": check.fingerprint,
        "num_rows": len(job.rows),
        "plan": _plan(job),
        "started_at": (old or {}).get("started_at", runs[-1]["started_at"]),
        "runs": runs,
    }
    if seed is not None:
        manifest["sampling_seed"] = seed
    out.delete(SUCCESS)
    out.write_text(MANIFEST, json.dumps(manifest, indent=2, default=str))
    return Resume(done, seed)


def open_output(job: Job) -> tuple[OutputDir, OutputLock]:
    """The job's output directory, checked to be this job's before anything in it is touched (then created), and
    its lock (to take with `with`); `OutputRefused` in one line for a directory this run cannot use."""
    try:
        out = OutputDir(job.output.output)
        check_output(out, job, job.output.overwrite)
        out.create()
        return out, OutputLock(out)
    except OSError as error:  # permissions, a missing bucket, credentials …
        raise OutputRefused(f"--output {job.output.output}: {type(error).__name__}: {error}") from None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _sum_counts(infos: list[dict[str, Any]]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for info in infos:
        for key, value in info.items():
            if isinstance(value, (int, float)) and key not in ("start", "stop", "index"):
                totals[key] = totals.get(key, 0) + value
    return totals


def _throughput(counts: dict[str, float], wall_seconds: float) -> dict[str, float]:
    """Tokens per second for the token counts present."""
    return {
        f"{tokens}_per_second": counts[tokens] / wall_seconds if wall_seconds else 0.0
        for tokens in ("generated_tokens", "scored_tokens")
        if tokens in counts
    }


def finalize_output(
    out: OutputDir, job: Job, wall_seconds: float, written: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    """Check every row is present exactly once, write totals into the manifest and `_SUCCESS`; return the totals.

    `written`: shard index → the stats this run wrote into that shard's file (its throughput counts only their
    tokens over its own wall time); only the files of shards from earlier runs are read back. The totals'
    throughput covers every run whose wall time is known; shards written by a run that crashed count in the
    totals' rows and tokens but not in their throughput (`untimed_shards`).
    """
    manifest = out.read_json(MANIFEST)
    shards = {}
    for shard in job.plan:
        info = written[shard.index] if shard.index in written else out.shard_info(shard.file_name)
        if info.get("rows") != shard.num_rows * job.samples_per_row or info.get("start") != shard.start:
            raise RuntimeError(
                f"{shard.file_name} holds {info.get('rows')} rows from {info.get('start')}, "
                f"expected {shard.num_rows * job.samples_per_row} from {shard.start}"
            )
        shards[str(shard.index)] = info
    totals: dict[str, Any] = {"rows": 0, "seconds": 0.0, **_sum_counts(list(shards.values()))}
    if totals["rows"] != len(job.rows) * job.samples_per_row:
        raise RuntimeError(
            f"output holds {totals['rows']} rows, input has {len(job.rows)} × {job.samples_per_row} samples"
        )
    token_keys = [k for k in ("generated_tokens", "scored_tokens") if k in totals]
    this_run = _sum_counts(list(written.values()))
    this_run = {"rows": this_run.get("rows", 0), **{k: this_run.get(k, 0) for k in token_keys}}
    run = manifest["runs"][-1]
    run.update(
        finished_at=_now(),
        wall_seconds=wall_seconds,
        shards_written=len(written),
        **this_run,
        **_throughput(this_run, wall_seconds),
    )
    timed = [r for r in manifest["runs"] if r.get("wall_seconds") is not None]
    timed_counts = _sum_counts([{k: r.get(k, 0) for k in token_keys} for r in timed])
    totals["runs"] = len(manifest["runs"])
    totals["wall_seconds"] = sum(r["wall_seconds"] for r in timed)
    totals.update(_throughput(timed_counts, totals["wall_seconds"]))
    totals["untimed_shards"] = len(job.plan) - sum(r.get("shards_written", 0) for r in timed)
    if totals.get("scored_tokens"):
        totals["corpus_perplexity"] = math.exp(-totals["sum_logprob"] / totals["scored_tokens"])
    if totals.get("prompt_tokens"):
        totals["prefix_cache_hit_rate"] = totals.get("prefix_cache_hit_tokens", 0) / totals["prompt_tokens"]
    if totals.get("num_draft_tokens"):
        totals["acceptance_rate"] = totals["num_accepted_draft_tokens"] / totals["num_draft_tokens"]
        totals["mean_accepted_length"] = 1 + totals["num_accepted_draft_tokens"] / totals["num_drafts"]
    manifest.update(status="complete", shards=shards, totals=totals, finished_at=_now())
    out.write_text(MANIFEST, json.dumps(manifest, indent=2, default=str))
    out.write_text(SUCCESS, "")
    return totals
