"""Resume and bookkeeping: `_manifest.json` (config, model, shard plan, per-shard stats, totals) and `_SUCCESS`."""

from __future__ import annotations

import json
import math
import time
from typing import Any

from pipeline.job import Job
from pipeline.output import MANIFEST, SUCCESS, OutputDir


def _plan(job: Job) -> list[dict[str, Any]]:
    return [{"shard": s.index, "start": s.start, "stop": s.stop, "file": s.file_name} for s in job.plan]


def _differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    keys = sorted(set(old) | set(new))
    out = []
    for key in keys:
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} → {b!r}")
    return out


def prepare_output(out: OutputDir, job: Job, model: dict[str, Any], overwrite: bool) -> set[int]:
    """Check the output directory against this job; return the shards already complete.

    Same job → finished shard files are kept as they are. A different job (or unknown files) → `ValueError`
    listing what differs, unless `overwrite`, which clears the directory's hybridgen files first.
    """
    out.remove_temporaries()
    fingerprint = json.loads(json.dumps({**job.fingerprint, "plan": _plan(job)}))
    parts = [n for n in out.names() if n.startswith("part-") and n.endswith(".parquet")]
    if out.exists(MANIFEST):
        old = out.read_json(MANIFEST)
        differences = _differences(old.get("fingerprint", {}), fingerprint)
    else:
        differences = [f"{len(parts)} part files without a {MANIFEST}"] if parts else []
    if differences and not overwrite:
        shown = "; ".join(differences[:5])
        raise ValueError(f"output {out.uri} holds a different job ({shown}); use --overwrite to replace it")
    if differences:
        for name in parts + [MANIFEST, SUCCESS]:
            out.delete(name)
        parts = []
    manifest = {
        "job": job.name,
        "status": "running",
        "config": job.config,
        "model": model,
        "fingerprint": fingerprint,
        "num_rows": len(job.rows),
        "plan": _plan(job),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    out.delete(SUCCESS)
    out.write_text(MANIFEST, json.dumps(manifest, indent=2, default=str))
    done = set(parts)
    return {s.index for s in job.plan if s.file_name in done}


def finalize_output(out: OutputDir, job: Job, wall_seconds: float) -> dict[str, Any]:
    """Check every row is present exactly once, write totals into the manifest and `_SUCCESS`; return the totals."""
    manifest = out.read_json(MANIFEST)
    shards, totals = {}, {"rows": 0, "seconds": 0.0}
    for shard in job.plan:
        info = out.shard_info(shard.file_name)
        if info.get("rows") != shard.num_rows or info.get("start") != shard.start:
            raise RuntimeError(f"{shard.file_name} holds {info.get('rows')} rows from {info.get('start')}, "
                               f"expected {shard.num_rows} from {shard.start}")  # fmt: skip
        shards[str(shard.index)] = info
        for key, value in info.items():
            if isinstance(value, (int, float)) and key not in ("start", "stop", "index"):
                totals[key] = totals.get(key, 0) + value
    if totals["rows"] != len(job.rows):
        raise RuntimeError(f"output holds {totals['rows']} rows, input has {len(job.rows)}")
    totals["wall_seconds"] = wall_seconds
    for tokens in ("generated_tokens", "scored_tokens"):
        if tokens in totals:
            totals[f"{tokens}_per_second"] = totals[tokens] / wall_seconds if wall_seconds else 0.0
    if totals.get("scored_tokens"):
        totals["corpus_perplexity"] = math.exp(-totals["sum_logprob"] / totals["scored_tokens"])
    if totals.get("num_draft_tokens"):
        totals["acceptance_rate"] = totals["num_accepted_draft_tokens"] / totals["num_draft_tokens"]
        totals["mean_accepted_length"] = 1 + totals["num_accepted_draft_tokens"] / totals["num_drafts"]
    manifest.update(status="complete", shards=shards, totals=totals, finished_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    out.write_text(MANIFEST, json.dumps(manifest, indent=2, default=str))
    out.write_text(SUCCESS, "")
    return totals
