"""``kvgrid router`` failover on 5xx and its start-up errors, with small real HTTP servers standing
in for vLLM pods (vLLM cannot be made to answer 5xx on demand) and the controller down (a closed
port), so routing is least-loaded/round-robin. The real-vLLM behaviour is in test_router_vllm.py."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.agent.helpers import kvgrid_env
from tests.router.cluster import http_ok, start_router, stop, wait_for


def _pod(status: int, cut: bool = False) -> type[BaseHTTPRequestHandler]:
    """A pod answering ``status`` with the JSON it received; ``cut``: the answer stops half-way
    (the pod dies mid-answer)."""

    class Pod(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            out = json.dumps({"status": status, "received": json.loads(body)}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out[: len(out) // 2] if cut else out)
            self.close_connection = True

        def log_message(self, *args: object) -> None:
            pass

    return Pod


@pytest.fixture
def pods() -> Iterator[dict[str, str]]:
    servers = {
        name: ThreadingHTTPServer(("127.0.0.1", 0), _pod(s, cut))
        for name, s, cut in (("bad", 503, False), ("good", 200, False), ("cut", 200, True))
    }
    for s in servers.values():
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield {name: f"http://127.0.0.1:{s.server_address[1]}" for name, s in servers.items()}
    for s in servers.values():
        s.shutdown()
        s.server_close()


def _router(
    tmp_path: Path, free_port: Callable[[], int], urls: dict[str, str]
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = start_router(
        f"127.0.0.1:{free_port()}", port, urls, tmp_path / "router.log", "--score-timeout-s", "0.3"
    )
    url = f"http://127.0.0.1:{port}"
    wait_for("kvgrid router", lambda: http_ok(url + "/health"), 60, proc)
    return proc, url


def test_a_pod_answering_5xx_fails_over_and_the_body_passes_unchanged(
    tmp_path: Path, free_port: Callable[[], int], pods: dict[str, str]
) -> None:
    proc, url = _router(tmp_path, free_port, {"bad": pods["bad"], "good": pods["good"]})
    try:
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 3, "extra": {"kept": [1, "two"]}}
        routes = []
        for _ in range(4):
            resp = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert resp.status_code == 200, resp.text
            assert resp.json() == {"status": 200, "received": body}
            assert resp.headers["x-kvgrid-pod"] == "good"
            routes.append(resp.headers["x-kvgrid-route"])
        # Round-robin puts the failing pod first on every other request; those fail over.
        assert "fallback+failover" in routes and "fallback" in routes, routes
        assert "pod bad answered 503; trying good" in (tmp_path / "router.log").read_text()
    finally:
        stop(proc)


def test_every_pod_failing_is_a_502_naming_each(
    tmp_path: Path, free_port: Callable[[], int], pods: dict[str, str]
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    proc, url = _router(tmp_path, free_port, {"bad": pods["bad"], "dead": dead})
    try:
        resp = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": [1, 2]}, timeout=30)
        assert resp.status_code == 502
        message = resp.json()["error"]["message"]
        assert "bad (" in message and "HTTP 503" in message
        assert f"dead ({dead})" in message and "ClientConnectorError" in message
    finally:
        stop(proc)


def test_a_bad_engine_url_stops_the_start_with_its_name(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgrid.cli",
            "router",
            "--port",
            "0",
            "--engine-urls",
            "{pod-a: 10.0.0.5:8000}",
        ],
        env=kvgrid_env("router"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "engine_urls['pod-a'] = '10.0.0.5:8000': expected a vLLM base URL" in out.stderr


def test_an_answer_cut_mid_way_is_cut_for_the_client_and_the_router_keeps_serving(
    tmp_path: Path, free_port: Callable[[], int], pods: dict[str, str]
) -> None:
    proc, url = _router(tmp_path, free_port, {"cut": pods["cut"]})
    try:
        with pytest.raises(httpx.RemoteProtocolError):  # fewer bytes than the Content-Length said
            httpx.post(url + "/v1/completions", json={"model": "m", "prompt": [1, 2]}, timeout=30)
        assert "answer from pod cut cut short" in (tmp_path / "router.log").read_text()
        assert httpx.get(url + "/health", timeout=30).json()["pods"] == 1
    finally:
        stop(proc)
