"""Redis/Valkey backend of :class:`~kvgrid.controller.index.ChunkIndex`: controller replicas share it.

Layout (every name starts with the configured prefix ``P``, default ``kvg:``)::

    P c:<key16>        HASH slot -> tier bits (1 = L1, 2 = GPU, 4 = L2)     one per chunk with holders
    P s:<key16>        HASH slot -> expiry (unix ms)                 speculative entries, PEXPIRE'd
    P sp:<slot>        SET of key16: a holder's speculative keys     PEXPIRE'd; expiries only extend
    P h:<slot>:<tier>  SET of key16                                  a holder's keys per tier
    P slots            HASH holder -> slot;  P owner  HASH slot -> holder;  P slotmap  bitmap
    P entries, P chunks counters
    P gen              STRING: the data generation, a random token written when missing

Every write is one Lua script (atomic for readers and for other replicas: a replace is a single
diff against the holder's set). A lookup is one pipelined round trip: ``HGETALL`` of each chunk's
hash and speculative hash plus the slot-owner table; the prefix walk happens client-side in
:mod:`kvgrid.controller.matching`, the same code the in-memory backend uses.

Outages and data loss: while the server cannot be reached every method raises
:class:`~kvgrid.common.errors.Unavailable` naming the URL (callers get UNAVAILABLE, never INTERNAL).
``P gen`` tells a server that lost its data (restarted empty, flushed) from one that did not: it is
written when missing, so :meth:`RedisIndex.data_generation` returns a new token after a loss and
the controller (every replica) rebuilds the index from the agents' snapshots.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable, Sequence
from typing import Any

import redis

from kvgrid.controller.index.base import ChunkIndex, IndexTier, PrefixView, check_keys
from kvgrid.controller.redis_common import reachable

__all__ = ["RedisIndex"]

_SLOT_FN = """
local P = ARGV[1]
local function slot_of(holder, create)
  local s = redis.call('HGET', P .. 'slots', holder)
  if s or not create then return s end
  local n = redis.call('BITPOS', P .. 'slotmap', 0)
  redis.call('SETBIT', P .. 'slotmap', n, 1)
  s = tostring(n)
  redis.call('HSET', P .. 'slots', holder, s)
  redis.call('HSET', P .. 'owner', s, holder)
  return s
end
local function setbits(slot, bitv, key)
  local c = P .. 'c:' .. key
  local v = tonumber(redis.call('HGET', c, slot) or '0')
  if v == 0 and redis.call('EXISTS', c) == 0 then redis.call('INCR', P .. 'chunks') end
  redis.call('HSET', c, slot, bit.bor(v, bitv))
end
local function clearbits(slot, bitv, key)
  local c = P .. 'c:' .. key
  local v = bit.band(tonumber(redis.call('HGET', c, slot) or '0'), bit.bnot(bitv))
  if v == 0 then
    redis.call('HDEL', c, slot)
    if redis.call('EXISTS', c) == 0 then redis.call('DECR', P .. 'chunks') end
  else
    redis.call('HSET', c, slot, v)
  end
end
"""

# ARGV: prefix, holder, tier(0|1|2), key...
_ADD = (
    _SLOT_FN
    + """
local slot = slot_of(ARGV[2], true)
local tier = tonumber(ARGV[3])
local set = P .. 'h:' .. slot .. ':' .. tier
local added = 0
for i = 4, #ARGV do
  if redis.call('SADD', set, ARGV[i]) == 1 then
    setbits(slot, bit.lshift(1, tier), ARGV[i])
    added = added + 1
  end
end
redis.call('INCRBY', P .. 'entries', added)
return added
"""
)

_REMOVE = (
    _SLOT_FN
    + """
local slot = slot_of(ARGV[2], false)
if not slot then return 0 end
local tier = tonumber(ARGV[3])
local set = P .. 'h:' .. slot .. ':' .. tier
local removed = 0
for i = 4, #ARGV do
  if redis.call('SREM', set, ARGV[i]) == 1 then
    clearbits(slot, bit.lshift(1, tier), ARGV[i])
    removed = removed + 1
  end
end
redis.call('INCRBY', P .. 'entries', -removed)
return removed
"""
)

_REPLACE = (
    _SLOT_FN
    + """
