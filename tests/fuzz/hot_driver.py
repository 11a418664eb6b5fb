"""The hot-path fuzz loop (common/hotpath.py's framed protocol on ``{uds}.hot``).

Frame: ``u32 length | u8 method (+0x80 one-way) | u16 n | n bytes of trace headers | message``;
reply: ``u32 length | u8 status | message or error text``. Each message the loop sends is one of:

- ``call``: a two-way frame of Lookup/Retrieve/Store/Release whose request is a structure-aware or
  raw mutation of a valid one (on a kept connection): one reply, OK or a named status with text;
- ``header``: a valid request under a mutated header (any method byte, one-way bit, header length
  past the frame, garbage or huge trace headers): a reply, or none for a one-way frame;
- ``one_way``: a mutated one-way frame (Release or another method), then at once a valid Lookup on
  the same connection: exactly one reply, the Lookup's, OK;
- ``partial``: a valid frame written a few bytes at a time with pauses: its reply;
- ``length``: the length field too small (< 3), over the limit, longer than the bytes sent (then
  the write side closed), or shorter (the rest follows at once): an INVALID_ARGUMENT reply and a
  close, or (truncated) a close without a reply;
- ``garbage``: random bytes, then the write side closed: replies (named statuses) and a close;
- ``pipelined``: two two-way frames without waiting: an INVALID_ARGUMENT reply, then a close.

A reply with INTERNAL/UNKNOWN/a status byte that names no code, an error without text, no reply
within the timeout (a hang) or a close where a reply is owed is a finding.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable, Mapping, Sequence

import grpc
from google.protobuf.message import Message

from tests.fuzz.fuzzlib import Liveness, Mutator, Oracle, code_of, string_field_numbers

HOT = ("Lookup", "Retrieve", "Store", "Release")
ONE_WAY = 0x80
TIMEOUT_S = 15.0
_INVALID = grpc.StatusCode.INVALID_ARGUMENT


def frame(kind: int, payload: bytes, head: bytes = b"", head_len: int | None = None) -> bytes:
    hl = len(head) if head_len is None else head_len
    body = struct.pack(">BH", kind & 0xFF, hl & 0xFFFF) + head + payload
    return struct.pack(">I", len(body)) + body


class _Closed(Exception):
    """The agent closed the connection (EOF or reset) where this loop waited for a reply."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            got = sock.recv(n - len(buf))
        except ConnectionResetError:
            got = b""
        if not got:
            raise _Closed(f"closed after {len(buf)} of {n} bytes")
        buf += got
    return bytes(buf)


def read_reply(sock: socket.socket) -> tuple[int, bytes]:
    """(status byte, payload) of one reply frame; _Closed on EOF; TimeoutError on a hang."""
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n == 0:
        return -1, b""
    body = _recv_exact(sock, n)
    return body[0], body[1:]


def read_until_close(sock: socket.socket) -> list[tuple[int, bytes]]:
    """Every reply until the agent closes the connection."""
    out = []
    while True:
        try:
            out.append(read_reply(sock))
        except _Closed:
            return out


