"""A full disk while writing shard files: the job fails with one message, what was written stays, a rerun resumes."""

from __future__ import annotations

import errno

import pytest

from pipeline.driver import JobFailed, run
from pipeline.generate import build_generate_job
from pipeline.output import SUCCESS, OutputDir
from tests.pipeline.conftest import NUM_ROWS, job_config, read_output

pytestmark = pytest.mark.slow


def test_full_disk_fails_the_job_and_a_rerun_resumes(checkpoint_dir, dataset, tmp_path, ray_session, monkeypatch):
    config = job_config(checkpoint_dir("granite_moe"), dataset, tmp_path / "out", num_workers=1)
    write = OutputDir.write_table
    calls = []

    def fill_up(self, name, table, info):
        calls.append(name)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, name, table, info)

    monkeypatch.setattr(OutputDir, "write_table", fill_up)
    with pytest.raises(
        JobFailed,
        match=r"writing part-0000\d\.parquet to .* failed \(OSError: \[Errno 28\] No space "
        r"left on device\); the 2 shard files written by this run are kept",
    ):
        run(build_generate_job(config))
    written = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("part-*.parquet")}
    assert len(written) == 2 and not (tmp_path / "out" / SUCCESS).exists()
    monkeypatch.setattr(OutputDir, "write_table", write)  # space freed
    run(build_generate_job(config))
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("part-*.parquet")}
    assert {name: after[name] for name in written} == written and len(after) == NUM_ROWS // 8
    assert [row["id"] for row in read_output(tmp_path / "out")] == [f"row-{i:03d}" for i in range(NUM_ROWS)]
