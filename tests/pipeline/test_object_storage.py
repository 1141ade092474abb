"""`--input` and `--output` on S3, against an S3-compatible server (moto) started by the test on 127.0.0.1."""

from __future__ import annotations

import socket

import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pytest

from pipeline.driver import run
from pipeline.generate import build_generate_job
from pipeline.inputs import load_rows
from tests.pipeline.conftest import NUM_ROWS, job_config, read_output

pytestmark = pytest.mark.slow
BUCKET = "hybridgen-test"


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on a free local port; AWS_* variables point boto3 and pyarrow at it. Stopped afterwards."""
    import boto3  # test dependencies: moto[server] brings boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    patch = pytest.MonkeyPatch()
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}.items():  # fmt: skip
        patch.setenv(name, value)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    try:
        yield client
    finally:
        patch.undo()
        server.stop()


def _modified(client, prefix: str) -> dict[str, object]:
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"]: (o["LastModified"], o["ETag"]) for o in listing if o["Key"].endswith(".parquet")}


def test_input_and_output_on_s3_with_resume(s3, checkpoint_dir, dataset, tmp_path, ray_session):
    s3.upload_file(str(dataset), BUCKET, "in/part-a/prompts.jsonl")
    assert load_rows(f"s3://{BUCKET}/in/").to_dict() == load_rows(str(dataset)).to_dict()  # directory
    assert len(load_rows(f"s3://{BUCKET}/in/*/*.jsonl")) == NUM_ROWS  # glob
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_rows(f"s3://{BUCKET}/nothing-here/")
    model = checkpoint_dir("granite_moe")
    run(build_generate_job(job_config(model, dataset, tmp_path / "local")))
    expected = read_output(tmp_path / "local")

    output = f"s3://{BUCKET}/out"
    config = job_config(model, f"s3://{BUCKET}/in/part-a/prompts.jsonl", output)
    run(build_generate_job(config))
    remote_fs, path = pafs.FileSystem.from_uri(output)
    rows = pads.dataset(path, filesystem=remote_fs, format="parquet").to_table().to_pylist()
    assert sorted(rows, key=lambda row: row["id"]) == expected
    assert remote_fs.get_file_info(f"{path}/_SUCCESS").type == pafs.FileType.File

    before = _modified(s3, "out/")
    assert len(before) == NUM_ROWS // 8
    s3.delete_object(Bucket=BUCKET, Key="out/part-00002.parquet")  # as if the driver died before writing it
    run(build_generate_job(config))
    after = _modified(s3, "out/")
    assert {k: v for k, v in after.items() if k != "out/part-00002.parquet"} == {
        k: v for k, v in before.items() if k != "out/part-00002.parquet"
    }  # finished shards untouched
    assert "out/part-00002.parquet" in after
    rows = pads.dataset(path, filesystem=remote_fs, format="parquet").to_table().to_pylist()
    assert sorted(rows, key=lambda row: row["id"]) == expected


def test_an_input_edited_on_s3_is_a_different_job(s3, checkpoint_dir, tmp_path):
    """A remote input is identified by the content of the files copied from it, whatever their names locally:
    unchanged it resumes; one row edited (same size, past the first 1,024) is refused."""
    from pipeline.manifest import prepare_output
    from pipeline.output import OutputDir

    def upload(changed_row: int | None) -> None:
        lines = [f'{{"key": "row-{i:04d}", "text": "{"cat" if i == changed_row else "dog"}"}}' for i in range(2000)]
        s3.put_object(Bucket=BUCKET, Key="animals/prompts.jsonl", Body=("\n".join(lines) + "\n").encode())

    upload(None)
    out = OutputDir(str(tmp_path / "out"))
    config = job_config(checkpoint_dir("granite_moe"), f"s3://{BUCKET}/animals/", tmp_path / "out")
    prepare_output(out, build_generate_job(config), overwrite=False)
    assert prepare_output(out, build_generate_job(config), overwrite=False).done == set()  # a fresh copy: resumes
    upload(1500)
    with pytest.raises(ValueError, match=r"different job \(input_identity\.files\.prompts\.jsonl\.sha256"):
        prepare_output(out, build_generate_job(config), overwrite=False)
