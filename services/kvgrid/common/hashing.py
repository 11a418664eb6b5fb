"""Chunk keys: chained, namespaced 128-bit keys over token ids (byte format in docs/hashing.md).

A prompt is cut into chunks of ``tokens_per_chunk`` token ids; only full chunks get a key (a partial
tail chunk is never cached). Keys are chained so that one key names a whole prefix, and the chain can
be continued from any key (:func:`chain_chunk_keys`; :func:`chunk_keys` starts it at the seed)::

    key_0 = H(seed || tokens_0)          seed = KeyNamespace.seed()
    key_i = H(key_{i-1} || tokens_i)     tokens_i = chunk i as little-endian u32
    H     = BLAKE2b with a 16-byte digest (hashlib)

The namespace seed covers everything besides token ids that changes the KV bytes (model, cache salt /
tenant, LoRA, chunk size, KV dtype/layout identity), so two namespaces never share a key. Nothing here
depends on PYTHONHASHSEED, the process or the engine's own block hash: every process, on every machine,
computes the same keys for the same tokens and namespace.
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Sequence
from hashlib import blake2b
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

__all__ = [
    "CHUNK_KEY_BYTES",
    "DEFAULT_TOKENS_PER_CHUNK",
    "NAMESPACE_DOMAIN_TAG",
    "TOKEN_ID_BYTES",
    "KeyNamespace",
    "chain_chunk_keys",
    "check_chunk_keys",
    "chunk_keys",
    "num_full_chunks",
    "pack_token_ids",
]

CHUNK_KEY_BYTES = 16
DEFAULT_TOKENS_PER_CHUNK = 256
# Versioned domain tag at the start of the seed material: a change to how existing fields are
# encoded needs a new tag (and so yields new namespace ids), never a silent reinterpretation.
NAMESPACE_DOMAIN_TAG = b"kvgrid/v1/ns"

_U32_LIMIT = 1 << 32
TOKEN_ID_BYTES = 4  # one token id in the hashed bytes: little-endian u32
_U32 = struct.Struct("<I")

# array.array converts a list of ints to machine u32 in one C loop (3x faster than numpy from a
# list); it rejects negatives, values >= 2**32 and non-integers, and accepts anything with __index__.
_ARRAY_U32 = next(code for code in ("I", "L") if array.array(code).itemsize == TOKEN_ID_BYTES)
_BIG_ENDIAN = sys.byteorder == "big"


def _check_string_field(name: str, value: object, *, required: bool = False) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"KeyNamespace.{name} must be a str, got {value!r} ({type(value).__name__})")
    if required and not value:
        raise ValueError(f"KeyNamespace.{name} must be a non-empty str, got {value!r}")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"KeyNamespace.{name} must be encodable as UTF-8, got {value!r}: {exc.reason}"
        ) from None


def _check_tokens_per_chunk(value: object, where: str = "KeyNamespace.tokens_per_chunk") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where} must be an int, got {value!r} ({type(value).__name__})")
    if not 0 < value < _U32_LIMIT:
        raise ValueError(f"{where} must be in [1, 2**32), got {value!r}")
    return value


class KeyNamespace(msgspec.Struct, frozen=True):
    """Everything besides token ids that changes the KV bytes of a chunk.

    Two requests share chunk keys only when every field is equal. ``kv_identity`` is free-form text
    naming the KV byte identity (dtype, layout, parallel rank, kernel-group shapes); the agent builds
    it, this module only hashes it. Fields follow ``KeyNamespace`` in proto/kvgrid/v1/common.proto.
    """

    model: str
    cache_salt: str = ""
    lora_name: str = ""
    tokens_per_chunk: int = DEFAULT_TOKENS_PER_CHUNK
    kv_identity: str = ""

    def __post_init__(self) -> None:
        # Fail at construction (and at msgspec decode), not at first use on a request path.
        self.seed_material()

    def seed_material(self) -> bytes:
        """The exact bytes hashed into the seed (docs/hashing.md, "Namespace seed").

        ``u32(len) || bytes`` for the domain tag and each string field (UTF-8), ``u32`` for
        ``tokens_per_chunk``, in field order; u32 is little-endian. Length prefixes make the
        encoding injective: moving a character from one field to the next changes the bytes.
        """
        parts = [_U32.pack(len(NAMESPACE_DOMAIN_TAG)), NAMESPACE_DOMAIN_TAG]
        for name in ("model", "cache_salt", "lora_name"):
            raw = _check_string_field(name, getattr(self, name), required=name == "model")
            parts += (_U32.pack(len(raw)), raw)
        parts.append(_U32.pack(_check_tokens_per_chunk(self.tokens_per_chunk)))
        raw = _check_string_field("kv_identity", self.kv_identity)
        parts += (_U32.pack(len(raw)), raw)
        return b"".join(parts)

    def seed(self) -> bytes:
        """16-byte namespace seed: BLAKE2b-128 of :meth:`seed_material`; the chain's key_{-1}."""
        return blake2b(self.seed_material(), digest_size=CHUNK_KEY_BYTES).digest()

    def namespace_id(self) -> str:
        """Hex of :meth:`seed` (32 characters); the namespace id on the wire."""
        return self.seed().hex()


