"""The chart's monitoring, proven against real components.

- The PrometheusRule's rules pass ``promtool check rules`` and ``promtool test rules`` (each alert
  fires on a failing series and stays quiet on a healthy one).
- Every metric the dashboards and alerts name is exported by a real controller and real agents
  under a workload (tests/deploy/workload.py).
- A real Prometheus (Debian's package; scripts/fetch_prometheus.sh) scrapes them with the job
  labels the ServiceMonitor and PodMonitor give, and every dashboard query and every alert's signal
  returns data.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.chart import NAMESPACE, RELEASE, find, run, template
from tests.deploy.workload import Deployment, deployment, run_workload, scrape

EXAMPLE: dict[str, Any] = {"examples": {"vllm": {"enabled": True}}}
CONTROLLER_JOB = f"{RELEASE}-kvgrid-controller"
AGENTS_JOB = f"{NAMESPACE}/{RELEASE}-kvgrid-agents"
# "(<signal>) <op> <threshold>": the form every alert expr of the chart has (templates/_alerts.tpl).
ALERT_EXPR = re.compile(r"^\((?P<signal>.*)\) (?P<op>[<>]=?|==|!=) (?P<threshold>[0-9.e+-]+)$", re.S)
METRIC = re.compile(r"\b(kvgrid_[a-z0-9_]+)\b")


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool not found: run scripts/fetch_prometheus.sh (make install runs it)")
    return found


def _rules(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return dict(find(docs, "PrometheusRule", f"{RELEASE}-kvgrid")["spec"])


def _alerts(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in _rules(docs)["groups"] for r in g["rules"]}


def _dashboards(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    cm = find(docs, "ConfigMap", f"{RELEASE}-kvgrid-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # the Grafana sidecar's label
    return {name: json.loads(text) for name, text in cm["data"].items()}


def _panel_queries(docs: list[dict[str, Any]]) -> dict[str, str]:
    return {
        f"{dash['title']} / {panel['title']} / {target['refId']}": target["expr"]
        for dash in _dashboards(docs).values()
        for panel in dash["panels"]
        for target in panel["targets"]
    }


@pytest.fixture(scope="module")
def docs(helm: list[str], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return template(helm, EXAMPLE, tmp_path_factory.mktemp("monitoring"))


# --- rendering --------------------------------------------------------------------------------------


def test_monitors_render_only_with_the_operator_or_when_asked(helm: list[str], tmp_path: Path) -> None:
    kinds = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    with_crds = {d["kind"] for d in template(helm, EXAMPLE, tmp_path)}
    assert kinds <= with_crds
    without = {"tls": {"provider": "existingSecrets", "existingSecrets": {"controller": "c", "agent": "a"}}}
    assert not kinds & {d["kind"] for d in template(helm, {**without, **EXAMPLE}, tmp_path, crds=False)}
    forced = {
        **without,
        "monitoring": {m: {"enabled": True} for m in ("serviceMonitor", "podMonitor", "prometheusRule")},
    }
    assert kinds <= {d["kind"] for d in template(helm, forced, tmp_path, crds=False)}
    off = {"monitoring": {m: {"enabled": False} for m in ("serviceMonitor", "podMonitor", "prometheusRule")}}
    assert not kinds & {d["kind"] for d in template(helm, off, tmp_path)}


def test_monitors_select_the_metrics_ports_and_name_the_alert_jobs(docs: list[dict[str, Any]]) -> None:
    sm = find(docs, "ServiceMonitor", CONTROLLER_JOB)  # job label = the Service's name
    service = find(docs, "Service", CONTROLLER_JOB)
    assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] in [p["name"] for p in service["spec"]["ports"]]
    pm = find(docs, "PodMonitor", f"{RELEASE}-kvgrid-agents")  # job label = <namespace>/<name>
    assert f"{NAMESPACE}/{pm['metadata']['name']}" == AGENTS_JOB
    for rule in _alerts(docs).values():
        assert ALERT_EXPR.match(rule["expr"]), rule["expr"]
    assert f'job="{CONTROLLER_JOB}"' in _alerts(docs)["KvgridControllerDown"]["expr"]
    assert f'job="{AGENTS_JOB}"' in _alerts(docs)["KvgridAgentDown"]["expr"]


# --- promtool ---------------------------------------------------------------------------------------


def test_promtool_checks_the_rules(docs: list[dict[str, Any]], tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(_rules(docs)))
    proc = run([_promtool(), "check", "rules", str(rules)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(_alerts(docs))} rules found" in proc.stdout


def _series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


C = {"job": CONTROLLER_JOB}
A = {"job": AGENTS_JOB}
WARN = [{"severity": "warning"}]
LATENCY = "kvgrid_rpc_server_duration_seconds_bucket"
CALLS = "kvgrid_rpc_server_calls_total"


def _up(job: dict[str, str], *values: str) -> list[dict[str, str]]:
    return [_series("up", job | {"instance": f"i{i}"}, v) for i, v in enumerate(values)]


def _latency(fast: str) -> list[dict[str, str]]:
    """MatchPrefix latency buckets: of 100 calls a minute, ``fast`` under 10 ms and all under 100 ms."""
    buckets = (("0.01", f"0+{fast}x30"), ("0.1", "0+100x30"), ("+Inf", "0+100x30"))
    return [_series(LATENCY, C | {"method": "MatchPrefix", "le": le}, v) for le, v in buckets]


def _calls(code: str, per_minute: int) -> list[dict[str, str]]:
    ok = _series(CALLS, C | {"method": "Score", "code": "OK"}, "0+100x30")
    return [ok, _series(CALLS, C | {"method": "Score", "code": code}, f"0+{per_minute}x30")]


# (alert, input series, evaluated at, labels of the expected alerts: [] = stays quiet)
UNIT_TESTS: list[tuple[str, list[dict[str, str]], str, list[dict[str, str]]]] = [
    ("KvgridControllerDown", _up(C, "0x10"), "5m", [{"severity": "critical"}]),
    ("KvgridControllerDown", _up(C, "1x10"), "5m", []),
    (
        "KvgridControllerNotReady",
        [_series("kvgrid_controller_ready", C | {"instance": "c"}, "0x20")],
        "15m",
        [{"severity": "warning", "instance": "c"}],
    ),
    (
        "KvgridControllerNotReady",
        [_series("kvgrid_controller_ready", C | {"instance": "c"}, "0x5 1x15")],
        "15m",
        [],
    ),
    ("KvgridAgentDown", _up(A, "0x10"), "7m", [{"severity": "warning", "instance": "i0"}]),
    ("KvgridAgentDown", _up(A, "1x10"), "7m", []),
    (
        "KvgridAgentsNotRegistered",
        [*_up(A, "1x20", "1x20"), _series("kvgrid_controller_agents", C, "1x20")],
        "15m",
        WARN,
    ),
    (
        "KvgridAgentsNotRegistered",
        [*_up(A, "1x20", "1x20"), _series("kvgrid_controller_agents", C, "2x20")],
        "15m",
        [],
    ),
    ("KvgridMatchLatencyHigh", _latency("10"), "20m", WARN),
    ("KvgridMatchLatencyHigh", _latency("100"), "20m", []),
    ("KvgridBackendLost", [_series("kvgrid_controller_backend_losses_total", C, "0 0 1 1 1")], "3m", WARN),
    ("KvgridBackendLost", [_series("kvgrid_controller_backend_losses_total", C, "0 0 0 0 0")], "3m", []),
    ("KvgridResyncsFrequent", [_series("kvgrid_controller_resyncs_total", C, "0+60x40")], "35m", WARN),
    ("KvgridResyncsFrequent", [_series("kvgrid_controller_resyncs_total", C, "0+1x40")], "35m", []),
    (
        "KvgridIndexEntriesRejected",
        [_series("kvgrid_controller_rejected_entries_total", C, "0 0 5 5")],
        "3m",
        WARN,
    ),
    (
        "KvgridIndexEntriesRejected",
        [_series("kvgrid_controller_rejected_entries_total", C, "0 0 0 0")],
        "3m",
        [],
    ),
    (
        "KvgridRpcErrors",
        _calls("INTERNAL", 10),
        "20m",
        [{"severity": "warning", "job": CONTROLLER_JOB, "method": "Score"}],
    ),
    ("KvgridRpcErrors", _calls("INVALID_ARGUMENT", 50), "20m", []),  # a client's mistake is no server failure
]


def test_promtool_unit_tests_fire_each_alert_and_only_then(
    docs: list[dict[str, Any]], tmp_path: Path
) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(_rules(docs)))
    tests = [
        {
            "interval": "1m",
            "input_series": series,
            "alert_rule_test": [
                {
                    "eval_time": at,
                    "alertname": alert,
                    "exp_alerts": [
                        {
                            "exp_labels": labels,
                            "exp_annotations": _annotations(docs, alert, labels),
                        }
                        for labels in expected
                    ],
                }
            ],
        }
        for alert, series, at, expected in UNIT_TESTS
    ]
    assert {t[0] for t in UNIT_TESTS} == set(_alerts(docs)), "every alert has a unit test"
    spec = tmp_path / "rules_test.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": tests}))
    proc = run([_promtool(), "test", "rules", str(spec)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


# What the $value templates of the firing unit tests render to (promtool compares annotations exactly).
VALUE_TEXT = {
    "KvgridAgentsNotRegistered": "1",
    "KvgridMatchLatencyHigh": "99ms",
    "KvgridResyncsFrequent": "1",
    "KvgridRpcErrors": "9.091%",
}


def _annotations(docs: list[dict[str, Any]], alert: str, labels: dict[str, str]) -> dict[str, str]:
    """The alert's annotations as Prometheus renders them for ``labels``."""
    out = {}
    for key, text in _alerts(docs)[alert]["annotations"].items():
        text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)
        out[key] = re.sub(r"\{\{ \$value( \| \w+)? \}\}", lambda _: VALUE_TEXT[alert], text)
    return out


