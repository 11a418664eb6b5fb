"""TIER_L2 events of the agent's event log from a real tier chain (two disk tiers): a chunk entering
the chain is an admit, a demotion within it is nothing, a drop from the last tier is an evict, a
read back into L1 is nothing; the listing (at attach and on the controller's request) is a CLEAR
then admits of every key, in events of at most ``L2_LISTING_EVENT_KEYS`` keys."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvgrid.agent import events
from kvgrid.agent.events import EventLog
from kvgrid.agent.l1 import Chunk
from kvgrid.agent.tiers.base import HEADER_BYTES
from kvgrid.agent.tiers.disk import DiskBlobStore
from kvgrid.agent.tiers.tier import Tier, TierChain
from kvgrid.api.v1 import common_pb2, controller_pb2

NS = "a" * 32
N = 8 * 1024
ADMIT, EVICT, CLEAR = (
    controller_pb2.EVENT_KIND_ADMIT,
    controller_pb2.EVENT_KIND_EVICT,
    controller_pb2.EVENT_KIND_CLEAR,
)


def key(i: int) -> bytes:
    return bytes([i]) * 16


def chunk(i: int) -> Chunk:
    data = np.full(N, i, dtype=np.uint8)
    return Chunk(key(i), NS, "L", 0, 1, N, torch.from_numpy(data))


def l2_events(log: EventLog, after: int = 0) -> list[tuple[int, str, tuple[bytes, ...]]]:
    got = log.wait_after(after, 0.1, max_events=1000)
    assert all(e.tier == common_pb2.TIER_L2 for e in got)
    return [(e.kind, e.namespace_id, e.keys) for e in got]


def test_chain_changes_and_listings_are_l2_events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    two = 2 * (HEADER_BYTES + N)
    chain = TierChain(
        [Tier(DiskBlobStore(tmp_path / "fast"), two), Tier(DiskBlobStore(tmp_path / "slow"), two)]
    )
    log = EventLog()
    try:
        log.attach_lower_tiers(chain)
        assert l2_events(log) == [(CLEAR, "", ())]  # nothing held yet
        start = log.last_sequence()
        for i in range(5):  # 0 and 1 are demoted to the slow tier, 0 then dropped from it
            chain.submit(chunk(i))
        assert chain.drain()
        want = [(ADMIT, NS, (key(i),)) for i in range(4)] + [(EVICT, NS, (key(0),)), (ADMIT, NS, (key(4),))]
        assert l2_events(log, start) == want
        assert chain.l2_keys() == {NS: [key(i) for i in range(1, 5)]}

        # read back into L1: the records stay where they are (L1 and L2 at once), no event
        seq = log.last_sequence()
        out = np.zeros(N, dtype=np.uint8)
        assert chain.read_into(NS, key(1), "L", out) is not None and out[0] == 1
        assert log.last_sequence() == seq

        # the controller's request: CLEAR, then the keys in events of at most 3
        monkeypatch.setattr(events, "L2_LISTING_EVENT_KEYS", 3)
        log.relist_l2()
        assert l2_events(log, seq) == [
            (CLEAR, "", ()),
            (ADMIT, NS, (key(1), key(2), key(3))),
            (ADMIT, NS, (key(4),)),
        ]
        assert log.l2_listings == 2
    finally:
        chain.close()


def test_a_log_without_tiers_lists_nothing() -> None:
    log = EventLog()
    log.relist_l2()
    assert log.last_sequence() == 0 and log.l2_listings == 0


def test_one_message_carries_a_bounded_number_of_keys() -> None:
    log = EventLog()
    for i in range(4):
        log.on_l2(NS, [key(i)] * 3, True)  # 3 keys each
    assert [e.sequence for e in log.wait_after(0, 0.1, max_keys=7)] == [1, 2]  # 6 keys; 9 > 7
    assert [e.sequence for e in log.wait_after(2, 0.1, max_keys=7)] == [3, 4]
    assert [e.sequence for e in log.wait_after(0, 0.1, max_keys=1)] == [1]  # an event is never split
