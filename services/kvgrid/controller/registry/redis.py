"""Redis/Valkey backend of :class:`~kvgrid.controller.registry.base.AgentRegistry`: one registry
for every controller replica (``index_backend=redis``, single server or ``redis_cluster``).

Layout (every name starts with ``R`` = ``<prefix>{<prefix>a}:``, default ``kvg:{kvg:a}:``: the
configured prefix, then one hash tag, so on a Valkey/Redis Cluster every record lives in one slot
and each script below touches that slot only; every script declares ``R ver`` to be routed there)::

    R epoch  HASH uid -> epoch, 19 digits zero-padded (string order = number order, all 63 bits)
    R pod    HASH uid -> PodIdentity (JSON)       R ns    HASH uid -> namespace ids (JSON list)
    R l1     HASH uid -> L1 capacity (bytes)      R since HASH uid -> registration time (server ms)
    R lease  HASH uid -> lease deadline (server ms, from the server's TIME)
    R load   HASH uid -> AgentLoad (JSON; absent until the first heartbeat with a load)
    R owner  HASH uid -> mTLS identity that registered the live pod
    R seq    HASH uid -> "<epoch19>:<sequence>": last event applied by the replica serving its stream
    R ver    counter, bumped by every change of the records but leases, loads and sequences
    R gen    STRING: random token written by the first snapshot that finds it missing (the records'
             data was lost: every replica re-reads them in full)

Invariants:

- Every write is one Lua script, so the ownership check, the epoch check and the write are atomic
  across replicas: two replicas cannot both accept different epochs, and a forged newer epoch from
  another identity is refused whichever replica it reaches. Lua rather than WATCH/MULTI: one round
  trip, no retry loop under contention (every agent heartbeats every few seconds), and lease
  deadlines come from the server's clock (``TIME`` inside the script), so replicas' clocks never
  disagree about who is alive.
- A lapsed lease is removed by whichever replica's sweep runs first (one script: it deletes the
  records and returns them; that replica drops their index entries); every other replica sees them
  gone at its next :meth:`RedisRegistry.sync` and fences them too.
- Each replica answers from a mirror of these hashes, refreshed by :meth:`RedisRegistry.sync`
  (the controller's sweeper, every ``sweep_interval_ms``) and by its own writes. A mirror record
  keeps its identity while its (uid, epoch) stays registered. ``synced`` is False until the first
  full sync: the replica is not ready before (:mod:`kvgrid.controller.readiness`).

While the server cannot be reached every method raises
:class:`~kvgrid.common.errors.Unavailable` naming the URL.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import msgspec
import redis
from redis.cluster import RedisCluster

from kvgrid.common.identity import PodIdentity
from kvgrid.controller.redis_common import epoch19, reachable, registry_keys
from kvgrid.controller.registry.base import (
    AgentLoad,
    AgentRecord,
    AgentRegistry,
    RegisterOutcome,
    SyncResult,
    UnknownPodError,
    check_namespace_ids,
    not_registered,
    owned_elsewhere,
    stale_epoch,
)

__all__ = ["RedisRegistry", "registry_keys"]


_NOW = """
local P = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function forget(uid)
  for _, f in ipairs({'epoch', 'pod', 'ns', 'l1', 'since', 'lease', 'load', 'owner', 'seq'}) do
    redis.call('HDEL', P .. f, uid)
  end
end
"""

# ARGV: P, uid, epoch19, pod_json, ttl_ms, owner ('' none), ns_json ('' none given), l1
_REGISTER = (
    _NOW
    + """
