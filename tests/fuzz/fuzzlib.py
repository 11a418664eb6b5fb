"""The fuzzers' shared parts: structure-aware protobuf mutations, raw byte mutations, the oracle,
generic gRPC calls with identity serializers, the budget and a server process's RSS.

Structure-aware: a mutation starts from a *valid* request and changes one field (possibly inside a
nested or repeated message) with a value of the field's type chosen to break assumptions: 0, -1,
the type's extremes, empty / huge / non-hex / NUL strings, empty / wrong-length / huge bytes,
unknown enum values, repeated fields emptied, cut to one element or grown to many, oneof members
switched. A few are stacked. Raw mutations then work on the serialized bytes: bit flips, byte
overwrites, truncation, insertions, unknown fields, wrong wire types, overlong varints, invalid
UTF-8 in a string field, deep group nesting, random bytes.

The oracle (:class:`Oracle`): every answer is OK or one of :data:`ALLOWED` (named, client-facing
codes) with a non-empty message; INTERNAL, UNKNOWN, DEADLINE_EXCEEDED (a hang) or a code not
allowed for that call is a :class:`Finding` that keeps the exact bytes sent and how they were made.

Budget: ``KVGRID_FUZZ_MESSAGES=N`` is the number of messages (frames, connections) per service;
unset, each test uses its CI default (a few seconds each). ``KVGRID_FUZZ_SEED`` changes the seed.
"""

from __future__ import annotations

import math
import os
import random
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

SEED = int(os.environ.get("KVGRID_FUZZ_SEED", "20260611"))
LIVENESS_EVERY = 200
"""Messages between two checks that the service still answers a valid request correctly."""

GRPC_ALLOWED = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.ABORTED,
    }
)
"""Codes any fuzzed call may end with. UNIMPLEMENTED and UNAVAILABLE are allowed only where a test
says why (e.g. the engine API on the agent's TCP port is UNIMPLEMENTED by design)."""

_CODE_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def code_of(value: int) -> grpc.StatusCode | None:
    """The status code with this number (the hot path's reply byte), None for no such code."""
    return _CODE_BY_VALUE.get(value)


def budget(ci_default: int) -> int:
    """Messages per service: ``KVGRID_FUZZ_MESSAGES`` when set, else ``ci_default``."""
    env = os.environ.get("KVGRID_FUZZ_MESSAGES", "").strip()
    return int(env) if env else ci_default


def rng_for(name: str) -> random.Random:
    """A seeded generator per test (``name``), independent of the order tests run in."""
    return random.Random(f"{SEED}:{name}")


# ---- structure-aware mutations ----------------------------------------------------------------


@dataclass
class Pools:
    """Values a service's requests use when valid (instance ids, namespace ids, stored keys...):
    mutations pick them as often as hostile ones, so the fuzzer reaches code past validation."""

    strings: list[str] = field(default_factory=list)
    bytes_: list[bytes] = field(default_factory=list)
    ints: list[int] = field(default_factory=list)


_I32 = (0, 1, -1, 2, 63, 64, 65, 255, 256, 4096, 65535, 2**31 - 1, -(2**31), 2**30)
_I64 = (*_I32, 2**63 - 1, -(2**63), 2**32, 2**53 + 1)
_U32 = (0, 1, 2, 15, 16, 17, 63, 64, 255, 256, 4096, 65536, 2**31 - 1, 2**31, 2**32 - 1)
_U64 = (*_U32, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1)
_FLOATS = (0.0, -0.0, -1.0, 1.0, 0.5, 1e308, -1e308, 5e-324, math.inf, -math.inf, math.nan)
_STRINGS = (
    "",
    " ",
    "\x00",
    "a\x00b",
    "..",
    "../../../../etc/passwd",
    "/dev/shm",
    "unix:/tmp/x",
    "0123456789abcdef0123456789abcdef",  # a well-formed namespace id nobody uses
    "0123456789ABCDEF0123456789ABCDEF",
    "g" * 32,
    "0" * 31,
    "0" * 33,
    "\u00fc\u00f1\u00ef\u00e7\u00f8d\u00e9\u2603\U0001f600",
    "\ufffd",
    "%s%n%x",
    "{}[]\"'\\",
    "-1",
    "NaN",
    "127.0.0.1:1",
    "[::1]:1",
    "localhost:0",
    ":",
    "host:99999999",
    "=\n=\n",
)


