"""Peer fetch stitches a prefix from several holders: pod A holds its first chunks, pod B the
following ones (A evicted them, or only B computed them), and a Lookup on pod C fetches the first
part from A and the rest from B (real controller and agent processes on loopback)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.agent.helpers import AgentProc, controller_with_pods, keys_for, wait_for
from tests.agent.test_peers import Cluster, chunk_bytes, chunk_ids, register, request_ids, same, store_on


@pytest.fixture(scope="module")
def three(
    tmp_path_factory: pytest.TempPathFactory, free_port: Callable[[], int]
) -> Iterator[tuple[Cluster, AgentProc]]:
    root = tmp_path_factory.mktemp("stitch")
    address = f"127.0.0.1:{free_port()}"
    pods: list[tuple[str, list[str]]] = [(uid, []) for uid in ("pod-a", "pod-b", "pod-c")]
    with controller_with_pods(root, address, pods) as (stub, agents):
        yield Cluster(root, stub, address, agents[0], agents[1]), agents[2]


def test_a_prefix_held_in_two_parts_on_two_pods_is_fetched_whole(three: tuple[Cluster, AgentProc]) -> None:
    cluster, c = three
    ea = register(cluster.a, cluster.root, "ea", seed=11)
    eb = register(cluster.b, cluster.root, "eb", seed=12)
    ec = register(c, cluster.root, "ec", seed=13)
    keys = keys_for(707, 5)
    store_on(ea, keys[:2])  # A: chunks 0-1
    store_on(eb, keys[2:5], first_block=8)  # B: chunks 2-4 only
    wait_for("A's part indexed", lambda: cluster.l1_chunks(cluster.a.pod_uid, keys) == 2)
    wait_for("B's part indexed", lambda: cluster.l1_chunks(cluster.b.pod_uid, keys[2:]) == 3)

    hit = ec.client.lookup(ec.instance_id, "r", keys)
    assert (hit.num_hit_chunks, hit.num_peer_chunks, hit.miss_cause) == (5, 5, "none")
    dst = 32
    res = ec.client.retrieve(ec.instance_id, "r", keys, request_ids(dst, 5))
    assert res.hit_mask == [True] * 5
    for i in (0, 1):  # A's bytes
        assert same(chunk_bytes(ec.tensors, chunk_ids(dst, i)), chunk_bytes(ea.tensors, chunk_ids(0, i)))
    for i in (2, 3, 4):  # B's bytes (stored from its blocks 8.. as chunks 0-2 of that request)
        assert same(chunk_bytes(ec.tensors, chunk_ids(dst, i)), chunk_bytes(eb.tensors, chunk_ids(8, i - 2)))
    assert ec.client.health().num_pinned_chunks == 0