local uid, ep, ttl, owner, ns, l1 = ARGV[2], ARGV[3], tonumber(ARGV[5]), ARGV[6], ARGV[7], ARGV[8]
local cur_owner = redis.call('HGET', P .. 'owner', uid)
if owner ~= '' and cur_owner and cur_owner ~= owner then return {'denied', cur_owner} end
local old = redis.call('HGET', P .. 'epoch', uid)
if old and ep < old then return {'stale', old} end
local pod_changed = redis.call('HGET', P .. 'pod', uid) ~= ARGV[4]
redis.call('HSET', P .. 'pod', uid, ARGV[4])
redis.call('HSET', P .. 'lease', uid, now + ttl)
if owner ~= '' and not cur_owner then redis.call('HSET', P .. 'owner', uid, owner) end
if old and ep == old then
  local changed = pod_changed
  if ns ~= '' and redis.call('HGET', P .. 'ns', uid) ~= ns then
    redis.call('HSET', P .. 'ns', uid, ns)
    changed = true
  end
  if l1 ~= '0' and redis.call('HGET', P .. 'l1', uid) ~= l1 then
    redis.call('HSET', P .. 'l1', uid, l1)
    changed = true
  end
  if changed then redis.call('INCR', P .. 'ver') end
  return {'same', ''}
end
redis.call('INCR', P .. 'ver')
redis.call('HSET', P .. 'epoch', uid, ep)
redis.call('HSET', P .. 'ns', uid, ns == '' and '[]' or ns)
redis.call('HSET', P .. 'l1', uid, l1)
redis.call('HSET', P .. 'since', uid, now)
redis.call('HDEL', P .. 'load', uid)
return {'new', old or ''}
"""
)

# ARGV: P, uid, epoch19, ttl_ms, load_json ('' none)
_HEARTBEAT = (
    _NOW
    + """
local uid, ep = ARGV[2], ARGV[3]
local old = redis.call('HGET', P .. 'epoch', uid)
if not old or ep > old then return {'unknown', old or ''} end
if ep < old then return {'stale', old} end
redis.call('HSET', P .. 'lease', uid, now + tonumber(ARGV[4]))
if ARGV[5] ~= '' then redis.call('HSET', P .. 'load', uid, ARGV[5]) end
return {'ok', old}
"""
)

# ARGV: P, uid, epoch19, ns_json: set the namespaces of that incarnation (no-op for another epoch)
_NAMESPACES = """
local P, uid = ARGV[1], ARGV[2]
if redis.call('HGET', P .. 'epoch', uid) ~= ARGV[3] then return 0 end
redis.call('HSET', P .. 'ns', uid, ARGV[4])
redis.call('INCR', P .. 'ver')
return 1
"""

# ARGV: P, (uid, epoch19, sequence)...: only for the incarnation still registered
_SEQUENCES = """
local P = ARGV[1]
for i = 2, #ARGV, 3 do
  if redis.call('HGET', P .. 'epoch', ARGV[i]) == ARGV[i + 1] then
    redis.call('HSET', P .. 'seq', ARGV[i], ARGV[i + 1] .. ':' .. ARGV[i + 2])
  end
end
return 0
"""

# ARGV: P, uid, identity
_SET_OWNER = """
local P, uid = ARGV[1], ARGV[2]
if redis.call('HEXISTS', P .. 'epoch', uid) == 1 then redis.call('HSETNX', P .. 'owner', uid, ARGV[3]) end
return 0
"""

# ARGV: P -> flat list uid, epoch19, pod_json of every record removed
_EXPIRE = (
    _NOW
    + """
local gone = {}
local leases = redis.call('HGETALL', P .. 'lease')
for i = 1, #leases, 2 do
  if tonumber(leases[i + 1]) <= now then
    local uid = leases[i]
    table.insert(gone, uid)
    table.insert(gone, redis.call('HGET', P .. 'epoch', uid) or '')
    table.insert(gone, redis.call('HGET', P .. 'pod', uid) or '')
    forget(uid)
  end
end
if #gone > 0 then redis.call('INCR', P .. 'ver') end
return gone
"""
)

# ARGV: P, uid -> {epoch19, pod_json} removed, or {}
_REMOVE = (
    _NOW
    + """
