"""One URL-based object-storage interface for checkpoints: local paths and S3.

`open_storage(url)` takes `file:///abs/dir`, a bare path (the embedded default) or
`s3://bucket/prefix` and returns a `Storage` whose keys are relative to that root.
S3 (AWS or any S3-compatible store) goes through boto3's public client: large
objects held in memory (pinned checkpoint snapshots) are parallel multipart uploads
streamed straight from the caller's buffers (no staging copy of the object); files
go through boto3's transfer manager.

Errors: every operation raises a `StorageError` subclass. Transient failures
(throttling, connection refused/reset, timeouts, 5xx) are retried by botocore's own
retry modes (`standard`, or `adaptive` to also rate-limit against throttling) with
as many attempts as fit in `retry_deadline_s`, then raised as `StorageUnavailable`;
permanent ones (missing bucket, denied, bad credentials, disk full) are raised at
once with a message that says how to fix them.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Sequence, TypeVar

from infra.atomic_write import atomic_write_chunks, is_temp_name

log = logging.getLogger(__name__)
T = TypeVar("T")


# --------------------------------------------------------------------------- errors


class StorageError(Exception):
    """A storage operation failed; `url` names the object or root involved."""

    def __init__(self, message: str, url: str = ""):
        super().__init__(message)
        self.url = url


class NoSuchBucket(StorageError):
    pass


class AccessDenied(StorageError):
    pass


class InvalidCredentials(StorageError):
    pass


class StorageFull(StorageError):
    pass


class ObjectNotFound(StorageError):
    pass


class StorageUnavailable(StorageError):
    """Transient errors persisted past the retry deadline (server down, throttled)."""


_THROTTLE_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
    "TooManyRequests", "TooManyRequestsException", "RequestThrottled",
    "RequestThrottledException", "ProvisionedThroughputExceededException",
}
_TRANSIENT_CODES = _THROTTLE_CODES | {
    "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable",
    "ServerBusy", "PriorRequestNotComplete", "BadDigest", "XAmzContentSHA256Mismatch",
}
_CREDENTIAL_CODES = {
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
    "TokenRefreshRequired", "InvalidClientTokenId", "AuthorizationHeaderMalformed",
}
_TRANSIENT_ERRNOS = {
    errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE,
    errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EAGAIN, errno.EINTR,
}


def _client_error(exc: BaseException) -> Any | None:
    """The botocore ClientError behind `exc` (itself, or the cause of a wrapping error)."""
    seen = 0
    while exc is not None and seen < 8:
        if hasattr(exc, "response") and isinstance(getattr(exc, "response"), dict):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _is_transient_transport(exc: BaseException) -> bool:
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError
    except ImportError:  # pragma: no cover - boto3 always brings botocore
        BotoConnectionError = HTTPClientError = ()  # type: ignore[assignment]
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, (BotoConnectionError, HTTPClientError, TimeoutError, ConnectionError)):
            return True
        if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def classify_error(exc: BaseException, url: str) -> StorageError | None:
    """Map an exception to a permanent StorageError, or None when it is worth retrying."""
    if isinstance(exc, StorageError):
        return None if isinstance(exc, StorageUnavailable) else exc
    if type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
        return InvalidCredentials(
            f"{url}: no S3 credentials found ({exc}); set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
            "(or a profile / instance role)", url)
    ce = _client_error(exc)
    if ce is not None:
        err = ce.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(ce.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        message = err.get("Message") or str(ce)
        if code in _TRANSIENT_CODES or status == 429 or (status >= 500 and code != "507"):
            return None
        if code == "NoSuchBucket":
            return NoSuchBucket(
                f"{url}: the bucket does not exist; create it or fix the bucket in the URL", url)
        if code in _CREDENTIAL_CODES:
            return InvalidCredentials(
                f"{url}: the storage server rejected the credentials ({code}: {message}); "
                "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN)", url)
        if code in {"AccessDenied", "AllAccessDisabled", "403", "Forbidden"}:
            return AccessDenied(
                f"{url}: access denied ({code}); grant these credentials read/write/list/delete "
                "on the bucket and prefix", url)
        if code in {"NoSuchKey", "404", "NotFound"}:
            return ObjectNotFound(f"{url}: no such object", url)
        if code in {"EntityTooLarge", "QuotaExceeded", "InsufficientStorage", "507"} or status == 507:
            return StorageFull(f"{url}: the storage server is out of space or quota ({code})", url)
        return StorageError(f"{url}: storage request failed ({code or status}: {message})", url)
    if _is_transient_transport(exc):
        return None
    if isinstance(exc, OSError):
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return StorageFull(
                f"{url}: no space left on the checkpoint target ({os.strerror(exc.errno)}); "
                "free space, lower checkpoint.keep_last or point checkpoint.url elsewhere", url)
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) or isinstance(exc, PermissionError):
            return AccessDenied(f"{url}: permission denied ({exc}); fix the directory's owner "
                                "or mode, or choose a writable checkpoint.url", url)
        if isinstance(exc, FileNotFoundError) or exc.errno == errno.ENOENT:
            return ObjectNotFound(f"{url}: no such object", url)
    return StorageError(f"{url}: {type(exc).__name__}: {exc}", url)


# A temporary file or multipart upload this old was left by a killed writer: a shard's persist
# ends well before the next checkpoint, and a day is far beyond any one upload.
STALE_UPLOAD_AGE_S = 24 * 3600.0


# --------------------------------------------------------------------------- options


@dataclass(frozen=True, kw_only=True)
class StorageOptions:
    """How to reach the store. None means: take it from the usual AWS_* variables."""

    endpoint_url: str | None = None
    region: str | None = None
    access_key: str | None = None
    secret_key: str | None = None
    session_token: str | None = None
    # 64 MiB parts x 4 in flight: few requests per GB, bounded memory for joined parts.
    part_size: int = 64 << 20
    max_concurrency: int = 4
    # botocore's retries: as many attempts as fit in the deadline at their longest backoff.
    retry_deadline_s: float = 120.0
    retry_mode: Literal["standard", "adaptive"] = "standard"
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0

    def to_dict(self) -> dict[str, Any]:
        """Every field, secrets included: for handing the options to a writer process."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def __repr__(self) -> str:
        # Options end up in logs and tracebacks: a set secret shows as "***", never its value.
        shown = {k: "***" if k in _SECRET_OPTIONS and v else v for k, v in self.to_dict().items()}
        return f"StorageOptions({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    __str__ = __repr__