# --- real services and a real Prometheus ------------------------------------------------------------


def _referenced_metrics(docs: list[dict[str, Any]]) -> dict[str, set[str]]:
    """metric name -> where it is used (panels and alerts)."""
    used: dict[str, set[str]] = {}
    for where, expr in [*_panel_queries(docs).items(), *((a, r["expr"]) for a, r in _alerts(docs).items())]:
        for name in METRIC.findall(expr):
            used.setdefault(name, set()).add(where)
    return used


@pytest.fixture(scope="module")
def live(
    tmp_path_factory: pytest.TempPathFactory, free_port: Callable[[], int]
) -> Iterator[tuple[Deployment, Path]]:
    root = tmp_path_factory.mktemp("live")
    with deployment(root, free_port) as dep:
        run_workload(dep, root)
        yield dep, root


def test_every_metric_the_dashboards_and_alerts_use_is_exported(
    docs: list[dict[str, Any]], live: tuple[Deployment, Path]
) -> None:
    dep, _ = live
    exported = {
        line.split("{")[0].split(" ")[0] for p in dep.metrics_ports() for line in scrape(p).splitlines()
    }
    used = _referenced_metrics(docs)
    assert len(used) >= 15
    missing = {name: sorted(where) for name, where in used.items() if name not in exported}
    assert not missing, f"not exported by the real services: {missing}"


