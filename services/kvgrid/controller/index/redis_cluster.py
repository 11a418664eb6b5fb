"""Valkey/Redis Cluster backend of :class:`~kvgrid.controller.index.ChunkIndex` (``redis_cluster``):
the chunk keys hashed across the cluster's shards, controller replicas sharing it.

Layout (every name starts with the configured prefix ``P``; ``{..}`` is the cluster hash tag;
``R`` = :func:`~kvgrid.controller.redis_common.registry_keys`, the agent registry's slot)::

    P c:{b}<key16>     HASH hid -> tier bits (1 = L1, 2 = GPU, 4 = L2)    b = bucket_of(key), 0..1023
    P n:{b}            counter: chunk hashes of bucket b (lost with them: stays exact)
    P s:<key16>        HASH hid -> expiry (unix ms), PEXPIRE'd    speculative, spread over shards
                       (it and P sp:{hid}: expiries only extend; lookups check each field's own)
    P h:{hid}:<tier>   SET of key16: a holder's keys per tier     P sp:{hid}  its speculative keys
    R islots  HASH holder -> "<slot>:<hid>"    R iowner  HASH slot -> hid + holder    R imap  bitmap
    R igen    STRING: the generation token of the holder table's shard

A holder's *hid* (16 hex digits) is drawn at random when it gets its slot, so a chunk hash names its
holders without the slot table and a holder dropped and added again (or a table lost and rebuilt)
never inherits the old incarnation's fields: a lookup keeps only the hids the owner table, read in
the same round trip, maps to a slot; fields of dropped hids are ignored (and wiped by the drop).

Invariants:

- Batch writes are grouped per cluster slot: one ``EVALSHA`` per bucket with every chunk hash of
  the batch in that bucket (atomic read-modify-write of the tier bits and that slot's chunk counter),
  sent as one pipeline per shard. A write is not atomic across shards: a concurrent lookup may see
  part of a batch (as it may see the batch before or after).
- The writes of one holder come from one replica at a time (the one serving its stream; a
  per-holder lock serialises this replica's threads), so the holder's key sets and the tier bits
  it owns in chunk hashes change in step. A drop takes the holder out of the table first, in one
  script that also checks the registry (same slot): a replica whose stale view drops a holder the
  registry holds again (re-registered after the registry's shard lost its data) changes nothing.
- Loss: a primary that restarts empty, a failover (asynchronous replication may lose the last
  writes) or a flush of the holder table's shard changes :meth:`RedisClusterIndex.data_generation`
  (primaries' node ids and run ids + the table shard's token); the controller then resyncs every
  agent. A resync's :meth:`replace` rewrites the bits of every key it is given (not only the diff
  against the holder's set, which may have survived while chunk hashes were lost). Resharding
  (MIGRATE) moves keys with their slot and changes no generation; the client follows MOVED/ASK.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, cast

import msgspec
import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from kvgrid.controller.index.base import ChunkIndex, IndexTier, PrefixView, check_keys
from kvgrid.controller.redis_common import epoch19, reachable, registry_keys

__all__ = ["CHUNK_BUCKETS", "RedisClusterIndex", "bucket_of"]

CHUNK_BUCKETS = 1024
"""Chunk hashes carry one of this many hash tags (from the key's first two bytes): enough to
spread them over ~100 shards, few enough that a batch shares cluster slots and that the
per-bucket chunk counters are one short pipeline to read."""

# KEYS: the slot's chunk counter, then chunk hashes of that cluster slot. ARGV: hid, op, bitv.
# op 'set' ORs bitv into hid's field, 'clear' clears it (deleting the field, and the hash when empty).
_BITS = """
local hid, op, bitv = ARGV[1], ARGV[2], tonumber(ARGV[3])
local delta = 0
for i = 2, #KEYS do
  local c = KEYS[i]
  local v = tonumber(redis.call('HGET', c, hid) or '0')
  if op == 'set' then
    if bit.band(v, bitv) == 0 then
      if redis.call('EXISTS', c) == 0 then delta = delta + 1 end
      redis.call('HSET', c, hid, bit.bor(v, bitv))
    end
  elseif bit.band(v, bitv) ~= 0 then
    v = bit.band(v, bit.bnot(bitv))
    if v == 0 then
      redis.call('HDEL', c, hid)
      if redis.call('EXISTS', c) == 0 then delta = delta - 1 end
    else
      redis.call('HSET', c, hid, v)
    end
  end
end
if delta ~= 0 then redis.call('INCRBY', KEYS[1], delta) end
return delta
"""

# KEYS: any one key on the shard (routing only). ARGV: hash names, all on this shard, of any
# slots -> msgpack list of each hash's flat field/value list. Reads only: a key of a slot being
# migrated away reads as missing (a lookup may miss it for that moment, never writes it).
_HGETALL_MANY = """#!lua flags=allow-cross-slot-keys,no-writes
local out = {}
for i = 1, #ARGV do out[i] = redis.call('HGETALL', ARGV[i]) end
return cmsgpack.pack(out)
"""

# KEYS: the holder's set of one tier. ARGV: key... -> the keys that were not members (now added).
_SADD_NEW = """
local new = {}
for i = 1, #ARGV do
  if redis.call('SADD', KEYS[1], ARGV[i]) == 1 then table.insert(new, ARGV[i]) end
end
return new
"""

# KEYS: the holder's set of one tier. ARGV: key... -> the keys that were members (now removed).
_SREM_OLD = """
local old = {}
for i = 1, #ARGV do
  if redis.call('SREM', KEYS[1], ARGV[i]) == 1 then table.insert(old, ARGV[i]) end
end
return old
"""

# KEYS: the holder's set of one tier. ARGV: the new key set -> the members not in it (now removed).
_REPLACE_SET = """
local new = {}
for i = 1, #ARGV do new[ARGV[i]] = true end
local gone = {}
for _, k in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if not new[k] then
    redis.call('SREM', KEYS[1], k)
    table.insert(gone, k)
  end
end
for i = 1, #ARGV do redis.call('SADD', KEYS[1], ARGV[i]) end
return gone
"""

# KEYS: speculative hashes of one cluster slot, or the holder's set sp:{hid}. ARGV: ttl_ms, then
# 'h', hid, expiry_ms (set hid's field of each hash) or 's', key... (add the keys to the set).
# Expiries only extend (PTTL -1: just created): a later, shorter TTL must not cut another entry of
# the same hash (a field's own deadline is checked at lookup) nor expire the set before keys it
# lists (the drop finds the holder's fields through it).
_SPECULATE = """
local ttl = tonumber(ARGV[1])
for i = 1, #KEYS do
  if ARGV[2] == 'h' then
    redis.call('HSET', KEYS[i], ARGV[3], ARGV[4])
  else
    for j = 3, #ARGV do redis.call('SADD', KEYS[i], ARGV[j]) end
  end
  if redis.call('PTTL', KEYS[i]) < ttl then redis.call('PEXPIRE', KEYS[i], ttl) end
end
return 0
"""

# KEYS: R islots, R iowner, R imap. ARGV: holder, a fresh hid, create (1|0) -> "<slot>:<hid>" or nil.
_HID_OF = """
local e = redis.call('HGET', KEYS[1], ARGV[1])
if e or ARGV[3] == '0' then return e end
local n = redis.call('BITPOS', KEYS[3], 0)
redis.call('SETBIT', KEYS[3], n, 1)
e = tostring(n) .. ':' .. ARGV[2]
redis.call('HSET', KEYS[1], ARGV[1], e)
redis.call('HSET', KEYS[2], tostring(n), ARGV[2] .. ARGV[1])
return e
"""

# KEYS: R islots, R iowner, R imap, R epoch. ARGV: holder, pod uid, epoch19 ('' unknown)
# -> {'alive'} when the registry holds that incarnation again (nothing dropped), else {'gone', hid}.
_DROP_ENTRY = """
if ARGV[3] ~= '' and redis.call('HGET', KEYS[4], ARGV[2]) == ARGV[3] then return {'alive'} end
local e = redis.call('HGET', KEYS[1], ARGV[1])
if not e then return {'gone', ''} end
local slot, hid = string.match(e, '^(%d+):(.*)$')
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], slot)
redis.call('SETBIT', KEYS[3], tonumber(slot), 0)
return {'gone', hid}
"""


HID_LEN = 16
"""A hid is 16 hex digits, random per slot assignment (see the module docstring)."""


def bucket_of(key: bytes) -> int:
    """The hash-tag bucket of a chunk key (its first two bytes: chunk keys are uniform hashes)."""
    return (key[0] << 8 | key[1]) % CHUNK_BUCKETS


_reachable = reachable("index backend", "Valkey/Redis Cluster")


class RedisClusterIndex(ChunkIndex):
    """Chunk index sharded over a Valkey/Redis Cluster (see the module docstring)."""

    backend = "redis-cluster"

    @property
    def shared(self) -> bool:
        return True

    def __init__(self, url: str, *, prefix: str = "kvg:", client: RedisCluster | None = None) -> None:
        if not prefix:
            raise ValueError("prefix='': expected a non-empty key prefix such as 'kvg:'")
        self.url = url
        self.prefix = prefix
        # Any: types-redis lacks RedisCluster's script methods, which redis-py has.
        if client is None:
            client = RedisCluster.from_url(url, socket_connect_timeout=2.0)
        self._r = cast(Any, client)
        self._pb = prefix.encode()
        r = registry_keys(prefix).encode()  # the holder table shares the registry's slot
        self._table = [r + b"islots", r + b"iowner", r + b"imap"]
        self._epochs = r + b"epoch"
        self._gen_key = r + b"igen"
        self._bits = self._r.register_script(_BITS)
        self._sadd_new = self._r.register_script(_SADD_NEW)
        self._srem_old = self._r.register_script(_SREM_OLD)
        self._replace_set = self._r.register_script(_REPLACE_SET)
        self._read = self._r.register_script(_HGETALL_MANY)
        self._hid_of = self._r.register_script(_HID_OF)
        self._drop_entry = self._r.register_script(_DROP_ENTRY)
        self._speculate = self._r.register_script(_SPECULATE)
        self._holder_locks: dict[str, threading.Lock] = defaultdict(threading.Lock)
        self._locks_lock = threading.Lock()
        self._loaded: set[str] = set()
        """SHA1s of scripts known loaded on every primary (pipelined EVALSHA cannot load them)."""
        self.data_generation()

    # --- key names ------------------------------------------------------------------------------
    def _chunk(self, key: bytes) -> bytes:
        return self._pb + b"c:{%d}" % bucket_of(key) + key

    def _spec(self, key: bytes) -> bytes:
        return self._pb + b"s:" + key

    def _set(self, hid: str, tier: IndexTier) -> bytes:
        return self._pb + b"h:{" + hid.encode() + b"}:%d" % int(tier)

    def _spec_set(self, hid: str) -> bytes:
        return self._pb + b"sp:{" + hid.encode() + b"}"

    def _counter(self, bucket: int) -> bytes:
        return self._pb + b"n:{%d}" % bucket

    def _lock(self, holder: str) -> threading.Lock:
        with self._locks_lock:
            return self._holder_locks[holder]

    # --- writes ---------------------------------------------------------------------------------
    def _hid(self, holder: str, *, create: bool) -> str | None:
        """The holder's current hid (a new slot and hid when ``create`` and it has none)."""
        e = self._hid_of(keys=self._table, args=[holder, secrets.token_hex(8), int(create)])
        return None if e is None else bytes(e).decode().partition(":")[2]

    def _write_bits(self, hid: str, ops: Sequence[tuple[str, int, Iterable[bytes]]]) -> None:
        """Apply ``(op, bitv, keys)`` to the chunk hashes: one EVALSHA per (op, cluster slot),
        pipelined per shard."""
        calls: list[list[bytes | str | int]] = []
        for op, bitv, keys in ops:
            groups: dict[int, list[bytes]] = defaultdict(list)
            for k in keys:
                groups[bucket_of(k)].append(self._chunk(k))
            for bucket, chunk_keys in groups.items():
                calls.append([len(chunk_keys) + 1, self._counter(bucket), *chunk_keys, hid, op, bitv])
        if calls:
            self._evalsha_pipelined(self._bits, calls)

    def _evalsha_pipelined(self, script: Any, calls: list[list[bytes | str | int]]) -> list[Any]:
        if script.sha not in self._loaded:
            self._r.script_load(script.script)  # on every primary (redis-py's cluster default)
            self._loaded.add(script.sha)
        for attempt in range(2):
            pipe = self._r.pipeline(transaction=False)
            for call in calls:
                pipe.execute_command("EVALSHA", script.sha, *call)
            try:
                return list(pipe.execute())
            except redis.exceptions.NoScriptError:
                if attempt:
                    raise
                self._r.script_load(script.script)  # a primary restarted or failed over: load again
        raise AssertionError("unreachable")

    @_reachable
    def add(self, holder: str, tier: IndexTier, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        if not keys:
            return
        with self._lock(holder):
            hid = self._hid(holder, create=True)
            assert hid is not None
            new = self._sadd_new(keys=[self._set(hid, tier)], args=list(keys))
            self._write_bits(hid, [("set", 1 << int(tier), new)])

    @_reachable
    def remove(self, holder: str, tier: IndexTier, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        if not keys:
            return
        with self._lock(holder):
            hid = self._hid(holder, create=False)
            if hid is None:
                return
            old = self._srem_old(keys=[self._set(hid, tier)], args=list(keys))
            self._write_bits(hid, [("clear", 1 << int(tier), old)])

    @_reachable
    def replace(self, holder: str, tier: IndexTier, keys: Iterable[bytes]) -> None:
        new = list(set(keys))
        check_keys(new)
        bitv = 1 << int(tier)
        with self._lock(holder):
            hid = self._hid(holder, create=True)
            assert hid is not None
            gone = self._replace_set(keys=[self._set(hid, tier)], args=new)
            # Every key's bits, not only the diff: after a shard's loss the holder's set may have
            # survived while chunk hashes of it did not (setting a set bit changes nothing).
            self._write_bits(hid, [("clear", bitv, gone), ("set", bitv, new)])

    @_reachable
    def drop_holder(self, holder: str) -> int:
        uid, _, epoch = holder.rpartition("/")
        with self._lock(holder):
            # First and atomically: out of the table, unless the registry holds this incarnation
            # again (a replica's stale view must not wipe a re-registered holder's resync). The
            # wipe below touches only the old hid: a new registration writes under a new one.
            status, *rest = self._drop_entry(
                keys=[*self._table, self._epochs],
                args=[holder, uid, epoch19(int(epoch)) if uid and epoch.isdigit() else ""],
            )
            hid = bytes(rest[0]).decode() if rest else ""
            if bytes(status) == b"alive" or not hid:
                return 0
            pipe = self._r.pipeline(transaction=False)
            for tier in IndexTier:
                pipe.smembers(self._set(hid, tier))
            pipe.smembers(self._spec_set(hid))
            *tiers, spec = pipe.execute()
            self._write_bits(hid, [("clear", 1 << int(t), tiers[int(t)]) for t in IndexTier])
            pipe = self._r.pipeline(transaction=False)
            for k in spec:
                pipe.hdel(self._spec(k), hid)
            for tier in IndexTier:
                pipe.delete(self._set(hid, tier))
            pipe.delete(self._spec_set(hid))
            pipe.execute()
        with self._locks_lock:
            self._holder_locks.pop(holder, None)
        return sum(len(t) for t in tiers)

    @_reachable
    def add_speculative(self, holder: str, keys: Sequence[bytes], ttl_ms: int) -> None:
        check_keys(keys)
        if not keys:
            return
        expiry, ttl = int(time.time() * 1000) + ttl_ms, max(1, ttl_ms)
        hid = self._hid(holder, create=True)
        assert hid is not None
        groups: dict[int, list[bytes]] = defaultdict(list)
        for k in keys:
            s = self._spec(k)
            groups[key_slot(s)].append(s)
        calls: list[list[bytes | str | int]] = [[len(g), *g, ttl, "h", hid, expiry] for g in groups.values()]
        calls.append([1, self._spec_set(hid), ttl, "s", *keys])
        self._evalsha_pipelined(self._speculate, calls)

    # --- reads ----------------------------------------------------------------------------------
    @_reachable
    def lookup(self, keys: Sequence[bytes]) -> PrefixView:
        names = [n for k in keys for n in (self._chunk(k), self._spec(k))]
        names.append(self._table[1])
        out = self._hgetall_per_shard(names)
        if out is None:  # the slot map moved (resharding, failover): the client follows redirects
            pipe = self._r.pipeline(transaction=False)
            for n in names:
                pipe.hgetall(n)
            out = [{_s(f): _s(v) for f, v in h.items()} for h in pipe.execute()]
        owners = out[-1]
        slot_of = {entry[:HID_LEN]: int(slot_s) for slot_s, entry in owners.items()}
        now_ms = time.time() * 1000
        l1: list[int] = []
        gpu: list[int] = []
        l2: list[int] = []
        union = 0
        for i in range(len(keys)):
            a = g = d = 0
            for hid, bits_s in out[2 * i].items():
                slot = slot_of.get(hid)
                if slot is None:  # its holder was dropped between commands (or is being dropped)
                    continue
                bits = int(bits_s)
                if bits & 1:
                    a |= 1 << slot
                if bits & 2:
                    g |= 1 << slot
                if bits & 4:
                    d |= 1 << slot
            for hid, exp_s in out[2 * i + 1].items():
                slot = slot_of.get(hid)
                if slot is not None and float(exp_s) > now_ms:
                    g |= 1 << slot
            if not a and not g and not d:
                break
            l1.append(a)
            gpu.append(g)
            l2.append(d)
            union |= a | g | d
        slots = {}
        for slot_s, entry in owners.items():
            slot = int(slot_s)
            if union >> slot & 1:
                slots[slot] = entry[HID_LEN:]
        return PrefixView(l1=l1, gpu=gpu, slots=slots, l2=l2 if any(l2) else None)

    def _hgetall_per_shard(self, names: list[bytes]) -> list[dict[str, str]] | None:
        """HGETALL of every name: one script call per shard (redis-py's cluster pipeline costs
        ~0.15 ms of client CPU per command; this is one command per shard). None when a name is
        not on the shard the client's slot map says (the map is stale): the caller falls back."""
        slots_cache = self._r.nodes_manager.slots_cache
        by_node: dict[str, tuple[Any, list[int]]] = {}
        try:
            for i, n in enumerate(names):
                node = slots_cache[key_slot(n)][0]
                by_node.setdefault(node.name, (node, []))[1].append(i)
        except (KeyError, IndexError):
            return None
        out: list[dict[str, str]] = [{}] * len(names)
        for node, idxs in by_node.values():
            args = [names[i] for i in idxs]
            conn = self._r.get_redis_connection(node)
            try:
                raw = conn.evalsha(self._read.sha, 1, args[0], *args)
            except redis.exceptions.NoScriptError:
                raw = conn.eval(_HGETALL_MANY, 1, args[0], *args)
            except redis.ResponseError:  # not local any more (MOVED keys, a migrating slot)
                return None
            for i, flat in zip(idxs, msgspec.msgpack.decode(raw), strict=True):
                it = iter(flat)
                out[i] = dict(zip(it, it, strict=True))
        return out

    @_reachable
    def holder_keys(self, holder: str, tier: IndexTier) -> set[bytes]:
        hid = self._hid(holder, create=False)
        return set() if hid is None else set(self._r.smembers(self._set(hid, tier)))

    @_reachable
    def holder_entries(self, holder: str) -> int:
        return sum(self.holder_tier_entries(holder, tier) for tier in IndexTier)

    @_reachable
    def holder_tier_entries(self, holder: str, tier: IndexTier) -> int:
        hid = self._hid(holder, create=False)
        return 0 if hid is None else int(self._r.scard(self._set(hid, tier)))

    @_reachable
    def data_generation(self) -> str:
        gen = self._r.get(self._gen_key)
        if gen is None:  # a new cluster, or the table's shard lost its data
            self._r.set(self._gen_key, secrets.token_hex(8), nx=True)  # another replica may be first
            gen = self._r.get(self._gen_key)
        return f"{bytes(gen or b'').decode()}/{self._primaries_token()}"

    def _primaries_token(self) -> str:
        """The primaries (address and run id, sorted): changes when a primary restarts (maybe empty)
        or a replica takes over (maybe without the last writes), not when slots move."""
        self._r.nodes_manager.initialize()  # the current topology, not the last one redirected to
        runs = sorted(
            f"{node.name}:{self._r.get_redis_connection(node).info('server')['run_id']}"
            for node in self._r.get_primaries()
        )
        return hashlib.blake2b("|".join(runs).encode(), digest_size=8).hexdigest()

    @_reachable
    def holders(self) -> list[str]:
        return [h.decode() for h in self._r.hkeys(self._table[0])]

    @_reachable
    def num_entries(self) -> int:
        hids = [bytes(e).decode().partition(":")[2] for e in self._r.hvals(self._table[0])]
        pipe = self._r.pipeline(transaction=False)
        for hid in hids:
            for tier in IndexTier:
                pipe.scard(self._set(hid, tier))
        return int(sum(pipe.execute())) if hids else 0

    @_reachable
    def num_chunks(self) -> int:
        pipe = self._r.pipeline(transaction=False)
        for b in range(CHUNK_BUCKETS):
            pipe.get(self._counter(b))
        return sum(int(v) for v in pipe.execute() if v is not None)

    @_reachable
    def flush(self) -> None:
        """Delete every key under the prefix on every primary (tests, benchmarks)."""
        for node in self._r.get_primaries():
            conn = self._r.get_redis_connection(node)
            pipe = conn.pipeline(transaction=False)
            for k in conn.scan_iter(match=self._pb + b"*", count=10_000):
                pipe.delete(k)  # one key per DEL: keys of different slots cannot share one
            pipe.execute()

    def close(self) -> None:
        self._r.close()


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
