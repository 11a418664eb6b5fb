"""The S3-compatible object-store blob store (SeaweedFS, MinIO, Ceph RGW, AWS S3), over ``minio``.

The client library was chosen by measurement (``docs/agent.md``, *Lower tiers*): against the
same SeaweedFS server, 16 objects of 8 MiB, ``minio`` got 0.5-0.75 GB/s and ``boto3``
0.41-0.48 GB/s; puts were server bound (about 0.1 GB/s) for both. ``boto3`` (botocore) also pins
``python-dateutil<3``, which conflicts with the ``kubernetes`` client the project depends on.

Invariants:

- Objects are named ``<prefix>/<namespace_id>/<key hex>``: one prefix per namespace, so a
  tenant's reads only ever name its own objects (the record header is checked too).
- A record larger than ``part_size`` is uploaded in parts (S3 multipart upload; the object
  appears only when the upload completes, so a reader never sees a partial object).
- Every operation is retried up to ``max_retries`` times on transport errors, 5xx and throttling
  (exponential back-off from ``backoff_s``, with jitter); a missing object (``NoSuchKey``) is
  :class:`~kvgrid.agent.tiers.base.BlobMissing` at once; other 4xx (access denied, no bucket)
  are raised at once. urllib3's own retries are off, so the count is ours.
- Credentials come from files (a mounted Kubernetes Secret) or the environment, read once at start.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar, cast

import urllib3
from minio import Minio
from minio.error import MinioException, S3Error, ServerError

from kvgrid.agent.tiers.base import HEADER_BYTES, BlobMissing

__all__ = ["S3BlobStore", "S3Credentials", "load_credentials"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_RETRIED_CODES = frozenset(
    {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "ServerBusy"}
)
_MISSING_CODES = frozenset({"NoSuchKey", "NoSuchObject"})
# File names tried in a credentials directory (a Secret's keys), first match wins.
_ACCESS_FILES = ("access_key_id", "AWS_ACCESS_KEY_ID", "accesskey")
_SECRET_FILES = ("secret_access_key", "AWS_SECRET_ACCESS_KEY", "secretkey")


class S3Credentials:
    __slots__ = ("access_key", "secret_key", "source")

    def __init__(self, access_key: str, secret_key: str, source: str) -> None:
        self.access_key, self.secret_key, self.source = access_key, secret_key, source

    def __repr__(self) -> str:  # never print the secret
        return f"S3Credentials(access_key={self.access_key!r}, source={self.source!r})"


def load_credentials(directory: str, env: dict[str, str] | None = None) -> S3Credentials:
    """From ``directory`` (a mounted Secret: files ``access_key_id`` and ``secret_access_key``, or
    ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``) when set, else from the environment's
    ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``. ValueError naming what is missing."""
    if directory:
        d = Path(directory)

        def first(names: tuple[str, ...]) -> str:
            for n in names:
                p = d / n
                if p.is_file():
                    return p.read_text().strip()
            raise ValueError(
                f"tier_s3_credentials_dir={directory!r}: expected a file named one of {list(names)}"
            )

        return S3Credentials(first(_ACCESS_FILES), first(_SECRET_FILES), f"files in {directory}")
    env = dict(os.environ) if env is None else env
    ak, sk = env.get("AWS_ACCESS_KEY_ID", ""), env.get("AWS_SECRET_ACCESS_KEY", "")
    if not ak or not sk:
        raise ValueError(
            "S3 tier: no credentials: expected tier_s3_credentials_dir (a mounted Secret) or the "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY environment variables"
        )
    return S3Credentials(ak, sk, "environment")


class _Reader(io.RawIOBase):
    """``header + payload`` as a readable stream without joining them (minio reads part by part)."""

    def __init__(self, header: bytes, payload: memoryview) -> None:
        self._bufs = [memoryview(header), payload]
        self._pos = 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        out = bytearray()
        while self._bufs and (size < 0 or len(out) < size):
            buf = self._bufs[0]
            take = len(buf) - self._pos if size < 0 else min(len(buf) - self._pos, size - len(out))
            out += buf[self._pos : self._pos + take]
            self._pos += take
            if self._pos == len(buf):
                self._bufs.pop(0)
                self._pos = 0
        return bytes(out)


class S3BlobStore:
    kind = "s3"

    def __init__(
        self,
        endpoint: str,
        bucket: str,
        *,
        prefix: str,
        credentials: S3Credentials,
        secure: bool = False,
        region: str = "",
        part_size: int = 16 * 1024 * 1024,
        max_retries: int = 4,
        backoff_s: float = 0.05,
        timeout_s: float = 30.0,
    ) -> None:
        if part_size < 5 * 1024 * 1024:
            raise ValueError(f"tier_s3_part_size={part_size}: expected >= 5MiB (the S3 minimum part size)")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.part_size = part_size
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.retries = 0
        """Requests retried since start (metric ``kvgrid_agent_tier_s3_retries``)."""
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=min(5.0, timeout_s), read=timeout_s), retries=False, maxsize=8
        )
        self.client = Minio(
            endpoint,
            access_key=credentials.access_key,
            secret_key=credentials.secret_key,
            secure=secure,
            region=region or None,
            http_client=http,
        )
        try:
            exists = self._retry("bucket_exists", lambda: self.client.bucket_exists(bucket))
        except Exception as e:  # unreachable, refused credentials: the agent must not start
            raise ValueError(
                f"tier_s3_endpoint={endpoint!r}, tier_s3_bucket={bucket!r}: cannot check the bucket: {e}"
            ) from None
        if not exists:
            raise ValueError(f"tier_s3_bucket={bucket!r}: no such bucket at {endpoint} (create it first)")

    def _object(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        delay = self.backoff_s
        for attempt in range(self.max_retries + 1):
            try:
                return fn()
            except S3Error as e:
                if e.code in _MISSING_CODES:
                    raise BlobMissing(what) from None
                if e.code not in _RETRIED_CODES or attempt == self.max_retries:
                    raise
                err: Exception = e
            except (ServerError, urllib3.exceptions.HTTPError, OSError, MinioException) as e:
                if attempt == self.max_retries:
                    raise
                err = e
            self.retries += 1
            log.info(
                "S3 %s failed (%s); retry %d of %d in %.2fs", what, err, attempt + 1, self.max_retries, delay
            )
            time.sleep(delay * (0.5 + random.random()))
            delay *= 2
        raise AssertionError("unreachable")

    def write(self, name: str, header: bytes, payload: memoryview) -> None:
        size = len(header) + len(payload)
        obj = self._object(name)

        def put() -> None:
            self.client.put_object(
                self.bucket,
                obj,
                cast(BinaryIO, _Reader(header, payload)),
                size,
                part_size=self.part_size,
                num_parallel_uploads=1,
            )

        self._retry(f"put {obj}", put)

    def read_into(self, name: str, header: bytearray, payload: memoryview) -> int:
        obj = self._object(name)

        def get() -> int:
            resp = self.client.get_object(self.bucket, obj)
            try:
                got = 0
                bufs = [memoryview(header), payload]
                for buf in bufs:
                    off = 0
                    while off < len(buf):
                        n = resp.readinto(buf[off:])
                        if not n:
                            return max(0, got - HEADER_BYTES)
                        off += n
                        got += n
                return got - HEADER_BYTES
            finally:
                resp.close()
                resp.release_conn()

        return self._retry(f"get {obj}", get)

    def delete(self, name: str) -> None:
        obj = self._object(name)
        with contextlib.suppress(BlobMissing):  # already gone
            self._retry(f"delete {obj}", lambda: self.client.remove_object(self.bucket, obj))

    def list(self, namespace_id: str) -> list[str]:
        base = self._object(namespace_id) + "/"
        cut = len(self.prefix) + 1 if self.prefix else 0

        def ls() -> list[str]:
            objects = self.client.list_objects(self.bucket, prefix=base, recursive=True)
            # Some servers (SeaweedFS) list an emptied "directory" as a name ending in /: not a record.
            return sorted(
                o.object_name[cut:] for o in objects if o.object_name and not o.object_name.endswith("/")
            )

        return self._retry(f"list {base}", ls)

    def close(self) -> None:
        self.client._http.clear()