local slot = slot_of(ARGV[2], true)
local tier = tonumber(ARGV[3])
local bitv = bit.lshift(1, tier)
local set = P .. 'h:' .. slot .. ':' .. tier
local new = {}
for i = 4, #ARGV do new[ARGV[i]] = true end
local delta = 0
for _, k in ipairs(redis.call('SMEMBERS', set)) do
  if new[k] then
    new[k] = false
  else
    redis.call('SREM', set, k)
    clearbits(slot, bitv, k)
    delta = delta - 1
  end
end
for i = 4, #ARGV do
  local k = ARGV[i]
  if new[k] then
    new[k] = false
    redis.call('SADD', set, k)
    setbits(slot, bitv, k)
    delta = delta + 1
  end
end
redis.call('INCRBY', P .. 'entries', delta)
return delta
"""
)

_DROP = (
    _SLOT_FN
    + """
local slot = slot_of(ARGV[2], false)
if not slot then return 0 end
local removed = 0
for tier = 0, 2 do
  local set = P .. 'h:' .. slot .. ':' .. tier
  for _, k in ipairs(redis.call('SMEMBERS', set)) do
    clearbits(slot, bit.lshift(1, tier), k)
    removed = removed + 1
  end
  redis.call('DEL', set)
end
local sp = P .. 'sp:' .. slot
for _, k in ipairs(redis.call('SMEMBERS', sp)) do redis.call('HDEL', P .. 's:' .. k, slot) end
redis.call('DEL', sp)
redis.call('INCRBY', P .. 'entries', -removed)
redis.call('HDEL', P .. 'slots', ARGV[2])
redis.call('HDEL', P .. 'owner', slot)
redis.call('SETBIT', P .. 'slotmap', tonumber(slot), 0)
return removed
"""
)

# ARGV: prefix, holder, expiry_ms, ttl_ms, key...
# The hashes' and the set's expiries only extend (PTTL -1: just created): a later, shorter TTL must
# not cut another entry of the same hash (a field's own deadline is checked at lookup) nor expire
# the set before keys it lists (the drop finds the holder's fields through it).
_SPECULATE = (
    _SLOT_FN
    + """
local slot = slot_of(ARGV[2], true)
local sp = P .. 'sp:' .. slot
local ttl = tonumber(ARGV[4])
local function extend(k)
  if redis.call('PTTL', k) < ttl then redis.call('PEXPIRE', k, ttl) end
end
for i = 5, #ARGV do
  local s = P .. 's:' .. ARGV[i]
  redis.call('HSET', s, slot, ARGV[3])
  extend(s)
  redis.call('SADD', sp, ARGV[i])
