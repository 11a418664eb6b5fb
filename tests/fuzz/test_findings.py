"""Minimized repros of what the fuzzers found, one test each, marked xfail(strict=True) while the
product bug is open: fix the bug, then drop the mark (strict: the suite fails once it passes) and
the fuzzer's ``known_bug`` filter that keeps it from re-finding the same bug."""

from __future__ import annotations

import socket
import time

import grpc
import pytest

from kvgrid.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2, controller_pb2, controller_pb2_grpc
from tests.agent.helpers import block_ids, start_controller
from tests.fuzz.conftest import ENGINE, Agent
from tests.fuzz.fuzzlib import code_of
from tests.fuzz.hot_driver import frame, read_reply


def test_register_refuses_a_huge_engine_group_id(agent: Agent) -> None:
    req = agent_pb2.RegisterKVCachesRequest()
    req.CopyFrom(agent.register_request)
    req.instance_id = "fz-finding-1"
    req.engine_groups[2].engine_group_id = 1 << 24  # 128 MiB and ~0.3 s now; the fuzzer sent 2**30
    with grpc.insecure_channel(f"unix:{agent.uds_path}") as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        t0 = time.monotonic()
        try:
            stub.RegisterKVCaches(req, timeout=60)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
            assert "engine_group_id" in (e.details() or ""), e.details()
            assert time.monotonic() - t0 < 2
            return
        stub.UnregisterKVCaches(agent_pb2.UnregisterKVCachesRequest(instance_id=req.instance_id), timeout=10)
    raise AssertionError(
        f"engine_group_id={1 << 24} with 3 infos was accepted in {time.monotonic() - t0:.2f} s"
    )


def _peak_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) >> 10 for line in f if line.startswith("VmHWM:"))


def test_batch_score_refuses_an_answer_over_the_limit_before_building_it(free_port: object) -> None:
    address = f"127.0.0.1:{free_port()}"  # type: ignore[operator]
    proc = start_controller(address, "--max-message-bytes", str(1 << 20), "--log-level", "ERROR")
    try:
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            ns = "0123456789abcdef0123456789abcdef"
            for i in range(50):
                pod = common_pb2.PodIdentity(pod_uid=f"p{i}", epoch=1)
                stub.RegisterAgent(controller_pb2.RegisterAgentRequest(pod=pod, namespaces=[ns]), timeout=10)
            one = controller_pb2.ScoreRequest(
                match=controller_pb2.MatchPrefixRequest(
                    chunk_keys=common_pb2.ChunkKeys(keys=[b"k" * 16]), namespace_id=ns
                )
            )
            req = controller_pb2.BatchScoreRequest(requests=[one] * 4096)  # 238 KB, max_batch allows it
            peak0, t0 = _peak_mib(proc.pid), time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                stub.BatchScore(req, timeout=60)
            took, grew = time.monotonic() - t0, _peak_mib(proc.pid) - peak0
            # The bound is no tighter than the answer: the same queries asking for one pod each fit.
            for one_pod in req.requests:
                one_pod.top_k = 1
            answered = stub.BatchScore(req, timeout=60)
            assert [len(r.scores) for r in answered.responses] == [1] * 4096
    finally:
        proc.terminate()
        proc.wait(10)
    code, details = err.value.code(), err.value.details() or ""
    assert code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT), (code, details)
    assert "top_k" in details, f"the refusal should say how to ask for less: {details!r}"
    assert grew < 32 and took < 1.0, f"refused after {took:.2f} s and {grew} MiB more peak RSS"


@pytest.mark.parametrize("transport", ["grpc", "hotpath"])
def test_retrieve_with_a_repeated_block_id_is_invalid_argument(agent: Agent, transport: str) -> None:
    agent.restore_engine()
    ids = block_ids(40, len(agent.keys))
    ids[0][1] = ids[0][0]  # block 40 twice in engine group 0
    req = agent_pb2.RetrieveRequest(
        instance_id=ENGINE,
        request_id="finding-3",
        chunk_keys=agent.keys,
        block_ids=[common_pb2.BlockIds(ids=b) for b in ids],
    )
    if transport == "grpc":
        with grpc.insecure_channel(f"unix:{agent.uds_path}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                agent_pb2_grpc.AgentServiceStub(channel).Retrieve(req, timeout=30)
            code, details = err.value.code(), err.value.details() or ""
    else:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(30)
            s.connect(agent.hot_path)
            s.sendall(frame(1, req.SerializeToString()))
            status, text = read_reply(s)
        code, details = code_of(status), text.decode()
    agent.client.release(ENGINE, "finding-3")
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "repeats block id" in details
