"""vLLM KV events -> GPU-tier index entries (ZMQ SUB, msgpack, replay on sequence gaps).

Wire format (vLLM ``distributed/kv_events.py``): each ZMQ message is ``(topic, seq: u64 big-endian,
payload)``, payload = msgpack ``[ts, [event, ...], dp_rank]``. An event is either a tagged map
``{"type": "BlockStored", "block_hashes": ..., ...}`` (vLLM >= 0.26) or a positional array
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...]``
(older vLLM); both are decoded. Block hashes are ints (u64 or i64) or bytes (last 8 bytes,
big-endian, as vLLM's own int conversion does).

Engine blocks are mapped to kvgrid chunk keys from the token ids in ``BlockStored``: per pod the
decoder keeps ``block hash -> (key of the last full chunk before the block end, tokens since
that chunk boundary, chunk key this block completes)``. A BlockStored continues from its parent's
state with :func:`kvgrid.common.hashing.chain_chunk_keys`, so keys chain exactly as
:func:`kvgrid.common.hashing.chunk_keys` would over the whole prompt; a BlockStored with a bad
token id changes nothing. A BlockRemoved of the block that completes a chunk evicts that chunk.
``medium`` GPU (or unset) maps to the GPU tier, CPU to L1; others are ignored. On a sequence gap
(and at start) the subscriber asks the replay socket for everything from the next sequence.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq

from kvgrid.common.hashing import TOKEN_ID_BYTES, KeyNamespace, chain_chunk_keys, pack_token_ids
from kvgrid.controller.config import VllmEventSource
from kvgrid.controller.index import ChunkIndex, IndexTier

__all__ = [
    "AllCleared",
    "BlockMapper",
    "Removed",
    "Stored",
    "VllmEventSubscriber",
    "decode_batch",
]

log = logging.getLogger(__name__)

_U64 = (1 << 64) - 1
_END_SEQ = _U64  # (-1) as 8-byte big-endian, read unsigned


class Stored(msgspec.Struct, frozen=True):
    block_hashes: tuple[int, ...]
    parent: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None


class Removed(msgspec.Struct, frozen=True):
    block_hashes: tuple[int, ...]
    medium: str | None


class AllCleared(msgspec.Struct, frozen=True):
    pass


VllmEvent = Stored | Removed | AllCleared


def _hash(h: object) -> int:
    if isinstance(h, bool):
        raise TypeError(f"block hash {h!r}: expected int or bytes")
    if isinstance(h, int):
        return h & _U64
    if isinstance(h, bytes | bytearray):
        return int.from_bytes(bytes(h[-8:]), "big")
    raise TypeError(f"block hash {h!r:.40}: expected int or bytes")


def _decode_event(ev: Any) -> VllmEvent | None:
    if isinstance(ev, dict):
        kind = ev.get("type")
        get = ev.get
    elif isinstance(ev, list | tuple) and ev:
        kind = ev[0]
        names = {
            "BlockStored": (
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
            ),
            "BlockRemoved": ("block_hashes", "medium"),
        }.get(kind, ())
        fields = dict(zip(names, ev[1:], strict=False))
        get = fields.get
    else:
        raise ValueError(f"KV event {ev!r:.60}: expected a tagged map or a positional array")
    if kind == "BlockStored":
        parent = get("parent_block_hash")
        return Stored(
            block_hashes=tuple(_hash(h) for h in get("block_hashes") or ()),
            parent=None if parent is None else _hash(parent),
            token_ids=tuple(get("token_ids") or ()),
            block_size=int(get("block_size") or 0),
            medium=get("medium"),
        )
    if kind == "BlockRemoved":
        return Removed(block_hashes=tuple(_hash(h) for h in get("block_hashes") or ()), medium=get("medium"))
    if kind == "AllBlocksCleared":
        return AllCleared()
    return None  # an event type this version does not know: skip it


def decode_batch(payload: bytes) -> list[VllmEvent]:
    """Events of one ``EventBatch`` payload (both event forms); ValueError on a malformed batch."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"KV event batch is not msgpack: {e}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError(f"KV event batch {batch!r:.60}: expected [ts, events, dp_rank]")
    out = []
    for ev in batch[1]:
        d = _decode_event(ev)
        if d is not None:
            out.append(d)
    return out


class _Block:
    __slots__ = ("completes", "media", "pending", "prev")

    def __init__(self, prev: bytes, pending: bytes, completes: bytes | None) -> None:
        self.prev = prev
        self.pending = pending
        self.completes = completes
        self.media = 0


_MEDIA = {None: IndexTier.GPU, "GPU": IndexTier.GPU, "CPU": IndexTier.L1}


