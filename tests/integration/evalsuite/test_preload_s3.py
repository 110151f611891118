"""Object keys from a real S3 server (moto's) never become paths outside the preload folder."""

from __future__ import annotations

import uuid

import pytest

from evalsuite.errors import PreloadError
from evalsuite.preload import preload
from testing.local_s3 import free_ports


@pytest.fixture(scope="module")
def s3_client():
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_ports(1)[0]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    yield endpoint, boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="moto",
                                 aws_secret_access_key="moto", region_name="us-east-1")
    server.stop()


@pytest.fixture
def bucket(s3_client, monkeypatch):
    """A fresh bucket; preload reaches the server through the usual AWS_* variables."""
    endpoint, client = s3_client
    for name, value in (("AWS_ENDPOINT_URL", endpoint), ("AWS_ACCESS_KEY_ID", "moto"),
                        ("AWS_SECRET_ACCESS_KEY", "moto"), ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    name = f"models-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=name)
    client.put_object(Bucket=name, Key="model/config.json", Body=b"{}")
    return name, client


@pytest.mark.parametrize("how", ["absolute (prefix//abs)", "parent (prefix/../x)", "dot (prefix/./a/../../x)"])
def test_a_key_that_would_leave_the_preload_folder_is_refused_before_any_copy(bucket, tmp_path, how):
    name, client = bucket
    root = tmp_path / "shm"
    target = tmp_path / "escaped"  # where each hostile key would land
    hostile = {"absolute (prefix//abs)": f"model/{target}",  # "model//tmp/.../escaped"
               "parent (prefix/../x)": "model/../../escaped",
               "dot (prefix/./a/../../x)": "model/./a/../../../escaped"}[how]
    client.put_object(Bucket=name, Key=hostile, Body=b"planted")
    with pytest.raises(PreloadError, match="would be written outside the preload folder"):
        preload(f"s3://{name}/model", root)
    assert not target.exists()
    assert [p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".lock")] == []


def test_a_plain_s3_model_folder_still_preloads(bucket, tmp_path):
    name, client = bucket
    client.put_object(Bucket=name, Key="model/sub/weights.bin", Body=b"\x01" * 64)
    local = preload(f"s3://{name}/model", tmp_path / "shm")
    assert (local / "sub" / "weights.bin").read_bytes() == b"\x01" * 64
    assert (local / "config.json").read_bytes() == b"{}"
