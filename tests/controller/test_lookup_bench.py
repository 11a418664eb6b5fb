"""``kvgrid bench lookup`` at a tiny size: its structure, and that it checks its answers (it stops
when kvgrid's paths, or a peer's answers, disagree); the same for ``--transports`` (gRPC, the lean
listener in plaintext and with mTLS: answers byte-identical before anything is timed). Speed is
never asserted here."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from kvgrid.bench import lookup as bench
from kvgrid.bench.lookup_workload import QUERY_MIX, Workload, chunk_tokens


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    small = ["--pods", "4", "--chunks", "2000", "--seconds", "0.1", "--rounds", "1", "--batch", "8"]
    return parser.parse_args([*small, "--streams", "2", "--concurrency", "1,2", *extra, "--json"])


def test_workload_is_deterministic_and_mixes_hits_and_misses() -> None:
    a, b = Workload(4, 2000), Workload(4, 2000)
    assert a.events() == b.events() and [q.keys for q in a.queries(50)] == [q.keys for q in b.queries(50)]
    qs = Workload(4, 2000).queries(400)
    assert {q.kind for q in qs} == {k for k, _ in QUERY_MIX}
    held = {k for lst in a.events().values() for _, keys in lst for k in keys}
    for q in qs:
        cached = sum(k in held for k in q.keys)
        if q.kind == "miss":
            assert cached == 0
        else:  # a new uncached turn at the end: a partial hit
            assert 0 < cached < len(q.keys) and q.keys[-1] not in held
    gpu = {k for lst in a.events().values() for tier, keys in lst if tier == "gpu" for k in keys}
    assert any(k in gpu for q in qs if q.kind == "next_turn" for k in q.keys[16:])  # the GPU tier is queried
    chains = a.chains()
    assert sum(len(k) for lst in chains.values() for _, k in lst) == sum(
        len(k) for lst in a.events().values() for t, k in lst if t == "l1"
    )
    assert chunk_tokens([bytes(range(16))]) == [0x03020100, 0x07060504, 0x0B0A0908, 0x0F0E0D0C]


def test_bench_runs_small(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run(_args()) == 0  # it also checks kvgrid's answers agree across gRPC, lean, batches
    out = json.loads(capsys.readouterr().out)
    ing = out["ingest"]
    assert ing["keys"] == out["memory"]["entries"] and ing["messages"] < ing["events"] < ing["keys"]
    # RSS growth at this tiny size is allocator noise and may be negative: only its presence is checked.
    assert ing["keys_s"] > 0 and out["memory"]["tracemalloc_per_entry"] > 0
    assert isinstance(out["memory"]["rss_per_entry"], float)
    rows = out["rows"]
    assert {
        "kvgrid in-process, 1 query",
        "kvgrid gRPC MatchPrefix (readable), c=1",
        "kvgrid gRPC 1 packed query, compact, c=1",
        "kvgrid gRPC 1 packed query, compact, c=2",
        "kvgrid lean listener 1 packed query, compact, c=1",
        "kvgrid lean listener 1 packed query, compact, c=2",
        "kvgrid lean listener mTLS 1 packed query, compact, c=1",
        "kvgrid lean listener mTLS 1 packed query, compact, c=2",
        "kvgrid gRPC packed compact x8, c=1",
    } == set(rows)
    # the vLLM ZMQ path: every chain's blocks, one GPU entry each, through one publisher per pod
    vllm = out["vllm_ingest"]
    chains = Workload(4, 2000).chains()
    assert (
        vllm["keys"]
        == sum(len(k) for lst in chains.values() for _, k in lst)
        == out["memory"]["chunk_pod_pairs"]
    )
    assert vllm["events"] == sum(map(len, chains.values())) and vllm["keys_s"] > 0
    for r in rows.values():
        assert r["queries_s"]["median"] > 0 and r["p50_ms"]["median"] <= r["p99_ms"]["median"]
    assert out["query_kinds"]["miss"] > 0 and out["peers"] == {}
    # in-process rows also carry the process's CPU per query (the load-independent number)
    assert 0 < rows["kvgrid in-process, 1 query"]["cpu_us_per_query"]["median"] < 1e6


def test_absent_peer_is_reported_not_measured(capsys: pytest.CaptureFixture[str]) -> None:
    # this environment has no ai-dynamo-runtime: the peer runner says so and the bench goes on
    assert bench.run(_args("--peers", "--peers-python", sys.executable)) == 0
    out = json.loads(capsys.readouterr().out)
    assert "No module named 'dynamo'" in out["peers"]["error"]
    assert not any("Dynamo" in name for name in out["rows"])


def test_bench_stops_when_the_mtls_listener_answers_differently(monkeypatch: pytest.MonkeyPatch) -> None:
    # the mTLS listener (started as `kvgrid controller` starts it) alone answers one byte longer
    from kvgrid.controller import lookup_server

    answer = lookup_server.LookupServer._answer

    def planted(self: lookup_server.LookupServer, method: int, body: bytes, denied: dict[int, str]) -> bytes:
        out = answer(self, method, body, denied)
        return lookup_server._frame(out[4], out[5:] + b"\x00") if self.tls else out

    monkeypatch.setattr(lookup_server.LookupServer, "_answer", planted)
    with pytest.raises(AssertionError, match="differ between the lean listener with and without mTLS"):
        bench.run(_args())


def test_bench_stops_when_the_vllm_event_path_misses_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    # every stored run names a parent block the engine never stored: its chunks cannot be keyed
    from kvgrid.bench import lookup_peers

    batch = lookup_peers._vllm_batch
    monkeypatch.setattr(lookup_peers, "_vllm_batch", lambda seq, parent, keys: batch(seq, b"\x01" * 16, keys))
    with pytest.raises(AssertionError, match=r"vLLM ZMQ ingest incomplete: 0 GPU entries of \d+ blocks"):
        bench.run(_args())


def test_bench_stops_when_answers_disagree(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgrid.controller import lookup_server

    monkeypatch.setitem(
        lookup_server._METHODS, lookup_server.METHOD_MATCH, ("MatchPrefix", lambda ctl, body: b"")
    )
    with pytest.raises(AssertionError, match="kvgrid answers differ between gRPC, the lean listener"):
        bench.run(_args())


TRANSPORTS = "grpc,listener,listener-mtls"


def test_transports_run_small(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.run(_args("--transports", TRANSPORTS)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["args"]["transports"] == TRANSPORTS.split(",") and "memory" not in out
    rows = out["transports"]
    assert set(rows) == {f"{t}, c={c}" for t in TRANSPORTS.split(",") for c in (1, 2)}
    for r in rows.values():
        assert r["queries_s"]["median"] > 0 and r["p50_ms"]["median"] <= r["p99_ms"]["median"]
        assert r["server_cpu_us_per_query"]["median"] > 0
    ratios = out["ratios_to_grpc"]
    assert set(ratios) == {f"{t}, c={c}" for t in ("listener", "listener-mtls") for c in (1, 2)}
    for r in ratios.values():
        assert all(r[k] > 0 for k in ("p50_ms", "p99_ms", "server_cpu_us_per_query"))
        assert r["queries_s"]["median"] > 0


def test_transports_stop_when_one_answers_differently(monkeypatch: pytest.MonkeyPatch) -> None:
    # the mTLS listener alone answers one byte longer: the bench stops before timing anything
    from kvgrid.controller import lookup_server

    answer = lookup_server.LookupServer._answer

    def planted(self: lookup_server.LookupServer, method: int, body: bytes, denied: dict[int, str]) -> bytes:
        out = answer(self, method, body, denied)
        return lookup_server._frame(out[4], out[5:] + b"\x00") if self.tls else out

    monkeypatch.setattr(lookup_server.LookupServer, "_answer", planted)
    with pytest.raises(AssertionError, match="listener-mtls's differ from the gRPC port's on 256 of 256"):
        bench.run(_args("--transports", TRANSPORTS))


def test_transports_refused_without_cryptography_or_with_peers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.run(_args("--transports", "grpc", "--peers")) == 2
    assert "--peers does not apply with --transports" in capsys.readouterr().err
    find_spec = bench.importlib.util.find_spec
    monkeypatch.setattr(
        bench.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "cryptography" else find_spec(name, *a),
    )
    assert bench.run(_args("--transports", "grpc,listener-mtls")) == 2
    assert "cryptography package, which is not installed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _args("--transports", "grpc,quic")
    assert "expected distinct names from grpc, listener, listener-mtls" in capsys.readouterr().err
