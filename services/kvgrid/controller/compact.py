"""The compact BatchMatchPrefix answer (``BatchMatchPrefixRequest.compact``): build and read it.

Server side, :func:`compact_response` turns a :class:`~kvgrid.controller.matching.BatchMatch` into
a ``BatchMatchPrefixResponse`` with a pod table (``pods``) and one ``CompactMatch`` of packed
arrays per query. When every number fits one varint byte (< 128: batches of up to 128 pods and
queries of up to 127 chunks) the packed arrays are plain uint8 bytes, so the whole answer is
written as protobuf wire bytes with a few numpy calls per batch and parsed once (upb); otherwise
it is built field by field with ``extend``. Both produce the same message (tested), which is the
wire format: readers need nothing but the generated classes.

``l2_chunks`` (field 7) is written for a query only when one of its listed pods has L2 chunks, so
answers without lower tiers are byte for byte what they were before the field existed.

Client side, :func:`read_compact` gives each query's matches as ``PodMatch`` messages, the
readable form, for callers that want it.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

import numpy as np

from kvgrid.api.v1 import controller_pb2
from kvgrid.controller.matching import BatchMatch

__all__ = ["compact_response", "read_compact"]

# Wire tags (field number << 3 | wire type): BatchMatchPrefixResponse.pods = 2, .compact = 3;
# CompactMatch: num_query_chunks = 1, peer_fetchable_chunks = 2 (varints), the arrays 3..7 (packed).
_TAG_POD = b"\x12"
_TAG_COMPACT = b"\x1a"
_TAG_CHUNKS, _TAG_PEER_FETCHABLE = b"\x08", b"\x10"
_TAG_ARRAYS = (b"\x1a", b"\x22", b"\x2a", b"\x32")
_TAG_L2 = b"\x3a"


def _varint(x: int) -> bytes:
    out = bytearray()
    while x >= 0x80:
        out.append(x & 0x7F | 0x80)
        x >>= 7
    out.append(x)
    return bytes(out)


_SMALL = [_varint(i) for i in range(1 << 12)]


def _v(x: int) -> bytes:
    return _SMALL[x] if x < len(_SMALL) else _varint(x)


def pod_ref_bytes(pod_uid: str, pod_name: str) -> bytes:
    """One ``pods`` entry of the response as wire bytes (tag, length, PodRef)."""
    body = controller_pb2.PodRef(pod_uid=pod_uid, pod_name=pod_name).SerializeToString()
    return _TAG_POD + _v(len(body)) + body


def compact_response(
    m: BatchMatch, num_query_chunks: Sequence[int], pod_refs: Sequence[bytes]
) -> controller_pb2.BatchMatchPrefixResponse:
    """The compact answer of ``m``; ``pod_refs[slot]`` is :func:`pod_ref_bytes` of each slot's pod."""
    arrays = (m.pod_index, m.gpu, m.l1, m.peer, m.l2)
    small = all(int(a.max(initial=0)) < 0x80 for a in arrays)
    if not small:
        return _built(m, num_query_chunks, pod_refs)
    packed = [a.astype(np.uint8).tobytes() for a in arrays]  # a packed varint < 128 is one byte
    l2 = packed.pop()
    if not m.l2.any():
        l2 = b""
    out = [pod_refs[s] for s in m.pods.tolist()]
    offsets, fetchable = m.offsets.tolist(), m.peer_fetchable.tolist()
    for b, nc in enumerate(num_query_chunks):
        lo, hi = offsets[b], offsets[b + 1]
        body: list[bytes] = []
        if nc:
            body += (_TAG_CHUNKS, _v(nc))
        if fetchable[b]:
            body += (_TAG_PEER_FETCHABLE, _v(fetchable[b]))
        if hi > lo:
            n = _SMALL[hi - lo]  # <= 128 pods here
            for tag, raw in zip(_TAG_ARRAYS, packed, strict=True):
                body += (tag, n, raw[lo:hi])
            if l2 and l2[lo:hi].count(0) != hi - lo:
                body += (_TAG_L2, n, l2[lo:hi])
        msg = b"".join(body)
        out += (_TAG_COMPACT, _v(len(msg)), msg)
    return controller_pb2.BatchMatchPrefixResponse.FromString(b"".join(out))


def _built(
    m: BatchMatch, num_query_chunks: Sequence[int], pod_refs: Sequence[bytes]
) -> controller_pb2.BatchMatchPrefixResponse:
    """Field-by-field construction (any sizes)."""
    resp = controller_pb2.BatchMatchPrefixResponse.FromString(b"".join(pod_refs[s] for s in m.pods.tolist()))
    offsets, fetchable = m.offsets.tolist(), m.peer_fetchable.tolist()
    pod_index, gpu, l1, peer, l2 = (a.tolist() for a in (m.pod_index, m.gpu, m.l1, m.peer, m.l2))
    add = resp.compact.add
    for b, nc in enumerate(num_query_chunks):
        lo, hi = offsets[b], offsets[b + 1]
        c = add(num_query_chunks=nc, peer_fetchable_chunks=fetchable[b])
        c.pod_index.extend(pod_index[lo:hi])
        c.gpu_chunks.extend(gpu[lo:hi])
        c.l1_chunks.extend(l1[lo:hi])
        c.peer_chunks.extend(peer[lo:hi])
        if any(l2[lo:hi]):
            c.l2_chunks.extend(l2[lo:hi])
    return resp


def read_compact(resp: controller_pb2.BatchMatchPrefixResponse) -> list[controller_pb2.MatchPrefixResponse]:
    """The readable form of a compact answer (one MatchPrefixResponse per query)."""
    pods = resp.pods
    out = []
    for c in resp.compact:
        r = controller_pb2.MatchPrefixResponse(
            num_query_chunks=c.num_query_chunks, peer_fetchable_chunks=c.peer_fetchable_chunks
        )
        l2 = c.l2_chunks or repeat(0)  # absent: no listed pod has L2 chunks
        for i, g, lo, p, d in zip(c.pod_index, c.gpu_chunks, c.l1_chunks, c.peer_chunks, l2, strict=False):
            r.matches.add(
                pod_uid=pods[i].pod_uid,
                pod_name=pods[i].pod_name,
                gpu_chunks=g,
                l1_chunks=lo,
                peer_chunks=p,
                l2_chunks=d,
            )
        out.append(r)
    return out