local uid = ARGV[2]
local ep = redis.call('HGET', P .. 'epoch', uid)
if not ep then return {} end
local pod = redis.call('HGET', P .. 'pod', uid) or ''
forget(uid)
redis.call('INCR', P .. 'ver')
return {ep, pod}
"""
)

# ARGV: P, the (gen:ver) this replica last read in full, a new generation token -> msgpack
# [now_ms, gen:ver, lease, load, seq, and when gen:ver differs: epoch, pod, ns, l1, since]
# (hashes as flat field/value lists). One string to parse instead of thousands of RESP items:
# redis-py's parser is pure Python.
_SNAPSHOT = """
local P = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local gen = redis.call('GET', P .. 'gen')
if not gen then  -- new, or the data was lost: a new generation (ARGV[3], random from the client)
  gen = ARGV[3]
  redis.call('SET', P .. 'gen', gen)
end
local ver = gen .. ':' .. (redis.call('GET', P .. 'ver') or '0')
local out = {now, ver, redis.call('HGETALL', P .. 'lease'), redis.call('HGETALL', P .. 'load'),
  redis.call('HGETALL', P .. 'seq')}
if ver ~= ARGV[2] then
  for _, f in ipairs({'epoch', 'pod', 'ns', 'l1', 'since'}) do
    table.insert(out, redis.call('HGETALL', P .. f))
  end