class HotFuzzer:
    def __init__(
        self,
        path: str,
        oracle: Oracle,
        mut: Mutator,
        seeds: Mapping[str, Sequence[Message]],
        valid_lookup: Message,
        limit: int,
        known_bug: Callable[[str, bytes], str] = lambda method, data: "",
    ) -> None:
        self.path, self.oracle, self.mut, self.seeds = path, oracle, mut, seeds
        self.valid_lookup = valid_lookup
        self.limit = limit
        self.known_bug = known_bug
        """(method, request) -> why it is not sent (a reported, open bug), else ""."""
        self.rng = mut.rng
        self._sock: socket.socket | None = None

    # -- connections

    def connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(TIMEOUT_S)
        s.connect(self.path)
        return s

    def kept(self) -> socket.socket:
        if self._sock is None:
            self._sock = self.connect()
        return self._sock

    def drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # -- checks

    def _reply(
        self, method: str, status: int, text: bytes, request: bytes, how: str
    ) -> grpc.StatusCode | None:
        code = code_of(status)
        self.oracle.check("hot", method, code, text.decode("utf-8", "replace"), request, how)
        return code

    def _owed(self, method: str, sock: socket.socket, request: bytes, how: str) -> grpc.StatusCode | None:
        """Read the one reply ``request`` is owed; a close or a hang instead is a finding."""
        try:
            status, text = read_reply(sock)
        except _Closed as e:
            self.oracle.fail("hot", method, f"closed without a reply ({e})", request, how)
            self.drop()
            return None
        except TimeoutError:
            self.oracle.fail("hot", method, f"no reply in {TIMEOUT_S} s (hang)", request, how)
            self.drop()
            return None
        return self._reply(method, status, text, request, how)

    def _closing(self, method: str, sock: socket.socket, request: bytes, how: str, *, replies: int) -> None:
        """The agent answers at most ``replies`` frames (each a named status) and closes."""
        try:
            got = read_until_close(sock)
        except TimeoutError:
            self.oracle.fail("hot", method, f"not closed in {TIMEOUT_S} s (hang)", request, how)
            return
        finally:
            sock.close()
        if len(got) > replies:
            self.oracle.fail("hot", method, f"{len(got)} replies, expected <= {replies}", request, how)
        if not got:
            self.oracle.check("hot", method, grpc.StatusCode.OK, "", request, how)  # a clean close
        for status, text in got:
            self._reply(method, status, text, request, how)

    # -- messages

    def _request(self) -> tuple[str, bytes, str]:
        method = self.rng.choice(HOT)
        seed = self.rng.choice(self.seeds[method])
        r = self.rng.random()
        if r < 0.6:
            msg, log = self.mut.message(seed)
            return method, msg.SerializeToString(), "; ".join(log)
        if r < 0.85:
            msg, log = self.mut.message(seed)
            data, how = self.mut.raw(msg.SerializeToString(), string_field_numbers(type(seed)))
            return method, data, "; ".join(log) + f"; then {how}"
        data, how = self.mut.raw(seed.SerializeToString(), string_field_numbers(type(seed)))
        return method, data, how

    def call(self) -> None:
        method, payload, how = self._request()
        if self.known_bug(method, payload):
            self.oracle.skipped += 1
            return
        f = frame(HOT.index(method), payload)
        sock = self.kept()
        sock.sendall(f)
        self._owed(method, sock, f, f"call: {how}")

    def header(self) -> None:
        rng = self.rng
        method = rng.choice(HOT)
        payload = rng.choice(self.seeds[method]).SerializeToString()
        kind = rng.choice((rng.randrange(256), HOT.index(method) | ONE_WAY, 4, 5, 0x7F, 0xFF))
        head = rng.choice(
            (
                b"",
                b"traceparent=00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                b"traceparent=garbage\ntracestate=\xff\xfe",
                b"=\n=\n\n==",
                rng.randbytes(rng.randint(1, 64)),
                b"tracestate=" + b"x" * 60000,
            )
        )
        head_len = rng.choice((None, None, 0, len(head) + len(payload) + 1, 0xFFFF))
        f = frame(kind, payload, head, head_len)
        how = f"header: kind={kind:#x} head={head[:40]!r}... head_len={head_len}"
        name = HOT[kind & 0x7F] if (kind & 0x7F) < len(HOT) else f"#{kind & 0x7F}"
        sock = self.kept()
        sock.sendall(f)
        if kind & ONE_WAY:
            # No reply: the next valid call on this connection answers, and only it.
            self._followed_by_lookup(name, f, how)
        else:
            self._owed(name, sock, f, how)

    def _followed_by_lookup(self, method: str, sent: bytes, how: str) -> None:
        sock = self.kept()
        lookup = frame(0, self.valid_lookup.SerializeToString())
        sock.sendall(lookup)
        code = self._owed(method, sock, sent + lookup, how + " (+ a valid Lookup)")
        if code is not None and code is not grpc.StatusCode.OK:
            self.oracle.fail(
                "hot", method, f"the valid Lookup after a one-way frame got {code.name}", sent, how
            )

    def one_way(self) -> None:
        rng = self.rng
        method = "Release" if rng.random() < 0.7 else rng.choice(HOT)
        seed = rng.choice(self.seeds[method])
        if rng.random() < 0.7:
            msg, log = self.mut.message(seed)
            payload, how = msg.SerializeToString(), "; ".join(log)
        else:
            payload, how = self.mut.raw(seed.SerializeToString())
        if self.known_bug(method, payload):
            self.oracle.skipped += 1
            return
        f = frame(HOT.index(method) | ONE_WAY, payload)
        self.kept().sendall(f)
        self._followed_by_lookup(method, f, f"one_way: {how}")

    def partial(self) -> None:
        method = self.rng.choice(HOT)
        f = frame(HOT.index(method), self.rng.choice(self.seeds[method]).SerializeToString())
        sock = self.kept()
        i = 0
        while i < len(f):
            k = self.rng.randint(1, 7)
            sock.sendall(f[i : i + k])
            i += k
            time.sleep(self.rng.choice((0, 0, 0.0002, 0.001)))
        self._owed(method, sock, f, "partial: a valid frame in pieces")

    def length(self) -> None:
        rng = self.rng
        method = rng.choice(HOT)
        payload = rng.choice(self.seeds[method]).SerializeToString()
        body = struct.pack(">BH", HOT.index(method), 0) + payload
        op = rng.choice(("short", "over_limit", "truncated", "longer_than_said"))
        sock = self.connect()
        try:
            if op == "short":
                n = rng.randint(0, 2)
                f = struct.pack(">I", n) + body[:n]
                sock.sendall(f)
                self._closing(method, sock, f, f"length: {n} (< 3)", replies=1)
            elif op == "over_limit":
                n = rng.choice((self.limit + 1, 1 << 31, 0xFFFFFFFF))
                f = struct.pack(">I", n) + body
                sock.sendall(f)
                self._closing(method, sock, f, f"length: {n} (> limit {self.limit})", replies=1)
            elif op == "truncated":
                n = len(body) + rng.randint(1, 1 << 20)
                f = struct.pack(">I", n) + body
                sock.sendall(f)
                sock.shutdown(socket.SHUT_WR)
                self._closing(method, sock, f, f"length: {n} > {len(body)} sent, then EOF", replies=0)
            else:
                cut = rng.randint(3, max(3, len(body) - 1)) if len(body) > 3 else 3
                f = struct.pack(">I", cut) + body
                sock.sendall(f)
                sock.shutdown(socket.SHUT_WR)
                # One refusal (the rest came at once), or answers to the cut frame and whatever the
                # rest reads as; then a close.
                self._closing(method, sock, f, f"length: {cut} < {len(body)} sent", replies=2)
        except (BrokenPipeError, ConnectionResetError):
            sock.close()  # the agent closed first (it may refuse before reading everything)
            self.oracle.check("hot", method, grpc.StatusCode.OK, "", b"", f"length {op}: closed early")

    def garbage(self) -> None:
        data = self.rng.randbytes(self.rng.randint(1, 300))
        sock = self.connect()
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass
        self._closing("garbage", sock, data, "garbage then EOF", replies=1 << 30)

    def pipelined(self) -> None:
        method = self.rng.choice(HOT)
        f = frame(HOT.index(method), self.rng.choice(self.seeds[method]).SerializeToString())
        sock = self.connect()
        sock.sendall(f + f)
        # The agent may answer the first before it sees the second (then the second's reply too,
        # or its refusal): at most two replies, then a close or a kept connection.
        sock.shutdown(socket.SHUT_WR)
        self._closing(method, sock, f + f, "pipelined: two two-way frames at once", replies=2)

    MODES: Sequence[tuple[str, float]] = (
        ("call", 45),
        ("header", 14),
        ("one_way", 10),
        ("partial", 6),
        ("length", 10),
        ("garbage", 8),
        ("pipelined", 7),
    )

    def run(self, messages: int, liveness: Liveness, modes: Sequence[str] | None = None) -> None:
        names = [m for m, _ in self.MODES if modes is None or m in modes]
        weights = [w for m, w in self.MODES if modes is None or m in modes]
        while self.oracle.messages < messages:
            mode = self.rng.choices(names, weights)[0]
            t0 = time.perf_counter()
            try:
                getattr(self, mode)()
            except (BrokenPipeError, ConnectionResetError) as e:
                # The kept connection was closed by the agent after an answer that said so (an
                # oversize frame): start a new one. Anything else surfaces as a finding above.
                self.drop()
                self.oracle.check("hot", mode, grpc.StatusCode.OK, "", b"", f"reconnect after {e!r}")
            self.oracle.seconds[mode] += time.perf_counter() - t0
            liveness.tick(self.oracle.messages)
        self.drop()


def hot_liveness(path: str, lookup: Message, extra: Callable[[], None] = lambda: None) -> Callable[[], None]:
    """A check that a fresh connection's valid Lookup answers OK."""

    def check() -> None:
        extra()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(TIMEOUT_S)
            s.connect(path)
            s.sendall(frame(0, lookup.SerializeToString()))
            status, text = read_reply(s)
        assert status == 0, f"a valid hot-path Lookup got status {status}: {text[:300]!r}"

    return check