end
extend(sp)
return 0
"""
)


_reachable = reachable("index backend", "Redis/Valkey")


class RedisIndex(ChunkIndex):
    """Chunk index in Redis/Valkey (see the module docstring for the layout)."""

    backend = "redis"

    @property
    def shared(self) -> bool:
        return True

    def __init__(self, url: str, *, prefix: str = "kvg:", client: redis.Redis | None = None) -> None:
        if not prefix:
            raise ValueError("prefix='': expected a non-empty key prefix such as 'kvg:'")
        self.url = url
        self.prefix = prefix
        self._r = client if client is not None else redis.Redis.from_url(url, socket_connect_timeout=2.0)
        self._r.ping()
        self._pb = prefix.encode()
        self._add = self._r.register_script(_ADD)
        self._remove = self._r.register_script(_REMOVE)
        self._replace = self._r.register_script(_REPLACE)
        self._drop = self._r.register_script(_DROP)
        self._speculate = self._r.register_script(_SPECULATE)
        self.data_generation()

    def _run(self, script: Any, *args: Any) -> int:
        return int(script(keys=[], args=[self.prefix, *args]))

    @_reachable
    def add(self, holder: str, tier: IndexTier, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        if keys:
            self._run(self._add, holder, int(tier), *keys)

    @_reachable
    def remove(self, holder: str, tier: IndexTier, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        if keys:
            self._run(self._remove, holder, int(tier), *keys)

    @_reachable
    def replace(self, holder: str, tier: IndexTier, keys: Iterable[bytes]) -> None:
        new = list(set(keys))
        check_keys(new)
        self._run(self._replace, holder, int(tier), *new)

    @_reachable
    def drop_holder(self, holder: str) -> int:
        return self._run(self._drop, holder)

    @_reachable
    def add_speculative(self, holder: str, keys: Sequence[bytes], ttl_ms: int) -> None:
        check_keys(keys)
        if keys:
            expiry = int(time.time() * 1000) + ttl_ms
            self._run(self._speculate, holder, expiry, max(1, ttl_ms), *keys)

    @_reachable
    def lookup(self, keys: Sequence[bytes]) -> PrefixView:
        pipe = self._r.pipeline(transaction=False)
        c, s = self._pb + b"c:", self._pb + b"s:"
        for k in keys:
            pipe.hgetall(c + k)
            pipe.hgetall(s + k)
        pipe.hgetall(self._pb + b"owner")
        out = pipe.execute()
        # A slot without owner was dropped between commands: its bits count for nobody (a chunk
        # held only there ends the prefix, as one nobody holds).
        owners: dict[int, bytes] = {int(slot_b): holder_b for slot_b, holder_b in out[-1].items()}
        live = 0
        for slot in owners:
            live |= 1 << slot
        now_ms = time.time() * 1000
        l1: list[int] = []
        gpu: list[int] = []
        l2: list[int] = []
        union = 0
        for i in range(len(keys)):
            entry: dict[bytes, bytes] = out[2 * i]
            spec: dict[bytes, bytes] = out[2 * i + 1]
            a = g = d = 0
            for slot_b, bits_b in entry.items():
                bits = int(bits_b)
                b = 1 << int(slot_b)
                if bits & 1:
                    a |= b
                if bits & 2:
                    g |= b
                if bits & 4:
                    d |= b
            for slot_b, exp_b in spec.items():
                if float(exp_b) > now_ms:
                    g |= 1 << int(slot_b)
            a, g, d = a & live, g & live, d & live
            if not a and not g and not d:
                break
            l1.append(a)
            gpu.append(g)
            l2.append(d)
            union |= a | g | d
        slots = {slot: holder.decode() for slot, holder in owners.items() if union >> slot & 1}
        return PrefixView(l1=l1, gpu=gpu, slots=slots, l2=l2 if any(l2) else None)

    def _slot(self, holder: str) -> str | None:
        s = self._r.hget(self._pb + b"slots", holder)
        return None if s is None else s.decode()

    @_reachable
    def holder_keys(self, holder: str, tier: IndexTier) -> set[bytes]:
        slot = self._slot(holder)
        if slot is None:
            return set()
        return set(self._r.smembers(self._pb + f"h:{slot}:{int(tier)}".encode()))

    @_reachable
    def holder_entries(self, holder: str) -> int:
        slot = self._slot(holder)
        if slot is None:
            return 0
        pipe = self._r.pipeline(transaction=False)
        for tier in IndexTier:
            pipe.scard(self._pb + f"h:{slot}:{int(tier)}".encode())
        return int(sum(pipe.execute()))

    @_reachable
    def holder_tier_entries(self, holder: str, tier: IndexTier) -> int:
        slot = self._slot(holder)
        if slot is None:
            return 0
        return int(self._r.scard(self._pb + f"h:{slot}:{int(tier)}".encode()))

    @_reachable
    def data_generation(self) -> str:
        key = self._pb + b"gen"
        gen = self._r.get(key)
        if gen is None:  # a new server, or one that lost its data: start a new generation
            self._r.set(key, secrets.token_hex(8), nx=True)  # another replica may have been first
            gen = self._r.get(key)
        return bytes(gen or b"").decode()

    @_reachable
    def holders(self) -> list[str]:
        return [h.decode() for h in self._r.hkeys(self._pb + b"slots")]

    @_reachable
    def num_entries(self) -> int:
        return int(self._r.get(self._pb + b"entries") or 0)

    @_reachable
    def num_chunks(self) -> int:
        return int(self._r.get(self._pb + b"chunks") or 0)

    @_reachable
    def flush(self) -> None:
        """Delete every key under the prefix (tests, benchmarks)."""
        batch = list(self._r.scan_iter(match=self._pb + b"*", count=10_000))
        for i in range(0, len(batch), 10_000):
            self._r.delete(*batch[i : i + 10_000])

    def close(self) -> None:
        self._r.close()
