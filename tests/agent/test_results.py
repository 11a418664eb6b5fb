"""The agent's result types: the miss cause is a :class:`MissCause` on every path."""

from __future__ import annotations

import msgspec

from kvgrid.common.agent_results import LookupResult, MissCause, RetrieveResult


def test_every_cause_reads_back_from_its_wire_text_and_an_unknown_one_as_not_found() -> None:
    for cause in MissCause:
        assert MissCause.from_wire(str(cause)) is cause
    assert MissCause.from_wire("") is MissCause.NONE  # proto3's default
    assert MissCause.from_wire("quota_exceeded") is MissCause.NOT_FOUND  # a newer agent's cause


def test_results_carry_the_enum_through_msgspec() -> None:
    r = msgspec.msgpack.decode(
        msgspec.msgpack.encode(LookupResult(2, MissCause.PEER_FAILED)), type=LookupResult
    )
    assert r.miss_cause is MissCause.PEER_FAILED and r.miss_cause == "peer_failed"
    assert RetrieveResult([True], 1, 0).miss_cause is MissCause.NONE
