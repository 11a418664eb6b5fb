"""Fuzz the peer data plane (agent/peers/dataplane/) of a real agent process: tickets from FetchChunks
(``data_streams`` mutated) and the HELLO every data connection starts with (magic, 32-byte ticket,
u32 stream index), mutated: wrong magic, flipped ticket bits, streams out of range or claimed
already (replays), truncated or garbage hellos, oversize writes, hellos written slowly or followed
by junk, tickets of finished streams, idle connections. A valid hello gets exactly its stream's
chunks, each followed by its XXH3-128 (checked); anything else is closed without a byte sent,
promptly (an idle one within HELLO_TIMEOUT_S). A full valid fetch still works every 200
connections and at the end, and the agent's RSS stays bounded."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

import grpc
import xxhash

from kvgrid.agent.peers.dataplane.protocol import (
    HELLO,
    HELLO_TIMEOUT_S,
    MAGIC,
    TICKET_BYTES,
    stream_indices,
    ticket_streams,
)
from kvgrid.api.v1 import agent_pb2, agent_pb2_grpc
from tests.fuzz.conftest import NS_ID, Agent
from tests.fuzz.fuzzlib import Liveness, Oracle, budget, rng_for, rss_bytes

CI_MESSAGES = 1000
TIMEOUT_S = 10.0
RSS_SLACK = 32 << 20
"""RSS growth allowed: a thread per data connection (at most 256 at once), socket buffers, allocator
arenas. A leak per ticket or connection of 1 KiB fails ``make fuzz``'s 100,000."""
CHECKSUM = 16


@dataclass
class Ticket:
    call: object
    secret: bytes
    port: int
    num_chunks: int
    chunk_bytes: int
    streams: int
    claimed: set[int] = field(default_factory=set)


def read_all(sock: socket.socket, limit: int = 1 << 26) -> bytes:
    """Everything until the agent closes (a reset counts as a close); TimeoutError on a hang."""
    buf = bytearray()
    while len(buf) <= limit:
        try:
            got = sock.recv(1 << 20)
        except ConnectionResetError:
            break
        if not got:
            break
        buf += got
    return bytes(buf)