class Mutator:
    """Structure-aware mutations of protobuf messages and raw mutations of their bytes."""

    def __init__(
        self, rng: random.Random, pools: Pools | None = None, *, huge: int = 64 << 10, grow: int = 8 << 20
    ) -> None:
        """``huge``: length of the huge strings/bytes (a few per cent of mutations); oversize
        messages are made by :meth:`oversize`. ``grow``: most bytes one "many values" or
        "duplicates" mutation adds to a repeated field (the count drawn is cut to fit; no other
        draw changes). Unbounded, duplicates of duplicates grew one request to 0.7 GB after ~7,000
        controller messages and the fuzzer past 20 GB later (killed by the kernel): far past every
        message limit, which a few MiB already exceed."""
        self.rng = rng
        self.pools = pools or Pools()
        self.huge = huge
        self.grow = grow

    # -- values by type

    def _int(self, base: Sequence[int], lo: int, hi: int) -> int:
        r = self.rng.random()
        if r < 0.3 and self.pools.ints:
            v = self.rng.choice(self.pools.ints)
        elif r < 0.8:
            v = self.rng.choice(base)
        else:
            v = self.rng.randint(-1000, 100_000)
        return min(max(v, lo), hi)

    def string(self) -> str:
        r = self.rng.random()
        if r < 0.35 and self.pools.strings:
            return self.rng.choice(self.pools.strings)
        if r < 0.8:
            return self.rng.choice(_STRINGS)
        if r < 0.9:
            return "".join(chr(self.rng.randint(32, 0x2FF)) for _ in range(self.rng.randint(1, 40)))
        return self.rng.choice("ab\u2603") * self.rng.choice((1000, self.huge))

    def blob(self, current: bytes = b"") -> bytes:
        r = self.rng.random()
        if r < 0.3 and self.pools.bytes_:
            return self.rng.choice(self.pools.bytes_)
        if r < 0.4 and current:
            b = bytearray(current)
            b[self.rng.randrange(len(b))] ^= 1 << self.rng.randrange(8)
            return bytes(b)
        if r < 0.85:
            n = self.rng.choice((0, 1, 8, 15, 16, 16, 16, 17, 31, 32, 33, 64, 255))
            return self.rng.randbytes(n)
        return self.rng.randbytes(self.rng.choice((1024, self.huge)))

    def value(self, f: FieldDescriptor, current: object = None) -> object:
        """A hostile-or-valid value of ``f``'s scalar type."""
        t = f.cpp_type
        if t == FieldDescriptor.CPPTYPE_INT32:
            return self._int(_I32, -(2**31), 2**31 - 1)
        if t == FieldDescriptor.CPPTYPE_INT64:
            return self._int(_I64, -(2**63), 2**63 - 1)
        if t == FieldDescriptor.CPPTYPE_UINT32:
            return self._int(_U32, 0, 2**32 - 1)
        if t == FieldDescriptor.CPPTYPE_UINT64:
            return self._int(_U64, 0, 2**64 - 1)
        if t in (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT):
            return self.rng.choice(_FLOATS)
        if t == FieldDescriptor.CPPTYPE_BOOL:
            return not current if current is not None else self.rng.random() < 0.5
        if t == FieldDescriptor.CPPTYPE_ENUM:
            known = [v.number for v in f.enum_type.values]
            return self.rng.choice([*known, 5, 99, -1, 2**31 - 1, -(2**31)])
        if f.type == FieldDescriptor.TYPE_BYTES:
            return self.blob(current if isinstance(current, bytes) else b"")
        return self.string()

    # -- messages

    def message(self, msg: Message, steps: int | None = None) -> tuple[Message, list[str]]:
        """A mutated copy of ``msg`` and what was done to it."""
        out = type(msg)()
        out.CopyFrom(msg)
        log: list[str] = []
        for _ in range(steps or self.rng.choice((1, 1, 1, 2, 2, 3, 4))):
            self._mutate_in(out, type(msg).__name__, 0, log)
        return out, log

    def _mutate_in(self, m: Message, path: str, depth: int, log: list[str]) -> None:
        fields = m.DESCRIPTOR.fields
        if not fields:
            log.append(f"{path}: no fields")
            return
        if depth < 4 and self.rng.random() < 0.4:
            subs: list[tuple[str, Message]] = []
            for f in fields:
                if f.cpp_type != FieldDescriptor.CPPTYPE_MESSAGE or _is_map(f):
                    continue
                if _is_repeated(f):
                    items = getattr(m, f.name)
                    if len(items):
                        i = self.rng.randrange(len(items))
                        subs.append((f"{path}.{f.name}[{i}]", items[i]))
                elif m.HasField(f.name):
                    subs.append((f"{path}.{f.name}", getattr(m, f.name)))
            if subs:
                sub_path, sub = self.rng.choice(subs)
                self._mutate_in(sub, sub_path, depth + 1, log)
                return
        f = self.rng.choice(fields)
        try:
            log.append(self._mutate_field(m, f, f"{path}.{f.name}", depth))
        except (ValueError, TypeError, OverflowError) as e:  # a value protobuf refuses to hold
            log.append(f"{path}.{f.name}: skipped ({type(e).__name__})")

    def _mutate_field(self, m: Message, f: FieldDescriptor, path: str, depth: int) -> str:
        rng = self.rng
        if _is_map(f):
            mp = getattr(m, f.name)
            op = rng.choice(("clear", "add", "many"))
            if op == "clear":
                mp.clear()
            else:
                for _ in range(1 if op == "add" else rng.choice((17, 300))):
                    k, v = self.string(), self.string()
                    val_f = f.message_type.fields_by_name["value"]
                    if val_f.cpp_type == FieldDescriptor.CPPTYPE_STRING:
                        mp[k] = v
            return f"{path}: map {op}"
        if _is_repeated(f):
            items = getattr(m, f.name)
            is_msg = f.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE
            op = rng.choice(("clear", "one", "many", "append", "dup", "shuffle", "set"))
            if op == "clear" or (op in ("one", "dup", "shuffle", "set") and not len(items)):
                del items[:]
                return f"{path}: cleared"
            if op == "one":
                keep = items[rng.randrange(len(items))]
                if is_msg:
                    keep_copy = type(keep)()
                    keep_copy.CopyFrom(keep)
                    del items[:]
                    items.add().CopyFrom(keep_copy)
                else:
                    del items[:]
                    items.append(keep)
                return f"{path}: one element"
            if op == "shuffle":
                vals = list(items)
                if is_msg:
                    copies = []
                    for v in vals:
                        c = type(v)()
                        c.CopyFrom(v)
                        copies.append(c)
                    rng.shuffle(copies)
                    del items[:]
                    for c in copies:
                        items.add().CopyFrom(c)
                else:
                    rng.shuffle(vals)
                    del items[:]
                    items.extend(vals)
                return f"{path}: shuffled"
            if op == "dup":
                n = rng.choice((2, 17, 300, 3000))
                base = list(items)
                size = sum(v.ByteSize() for v in base) if is_msg else sum(len(_bytes_of(v)) for v in base)
                n = max(1, min(n, self.grow * len(base) // max(1, size)))
                for i in range(n):
                    v = base[i % len(base)]
                    if is_msg:
                        items.add().CopyFrom(v)
                    else:
                        items.append(v)
                return f"{path}: +{n} duplicates"
            if op == "set" and not is_msg:
                i = rng.randrange(len(items))
                items[i] = self.value(f, items[i])
                return f"{path}[{i}] = {_short(items[i])}"
            if is_msg:
                if op == "set" and len(items):
                    i = rng.randrange(len(items))
                    log: list[str] = []
                    self._mutate_in(items[i], f"{path}[{i}]", depth + 1, log)
                    return "; ".join(log)
                n = 1 if op == "append" else rng.choice((2, 17, 300))
                for _ in range(n):
                    items.add()
                return f"{path}: +{n} empty elements"
            n = 1 if op == "append" else rng.choice((2, 17, 300, 5000))
            distinct = [self.value(f) for _ in range(min(n, 8))]  # a few values, cycled: cheap to build
            size = sum(len(_bytes_of(v)) for v in distinct)
            n = max(1, min(n, self.grow * len(distinct) // max(1, size)))
            items.extend(distinct[i % len(distinct)] for i in range(n))
            return f"{path}: +{n} values"
        if f.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            op = rng.choice(("clear", "empty", "recurse", "recurse"))
            if op == "clear":
                m.ClearField(f.name)
                return f"{path}: cleared"
            sub = getattr(m, f.name)
            if op == "empty":
                sub.Clear()
                sub.SetInParent()
                return f"{path}: empty message"
            sub.SetInParent()
            log = []
            self._mutate_in(sub, path, depth + 1, log)
            return "; ".join(log)
        v = self.value(f, getattr(m, f.name))
        setattr(m, f.name, v)
        return f"{path} = {_short(v)}"

    # -- raw bytes

    def raw(self, data: bytes, string_fields: Sequence[int] = ()) -> tuple[bytes, str]:
        """A raw mutation of serialized bytes; ``string_fields``: numbers of the top-level string
        fields (for invalid UTF-8)."""
        rng = self.rng
        b = bytearray(data)
        op = rng.choice(
            (
                "flip",
                "flip",
                "overwrite",
                "truncate",
                "truncate",
                "insert",
                "delete",
                "duplicate",
                "unknown_field",
                "wire_type",
                "overlong_varint",
                "bad_utf8",
                "nesting",
                "random",
            )
        )
        if op in ("flip", "overwrite", "truncate", "delete", "duplicate") and not b:
            op = "random"
        if op == "flip":
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == "overwrite":
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.choice((0x00, 0xFF, 0x80, 0x7F, rng.randrange(256)))
        elif op == "truncate":
            del b[rng.randrange(len(b)) :]
        elif op == "insert":
            at = rng.randint(0, len(b))
            b[at:at] = rng.randbytes(rng.randint(1, 16))
        elif op == "delete":
            at = rng.randrange(len(b))
            del b[at : at + rng.randint(1, 8)]
        elif op == "duplicate":
            at = rng.randrange(len(b))
            seg = b[at : at + rng.randint(1, 64)]
            b[at:at] = seg
        elif op == "unknown_field":
            num = rng.choice((15, 99, 1000, 536870911))
            wt = rng.choice((0, 1, 2, 5))
            payload = {
                0: _varint(rng.getrandbits(64)),
                1: rng.randbytes(8),
                2: _varint(5) + rng.randbytes(5),
                5: rng.randbytes(4),
            }[wt]
            b += _varint(num << 3 | wt) + payload
        elif op == "wire_type":
            num = rng.randint(1, 9)
            wt = rng.choice((0, 1, 2, 5, 3, 4, 6, 7))
            b += _varint(num << 3 | wt) + rng.randbytes(rng.randint(0, 9))
        elif op == "overlong_varint":
            num = rng.randint(1, 9)
            b += _varint(num << 3) + b"\xff" * rng.randint(10, 12) + b"\x01"
        elif op == "bad_utf8":
            num = rng.choice(list(string_fields) or [1])
            bad = rng.choice((b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"a\xe2\x82"))
            b += _varint(num << 3 | 2) + _varint(len(bad)) + bad
        elif op == "nesting":
            # Start-group tags nested past any parser's depth limit (then maybe closed).
            depth = rng.choice((65, 101, 1000, 20000))
            b += b"\x7b" * depth  # field 15, wire type 3 (start group)
            if rng.random() < 0.5:
                b += b"\x7c" * depth
        else:
            b = bytearray(rng.randbytes(rng.randint(0, 256)))
        return bytes(b), f"raw {op}"

    def oversize(self, msg: Message, limit: int) -> tuple[bytes, str]:
        """``msg`` serialized with an unknown bytes field that makes it longer than ``limit``."""
        pad = limit + self.rng.randint(1, 64 << 10)
        return msg.SerializeToString() + _varint(1000 << 3 | 2) + _varint(pad) + b"\0" * pad, (
            f"oversize: +{pad} bytes"
        )


def _bytes_of(v: object) -> bytes:
    """About the wire size of one repeated scalar value (at least one byte)."""
    if isinstance(v, bytes):
        return v or b"\0"
    if isinstance(v, str):
        return v.encode("utf-8", "replace") or b"\0"
    return b"\0" * 8


def _is_repeated(f: FieldDescriptor) -> bool:
    return bool(f.is_repeated)


def _is_map(f: FieldDescriptor) -> bool:
    return (
        _is_repeated(f)
        and f.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE
        and f.message_type.GetOptions().map_entry
    )


def _short(v: object) -> str:
    r = repr(v)
    return r if len(r) <= 60 else f"{r[:50]}...({len(r)} chars)"


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def string_field_numbers(cls: type[Message]) -> list[int]:
    return [f.number for f in cls.DESCRIPTOR.fields if f.type == FieldDescriptor.TYPE_STRING]


# ---- the oracle ------------------------------------------------------------------------------


@dataclass
class Finding:
    where: str
    method: str
    code: str
    details: str
    request: bytes
    how: str

    def __str__(self) -> str:
        req = self.request[:96].hex() + ("..." if len(self.request) > 96 else "")
        return (
            f"{self.where} {self.method}: {self.code}: {self.details[:300]!r}\n"
            f"    made by: {self.how[:300]}\n    request ({len(self.request)} bytes): {req}"
        )


class Oracle:
    """Counts answers per (method, code) and keeps every answer that breaks the contract."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.codes: Counter[tuple[str, str]] = Counter()
        self.findings: list[Finding] = []
        self.messages = 0
        self.seconds: Counter[str] = Counter()
        """Wall time per method (the client's view: building, sending, answer)."""
        self.skipped = 0
        """Requests not sent because they would hit a known, reported bug (see the xfail tests)."""
        self.t0 = time.perf_counter()

    def check(
        self,
        where: str,
        method: str,
        code: grpc.StatusCode | None,
        details: str,
        request: bytes,
        how: str,
        *,
        allowed: Iterable[grpc.StatusCode] = (),
        count: int = 1,
    ) -> bool:
        """Record one answer; False (and a finding) when it breaks the contract. ``code`` None:
        a status the wire cannot name."""
        self.messages += count
        name = code.name if code is not None else "NO_SUCH_CODE"
        self.codes[(method, name)] += 1
        ok_codes = GRPC_ALLOWED | frozenset(allowed)
        problem = ""
        if code is None or code not in ok_codes:
            problem = name
        elif code is not grpc.StatusCode.OK and not details.strip():
            problem = f"{name} with an empty message"
        if problem:
            self.findings.append(Finding(where, method, problem, details, request, how))
            return False
        return True

    def fail(self, where: str, method: str, what: str, request: bytes, how: str) -> None:
        """A contract breach that is not a status: a hang, a crash, a wrong answer to a valid call."""
        self.findings.append(Finding(where, method, what, "", request, how))

    @property
    def rate(self) -> float:
        return self.messages / max(1e-9, time.perf_counter() - self.t0)

    def summary(self) -> str:
        by_code: Counter[str] = Counter()
        for (_, c), n in self.codes.items():
            by_code[c] += n
        return (
            f"[fuzz {self.service}] {self.messages} messages in {time.perf_counter() - self.t0:.1f} s "
            f"({self.rate:.0f}/s); codes {dict(sorted(by_code.items()))}"
            + (f"; {self.skipped} not sent (known bugs)" if self.skipped else "")
            + (
                "; seconds by method " + str({m: round(s, 1) for m, s in self.seconds.most_common()})
                if self.seconds
                else ""
            )
        )

    def assert_clean(self) -> None:
        print(self.summary())
        if self.findings:
            kinds = Counter((f.method, f.code.split(" ")[0]) for f in self.findings)
            shown = "\n".join(str(f) for f in self.findings[:5])
            raise AssertionError(
                f"{self.service}: {len(self.findings)} answers broke the contract "
                f"(OK or a named client-facing status with a message; no crash or hang): "
                f"{dict(kinds)}\nfirst ones:\n{shown}"
            )


# ---- generic gRPC calls ----------------------------------------------------------------------


def _identity(b: bytes) -> bytes:
    return b


class RawCaller:
    """Calls any method of a channel with bytes in, bytes out (no client-side (de)serialization),
    so a malformed request reaches the server as sent."""

    def __init__(self, channel: grpc.Channel, service: str, timeout_s: float = 15.0) -> None:
        self.channel, self.service, self.timeout_s = channel, service, timeout_s

    def unary(self, method: str, data: bytes) -> tuple[grpc.StatusCode, str, list[bytes]]:
        call = self.channel.unary_unary(
            f"/{self.service}/{method}", request_serializer=_identity, response_deserializer=_identity
        )
        try:
            return grpc.StatusCode.OK, "", [call(data, timeout=self.timeout_s)]
        except grpc.RpcError as e:
            return e.code(), e.details() or "", []

    def unary_stream(
        self,
        method: str,
        data: bytes,
        max_responses: int = 64,
        stop: Callable[[bytes], bool] | None = None,
    ) -> tuple[grpc.StatusCode, str, list[bytes]]:
        """Reads at most ``max_responses`` (or until ``stop(response)``) and then cancels (what a
        client may always do): the status is that of the part read."""
        call = self.channel.unary_stream(
            f"/{self.service}/{method}", request_serializer=_identity, response_deserializer=_identity
        )
        it = call(data, timeout=self.timeout_s)
        got: list[bytes] = []
        try:
            for r in it:
                got.append(r)
                if len(got) >= max_responses or (stop is not None and stop(r)):
                    it.cancel()
                    return grpc.StatusCode.OK, "", got
            return grpc.StatusCode.OK, "", got
        except grpc.RpcError as e:
            return e.code(), e.details() or "", got

    def stream_stream(
        self, method: str, messages: Sequence[bytes], pause_s: float = 0.0
    ) -> tuple[grpc.StatusCode, str, list[bytes]]:
        call = self.channel.stream_stream(
            f"/{self.service}/{method}", request_serializer=_identity, response_deserializer=_identity
        )

        def requests() -> Iterable[bytes]:
            for m in messages:
                yield m
                if pause_s:
                    time.sleep(pause_s)

        got: list[bytes] = []
        try:
            for r in call(iter(requests()), timeout=self.timeout_s):
                got.append(r)
            return grpc.StatusCode.OK, "", got
        except grpc.RpcError as e:
            return e.code(), e.details() or "", got


# ---- processes -------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (``VmRSS`` of /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def log_tail(path: str | os.PathLike[str], n: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


class Liveness:
    """Runs ``check`` every :data:`LIVENESS_EVERY` messages; ``check`` raises AssertionError when
    the service no longer answers a valid request correctly."""

    def __init__(self, check: Callable[[], None], every: int = LIVENESS_EVERY) -> None:
        self.check, self.every, self.next, self.runs = check, every, every, 0

    def tick(self, messages: int) -> None:
        if messages >= self.next:
            self.next = messages + self.every
            self.runs += 1
            self.check()


def pack_u32(n: int) -> bytes:
    return struct.pack(">I", n & 0xFFFFFFFF)
