"""`kvgrid lookup` against a real controller: what a human sees for match, score, agents and stats."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from kvgrid import cli
from kvgrid.api.v1 import controller_pb2_grpc
from kvgrid.common.hashing import KeyNamespace, chunk_keys
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.service import serve
from tests.controller.support import FakeAgent, index_keys, wait_until

NS = KeyNamespace(model="tiny-model", tokens_per_chunk=4)
TOKENS = list(range(100, 112))  # three chunks of four
KEYS = chunk_keys(TOKENS, NS)


@pytest.fixture(scope="module")
def controller() -> Iterator[str]:
    server = serve(ControllerConfig(listen="127.0.0.1:0", lease_ttl_ms=60_000))
    agent = FakeAgent(server.address, "pod-a", namespace_id=NS.namespace_id())
    channel = grpc.insecure_channel(server.address)
    stub = controller_pb2_grpc.ControllerServiceStub(channel)
    try:
        agent.admit(KEYS[:2])
        wait_until(lambda: index_keys(stub, "pod-a") == set(KEYS[:2]), what="agent's chunks indexed")
        yield server.address
    finally:
        channel.close()
        agent.close()
        server.stop()


def _row(out: str, first_cell: str) -> list[str]:
    """The cells of the table row that starts with ``first_cell`` (rich draws │ between cells)."""
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if cells and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} in:\n{out}")


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # one table row per line, whatever terminal runs the tests


def _lookup(capsys: pytest.CaptureFixture[str], address: str, *args: str) -> tuple[int, str]:
    rc = cli.main(["lookup", "--controller", address, *args])
    return rc, capsys.readouterr().out


def test_match_by_tokens_counts_leading_chunks_per_tier(
    controller: str, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = ",".join(map(str, TOKENS))
    rc, out = _lookup(
        capsys, controller, "match", "--tokens", tokens, "--model", "tiny-model", "--tokens-per-chunk", "4"
    )
    assert rc == 0 and "3 query chunks" in out
    assert _row(out, "pod-a") == [
        "pod-a",
        "name-pod-a",
        "0",
        "2",
        "0",
        "0",
        "2",
    ]  # pod, name, GPU, L1, L2, peer, total


def test_score_by_keys_ranks_the_holder(controller: str, capsys: pytest.CaptureFixture[str]) -> None:
    keys = ",".join(k.hex() for k in KEYS)
    rc, out = _lookup(capsys, controller, "score", "--keys", keys, "--namespace-id", NS.namespace_id())
    assert rc == 0 and "3 query chunks, best first" in out
    assert _row(out, "pod-a")[1:5] == ["0", "2", "0", "0"]  # GPU, L1, L2, peer


def test_agents_and_stats(controller: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _lookup(capsys, controller, "agents")
    assert rc == 0 and "1 agents" in out
    row = _row(out, "pod-a")
    assert row[1:3] == ["name-pod-a", "node-a"] and row[5] == "2"  # chunks
    rc, out = _lookup(capsys, controller, "stats")
    assert rc == 0 and _row(out, "num_entries") == ["num_entries", "2"]


def test_bad_input_is_one_clear_line(controller: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _lookup(capsys, controller, "match", "--keys", "abcd", "--namespace-id", NS.namespace_id())
    assert rc == 1
    assert "INVALID_ARGUMENT" in out and "got 2 bytes, expected a 16-byte chunk key" in out
    with pytest.raises(SystemExit, match="--model is required"):
        cli.main(["lookup", "--controller", controller, "match", "--tokens", "1,2"])
