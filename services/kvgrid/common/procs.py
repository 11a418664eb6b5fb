"""Child processes of the commands that start services on this machine (``kvgrid demo``, benches):
a free loopback port, and waiting until a started server answers."""

from __future__ import annotations

import socket
import subprocess
import time

import grpc

__all__ = ["free_port", "wait_serving"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_serving(target: str, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 60.0) -> None:
    """Return once a gRPC channel to ``target`` is ready; raise RuntimeError naming ``what`` if
    ``proc`` exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as ch:
        while True:
            try:
                grpc.channel_ready_future(ch).result(timeout=0.5)
                return
            except grpc.FutureTimeoutError:
                if proc.poll() is not None:
                    code = proc.returncode
                    raise RuntimeError(f"{what} exited with code {code} before it served") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what} did not serve on {target} within {timeout_s:.0f} s") from None