_SECRET_OPTIONS = ("secret_key", "session_token")


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float  # seconds since the epoch


# botocore's standard/adaptive backoff before retry n (n = 1, 2, ...) is
# uniform(0, 1) * 2^(n-1) seconds, capped at 20 s (botocore.retries.standard).
_BOTOCORE_MAX_BACKOFF_S = 20.0


def attempts_within(deadline_s: float) -> int:
    """Total attempts (first try included) whose longest possible backoffs fit in `deadline_s`.

    botocore counts attempts, not seconds; this keeps `retry_deadline_s` meaning what it
    says: a server back within the deadline is reached (the expected wait is half the
    longest), and one that stays down is given up on within it.
    """
    attempts, waited = 1, 0.0
    while True:
        backoff = min(_BOTOCORE_MAX_BACKOFF_S, 2.0 ** (attempts - 1))
        if waited + backoff > deadline_s:
            return attempts
        waited += backoff
        attempts += 1


class _MemoryReader(io.RawIOBase):
    """A seekable file over a memoryview, so botocore streams a part without copying it."""

    def __init__(self, view: memoryview):
        self._view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self._view)}[whence]
        self._pos = max(0, min(len(self._view), base + offset))
        return self._pos

    def readinto(self, buffer) -> int:  # type: ignore[override]
        n = min(len(buffer), len(self._view) - self._pos)
        buffer[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def __len__(self) -> int:
        return len(self._view)


def iter_parts(chunks: Sequence[memoryview | bytes], part_size: int) -> Iterable[memoryview | bytes]:
    """Cut the concatenation of `chunks` into parts of exactly `part_size` (last shorter).

    A part inside one chunk is a view (no copy); only parts that straddle chunk
    boundaries are joined, so extra memory stays below one part.
    """
    pending: list[memoryview] = []
    pending_len = 0
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        pos = 0
        while pos < len(view):
            if pending_len == 0 and len(view) - pos >= part_size:
                yield view[pos:pos + part_size]
                pos += part_size
                continue
            take = min(part_size - pending_len, len(view) - pos)
            pending.append(view[pos:pos + take])
            pending_len += take
            pos += take
            if pending_len == part_size:
                yield b"".join(pending)
                pending, pending_len = [], 0
    if pending_len:
        yield b"".join(pending) if len(pending) > 1 else pending[0]


# --------------------------------------------------------------------------- storage


class Storage:
    """Objects under one root URL. Keys use '/' and are relative to the root."""

    scheme = ""

    def __init__(self, root_url: str, options: StorageOptions):
        self.root_url = root_url.rstrip("/")
        self.options = options

    def url(self, key: str = "") -> str:
        return f"{self.root_url}/{key}" if key else self.root_url

    # Subclasses implement these.
    def put_bytes(self, key: str, data: bytes) -> None:
        """Write a whole object; readers see either the old object or the new one."""
        raise NotImplementedError

    def put_chunks(self, key: str, chunks: Sequence[memoryview | bytes]) -> int:
        """Write the concatenation of `chunks` as one object (atomically); returns its size."""
        raise NotImplementedError

    def get_bytes(self, key: str) -> bytes:
        raise NotImplementedError

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """All objects whose key starts with `prefix` (recursive)."""
        raise NotImplementedError

    def delete(self, keys: Iterable[str]) -> None:
        """Delete objects; missing ones are ignored."""
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def check_writable(self) -> None:
        """Preflight at job start: raise one clear StorageError if checkpoints cannot be written."""
        raise NotImplementedError

    def remove_stale_uploads(self, older_than_s: float = STALE_UPLOAD_AGE_S) -> list[str]:
        """Remove what killed writers left under the root, once older than `older_than_s` (a
        live writer is never that slow): temporary files of atomic writes on a local disk,
        incomplete multipart uploads on S3 (whose parts are stored, and billed, until
        aborted). Returns what went (keys)."""
        raise NotImplementedError

    # Shared helpers.
    def put_file(self, key: str, path: str | os.PathLike) -> int:
        import mmap

        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                self.put_bytes(key, b"")
                return 0
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                view = memoryview(m)
                try:
                    return self.put_chunks(key, [view])
                finally:
                    view.release()

    def get_file(self, key: str, path: str | os.PathLike) -> int:
        data = self.get_bytes(key)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)
        return len(data)

    def close(self) -> None:
        pass