def num_full_chunks(n_tokens: int, tokens_per_chunk: int) -> int:
    """How many full chunks (and so keys) ``n_tokens`` tokens make; the partial tail is dropped."""
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int):
        raise TypeError(f"n_tokens must be an int, got {n_tokens!r} ({type(n_tokens).__name__})")
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens!r}")
    return n_tokens // _check_tokens_per_chunk(tokens_per_chunk, "tokens_per_chunk")


def _not_integer(index: int, value: object) -> TypeError:
    return TypeError(
        f"token_ids[{index}] = {value!r} ({type(value).__name__}) is not an integer; "
        "expected int token ids in [0, 2**32)"
    )


def _out_of_range(index: int, value: int) -> ValueError:
    return ValueError(f"token_ids[{index}] = {value} is out of range; expected 0 <= token id < 2**32")


def _find_bad_token(token_ids: Sequence[Any]) -> Exception:
    # Error path only: find the first offending element so the message names value and position.
    for index, value in enumerate(token_ids):
        try:
            number = value.__index__()
        except (AttributeError, TypeError):
            return _not_integer(index, value)
        if not 0 <= number < _U32_LIMIT:
            return _out_of_range(index, number)
    return TypeError(f"token_ids could not be read as u32 token ids: {token_ids!r:.200}")


def _array_token_bytes(token_ids: npt.NDArray[Any]) -> memoryview:
    if token_ids.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got an array of shape {token_ids.shape}")
    kind = token_ids.dtype.kind
    if kind == "O":
        return _sequence_token_bytes(token_ids.tolist())
    if kind not in "iu":
        # bool arrays too: a mask is never a token sequence.
        first = f" (token_ids[0] = {token_ids[0].item()!r})" if token_ids.size else ""
        raise TypeError(f"token_ids must hold integers, got a numpy array of dtype {token_ids.dtype}{first}")
    if token_ids.size and not (kind == "u" and token_ids.dtype.itemsize <= TOKEN_ID_BYTES):
        too_small = kind == "i" and token_ids.min() < 0
        too_large = token_ids.dtype.itemsize > TOKEN_ID_BYTES and token_ids.max() >= _U32_LIMIT
        if too_small or too_large:
            bad = np.flatnonzero((token_ids < 0) | (token_ids >= _U32_LIMIT))[0]
            raise _out_of_range(int(bad), int(token_ids[bad]))
    # Copies only when the dtype, byte order or strides differ; a view, not a bytes copy (fresh
    # 512 KiB buffers cost page faults comparable to hashing them).
    return np.ascontiguousarray(token_ids, dtype="<u4").data.cast("B")


def _sequence_token_bytes(token_ids: Sequence[Any]) -> memoryview:
    try:
        packed = array.array(_ARRAY_U32, token_ids)
    except (TypeError, OverflowError, ValueError):
        raise _find_bad_token(token_ids) from None
    if _BIG_ENDIAN:
        packed.byteswap()
    return memoryview(packed).cast("B")


