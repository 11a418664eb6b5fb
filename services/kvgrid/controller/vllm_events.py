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
    "Block",
    "BlockMapper",
    "Removed",
    "Stored",
    "VllmEventSubscriber",
    "decode_batch",
    "subscriber_context",
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


_POSITIONAL = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
}


def _hashes(hs: Any) -> tuple[int, ...]:
    # ints (vLLM's usual form) at C speed; anything else through _hash, which names a bad one
    if type(hs) is list and all(type(h) is int for h in hs):
        return tuple(h & _U64 for h in hs)
    return tuple(_hash(h) for h in hs or ())


def _decode_event(ev: Any) -> VllmEvent | None:
    if isinstance(ev, dict):
        kind = ev.get("type")
        get = ev.get
    elif isinstance(ev, list | tuple) and ev:
        kind = ev[0]
        fields = dict(zip(_POSITIONAL.get(kind, ()), ev[1:], strict=False))
        get = fields.get
    else:
        raise ValueError(f"KV event {ev!r:.60}: expected a tagged map or a positional array")
    if kind == "BlockStored":
        parent = get("parent_block_hash")
        return Stored(
            block_hashes=_hashes(get("block_hashes")),
            parent=None if parent is None else _hash(parent),
            token_ids=tuple(get("token_ids") or ()),
            block_size=int(get("block_size") or 0),
            medium=get("medium"),
        )
    if kind == "BlockRemoved":
        return Removed(block_hashes=_hashes(get("block_hashes")), medium=get("medium"))
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


Block = tuple[bytes, bytes, bytes | None, int]
"""One engine block's state: (key of the last full chunk before its end, its tokens since that
chunk boundary (packed), the chunk key it completes or None, the tiers holding it as bits). A plain
tuple of bytes, ints and None: the garbage collector stops tracking such a tuple once it has seen it,
so a controller holding millions of blocks does not scan them at every full collection (a class
instance per block made the collections most of the vLLM event path's CPU)."""


_MEDIA = {None: IndexTier.GPU, "GPU": IndexTier.GPU, "CPU": IndexTier.L1}


class BlockMapper:
    """Per pod: engine blocks -> chunk keys, and which chunks are held per tier (pure state)."""

    def __init__(self, namespace: KeyNamespace) -> None:
        self.ns = namespace
        self.seed = namespace.seed()
        self.blocks: dict[int, Block] = {}
        self.unknown_parents = 0

    def stored(self, ev: Stored) -> tuple[IndexTier, list[bytes]] | None:
        """Apply a BlockStored; returns (tier, chunk keys now held) or None if unusable."""
        tier = _MEDIA.get(ev.medium)
        if tier is None:
            return None
        bit = 1 << tier
        added: list[bytes] = []
        blocks = self.blocks
        if not ev.token_ids:  # offload events may carry no tokens: only known blocks can be used
            for h in ev.block_hashes:
                b = blocks.get(h)
                if b is not None:
                    blocks[h] = (b[0], b[1], b[2], b[3] | bit)
                    if b[2]:
                        added.append(b[2])
            return tier, added
        if ev.parent is None:
            prev, pending = self.seed, b""
        else:
            parent = blocks.get(ev.parent)
            if parent is None:
                self.unknown_parents += 1
                return None
            prev, pending = parent[0], parent[1]
        bs = ev.block_size
        if bs <= 0 or len(ev.token_ids) < bs * len(ev.block_hashes):
            raise ValueError(
                f"BlockStored: {len(ev.token_ids)} token ids for {len(ev.block_hashes)} blocks of "
                f"block_size={bs}: expected block_size * blocks"
            )
        tokens_per_chunk = self.ns.tokens_per_chunk
        step = tokens_per_chunk * TOKEN_ID_BYTES
        block_bytes = bs * TOKEN_ID_BYTES
        # the parent's tokens past its last chunk, then the run's: every chunk the run completes is
        # keyed by one call; block j's state is where its end falls in that buffer
        data = pending + pack_token_ids(ev.token_ids[: bs * len(ev.block_hashes)])
        keys = chain_chunk_keys(prev, data, tokens_per_chunk)
        end = len(pending)
        done = 0  # chunks completed by the blocks before
        for h in ev.block_hashes:
            end += block_bytes
            c = end // step  # chunks completed by this block's end
            completes = None
            if c > done:
                completes = keys[c - 1]
                done = c
            b = blocks.get(h)
            if b is None:
                blocks[h] = (keys[c - 1] if c else prev, data[c * step : end], completes, bit)
                if completes:
                    added.append(completes)
                continue
            if not b[3] & bit:
                blocks[h] = (b[0], b[1], b[2], b[3] | bit)
            if b[2]:
                added.append(b[2])
        return tier, added

    def removed(self, ev: Removed) -> tuple[IndexTier, list[bytes]] | None:
        tier = _MEDIA.get(ev.medium)
        if tier is None:
            return None
        bit = 1 << tier
        gone: list[bytes] = []
        blocks = self.blocks
        for h in ev.block_hashes:
            b = blocks.get(h)
            if b is None or not b[3] & bit:
                continue
            if b[2]:
                gone.append(b[2])
            media = b[3] & ~bit
            if media:
                blocks[h] = (b[0], b[1], b[2], media)
            else:
                del blocks[h]
        return tier, gone

    def cleared(self) -> None:
        self.blocks.clear()

    def held(self) -> dict[IndexTier, list[bytes]]:
        out: dict[IndexTier, list[bytes]] = {t: [] for t in IndexTier}
        for _, _, completes, media in self.blocks.values():
            if completes:
                for t in IndexTier:
                    if media >> t & 1:
                        out[t].append(completes)
        return out


def subscriber_context(sources: int) -> zmq.Context:
    """A ZMQ context with room for ``sources`` subscribers' sockets (a SUB each, and a DEALER while
    it replays): libzmq allows 1,023 sockets per context by default, so one context for a
    controller of 1,024 engines refused the last subscriber's socket ("Too many open files")."""
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, max(1024, 2 * sources + 16))  # before its first socket: fixed after
    return ctx


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

    def stop(self, wait: bool = True) -> None:
        """Stop the thread (it notices within 100 ms); ``wait``: until it ended (at most 2 s)."""
        self._stop.set()
        if wait and self._thread.is_alive():
            self._thread.join(timeout=2)

    @property
    def running(self) -> bool:
        """Its thread is alive (it holds sockets of its context)."""
        return self._thread.is_alive()

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