class LocalStorage(Storage):
    """A directory on a local (or network-mounted) file system."""

    scheme = "file"

    def __init__(self, root_url: str, options: StorageOptions):
        super().__init__(root_url, options)
        import fsspec

        self.root = Path(root_url[len("file://"):] if root_url.startswith("file://") else root_url)
        self.root = self.root.expanduser().absolute()
        self.fs = fsspec.filesystem("file")

    def _path(self, key: str) -> Path:
        return self.root / key

    def _wrap(self, exc: BaseException, key: str) -> StorageError:
        return classify_error(exc, self.url(key)) or StorageError(f"{self.url(key)}: {exc}", self.url(key))

    def put_chunks(self, key: str, chunks: Sequence[memoryview | bytes]) -> int:
        # A temporary sibling, fsynced, then renamed (and the folder fsynced): a crash never
        # leaves a half object under the final name.
        try:
            return atomic_write_chunks(self._path(key), chunks)
        except Exception as e:
            raise self._wrap(e, key) from e

    def put_bytes(self, key: str, data: bytes) -> None:
        self.put_chunks(key, [data])


    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except Exception as e:
            raise self._wrap(e, key) from e

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        if not self.root.is_dir():
            return out
        try:
            for dirpath, _dirs, files in os.walk(self.root):
                for name in files:
                    full = Path(dirpath) / name
                    key = full.relative_to(self.root).as_posix()
                    if key.startswith(prefix) and not name.endswith(".tmp"):
                        st = full.stat()
                        out.append(ObjectInfo(key, st.st_size, st.st_mtime))
        except FileNotFoundError:
            pass  # a concurrent delete; the listing is a snapshot either way
        except Exception as e:
            raise self._wrap(e, prefix) from e
        return sorted(out, key=lambda o: o.key)

    def delete(self, keys: Iterable[str]) -> None:
        parents: set[Path] = set()
        for key in keys:
            path = self._path(key)
            try:
                path.unlink(missing_ok=True)
            except Exception as e:
                raise self._wrap(e, key) from e
            parents.add(path.parent)
        for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            while parent != self.root and parent.is_relative_to(self.root):
                try:
                    parent.rmdir()  # only empty directories go
                except OSError:
                    break
                parent = parent.parent

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def remove_stale_uploads(self, older_than_s: float = STALE_UPLOAD_AGE_S) -> list[str]:
        cutoff = time.time() - older_than_s
        removed: list[str] = []
        if not self.root.is_dir():
            return removed
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                path = Path(dirpath) / name
                try:
                    if is_temp_name(name) and path.stat().st_mtime < cutoff:
                        path.unlink()
                        removed.append(path.relative_to(self.root).as_posix())
                except FileNotFoundError:
                    continue  # its writer finished (renamed it) or another cleaner got it
                except OSError as e:
                    raise self._wrap(e, name) from e
        return removed

    def check_writable(self) -> None:
        probe = f".forgeflow-probe-{uuid.uuid4().hex[:8]}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except Exception as e:
            raise self._wrap(e, "") from e
        self.put_bytes(probe, b"probe")
        if self.get_bytes(probe) != b"probe":
            raise StorageError(f"{self.url()}: wrote a probe object but read back other bytes", self.url())
        self.delete([probe])


