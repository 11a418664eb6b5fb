"""The shared agent registry (RedisRegistry) against a real Valkey: the rules of the memory backend,
kept atomically across replicas (several registry instances on one key prefix play the replicas)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvgrid.common.errors import PermissionDenied, Unavailable
from kvgrid.common.identity import MAX_EPOCH, PodIdentity
from kvgrid.controller.registry import AgentLoad, MemoryRegistry, StaleEpochError, UnknownPodError
from kvgrid.controller.registry.base import AgentRegistry
from kvgrid.controller.registry.redis import RedisRegistry
from tests.controller.support import NS_ID, unique_prefix


@pytest.fixture
def three(valkey_url: str) -> Iterator[list[RedisRegistry]]:
    prefix = unique_prefix()
    regs = [RedisRegistry(valkey_url, 60_000, prefix=prefix) for _ in range(3)]
    yield regs
    for r in regs:
        r.close()


def test_epochs_compare_exactly_over_all_63_bits(three: list[RedisRegistry]) -> None:
    # 2**62 and 2**62 + 1 are the same double: a numeric compare in Lua would call them equal.
    a, b, _ = three
    hi = 2**62 + 1
    a.register(PodIdentity("p", epoch=hi), [NS_ID])
    with pytest.raises(StaleEpochError, match=str(hi)):
        b.register(PodIdentity("p", epoch=hi - 1), [NS_ID])
    with pytest.raises(StaleEpochError):
        b.heartbeat("p", hi - 1, None)
    out = b.register(PodIdentity("p", epoch=MAX_EPOCH), [NS_ID])
    assert out.is_new and out.replaced is not None and out.replaced.holder == f"p/{hi}"


def test_state_written_through_one_is_seen_by_the_others(three: list[RedisRegistry]) -> None:
    a, b, c = three
    pod = PodIdentity("p", pod_name="n", epoch=7, agent_address="10.0.0.1:5")
    a.register(pod, [NS_ID], 1 << 30)
    b.heartbeat("p", 7, AgentLoad(running_requests=2, waiting_requests=1, gpu_kv_usage=0.5))
    # b mirrored it when the heartbeat came through (unknown to its mirror); c at its sync.
    assert c.get("p") is None and c.sync().changed
    recs = [r.get("p") for r in three]
    a.sync()
    for rec in recs:
        assert rec is not None
        assert rec.pod == pod and rec.namespaces == (NS_ID,) and rec.l1_capacity_bytes == 1 << 30
        assert rec.load == AgentLoad(running_requests=2, waiting_requests=1, gpu_kv_usage=0.5)
        assert 0 < c.lease_remaining_ms(rec) <= 60_000
    # The same object while the incarnation lasts (event streams compare records by identity).
    assert c.get("p") is recs[2]
    c.sync()
    assert c.get("p") is recs[2] and not c.sync().changed


def test_one_replica_expires_a_lease_and_the_others_see_it_gone(valkey_url: str) -> None:
    prefix = unique_prefix()
    short = RedisRegistry(valkey_url, 100, prefix=prefix)
    other = RedisRegistry(valkey_url, 100, prefix=prefix)
    try:
        short.register(PodIdentity("p", epoch=1), [])
        other.sync()
        seen = other.get("p")
        assert seen is not None
        time.sleep(0.25)
        gone = short.expire()
        assert [r.holder for r in gone] == ["p/1"] and short.expired_total == 1
        assert other.expire() == []  # removed once, by whichever replica ran first
        synced = other.sync()
        assert synced.gone == [seen] and seen.dropped and other.get("p") is None
        with pytest.raises(UnknownPodError):
            other.heartbeat("p", 1, None)
    finally:
        short.close()
        other.close()


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_racing_registrations_by_two_identities_leave_one_owner(backend: str, valkey_url: str) -> None:
    """Two identities register the same pod at once through two replicas: exactly one wins, the
    other is PERMISSION_DENIED (the check and the write are one step)."""
    prefix = unique_prefix()
    if backend == "memory":
        shared = MemoryRegistry(60_000)
        regs: list[AgentRegistry] = [shared, shared]
    else:
        regs = [RedisRegistry(valkey_url, 60_000, prefix=prefix) for _ in range(2)]
    for round_ in range(20):
        uid = f"p{round_}"
        barrier = threading.Barrier(2)
        results: list[str] = ["", ""]

        def go(
            i: int, uid: str = uid, barrier: threading.Barrier = barrier, results: list[str] = results
        ) -> None:
            barrier.wait()
            try:
                regs[i].register(PodIdentity(uid, epoch=1 + i), [], owner=f"spiffe://x/agent/{i}")
                results[i] = "ok"
            except PermissionDenied:
                results[i] = "denied"

        threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == ["denied", "ok"], (round_, results)
        winner = results.index("ok")
        for r in regs:
            r.check_owner(uid, f"spiffe://x/agent/{winner}")
            with pytest.raises(PermissionDenied):
                r.check_owner(uid, f"spiffe://x/agent/{1 - winner}")
    for r in regs:
        r.close()


def test_a_refresh_inside_a_call_keeps_what_left_for_the_next_sync(three: list[RedisRegistry]) -> None:
    """A heartbeat for a pod another replica registered reloads the mirror at once; a record that
    left meanwhile must still come out of the next :meth:`sync` (the controller drops it there)."""
    a, b, _ = three
    a.register(PodIdentity("x", epoch=1), [])
    b.sync()
    x = b.get("x")
    assert x is not None
    a.remove("x")
    a.register(PodIdentity("y", epoch=1), [])
    b.heartbeat("y", 1, None)  # unknown to b's mirror: reloads it, and x is gone from it
    assert b.get("x") is None and x.dropped
    assert b.sync().gone == [x]
    assert b.sync().gone == []


def test_changes_of_a_known_record_reach_a_replica_that_already_read_it(three: list[RedisRegistry]) -> None:
    """A sync re-reads records only when ``a:ver`` moved: every change of identity, address or
    namespaces must move it."""
    a, b, _ = three
    ns2 = "f" * 32
    a.register(PodIdentity("p", epoch=3, agent_address="10.0.0.1:1"), [NS_ID])
    b.sync()
    seen = b.get("p")
    assert seen is not None and seen.pod.agent_address == "10.0.0.1:1"
    assert not b.sync().changed  # nothing moved
    a.register(PodIdentity("p", epoch=3, agent_address="10.0.0.2:1"), [])  # same incarnation, new address
    assert b.sync().changed and seen.pod.agent_address == "10.0.0.2:1" and seen.namespaces == (NS_ID,)
    rec = a.get("p")
    assert rec is not None and a.learn_namespaces(rec, [ns2])
    assert b.sync().changed and seen.namespaces == (NS_ID, ns2)
    assert b.get("p") is seen


def test_a_server_that_cannot_be_reached_is_unavailable_naming_it(free_port: Callable[[], int]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    reg = RedisRegistry(url, 60_000, prefix=unique_prefix())
    try:
        for call in (
            lambda: reg.register(PodIdentity("pod-x", epoch=1), [NS_ID]),
            lambda: reg.heartbeat("pod-x", 1, None),
            reg.sync,
            reg.expire,
        ):
            with pytest.raises(Unavailable, match=f"agent registry unavailable: Redis/Valkey at {url} "):
                call()
    finally:
        reg.close()
