"""What the agent benches (``agent.py``, ``agent_tp.py``, ``hotpath.py``, ``p2p.py``) share: a scratch
directory for the engines' shared-memory KV caches and the agents' sockets, and ``kvgrid``
processes started from the CLI and stopped again.

Invariants:

- :func:`start_agent` returns only an agent that printed its JSON ready line; one that did not is
  stopped and :class:`AgentDidNotStart` names it and its exit status.
- :func:`stop_all` closes the clients before it terminates the processes (newest first), so no
  call of the bench is in flight when an agent goes and the agents stop before the controller.
- :func:`shm_scratch` removes its directory and every file in it on exit (the benches put files
  there, never subdirectories).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = ["KVGRID", "AgentDidNotStart", "bench_env", "shm_scratch", "start_agent", "stop_all"]

KVGRID = [sys.executable, "-m", "kvgrid.cli"]
"""The ``kvgrid`` command of this interpreter."""


class AgentDidNotStart(RuntimeError):
    """An agent process exited or printed something else before its JSON ready line."""


class _Closable(Protocol):
    def close(self) -> None: ...


@contextlib.contextmanager
def shm_scratch(prefix: str) -> Iterator[Path]:
    """A fresh directory under /dev/shm (the temp dir where there is none: shared memory files
    must not hit a disk), removed with its files on exit."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        yield tmp
    finally:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()


def bench_env() -> dict[str, str]:
    """This process's environment for the services a bench starts: no ``KVGRID_*`` setting (the
    bench's flags alone configure them) and no OpenTelemetry export."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGRID_")}
    env["OTEL_SDK_DISABLED"] = "true"
    return env


def start_agent(
    name: str, flags: Sequence[str], env: Mapping[str, str] | None = None
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """``kvgrid agent <flags>`` (``env``: the environment, default this process's); returns the
    process and its ready line (``uds_path``, ``tcp_port``, ...) once it printed that line."""
    proc = subprocess.Popen([*KVGRID, "agent", *flags], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("{"):
        proc.terminate()
        raise AgentDidNotStart(f"agent {name} did not start (exit {proc.wait(30)})")
    return proc, json.loads(line)


def stop_all(clients: Iterable[_Closable], procs: Sequence[subprocess.Popen[Any]]) -> None:
    """Close ``clients``, then terminate ``procs`` newest first and wait for each (30 s)."""
    for c in clients:
        c.close()
    for proc in reversed(procs):
        proc.terminate()
        proc.wait(30)
