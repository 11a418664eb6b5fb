"""Telemetry of the real ``kvgrid controller`` and ``kvgrid agent`` processes: ``/metrics`` scraped over
HTTP, OTLP over gRPC and HTTP to real receivers, bad telemetry settings that must not stop a
service, and the agent's connection state to the controller across a controller restart."""

from __future__ import annotations

import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import grpc
import pytest

from kvgrid.api.v1 import controller_pb2, controller_pb2_grpc
from tests.agent.helpers import AgentProc, start_agent, start_controller, wait_for
from tests.telemetry.receivers import HttpReceiver


def scrape(port: int) -> dict[str, float]:
    """``/metrics`` of a process as {sample with labels: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def value(samples: dict[str, float], name: str, **labels: str) -> float | None:
    """The value of the ``name`` sample whose labels include ``labels`` (None: no such sample)."""
    for sample, v in samples.items():
        base, _, rest = sample.partition("{")
        if base == name and all(f'{k}="{lv}"' in rest for k, lv in labels.items()):
            return v
    return None


@contextmanager
def controller(address: str, metrics_port: int, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    proc = start_controller(address, "--prometheus-port", str(metrics_port), env=env)
    try:
        with grpc.insecure_channel(address) as ch:
            grpc.channel_ready_future(ch).result(timeout=60)
        yield proc
    finally:
        proc.terminate()
        proc.wait(10)


@contextmanager
def agent(
    root: Path, ctl: str, metrics_port: int, env: dict[str, str], mp: pytest.MonkeyPatch
) -> Iterator[AgentProc]:
    for k, v in env.items():
        mp.setenv(k, v)  # start_agent passes this process's environment on
    root.mkdir()
    proc = start_agent(
        root,
        "--controller-address", ctl, "--prometheus-port", str(metrics_port),
        "--heartbeat-interval-ms", "200", "--reconnect-max-backoff-ms", "300",
        pod_uid="pod-t",
    )  # fmt: skip
    try:
        yield proc
    finally:
        proc.stop()


BAD_SETTINGS = {
    # A regression: this made the agent exit with rc 2 and the controller drop /metrics.
    "http-to-unreachable": {
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
    },
    "unknown-protocol": {
        "OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
    },
    "unknown-exporters": {
        "OTEL_TRACES_EXPORTER": "zipkin",
        "OTEL_METRICS_EXPORTER": "statsd",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
    },
    "unreachable-grpc": {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
        "OTEL_METRIC_EXPORT_INTERVAL": "200",
    },
}


@pytest.mark.parametrize("setting", sorted(BAD_SETTINGS))
def test_a_bad_telemetry_setting_never_stops_a_service(
    setting: str, tmp_path: Path, free_port: Callable[[], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = BAD_SETTINGS[setting]
    address, cport, aport = f"127.0.0.1:{free_port()}", free_port(), free_port()
    with controller(address, cport, env), agent(tmp_path / "a", address, aport, env, monkeypatch) as a:
        # Both serve: the agent registered with the controller, which answers queries.
        with grpc.insecure_channel(address) as ch:
            stub = controller_pb2_grpc.ControllerServiceStub(ch)
            wait_for(
                "agent registered", lambda: stub.GetStats(controller_pb2.GetStatsRequest()).num_agents == 1
            )
        assert a.client().health().l1_capacity_bytes > 0
        # Both still expose /metrics, with the per-call RPC metrics under the same names.
        ctl = scrape(cport)
        assert (value(ctl, "kvgrid_rpc_server_calls_total", method="RegisterAgent", code="OK") or 0) >= 1
        assert value(ctl, "kvgrid_controller_ready") == 1.0
        ag = scrape(aport)
        assert (value(ag, "kvgrid_rpc_server_calls_total", method="Health", code="OK") or 0) >= 1
        assert value(ag, "kvgrid_agent_l1_capacity_bytes") == a.client().health().l1_capacity_bytes


def test_otlp_over_http_from_both_services(
    tmp_path: Path, free_port: Callable[[], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver = HttpReceiver()
    env = {
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_METRIC_EXPORT_INTERVAL": "300",
    }
    address = f"127.0.0.1:{free_port()}"
    try:
        with (
            controller(address, free_port(), env),
            agent(tmp_path / "a", address, free_port(), env, monkeypatch) as a,
        ):
            a.client().health()

            def got(service: str, span: str, metric: str) -> bool:
                spans = {s.name for res, s in receiver.spans if res.get("service.name") == service}
                metrics = {m.name for res, m in receiver.metrics if res.get("service.name") == service}
                return span in spans and metric in metrics

            receiver.wait_for(
                lambda: got("kvgrid-agent", "kvgrid.v1.AgentService/Health", "kvgrid_rpc_server_calls")
            )
            receiver.wait_for(
                lambda: got(
                    "kvgrid-controller",
                    "kvgrid.v1.ControllerService/RegisterAgent",
                    "kvgrid_controller_agents",
                )
            )
            with receiver.lock:
                assert got("kvgrid-agent", "kvgrid.v1.AgentService/Health", "kvgrid_rpc_server_calls")
                assert got(
                    "kvgrid-controller",
                    "kvgrid.v1.ControllerService/RegisterAgent",
                    "kvgrid_controller_agents",
                )
    finally:
        receiver.close()


def test_agent_connection_state_and_reconnects_across_a_controller_restart(
    tmp_path: Path, free_port: Callable[[], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, aport = f"127.0.0.1:{free_port()}", free_port()

    def state() -> dict[str, float | None]:
        m = scrape(aport)
        return {
            s: value(m, "kvgrid_agent_controller_connection_state", state=s)
            for s in ("connected", "registering", "disconnected")
        } | {"reconnects": value(m, "kvgrid_agent_controller_reconnects_total")}

    first = ExitStack()
    first.enter_context(controller(address, free_port(), {}))
    try:
        with agent(tmp_path / "a", address, aport, {}, monkeypatch):
            wait_for("connected", lambda: state()["connected"] == 1.0)
            assert state() == {"connected": 1.0, "registering": 0.0, "disconnected": 0.0, "reconnects": 0.0}
            first.close()  # the controller goes away: heartbeats fail, the agent says so
            wait_for("disconnected", lambda: state()["disconnected"] == 1.0)
            assert state()["connected"] == 0.0
            with controller(address, free_port(), {}):  # back (a restart): the agent reconnects
                wait_for("connected again", lambda: state()["connected"] == 1.0)
                reconnects = state()["reconnects"]
                assert reconnects is not None and reconnects >= 1
    finally:
        first.close()