class S3Storage(Storage):
    """A bucket/prefix on S3 or an S3-compatible server, through boto3's public client."""

    scheme = "s3"

    def __init__(self, root_url: str, options: StorageOptions):
        super().__init__(root_url, options)
        import boto3
        from botocore.config import Config

        path = root_url[len("s3://"):].strip("/")
        self.bucket, _, self.prefix = path.partition("/")
        if not self.bucket:
            raise StorageError(f"{root_url}: an S3 URL needs a bucket: s3://BUCKET/PREFIX", root_url)
        region = options.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        self.endpoint_url = options.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
            "AWS_ENDPOINT_URL")
        session = boto3.session.Session(
            aws_access_key_id=options.access_key, aws_secret_access_key=options.secret_key,
            aws_session_token=options.session_token, region_name=region)
        self.client = session.client("s3", endpoint_url=self.endpoint_url, config=Config(
            # botocore retries throttling, 5xx, connection and read errors with jittered backoff.
            retries={"mode": options.retry_mode, "total_max_attempts": attempts_within(options.retry_deadline_s)},
            connect_timeout=options.connect_timeout_s,
            read_timeout=options.read_timeout_s,
            max_pool_connections=max(10, options.max_concurrency + 2),
            # Over plain http botocore signs every payload with SHA-256, which the server
            # checks; the CRC32 it adds by default would be a second pass over every byte of
            # a checkpoint that protects nothing more. Over https (payload unsigned) it stays.
            request_checksum_calculation=("when_required" if str(self.endpoint_url or "").startswith(
                "http://") else "when_supported"),
        ))
        self._parts = ThreadPoolExecutor(max(1, options.max_concurrency), thread_name_prefix="s3-part")

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, key: str, call: Callable[[], T]) -> T:
        """Run one client call (botocore retries it); map what it ends in to a StorageError."""
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - classified below
            permanent = classify_error(e, self.url(key))
            if permanent is not None:
                raise permanent from e
            raise StorageUnavailable(
                f"{self.url(key)}: {what} kept failing for ~{self.options.retry_deadline_s:.0f}s "
                f"({type(e).__name__}: {e}); is the storage server reachable?", self.url(key)) from e

    def put_bytes(self, key: str, data: bytes) -> None:
        self.put_chunks(key, [data])

    def put_chunks(self, key: str, chunks: Sequence[memoryview | bytes]) -> int:
        total = sum(memoryview(c).nbytes for c in chunks)
        if total <= self.options.part_size:
            # One PUT is atomic on S3: small objects (manifests, pointers) never appear half-written.
            body = b"".join(memoryview(c).cast("B") for c in chunks) if len(chunks) != 1 else chunks[0]
            self._call("put_object", key, lambda: self.client.put_object(
                Bucket=self.bucket, Key=self._key(key), Body=_MemoryReader(memoryview(body))))
            return total
        return self._multipart(key, chunks, total)

    def _multipart(self, key: str, chunks: Sequence[memoryview | bytes], total: int) -> int:
        """Parts streamed from views of the caller's buffers (a pinned snapshot is never
        copied whole; boto3's transfer manager would read each part into a new buffer)."""
        s3_key = self._key(key)
        created = self._call("create_multipart_upload", key, lambda: self.client.create_multipart_upload(
            Bucket=self.bucket, Key=s3_key))
        upload_id = created["UploadId"]

        def upload(number: int, part: memoryview | bytes) -> dict[str, Any]:
            reply = self._call(f"upload_part {number}", key, lambda: self.client.upload_part(
                Bucket=self.bucket, Key=s3_key, UploadId=upload_id, PartNumber=number,
                Body=_MemoryReader(memoryview(part))))
            return {"PartNumber": number, "ETag": reply["ETag"]}

        in_flight: list = []
        parts: list[dict[str, Any]] = []
        try:
            # Parts are cut lazily, at most max_concurrency in flight: views cost nothing
            # and only that many joined boundary parts exist at once.
            for number, part in enumerate(iter_parts(chunks, self.options.part_size), start=1):
                if len(in_flight) >= self.options.max_concurrency:
                    parts.append(in_flight.pop(0).result())
                in_flight.append(self._parts.submit(upload, number, part))
            while in_flight:
                parts.append(in_flight.pop(0).result())
            self._call("complete_multipart_upload", key, lambda: self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=s3_key, UploadId=upload_id, MultipartUpload={"Parts": parts}))
        except BaseException:
            for future in in_flight:
                future.cancel()
            for future in in_flight:
                try:
                    future.result()
                except BaseException:  # noqa: BLE001 - the first failure is what we raise
                    pass
            try:  # best effort: a dead server keeps the parts until its own lifecycle rule
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=s3_key, UploadId=upload_id)
            except Exception as e:  # noqa: BLE001
                log.warning("storage: could not abort multipart upload of %s: %s", self.url(key), e)
            raise
        return total

    def remove_stale_uploads(self, older_than_s: float = STALE_UPLOAD_AGE_S) -> list[str]:
        cutoff = time.time() - older_than_s
        prefix = self._key("")

        def stale() -> list[tuple[str, str]]:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=prefix)
            return [(u["Key"], u["UploadId"]) for page in pages for u in page.get("Uploads", [])
                    if u["Key"].startswith(prefix) and u["Initiated"].timestamp() < cutoff]

        removed = []
        for s3_key, upload_id in self._call("list_multipart_uploads", "", stale):
            key = s3_key[len(prefix):]
            self._call("abort_multipart_upload", key, lambda: self.client.abort_multipart_upload(
                Bucket=self.bucket, Key=s3_key, UploadId=upload_id))
            removed.append(key)
        return removed

    def get_bytes(self, key: str) -> bytes:
        # The transfer manager, not a bare get_object: it retries a body cut off mid-read
        # (botocore retries requests, not the streaming of a reply) and reads large
        # shards as parallel ranged GETs.
        buffer = io.BytesIO()
        self._call("get_object", key, lambda: self.client.download_fileobj(
            self.bucket, self._key(key), buffer, Config=self._transfer_config()))
        return buffer.getvalue()

    def put_file(self, key: str, path: str | os.PathLike) -> int:
        size = os.path.getsize(path)
        if size <= self.options.part_size:
            return super().put_file(key, path)  # one atomic PUT
        self._call("upload_file", key, lambda: self.client.upload_file(
            str(path), self.bucket, self._key(key), Config=self._transfer_config()))
        return size

    def get_file(self, key: str, path: str | os.PathLike) -> int:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._call("download_file", key, lambda: self.client.download_file(
            self.bucket, self._key(key), str(path), Config=self._transfer_config()))
        return os.path.getsize(path)

    def _transfer_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(multipart_threshold=self.options.part_size,
                              multipart_chunksize=self.options.part_size,
                              max_concurrency=self.options.max_concurrency,
                              num_download_attempts=attempts_within(self.options.retry_deadline_s))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        strip = len(self.prefix) + 1 if self.prefix else 0

        def list_all() -> list[ObjectInfo]:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix))
            return [ObjectInfo(obj["Key"][strip:], int(obj["Size"]), obj["LastModified"].timestamp())
                    for page in pages for obj in page.get("Contents", [])]

        return sorted(self._call("list", prefix, list_all), key=lambda o: o.key)

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": self._key(k)} for k in keys[start:start + 1000]]
            reply = self._call("delete_objects", keys[start], lambda: self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}))
            errors = [e for e in reply.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                raise StorageError(f"{self.url()}: could not delete {len(errors)} object(s), first: "
                                   f"{errors[0].get('Key')}: {errors[0].get('Code')}", self.url())

    def exists(self, key: str) -> bool:
        try:
            self._call("head_object", key, lambda: self.client.head_object(Bucket=self.bucket, Key=self._key(key)))
            return True
        except ObjectNotFound:
            return False

    def check_writable(self) -> None:
        try:
            self._call("head_bucket", "", lambda: self.client.head_bucket(Bucket=self.bucket))
        except ObjectNotFound as e:
            raise NoSuchBucket(
                f"s3://{self.bucket}: the bucket does not exist (endpoint {self._endpoint()}); "
                "create it first or fix checkpoint.url", self.url()) from e
        except AccessDenied:
            # HEAD replies carry no error code; a tiny PUT tells bad keys from missing rights.
            pass
        probe = f".forgeflow-probe-{uuid.uuid4().hex[:8]}"
        self.put_bytes(probe, b"probe")
        self.delete([probe])

    def _endpoint(self) -> str:
        return str(self.endpoint_url or "AWS default")

    def close(self) -> None:
        self._parts.shutdown(wait=False, cancel_futures=True)
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing is best effort
            pass


def open_storage(url: str, options: StorageOptions | None = None) -> Storage:
    """A Storage for `file://DIR`, a bare path, or `s3://BUCKET/PREFIX`."""
    options = options or StorageOptions()
    if url.startswith("s3://"):
        return S3Storage(url, options)
    if "://" in url and not url.startswith("file://"):
        raise StorageError(f"{url}: unsupported storage URL; use file://DIR, a path, or s3://BUCKET/PREFIX",
                           url)
    return LocalStorage(url, options)


def storage_options_from_config(checkpoint_config: Any, **overrides: Any) -> StorageOptions:
    """StorageOptions from a job spec's CheckpointConfig (endpoint_url, region)."""
    values: dict[str, Any] = {
        "endpoint_url": getattr(checkpoint_config, "endpoint_url", None),
        "region": getattr(checkpoint_config, "region", None),
    }
    values.update(overrides)
    return StorageOptions(**values)