class DataPlaneFuzzer:
    def __init__(self, agent: Agent, oracle: Oracle, seed_name: str) -> None:
        self.agent, self.oracle = agent, oracle
        self.rng = rng_for(seed_name)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{agent.tcp_port}")
        self.stub = agent_pb2_grpc.AgentServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def ticket(self, streams: int) -> Ticket | None:
        req = agent_pb2.FetchChunksRequest(
            chunk_keys=self.agent.keys,
            layout_id=self.agent.layout_id,
            namespace_id=NS_ID,
            data_streams=streams,
        )
        call = self.stub.FetchChunks(req, timeout=30)
        try:
            first = next(call)
        except grpc.RpcError as e:
            self.oracle.check(
                "data", "FetchChunks(ticket)", e.code(), e.details() or "", req.SerializeToString(), ""
            )
            return None
        self.oracle.check(
            "data", "FetchChunks(ticket)", grpc.StatusCode.OK, "", b"", f"data_streams={streams}"
        )
        if not first.data_ticket:
            call.cancel()
            if streams:  # a data plane that is on hands out a ticket for held chunks
                self.oracle.fail("data", "FetchChunks(ticket)", "no ticket", req.SerializeToString(), "")
            return None
        assert len(first.data_ticket) == TICKET_BYTES
        return Ticket(
            call,
            first.data_ticket,
            first.data_port,
            first.num_chunks,
            first.chunk_bytes,
            ticket_streams(streams, first.num_chunks),
        )

    # -- one connection

    def send(self, port: int, data: bytes, *, pieces: bool = False, shut: bool = True) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
        try:
            if pieces:
                i = 0
                while i < len(data):
                    k = self.rng.randint(1, 9)
                    sock.sendall(data[i : i + k])
                    i += k
                    time.sleep(self.rng.choice((0, 0.0005, 0.002)))
            else:
                sock.sendall(data)
            if shut:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass  # refused before reading everything (reset): what is left to check is the close
        return sock

    def expect_refused(self, port: int, data: bytes, how: str, **kw: bool) -> None:
        sock = self.send(port, data, **kw)
        t0 = time.monotonic()
        try:
            got = read_all(sock)
        except TimeoutError:
            self.oracle.fail("data", "hello", f"not closed in {TIMEOUT_S} s (hang)", data, how)
            return
        finally:
            sock.close()
        if got:
            self.oracle.fail("data", "hello", f"refused hello got {len(got)} bytes", data, how)
        elif time.monotonic() - t0 > HELLO_TIMEOUT_S + 2:
            self.oracle.fail("data", "hello", "closed only after the hello timeout", data, how)
        else:
            self.oracle.check("data", "hello", grpc.StatusCode.OK, "", data, how)

    def expect_chunks(self, t: Ticket, stream: int, data: bytes, how: str, **kw: bool) -> None:
        sock = self.send(t.port, data, **kw)
        try:
            got = read_all(sock)
        except TimeoutError:
            self.oracle.fail("data", "hello", f"stream {stream}: no close in {TIMEOUT_S} s", data, how)
            return
        finally:
            sock.close()
        want = list(stream_indices(stream, t.streams, t.num_chunks))
        size = t.chunk_bytes + CHECKSUM
        if len(got) != size * len(want):
            self.oracle.fail(
                "data", "hello", f"stream {stream}: {len(got)} bytes, expected {size * len(want)}", data, how
            )
            return
        for i in range(len(want)):
            part = got[i * size : (i + 1) * size]
            if xxhash.xxh3_128(part[: t.chunk_bytes]).digest() != part[t.chunk_bytes :]:
                self.oracle.fail("data", "hello", f"chunk {want[i]}: checksum mismatch", data, how)
                return
        self.oracle.check("data", "hello", grpc.StatusCode.OK, "", data, how)

    # -- a round: one ticket, several connections

    def round(self) -> None:
        rng = self.rng
        streams = rng.choice((1, 2, 3, 4, 4, 16, 17, 255, 2**32 - 1))
        t = self.ticket(streams)
        if t is None:
            return
        try:
            for _ in range(rng.randint(1, 8)):
                self.connection(t)
        finally:
            t.call.cancel()  # type: ignore[attr-defined]
        if rng.random() < 0.2:  # the ticket dies with its stream: a replay of it is refused
            free = next((s for s in range(t.streams) if s not in t.claimed), 0)
            self.expect_retired(t, HELLO.pack(MAGIC, t.secret, free))

    def expect_retired(self, t: Ticket, data: bytes, within_s: float = 2.0) -> None:
        """The agent learns of the cancel asynchronously: until it has, the ticket is still live and a
        hello may get its chunks; within ``within_s`` the same hello must be refused."""
        end = time.monotonic() + within_s
        while True:
            sock = self.send(t.port, data)
            try:
                got = read_all(sock)
            except TimeoutError:
                self.oracle.fail(
                    "data", "hello", f"not closed in {TIMEOUT_S} s (hang)", data, "retired ticket"
                )
                return
            finally:
                sock.close()
            if not got:
                self.oracle.check("data", "hello", grpc.StatusCode.OK, "", data, "hello of a retired ticket")
                return
            if time.monotonic() > end:
                why = f"a ticket cancelled {within_s} s ago still served {len(got)} bytes"
                self.oracle.fail("data", "hello", why, data, "hello of a retired ticket")
                return
            time.sleep(0.05)

    def connection(self, t: Ticket) -> None:
        rng = self.rng
        free = [s for s in range(t.streams) if s not in t.claimed]
        op = rng.choice(
            (
                "valid",
                "valid_slow",
                "valid_junk",
                "replay",
                "magic",
                "ticket_bit",
                "zero_ticket",
                "random_ticket",
                "stream_range",
                "truncated",
                "garbage",
                "oversize",
                "empty",
            )
        )
        if op.startswith("valid") and not free:
            op = "replay"
        if op == "replay" and not t.claimed:
            op = "stream_range"
        if op.startswith("valid"):
            s = rng.choice(free)
            t.claimed.add(s)
            hello = HELLO.pack(MAGIC, t.secret, s)
            if op == "valid_junk":
                hello += rng.randbytes(rng.randint(1, 4096))
            self.expect_chunks(t, s, hello, op, pieces=op == "valid_slow")
        elif op == "replay":
            self.expect_refused(t.port, HELLO.pack(MAGIC, t.secret, rng.choice(sorted(t.claimed))), op)
        elif op == "magic":
            magic = rng.choice((b"KVGd", b"\0\0\0\0", b"DGVK", rng.randbytes(4)))
            s = free[0] if free else 0
            self.expect_refused(t.port, HELLO.pack(magic, t.secret, s), f"{op} {magic!r}")
        elif op == "ticket_bit":
            b = bytearray(t.secret)
            b[rng.randrange(TICKET_BYTES)] ^= 1 << rng.randrange(8)
            self.expect_refused(t.port, HELLO.pack(MAGIC, bytes(b), free[0] if free else 0), op)
        elif op == "zero_ticket":
            self.expect_refused(t.port, HELLO.pack(MAGIC, b"\0" * TICKET_BYTES, 0), op)
        elif op == "random_ticket":
            self.expect_refused(t.port, HELLO.pack(MAGIC, rng.randbytes(TICKET_BYTES), 0), op)
        elif op == "stream_range":
            s = rng.choice((t.streams, t.streams + 1, 16, 2**31, 2**32 - 1))
            self.expect_refused(t.port, HELLO.pack(MAGIC, t.secret, s), f"{op} {s}")
        elif op == "truncated":
            cut = rng.randrange(HELLO.size)
            hello = HELLO.pack(MAGIC, t.secret, free[0] if free else 0)[:cut]
            self.expect_refused(t.port, hello, f"{op} at {cut} then EOF")
        elif op == "garbage":
            self.expect_refused(t.port, rng.randbytes(rng.choice((1, 39, HELLO.size, 41, 300))), op)
        elif op == "oversize":
            self.expect_refused(t.port, rng.randbytes(1 << 20), op)
        else:
            self.expect_refused(t.port, b"", op)

    def full_fetch(self) -> None:
        """A valid fetch over two streams gets every chunk intact (liveness)."""
        self.agent.alive()
        self.agent.restore_engine()
        t = self.ticket(2)
        assert t is not None, "no ticket for a valid FetchChunks"
        before = len(self.oracle.findings)
        try:
            for s in range(t.streams):
                self.expect_chunks(t, s, HELLO.pack(MAGIC, t.secret, s), "liveness")
            rest = list(t.call)  # type: ignore[call-overload]  # the stream ends once all went out
            assert not rest, rest
        finally:
            t.call.cancel()  # type: ignore[attr-defined]
        assert len(self.oracle.findings) == before, "a valid data-plane fetch failed:\n" + "\n".join(
            str(f) for f in self.oracle.findings[before:]
        )

    def stalled(self, t: Ticket) -> list[socket.socket]:
        """Connections that send part of a hello and then nothing (the agent must drop them)."""
        out = []
        for cut in (0, 4, HELLO.size - 1):
            out.append(self.send(t.port, HELLO.pack(MAGIC, t.secret, 0)[:cut], shut=False))
        return out