end
return cmsgpack.pack(out)
"""

_reachable = reachable("agent registry", "Redis/Valkey")


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


class _Static(msgspec.Struct, frozen=True):
    epoch: int
    pod: PodIdentity
    namespaces: tuple[str, ...]
    l1_capacity_bytes: int
    since_ms: int


def _pairs(flat: list[Any]) -> dict[str, bytes]:
    it = iter(flat)
    return {_s(k): v if isinstance(v, bytes) else str(v).encode() for k, v in zip(it, it, strict=True)}


class RedisRegistry(AgentRegistry):
    """The agent registry in Redis/Valkey, shared by controller replicas (see the module docstring)."""

    def __init__(
        self,
        url: str,
        lease_ttl_ms: int,
        *,
        prefix: str = "kvg:",
        client: redis.Redis | RedisCluster | None = None,
        cluster: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not prefix:
            raise ValueError("prefix='': expected a non-empty key prefix such as 'kvg:'")
        self.url, self.prefix = url, prefix
        self.keys = registry_keys(prefix)
        """Every record name starts with this (one hash tag: one cluster slot for all of them)."""
        self.lease_s = lease_ttl_ms / 1000.0
        self._ttl_ms = lease_ttl_ms
        self._clock = clock
        # Any: types-redis lacks RedisCluster's script methods, which redis-py has.
        if client is None:
            client = (RedisCluster if cluster else redis.Redis).from_url(url, socket_connect_timeout=2.0)
        self._r = cast(Any, client)
        self._route = [self.keys + "ver"]
        """The one declared key of every script: routes it to the registry's slot in a cluster."""
        self._register = self._r.register_script(_REGISTER)
        self._heartbeat = self._r.register_script(_HEARTBEAT)
        self._namespaces = self._r.register_script(_NAMESPACES)
        self._expire = self._r.register_script(_EXPIRE)
        self._remove = self._r.register_script(_REMOVE)
        self._set_owner = self._r.register_script(_SET_OWNER)
        self._snapshot = self._r.register_script(_SNAPSHOT)
        self._sequences = self._r.register_script(_SEQUENCES)
        self._published: dict[str, tuple[int, int]] = {}
        """What this replica last published with :meth:`publish_sequences` (only changes are sent)."""
        self._static: dict[str, _Static] = {}
        """uid -> what changes only with ``a:ver``, as of the last full read (``_static_ver``)."""
        self._static_ver = ""
        self._by_uid: dict[str, AgentRecord] = {}
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._synced = False
        self._writes = 0
        """Bumped by every record this replica puts in its mirror itself (under ``_lock``)."""
        self._born: dict[str, int] = {}
        """uid -> ``_writes`` when this replica last put its record in the mirror: a sync whose
        snapshot was read before that leaves the record alone (it may predate the write)."""
        self._pending_gone: list[AgentRecord] = []
        self._pending_changed = False
        self.expired_total = 0

    @property
    def shared(self) -> bool:
        return True

    @property
    def synced(self) -> bool:
        return self._synced

    def _key(self, field: str) -> str:
        return self.keys + field

    def _run(self, script: Any, *args: Any) -> Any:
        return script(keys=self._route, args=[self.keys, *args])

    # --- ownership ------------------------------------------------------------------------------
    @_reachable
    def check_owner(self, pod_uid: str, identity: str) -> None:
        owner = self._r.hget(self._key("owner"), pod_uid)
        if owner is not None and _s(owner) != identity:
            raise owned_elsewhere(pod_uid, _s(owner), identity)

    @_reachable
    def set_owner(self, pod_uid: str, identity: str) -> None:
        # Only while registered (the registration script sets it atomically when given an owner;
        # this is for callers that registered without one); an existing owner is kept.
        self._run(self._set_owner, pod_uid, identity)

    # --- writes ---------------------------------------------------------------------------------
    @_reachable
    def register(
        self,
        pod: PodIdentity,
        namespaces: Sequence[str],
        l1_capacity_bytes: int = 0,
        *,
        owner: str | None = None,
    ) -> RegisterOutcome:
        ns = check_namespace_ids(namespaces)
        status, old = (
            _s(v)
            for v in self._run(
                self._register,
                pod.pod_uid,
                epoch19(pod.epoch),
                msgspec.json.encode(pod),
                self._ttl_ms,
                owner or "",
                msgspec.json.encode(list(ns)) if ns else "",
                int(l1_capacity_bytes),
            )
        )
        if status == "denied":
            raise owned_elsewhere(pod.pod_uid, old, owner or "")
        if status == "stale":
            raise stale_epoch(pod.pod_uid, pod.epoch, int(old), registering=True)
        now = self._clock()
        with self._lock:
            mine = self._by_uid.get(pod.pod_uid)
            if status == "same" and mine is not None and mine.pod.epoch == pod.epoch:
                mine.pod = pod
                mine.namespaces = ns or mine.namespaces
                mine.l1_capacity_bytes = l1_capacity_bytes or mine.l1_capacity_bytes
                mine.lease_deadline = now + self.lease_s
                return RegisterOutcome(record=mine, replaced=None, is_new=False)
            if status != "same":
                rec = AgentRecord(
                    pod=pod,
                    namespaces=ns,
                    l1_capacity_bytes=l1_capacity_bytes,
                    load=AgentLoad(l1_capacity_bytes=l1_capacity_bytes),
                    lease_deadline=now + self.lease_s,
                    registered_at=now,
                )
                self._by_uid[pod.pod_uid] = rec
                self._writes += 1
                self._born[pod.pod_uid] = self._writes
        if status == "same":  # registered through another replica, not mirrored here yet
            self._refresh()
            same = self.get(pod.pod_uid)
            if same is None or same.pod.epoch != pod.epoch:
                raise UnknownPodError(f"pod {pod.pod_uid!r} epoch {pod.epoch} left the registry meanwhile")
            return RegisterOutcome(record=same, replaced=None, is_new=False)
        with self._lock:
            replaced = None
            if old:
                old_epoch = int(old)
                if mine is not None and mine.pod.epoch == old_epoch:
                    replaced = mine
                else:
                    replaced = msgspec.structs.replace(rec, pod=msgspec.structs.replace(pod, epoch=old_epoch))
            return RegisterOutcome(record=rec, replaced=replaced, is_new=True)

    @_reachable
    def heartbeat(self, pod_uid: str, epoch: int, load: AgentLoad | None) -> AgentRecord:
        status, cur = (
            _s(v)
            for v in self._run(
                self._heartbeat,
                pod_uid,
                epoch19(epoch),
                self._ttl_ms,
                msgspec.json.encode(load) if load is not None else "",
            )
        )
        if status == "unknown":
            raise not_registered(pod_uid, epoch)
        if status == "stale":
            raise stale_epoch(pod_uid, epoch, int(cur))
        with self._lock:
            rec = self._by_uid.get(pod_uid)
            if rec is not None and rec.pod.epoch == epoch:
                rec.lease_deadline = self._clock() + self.lease_s
                if load is not None:
                    rec.load = load
                return rec
        self._refresh()  # registered through another replica since this one's last sync
        rec = self.get(pod_uid)
        if rec is None or rec.pod.epoch != epoch:
            raise UnknownPodError(f"pod {pod_uid!r} epoch {epoch} left the registry meanwhile")
        return rec

    @_reachable
    def learn_namespaces(self, rec: AgentRecord, namespaces: Sequence[str]) -> bool:
        if not namespaces or set(namespaces) <= set(rec.namespaces):
            return False
        merged = tuple(dict.fromkeys((*rec.namespaces, *namespaces)))
        self._run(
            self._namespaces, rec.pod.pod_uid, epoch19(rec.pod.epoch), msgspec.json.encode(list(merged))
        )
        with self._lock:
            rec.namespaces = merged
        return True

    @_reachable
    def expire(self) -> list[AgentRecord]:
        flat = [_s(v) for v in self._run(self._expire)]
        gone = []
        with self._lock:
            for i in range(0, len(flat), 3):
                uid, ep, pod_json = flat[i : i + 3]
                gone.append(self._take(uid, int(ep or 0), pod_json))
            self.expired_total += len(gone)
        return gone

    @_reachable
    def remove(self, pod_uid: str) -> AgentRecord | None:
        out = [_s(v) for v in self._run(self._remove, pod_uid)]
        if not out:
            with self._lock:
                self._born.pop(pod_uid, None)
                return self._by_uid.pop(pod_uid, None)
        with self._lock:
            return self._take(pod_uid, int(out[0]), out[1])

    def _take(self, uid: str, epoch: int, pod_json: str) -> AgentRecord:
        """Remove ``uid`` from the mirror: its mirror record when it is that epoch, else one built
        from the removed data (this replica never mirrored it)."""
        mine = self._by_uid.get(uid)
        if mine is not None and mine.pod.epoch == epoch:
            del self._by_uid[uid]
            self._born.pop(uid, None)
            return mine
        pod = msgspec.json.decode(pod_json, type=PodIdentity) if pod_json else PodIdentity(uid, epoch=epoch)
        now = self._clock()
        return AgentRecord(pod=pod, namespaces=(), l1_capacity_bytes=0, load=AgentLoad(), lease_deadline=now,
                           registered_at=now)  # fmt: skip

    # --- reads (from the mirror) ----------------------------------------------------------------
    def get(self, pod_uid: str) -> AgentRecord | None:
        with self._lock:
            return self._by_uid.get(pod_uid)

    def current(self, pod_uid: str, epoch: int) -> AgentRecord | None:
        rec = self.get(pod_uid)
        if rec is not None and epoch < rec.pod.epoch:
            raise stale_epoch(pod_uid, epoch, rec.pod.epoch)
        if rec is None or epoch > rec.pod.epoch:
            # Not mirrored yet, or a newer epoch registered elsewhere: the backend decides.
            fresh = self._fetch_epoch(pod_uid)
            if fresh is not None and epoch < fresh:
                raise stale_epoch(pod_uid, epoch, fresh)
            if fresh == epoch:
                self._refresh()
                rec = self.get(pod_uid)
                return rec if rec is not None and rec.pod.epoch == epoch else None
            return None
        return rec

    @_reachable
    def _fetch_epoch(self, pod_uid: str) -> int | None:
        v = self._r.hget(self._key("epoch"), pod_uid)
        return None if v is None else int(v)

    def all(self) -> list[AgentRecord]:
        with self._lock:
            return list(self._by_uid.values())

    def lease_remaining_ms(self, rec: AgentRecord) -> int:
        return int((rec.lease_deadline - self._clock()) * 1000)

    # --- the mirror -----------------------------------------------------------------------------
    @_reachable
    def sync(self) -> SyncResult:
        self._refresh()
        with self._lock:
            out = SyncResult(self._pending_gone, self._pending_changed)
            self._pending_gone, self._pending_changed = [], False
        return out

    @_reachable
    def _refresh(self) -> None:
        """Reload the mirror; what left or changed waits in ``_pending_*`` for :meth:`sync`'s caller
        (a refresh inside register/heartbeat must not lose records the controller has to drop)."""
        with self._refresh_lock:  # one at a time: an older snapshot must never be applied last
            self._refresh_locked()

    def _refresh_locked(self) -> None:
        with self._lock:
            read_at = self._writes
        raw = self._snapshot(keys=self._route, args=[self.keys, self._static_ver, secrets.token_hex(8)])
        out = msgspec.msgpack.decode(raw)
        server_now_ms, ver = int(out[0]), _s(out[1])
        leases, loads, seqs = _pairs(out[2]), _pairs(out[3]), _pairs(out[4])
        if len(out) > 5:  # something but leases and loads changed: decode the records again
            epochs, pods, nss, l1s, sinces = (_pairs(x) for x in out[5:10])
            self._static = {
                uid: _Static(
                    epoch=int(ep),
                    pod=msgspec.json.decode(pods[uid], type=PodIdentity),
                    namespaces=tuple(msgspec.json.decode(nss.get(uid, b"[]"), type=list[str])),
                    l1_capacity_bytes=int(l1s.get(uid, b"0")),
                    since_ms=int(sinces.get(uid, b"0")),
                )
                for uid, ep in epochs.items()
                if uid in pods
            }
            self._static_ver = ver
            self._published = {}  # the data may have been lost: publish every sequence again
        now = self._clock()
        gone: list[AgentRecord] = []
        changed = False
        with self._lock:
            seen = set()
            for uid, st in self._static.items():
                seen.add(uid)
                epoch, pod, ns, l1 = st.epoch, st.pod, st.namespaces, st.l1_capacity_bytes
                load_b = loads.get(uid)
                load = (
                    msgspec.json.decode(load_b, type=AgentLoad) if load_b else AgentLoad(l1_capacity_bytes=l1)
                )
                deadline = now + (int(leases.get(uid, b"0")) - server_now_ms) / 1000
                seq_ep, _, seq = seqs.get(uid, b"").partition(b":")
                last_seq = int(seq) if seq and int(seq_ep) == epoch else 0
                rec = self._by_uid.get(uid)
                if self._born.get(uid, 0) > read_at:
                    continue  # written here after the snapshot was read: newer than it
                if rec is not None and rec.pod.epoch == epoch:
                    if rec.pod != pod or rec.namespaces != ns:
                        changed = True
                    rec.pod, rec.namespaces, rec.l1_capacity_bytes = pod, ns, l1
                    rec.load, rec.lease_deadline, rec.last_sequence = load, deadline, last_seq
                    continue
                if rec is not None:
                    rec.dropped = True
                    gone.append(rec)
                since = now + (st.since_ms - server_now_ms) / 1000
                self._by_uid[uid] = AgentRecord(
                    pod=pod, namespaces=ns, l1_capacity_bytes=l1, load=load, lease_deadline=deadline,
                    registered_at=since, last_sequence=last_seq,
                )  # fmt: skip
                changed = True
            for uid in [u for u in self._by_uid if u not in seen and self._born.get(u, 0) <= read_at]:
                rec = self._by_uid.pop(uid)
                self._born.pop(uid, None)
                rec.dropped = True
                gone.append(rec)
                changed = True
            self._synced = True
            self._pending_gone.extend(gone)
            self._pending_changed = self._pending_changed or changed

    @_reachable
    def publish_sequences(self, sequences: dict[str, tuple[int, int]]) -> None:
        changed = {uid: v for uid, v in sequences.items() if self._published.get(uid) != v}
        if changed:
            args: list[str | int] = []
            for uid, (epoch, seq) in changed.items():
                args += [uid, epoch19(epoch), seq]
            self._run(self._sequences, *args)
        self._published = dict(sequences)

    def close(self) -> None:
        self._r.close()
