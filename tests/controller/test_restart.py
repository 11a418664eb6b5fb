"""kill -9 a `kvgrid controller` process mid-stream, restart it: its index equals the agents' truth again."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable

import grpc

from kvgrid.api.v1 import controller_pb2, controller_pb2_grpc
from tests.agent.helpers import start_controller
from tests.controller.support import FakeAgent, index_keys, rand_keys, wait_until


def _start(port: int) -> subprocess.Popen[bytes]:
    proc = start_controller(
        f"127.0.0.1:{port}", "--lease-ttl-ms", "3000", "--resync-retry-ms", "100", stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    lines = []
    for _ in range(10):  # the log (e.g. the no-TLS warning) may come first
        lines.append(proc.stdout.readline().decode())
        if "listening on" in lines[-1]:
            return proc
    raise AssertionError("".join(lines))


def test_kill_9_and_restart_resyncs_from_agents(free_port: Callable[[], int]) -> None:
    port = free_port()
    addr = f"127.0.0.1:{port}"
    proc = _start(port)
    agents = [FakeAgent(addr, f"pod-{i}", epoch=100 + i) for i in range(3)]
    stop = threading.Event()
    pool = rand_keys(400)

    def churn() -> None:
        rng = random.Random(1)
        while not stop.is_set():
            a = rng.choice(agents)
            ks = rng.sample(pool, 5)
            (a.admit if rng.random() < 0.7 else a.evict)(ks)
            time.sleep(0.002)

    worker = threading.Thread(target=churn, daemon=True)
    ch = grpc.insecure_channel(addr)
    stub = controller_pb2_grpc.ControllerServiceStub(ch)
    try:
        worker.start()
        time.sleep(0.5)
        # Mid-stream: events are flowing while the controller dies.
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
        time.sleep(0.3)  # events published while it is down are lost with the streams
        proc = _start(port)
        time.sleep(0.5)
        stop.set()
        worker.join(5)
        took = wait_until(
            lambda: all(index_keys(stub, a.pod.pod_uid) == a.truth() for a in agents),
            timeout=10,
            what="restarted controller index == agents' truth",
        )
        assert took < 10
        st = stub.GetStats(controller_pb2.GetStatsRequest())
        assert st.num_agents == 3
        assert st.num_entries == sum(len(a.truth()) for a in agents) > 0
        assert st.resyncs >= 3
    finally:
        stop.set()
        for a in agents:
            a.close()
        ch.close()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(5)