def test_dataplane_fuzz(agent: Agent) -> None:
    n = budget(CI_MESSAGES)
    agent.restore_engine()
    oracle = Oracle("agent data plane")
    fz = DataPlaneFuzzer(agent, oracle, "agent-dataplane")
    try:
        live = Liveness(fz.full_fetch)
        stall_ticket = fz.ticket(1)
        assert stall_ticket is not None
        stalled = fz.stalled(stall_ticket)
        t_stall = time.monotonic()
        while oracle.messages < min(200, n // 5):
            fz.round()
        rss0 = rss_bytes(agent.proc.pid)
        while oracle.messages < n:
            fz.round()
            live.tick(oracle.messages)
        # The stalled hellos: closed by the agent once HELLO_TIMEOUT_S passed, without a byte.
        for sock in stalled:
            sock.settimeout(max(0.1, t_stall + HELLO_TIMEOUT_S + 3 - time.monotonic()))
            try:
                got = read_all(sock)
            except TimeoutError:
                oracle.fail("data", "hello", "a stalled partial hello was never closed", b"", "stall")
                got = b""
            finally:
                sock.close()
            if got:
                oracle.fail("data", "hello", f"a stalled partial hello got {len(got)} bytes", b"", "stall")
        stall_ticket.call.cancel()  # type: ignore[attr-defined]
        fz.full_fetch()
        rss1 = rss_bytes(agent.proc.pid)
    finally:
        fz.close()
    print(f"[fuzz agent data plane] RSS {rss0 >> 20} -> {rss1 >> 20} MiB; liveness checks {live.runs + 1}")
    oracle.assert_clean()
    assert rss1 - rss0 < RSS_SLACK, (
        f"agent RSS grew {(rss1 - rss0) >> 20} MiB over {oracle.messages} connections"
    )
