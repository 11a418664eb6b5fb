"""Planted-defect controls: the fuzzers must catch a handler that fails on a value they generate.

In-process servers (real gRPC, a real hot-path socket) whose servicer method is monkeypatched to
raise ``ValueError`` on one field value the mutators produce (a uint32 of 2**32 - 1): the fuzz loop
must report it as INTERNAL with the planted text, with the exact request that triggers it, and
``assert_clean`` must fail with a message naming the method and code.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvgrid.agent.config import AgentConfig
from kvgrid.agent.service import AgentServer, AgentServicer
from kvgrid.api.v1 import agent_pb2, controller_pb2
from kvgrid.common.identity import PodIdentity
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.service import ControllerServicer, serve
from tests.fuzz import grpc_driver
from tests.fuzz.controller_cases import CONTROLLER_SERVICE, pools, rpcs
from tests.fuzz.fuzzlib import Liveness, Mutator, Oracle, Pools, RawCaller, rng_for
from tests.fuzz.hot_driver import HotFuzzer

PLANTED = 2**32 - 1
MESSAGES = 400
# The hot path's four methods draw from every field of their messages: a field added to any of them
# moves where the planted value falls, so this control gets room (about 2 s here).
HOT_MESSAGES = 2000


def test_grpc_fuzzer_catches_a_planted_defect(monkeypatch: pytest.MonkeyPatch) -> None:
    original = ControllerServicer.MatchPrefix

    def planted(self: ControllerServicer, req: controller_pb2.MatchPrefixRequest) -> object:
        if req.max_pods == PLANTED:
            raise ValueError(f"planted defect: max_pods={req.max_pods}")
        return original(self, req)

    monkeypatch.setattr(ControllerServicer, "MatchPrefix", planted)
    srv = serve(ControllerConfig(listen="127.0.0.1:0", max_message_bytes=1 << 20))
    channel = grpc.insecure_channel(srv.address)
    try:
        methods = [r for r in rpcs("127.0.0.1:1", "nobody") if r.name == "MatchPrefix"]
        oracle = Oracle("controller (planted defect)")
        grpc_driver.run(
            oracle,
            [grpc_driver.Target("tcp", RawCaller(channel, CONTROLLER_SERVICE))],
            methods,
            Mutator(rng_for("control-grpc"), pools("127.0.0.1:1")),
            MESSAGES,
            Liveness(lambda: None),
            1 << 20,
        )
    finally:
        channel.close()
        srv.stop()
    with pytest.raises(AssertionError, match=r"broke the contract.*\('MatchPrefix', 'INTERNAL'\)") as err:
        oracle.assert_clean()
    assert "planted defect: max_pods=4294967295" in str(err.value)
    found = oracle.findings[0]
    # The finding carries the exact request that reproduces it.
    assert controller_pb2.MatchPrefixRequest.FromString(found.request).max_pods == PLANTED


@pytest.fixture
def agent_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AgentServer]:
    original = AgentServicer.Lookup

    def planted(self: AgentServicer, req: agent_pb2.LookupRequest) -> object:
        if req.pin_ttl_ms == PLANTED:
            raise ValueError(f"planted defect: pin_ttl_ms={req.pin_ttl_ms}")
        return original(self, req)

    monkeypatch.setattr(AgentServicer, "Lookup", planted)
    cfg = AgentConfig(uds_path=str(tmp_path / "a.sock"), tcp_port=-1, l1_size=1 << 20, l1_page_size=4096)
    server = AgentServer(cfg, pod=PodIdentity(pod_uid="uid-control", epoch=1)).start()
    yield server
    server.stop(0)


def test_hot_path_fuzzer_catches_a_planted_defect(agent_in_process: AgentServer) -> None:
    assert agent_in_process.hot_path is not None
    seeds = {
        "Lookup": [agent_pb2.LookupRequest(instance_id="e", request_id="r", chunk_keys=[b"k" * 16])],
        "Retrieve": [agent_pb2.RetrieveRequest(instance_id="e", request_id="r")],
        "Store": [agent_pb2.StoreRequest(instance_id="e")],
        "Release": [agent_pb2.ReleaseRequest(instance_id="e", request_id="r")],
    }
    oracle = Oracle("agent hot path (planted defect)")
    fuzzer = HotFuzzer(
        agent_in_process.hot_path.path,
        oracle,
        Mutator(rng_for("control-hot"), Pools(strings=["e"])),
        seeds,
        seeds["Lookup"][0],
        1 << 20,
    )
    fuzzer.run(HOT_MESSAGES, Liveness(lambda: None), modes=("call",))
    with pytest.raises(AssertionError, match=r"broke the contract.*\('Lookup', 'INTERNAL'\)") as err:
        oracle.assert_clean()
    assert "planted defect: pin_ttl_ms=4294967295" in str(err.value)
