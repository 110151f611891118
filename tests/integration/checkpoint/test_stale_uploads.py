"""What a killed writer leaves (temporary shard files, incomplete multipart uploads) is removed
by the next engine opened on the root, once old enough; a live writer's never is."""

from __future__ import annotations

import os
import time

from checkpoint.engine import CheckpointEngine
from infra.storage import STALE_UPLOAD_AGE_S, open_storage
from testing.local_s3 import ACCESS_KEY, SECRET_KEY

DAY_AND_AN_HOUR = STALE_UPLOAD_AGE_S + 3600


def test_local_temporaries_of_a_killed_writer_go_on_the_next_open(tmp_path):
    root = tmp_path / "ckpt"
    step = root / "step-00000010"
    step.mkdir(parents=True)
    stale = step / ".rank-0-of-2.bin.4242.0badf00d.tmp"   # atomic_write_chunks' name, writer killed
    live = step / ".rank-1-of-2.bin.4243.1234abcd.tmp"    # a writer still writing
    lookalike = step / "notes.tmp"                         # not the writers' naming: not ours to delete
    shard = step / "rank-0-of-2.bin"
    for path in (stale, live, lookalike, shard):
        path.write_bytes(b"x" * 16)
    old = time.time() - DAY_AND_AN_HOUR
    for path in (stale, lookalike, shard):
        os.utime(path, (old, old))
    CheckpointEngine(str(root), async_save=False, writer="thread").close()  # the next job's open
    assert not stale.exists()
    assert live.exists() and lookalike.exists() and shard.exists()


def test_incomplete_multipart_uploads_under_the_jobs_prefix_are_aborted(seaweed):
    """On SeaweedFS: moto dates every upload 2010, so only a real server shows a young one kept."""
    import boto3

    bucket = seaweed.make_bucket()
    client = boto3.client("s3", endpoint_url=seaweed.endpoint, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY, region_name="us-east-1")
    killed = client.create_multipart_upload(Bucket=bucket, Key="job-a/step-00000010/rank-0-of-1.bin")
    client.upload_part(Bucket=bucket, Key="job-a/step-00000010/rank-0-of-1.bin", UploadId=killed["UploadId"],
                       PartNumber=1, Body=b"x" * 1024)
    other_job = client.create_multipart_upload(Bucket=bucket, Key="job-ab/step-00000010/rank-0-of-1.bin")

    def uploads() -> set[str]:
        return {u["UploadId"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])}

    storage = open_storage(f"s3://{bucket}/job-a", seaweed.options())
    assert storage.remove_stale_uploads() == []          # minutes old: could be a live writer's
    assert uploads() == {killed["UploadId"], other_job["UploadId"]}
    assert storage.remove_stale_uploads(older_than_s=0) == ["step-00000010/rank-0-of-1.bin"]
    assert uploads() == {other_job["UploadId"]}          # another job's prefix is left alone
    storage.close()
