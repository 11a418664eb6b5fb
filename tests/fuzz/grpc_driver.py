"""The gRPC fuzz loop shared by the agent and controller fuzzers (and the planted-defect control):
pick an RPC and a listener, build a request from a valid seed (structure-aware mutation, raw byte
mutation on top, raw mutation of the seed, or an oversize message), send it as bytes, check the
status with the oracle; streams send sequences of such messages."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import Message

from tests.fuzz.fuzzlib import Liveness, Mutator, Oracle, RawCaller, string_field_numbers


@dataclass
class Rpc:
    name: str
    kind: str
    """"unary", "server_stream" or "bidi"."""
    seeds: Sequence[Message] = ()
    weight: float = 1.0
    sequence: Callable[[random.Random], list[Message]] | None = None
    """bidi: a valid sequence of request messages (each is then mutated or not)."""
    stop: Callable[[bytes], bool] | None = None
    """server_stream: cancel after a response for which this is true (e.g. a data-plane ticket)."""
    known_bug: Callable[[bytes], str] | None = None
    """A request that would hit a reported, not yet fixed bug: the reason (the request is not sent,
    its xfail test covers it), else "". Remove once the bug is fixed."""


@dataclass
class Target:
    name: str
    caller: RawCaller
    served: frozenset[str] | None = None
    """Methods this listener serves (None: all); the others must answer UNIMPLEMENTED."""
    weight_unserved: float = 0.05
    extra_allowed: frozenset[grpc.StatusCode] = field(default_factory=frozenset)


def build(mut: Mutator, seed: Message, limit: int) -> tuple[bytes, str]:
    """One request's bytes from ``seed``, and how they were made."""
    rng = mut.rng
    strings = string_field_numbers(type(seed))
    r = rng.random()
    if r < 0.01:
        return mut.oversize(seed, limit)
    if r < 0.66:
        msg, log = mut.message(seed)
        return msg.SerializeToString(), "; ".join(log)
    if r < 0.91:
        msg, log = mut.message(seed)
        data, how = mut.raw(msg.SerializeToString(), strings)
        return data, "; ".join(log) + f"; then {how}"
    return mut.raw(seed.SerializeToString(), strings)


def run(
    oracle: Oracle,
    targets: Sequence[Target],
    rpcs: Sequence[Rpc],
    mut: Mutator,
    messages: int,
    liveness: Liveness,
    limit: int,
) -> None:
    """Fuzz until ``messages`` requests were sent (stream messages count one each)."""
    rng = mut.rng
    weights = [r.weight for r in rpcs]
    while oracle.messages < messages:
        t0 = time.perf_counter()
        rpc = rng.choices(rpcs, weights)[0]
        tw = [1.0 if t.served is None or rpc.name in t.served else t.weight_unserved for t in targets]
        target = rng.choices(targets, tw)[0]
        allowed = set(target.extra_allowed)
        if target.served is not None and rpc.name not in target.served:
            allowed.add(grpc.StatusCode.UNIMPLEMENTED)  # by design: named listener split
        where = target.name
        if rpc.kind == "bidi":
            assert rpc.sequence is not None
            seq, hows = [], []
            for i, m in enumerate(rpc.sequence(rng)):
                if rng.random() < 0.5:
                    data, how = build(mut, m, limit)
                    seq.append(data)
                    hows.append(f"[{i}] {how}")
                else:
                    seq.append(m.SerializeToString())
            code, details, _ = target.caller.stream_stream(rpc.name, seq)
            request = b"".join(len(s).to_bytes(4, "big") + s for s in seq)
            how = f"stream of {len(seq)} (u32-length-prefixed below): " + " | ".join(hows)
            oracle.check(where, rpc.name, code, details, request, how, allowed=allowed, count=len(seq))
        else:
            seed = rng.choice(rpc.seeds)
            data, how = build(mut, seed, limit)
            if rpc.known_bug is not None and rpc.known_bug(data):
                oracle.skipped += 1
                continue
            if rpc.kind == "server_stream":
                code, details, _ = target.caller.unary_stream(rpc.name, data, stop=rpc.stop)
            else:
                code, details, _ = target.caller.unary(rpc.name, data)
            oracle.check(where, rpc.name, code, details, data, how, allowed=allowed)
        oracle.seconds[rpc.name] += time.perf_counter() - t0
        liveness.tick(oracle.messages)