def pack_token_ids(token_ids: object) -> memoryview:
    """``token_ids`` as the bytes the chain hashes (little-endian u32), after checking every id.

    Accepts what :func:`chunk_keys` accepts and raises the same TypeError/ValueError naming the bad
    value and its position; no per-token Python loop.
    """
    if isinstance(token_ids, np.ndarray):
        return _array_token_bytes(token_ids)
    # str/bytes are Sequences too; array.array would even take bytes as raw machine values.
    if isinstance(token_ids, (str, bytes, bytearray, memoryview)) or not isinstance(token_ids, Sequence):
        raise TypeError(
            "token_ids must be a sequence of ints or a 1-D numpy integer array, "
            f"got {type(token_ids).__name__}: {token_ids!r:.80}"
        )
    return _sequence_token_bytes(token_ids)


def chain_chunk_keys(
    prev_key: bytes, packed_tokens: bytes | memoryview, tokens_per_chunk: int
) -> list[bytes]:
    """Keys of the full chunks of ``packed_tokens`` chained after ``prev_key`` (the tail is not keyed).

    ``prev_key`` is a namespace seed (:meth:`KeyNamespace.seed`) or the key of the chunk just before
    ``packed_tokens``; ``packed_tokens`` is :func:`pack_token_ids` output. So a prompt's keys can be
    computed in pieces: continuing from key *i* over the tokens after chunk *i* gives keys *i+1...*
    exactly as :func:`chunk_keys` over the whole prompt does.
    """
    if not isinstance(prev_key, bytes) or len(prev_key) != CHUNK_KEY_BYTES:
        raise ValueError(f"prev_key must be a {CHUNK_KEY_BYTES}-byte chunk key or seed, got {prev_key!r:.80}")
    view = memoryview(packed_tokens).cast("B")
    if len(view) % TOKEN_ID_BYTES:
        raise ValueError(f"packed_tokens: {len(view)} bytes is not a whole number of u32 token ids")
    step = _check_tokens_per_chunk(tokens_per_chunk, "tokens_per_chunk") * TOKEN_ID_BYTES
    key = prev_key
    keys: list[bytes] = []
    for offset in range(0, len(view) - step + 1, step):
        h = blake2b(key, digest_size=CHUNK_KEY_BYTES)
        h.update(view[offset : offset + step])
        key = h.digest()
        keys.append(key)
    return keys


def chunk_keys(
    token_ids: Sequence[int] | npt.NDArray[np.integer[Any]], namespace: KeyNamespace
) -> list[bytes]:
    """Chained 16-byte keys, one per *full* chunk of ``token_ids`` (the partial tail is not keyed).

    ``token_ids`` is a list/tuple (or other sequence) of ints, or a 1-D numpy integer array; every id
    must be in [0, 2**32). Bad input raises TypeError (non-integers, numpy bool/float arrays) or
    ValueError (out-of-range ids, arrays not 1-D) naming the value and its position. Python bools in
    a list count as the ints 0/1 (``bool`` subclasses ``int``); checking each element's type would
    cost more than hashing it.
    """
    if not isinstance(namespace, KeyNamespace):
        raise TypeError(
            f"namespace must be a KeyNamespace, got {type(namespace).__name__}: {namespace!r:.80}"
        )
    return chain_chunk_keys(namespace.seed(), pack_token_ids(token_ids), namespace.tokens_per_chunk)


def check_chunk_keys(keys: Sequence[bytes], what: str = "chunk_keys") -> list[bytes]:
    """``keys`` as a list, after checking each is a :data:`CHUNK_KEY_BYTES`-byte ``bytes`` (keys from
    the wire); the ValueError names the field and the position of the first bad key."""
    if set(map(type, keys)) <= {bytes} and set(map(len, keys)) <= {CHUNK_KEY_BYTES}:
        return list(keys)  # the common case, checked at C speed
    for i, k in enumerate(keys):
        if not isinstance(k, bytes) or len(k) != CHUNK_KEY_BYTES:
            got = f"{len(k)} bytes" if isinstance(k, bytes) else type(k).__name__
            raise ValueError(f"{what}[{i}]: got {got}, expected a {CHUNK_KEY_BYTES}-byte chunk key")
    return list(keys)
