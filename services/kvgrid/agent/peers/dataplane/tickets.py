"""Tickets: what one ``FetchChunks`` call may fetch on the data port.

A ticket is 256 random bits issued over the authorized control plane, bound to the chunks it was
issued for (referenced until sent, so eviction never reuses a buffer a socket still reads from),
to the certificate identity it was issued to and, for ``mac`` and ``aead``, to a random key of its
own; each stream index may be claimed once, and it dies with its gRPC stream.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Sequence

from kvgrid.agent.cache import ChunkCache
from kvgrid.agent.l1 import Chunk
from kvgrid.agent.peers.dataplane.keys import TicketKeys
from kvgrid.agent.peers.dataplane.protocol import KEY_BYTES, TICKET_BYTES

__all__ = ["Ticket"]


class Ticket:
    """The chunks one ``FetchChunks`` call may send on the data plane, referenced until sent.

    Each stream index may be claimed once. A chunk being sent stays referenced until
    :meth:`sent` (even when the ticket is closed meanwhile), so eviction never reuses a buffer
    while a socket reads from it. :attr:`finished` is set once nothing more will be sent.
    """

    def __init__(
        self,
        cache: ChunkCache,
        chunks: Sequence[Chunk],
        streams: int,
        identity: str = "",
        security: str = "plain",
    ) -> None:
        self.secret = secrets.token_bytes(TICKET_BYTES)
        self.identity = identity
        """The certificate identity (its SAN) the ticket was issued to; "" without TLS."""
        self.security = security
        """How its bytes are protected: plain (no TLS configured), tls, mac or aead."""
        self.key = secrets.token_bytes(KEY_BYTES) if security in ("mac", "aead") else b""
        """mac, aead: this ticket's own random key (sent once, over the mTLS control call)."""
        self.keys = TicketKeys(self.key) if self.key else None
        self.cache = cache
        self.streams = streams
        self.num_chunks = len(chunks)
        self._lock = threading.Lock()
        self._held: dict[int, Chunk] = dict(enumerate(chunks))
        self._sending: set[int] = set()
        self._claimed: set[int] = set()
        self._ended = 0  # claimed streams that hung up
        self._closed = False
        self.finished = threading.Event()
        if not chunks:
            self.finished.set()

    def claim(self, stream: int) -> bool:
        with self._lock:
            if self._closed or not 0 <= stream < self.streams or stream in self._claimed:
                return False
            self._claimed.add(stream)
            return True

    def take(self, index: int) -> Chunk | None:
        """The chunk to send next on a stream, marked in flight; None once the ticket closed."""
        with self._lock:
            chunk = None if self._closed else self._held.get(index)
            if chunk is not None:
                self._sending.add(index)
            return chunk

    def sent(self, index: int) -> None:
        with self._lock:
            self._sending.discard(index)
            chunk = self._held.pop(index, None)
            self._update()
        if chunk is not None:
            self.cache.release([chunk])

    def stream_ended(self) -> None:
        with self._lock:
            self._ended += 1
            if self._ended >= self.streams:
                self._closed = True  # every stream hung up: nobody can ask for the rest
            left = self._drop_idle()
            self._update()
        self.cache.release(left)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            left = self._drop_idle()
            self._update()
        self.cache.release(left)

    def _drop_idle(self) -> list[Chunk]:
        if not self._closed:
            return []
        idle = [i for i in self._held if i not in self._sending]
        return [self._held.pop(i) for i in idle]

    def _update(self) -> None:
        if not self._held or (self._closed and not self._sending):
            self.finished.set()