def _query(port: int, expr: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


@pytest.fixture(scope="module")
def prometheus(
    docs: list[dict[str, Any]], live: tuple[Deployment, Path], free_port: Callable[[], int]
) -> Iterator[int]:
    """A real Prometheus scraping the live services every second, with the jobs the monitors give."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus not found: run scripts/fetch_prometheus.sh (make install runs it)")
    dep, root = live
    labels = {"namespace": NAMESPACE}
    controller = f"127.0.0.1:{dep.controller_metrics_port}"
    agents = [f"127.0.0.1:{p}" for p in dep.agent_metrics_ports]
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": CONTROLLER_JOB, "static_configs": [{"targets": [controller], "labels": labels}]},
            {"job_name": AGENTS_JOB, "static_configs": [{"targets": agents, "labels": labels}]},
        ],
    }  # fmt: skip
    (root / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [
            binary, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:  # every target scraped at least twice (rates need two samples)
            try:
                ups = _query(port, "count_over_time(up[1m])")
                if len(ups) == 3 and all(float(r["value"][1]) >= 2 for r in ups):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "Prometheus did not scrape the services"
            time.sleep(0.5)
        run_workload(dep, root)  # a second round while Prometheus watches: counters move
        time.sleep(3)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


# Alerts whose condition depends on how busy the test machine is (a 2-core CI runner can take more
# than 50 ms for a MatchPrefix now and then); their promtool unit tests cover when they fire.
LOAD_DEPENDENT = {"KvgridMatchLatencyHigh"}


def _dashboard_expr(expr: str) -> str:
    return expr.replace("$__rate_interval", "30s").replace("$namespace", NAMESPACE)


def test_every_dashboard_query_returns_data_from_a_real_prometheus(
    docs: list[dict[str, Any]], prometheus: int
) -> None:
    queries = _panel_queries(docs)
    assert len(queries) >= 20
    empty = [where for where, expr in queries.items() if not _query(prometheus, _dashboard_expr(expr))]
    assert not empty, f"no data for {empty}"


def test_every_alert_signal_returns_data_and_no_alert_fires_on_a_healthy_system(
    docs: list[dict[str, Any]], prometheus: int
) -> None:
    for alert, rule in _alerts(docs).items():
        m = ALERT_EXPR.match(rule["expr"])
        assert m, rule["expr"]
        assert _query(prometheus, m["signal"]), f"{alert}: its signal returns no data: {m['signal']}"
        if alert in LOAD_DEPENDENT:
            continue
        assert not _query(prometheus, rule["expr"]), f"{alert} would fire on a healthy system"