class BlockMapper:
    """Per pod: engine blocks -> chunk keys, and which chunks are held per tier (pure state)."""

    def __init__(self, namespace: KeyNamespace) -> None:
        self.ns = namespace
        self.seed = namespace.seed()
        self.blocks: dict[int, _Block] = {}
        self.unknown_parents = 0

    def stored(self, ev: Stored) -> tuple[IndexTier, list[bytes]] | None:
        """Apply a BlockStored; returns (tier, chunk keys now held) or None if unusable."""
        tier = _MEDIA.get(ev.medium)
        if tier is None:
            return None
        bit = 1 << tier
        added: list[bytes] = []
        if not ev.token_ids:  # offload events may carry no tokens: only known blocks can be used
            for h in ev.block_hashes:
                b = self.blocks.get(h)
                if b is not None:
                    b.media |= bit
                    if b.completes:
                        added.append(b.completes)
            return tier, added
        if ev.parent is None:
            prev, pending = self.seed, b""
        else:
            parent = self.blocks.get(ev.parent)
            if parent is None:
                self.unknown_parents += 1
                return None
            prev, pending = parent.prev, parent.pending
        bs = ev.block_size
        if bs <= 0 or len(ev.token_ids) < bs * len(ev.block_hashes):
            raise ValueError(
                f"BlockStored: {len(ev.token_ids)} token ids for {len(ev.block_hashes)} blocks of "
                f"block_size={bs}: expected block_size * blocks"
            )
        tokens_per_chunk = self.ns.tokens_per_chunk
        step = tokens_per_chunk * TOKEN_ID_BYTES
        packed = pack_token_ids(ev.token_ids[: bs * len(ev.block_hashes)])
        for j, h in enumerate(ev.block_hashes):
            pending += packed[j * bs * TOKEN_ID_BYTES : (j + 1) * bs * TOKEN_ID_BYTES]
            completes = None
            if len(pending) >= step:
                keys = chain_chunk_keys(prev, pending, tokens_per_chunk)
                completes = keys[-1]
                prev = completes
                pending = pending[len(keys) * step :]
            b = self.blocks.get(h)
            if b is None:
                b = self.blocks[h] = _Block(prev, pending, completes)
            b.media |= bit
            if b.completes:
                added.append(b.completes)
        return tier, added

    def removed(self, ev: Removed) -> tuple[IndexTier, list[bytes]] | None:
        tier = _MEDIA.get(ev.medium)
        if tier is None:
            return None
        bit = 1 << tier
        gone: list[bytes] = []
        for h in ev.block_hashes:
            b = self.blocks.get(h)
            if b is None or not b.media & bit:
                continue
            b.media &= ~bit
            if b.completes:
                gone.append(b.completes)
            if not b.media:
                del self.blocks[h]
        return tier, gone

    def cleared(self) -> None:
        self.blocks.clear()

    def held(self) -> dict[IndexTier, list[bytes]]:
        out: dict[IndexTier, list[bytes]] = {t: [] for t in IndexTier}
        for b in self.blocks.values():
            if b.completes:
                for t in IndexTier:
                    if b.media >> t & 1:
                        out[t].append(b.completes)
        return out


class VllmEventSubscriber:
    """One thread per vLLM publisher: SUB the stream, replay gaps, write the pod's entries."""

    def __init__(
        self,
        source: VllmEventSource,
        index: ChunkIndex,
        holder_of: Callable[[str], str | None],
        *,
        context: zmq.Context | None = None,
        replay_timeout_ms: int = 2000,
    ) -> None:
        self.source = source
        self.index = index
        self._holder_of = holder_of
        self._ctx = context or zmq.Context.instance()
        self.mapper = BlockMapper(source.namespace)
        self._holder: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"vllm-events-{source.pod_uid}", daemon=True)
        self._replay_timeout = replay_timeout_ms
        self.last_seq: int | None = None
        self.events = 0
        self.replays = 0
        self.errors = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    # --- holder binding -----------------------------------------------------------------------
    def rebind(self, force: bool = False) -> None:
        """The pod's incarnation may have changed: re-write what the engine holds under it (with
        ``force`` even when it did not: the index lost its data)."""
        with self._lock:
            holder = self._holder_of(self.source.pod_uid)
            if holder == self._holder and not force:
                return
            self._holder = holder
            if holder is not None:
                held = self.mapper.held()
                # The engine owns the GPU tier (exact replace); L1 is shared with the agent (add only).
                self.index.replace(holder, IndexTier.GPU, held[IndexTier.GPU])
                self.index.add(holder, IndexTier.L1, held[IndexTier.L1])

    def apply(self, events: Sequence[VllmEvent]) -> None:
        with self._lock:
            holder = self._holder
            for ev in events:
                self.events += 1
                if isinstance(ev, Stored):
                    r = self.mapper.stored(ev)
                    if r and holder and r[1]:
                        self.index.add(holder, r[0], r[1])
                elif isinstance(ev, Removed):
                    r = self.mapper.removed(ev)
                    if r and holder and r[1]:
                        self.index.remove(holder, r[0], r[1])
                else:
                    self.mapper.cleared()
                    if holder:
                        self.index.replace(holder, IndexTier.GPU, ())

    # --- sockets ------------------------------------------------------------------------------
    def _handle(self, seq: int, payload: bytes) -> None:
        if self.last_seq is not None and seq <= self.last_seq:
            return  # duplicate (replayed and live copies overlap)
        try:
            events = decode_batch(payload)
            self.apply(events)
        except (ValueError, TypeError) as e:
            self.errors += 1
            log.warning("vLLM events from %s seq %d: %s", self.source.endpoint, seq, e)
        self.last_seq = seq

    def _replay(self, start: int) -> None:
        if not self.source.replay_endpoint:
            return
        self.replays += 1
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.source.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            while not self._stop.is_set():
                if not sock.poll(self._replay_timeout):
                    log.warning("replay from %s timed out", self.source.replay_endpoint)
                    return
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    continue
                _, _topic, seq_b, payload = frames
                seq = int.from_bytes(seq_b, "big")
                if seq == _END_SEQ:
                    return
                self._handle(seq, payload)
        finally:
            sock.close()

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        sub.connect(self.source.endpoint)
        try:
            self.rebind()
            # Whatever was published before we connected is only in the replay buffer.
            self._replay(0)
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3:
                    self.errors += 1
                    continue
                _topic, seq_b, payload = frames
                seq = int.from_bytes(seq_b, "big")
                if self.last_seq is not None and seq > self.last_seq + 1:
                    self._replay(self.last_seq + 1)
                elif self.last_seq is None and seq > 0:
                    self._replay(0)
                self._handle(seq, payload)
        finally:
            sub.close()
