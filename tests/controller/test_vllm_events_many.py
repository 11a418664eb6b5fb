"""A controller subscribed to more vLLM engines than one default ZMQ context has sockets for (1,023):
every subscriber gets its socket and applies its engine's events (raw ZMQ and msgpack, as vLLM
publishes them; no vLLM needed)."""

from __future__ import annotations

import gc
import time

import msgspec
import zmq

from kvgrid.common.hashing import KeyNamespace, chunk_keys
from kvgrid.common.identity import PodIdentity
from kvgrid.controller.config import ControllerConfig, VllmEventSource
from kvgrid.controller.core import Controller
from kvgrid.controller.index import IndexTier
from tests.controller.support import wait_until

NS = KeyNamespace(model="many-engines", tokens_per_chunk=4)
ENGINES = 1030


def test_more_engines_than_a_default_zmq_context_holds() -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    sources = [
        VllmEventSource(pod_uid=f"engine-{i}", endpoint=endpoint, namespace=NS) for i in range(ENGINES)
    ]
    ctl = Controller(ControllerConfig(lease_ttl_ms=60_000, vllm_sources=sources))
    ctl.start()
    try:
        last = sources[-1].pod_uid
        ctl.register(PodIdentity(pod_uid=last, epoch=1), [NS.namespace_id()], 0)
        holder = f"{last}/1"
        tokens = [7, 8, 9, 10]
        stored = ["BlockStored", [11], None, tokens, 4, None, "GPU", None]
        seq = 0

        def published() -> bool:  # subscribers connect asynchronously: publish until one is applied
            nonlocal seq
            seq += 1
            pub.send_multipart(
                [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), [stored], 0])]
            )
            return ctl.vllm[-1].events > 0

        wait_until(published, timeout=60, what="the last engine's subscriber to apply an event")
        assert all(s.running for s in ctl.vllm)
        assert ctl.index.holder_keys(holder, IndexTier.GPU) == set(chunk_keys(tokens, NS))
    finally:
        ctl.stop()
        pub.close(0)
        ctx.term()
    assert not any(s.running for s in ctl.vllm)


def _reference_states(
    ns: KeyNamespace, runs: list[tuple[int, ...]], tokens: list[int], bs: int
) -> dict[int, tuple[bytes, bytes, bytes | None]]:
    """Block -> (key before it, tokens past that chunk, chunk it completes): one chain call per block."""
    from kvgrid.common.hashing import TOKEN_ID_BYTES, chain_chunk_keys, pack_token_ids

    out: dict[int, tuple[bytes, bytes, bytes | None]] = {}
    prev, pending = ns.seed(), b""
    step = ns.tokens_per_chunk * TOKEN_ID_BYTES
    packed = bytes(pack_token_ids(tokens))
    i = 0
    for run in runs:
        for h in run:
            pending += packed[i * bs * TOKEN_ID_BYTES : (i + 1) * bs * TOKEN_ID_BYTES]
            i += 1
            completes = None
            if len(pending) >= step:
                keys = chain_chunk_keys(prev, pending, ns.tokens_per_chunk)
                completes = keys[-1]
                prev, pending = completes, pending[len(keys) * step :]
            out[h] = (prev, pending, completes)
    return out


def test_block_states_equal_a_chain_call_per_block() -> None:
    # block sizes below, at and above the chunk size, runs split anywhere: the state each block keeps
    # (what a later run continuing from it starts with) is what hashing block by block gives
    import random

    from kvgrid.controller.vllm_events import BlockMapper, Stored

    rng = random.Random(3)
    for _ in range(200):
        ns = KeyNamespace(model="m", tokens_per_chunk=rng.choice([1, 4, 6, 16]))
        bs = rng.choice([1, 2, 3, 4, 5, 16, 40])
        n = rng.randrange(1, 30)
        tokens = [rng.randrange(1 << 31) for _ in range(n * bs)]
        cuts = sorted(rng.sample(range(1, n), k=rng.randrange(0, min(4, n - 1) + 1))) if n > 1 else []
        runs = [tuple(range(a + 1, b + 1)) for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
        m = BlockMapper(ns)
        parent = None
        for run in runs:
            lo = (run[0] - 1) * bs
            assert (
                m.stored(Stored(run, parent, tuple(tokens[lo : lo + len(run) * bs]), bs, "GPU")) is not None
            )
            parent = run[-1]
        want = _reference_states(ns, runs, tokens, bs)
        got = {h: (b[0], bytes(b[1]), b[2]) for h, b in m.blocks.items()}
        assert got == want
    # the states are plain tuples of bytes, ints and None: once seen, the collector stops tracking them
    gc.collect()
    assert m.blocks and not any(gc.is_tracked(b) for b in m.blocks.values())
