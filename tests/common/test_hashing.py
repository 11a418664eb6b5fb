"""Chunk keys: published vectors (read from docs/hashing.md), properties, cross-process stability, errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from hashlib import blake2b
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvgrid import cli
from kvgrid.common.hashing import (
    CHUNK_KEY_BYTES,
    DEFAULT_TOKENS_PER_CHUNK,
    KeyNamespace,
    chain_chunk_keys,
    chunk_keys,
    num_full_chunks,
    pack_token_ids,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "hashing.md"
_VECTOR_BLOCK = re.compile(r"^```json test-vector\n(.*?)^```$", re.DOTALL | re.MULTILINE)
_NS_FIELDS = ("model", "cache_salt", "lora_name", "tokens_per_chunk", "kv_identity")


def _load_vectors() -> list[dict[str, Any]]:
    return [json.loads(block) for block in _VECTOR_BLOCK.findall(DOC.read_text(encoding="utf-8"))]


VECTORS = _load_vectors()


def _vector_tokens(vector: dict[str, Any]) -> list[int]:
    if "token_ids_range" in vector:
        start, stop = vector["token_ids_range"]
        return list(range(start, stop))
    return list(vector["token_ids"])


# --- an independent reference: struct per field, one pack per chunk, no shared code ---------------


def _ref_str(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def _ref_seed_material(ns: dict[str, Any]) -> bytes:
    return (
        _ref_str("kvgrid/v1/ns")
        + _ref_str(ns["model"])
        + _ref_str(ns["cache_salt"])
        + _ref_str(ns["lora_name"])
        + struct.pack("<I", ns["tokens_per_chunk"])
        + _ref_str(ns["kv_identity"])
    )


def _ref_keys(tokens: list[int], ns: dict[str, Any]) -> list[bytes]:
    size = ns["tokens_per_chunk"]
    prev = blake2b(_ref_seed_material(ns), digest_size=16).digest()
    keys = []
    for start in range(0, len(tokens) - size + 1, size):
        chunk = tokens[start : start + size]
        prev = blake2b(prev + struct.pack(f"<{size}I", *chunk), digest_size=16).digest()
        keys.append(prev)
    return keys


def _fields(ns: KeyNamespace) -> dict[str, Any]:
    return {name: getattr(ns, name) for name in _NS_FIELDS}


# --- published vectors --------------------------------------------------------------------------


def test_docs_publish_the_required_vectors() -> None:
    assert len(VECTORS) >= 3
    assert len({v["name"] for v in VECTORS}) == len(VECTORS), "vector names must be unique"
    assert any(len(v["keys"]) >= 2 for v in VECTORS), "need a multi-chunk vector"
    assert any(
        v["namespace"]["cache_salt"] and v["namespace"]["lora_name"] and v["namespace"]["kv_identity"]
        for v in VECTORS
    ), "need a vector with a non-default namespace"
    assert any(v["namespace"]["tokens_per_chunk"] == DEFAULT_TOKENS_PER_CHUNK for v in VECTORS)
    for vector in VECTORS:
        assert set(vector["namespace"]) == set(_NS_FIELDS), vector["name"]


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_published_vector(vector: dict[str, Any]) -> None:
    ns = KeyNamespace(**vector["namespace"])
    tokens = _vector_tokens(vector)
    assert ns.seed_material().hex() == vector["seed_material"]
    assert ns.namespace_id() == vector["namespace_id"]
    assert ns.seed().hex() == vector["namespace_id"]
    expected = vector["keys"]
    assert len(expected) == len(tokens) // ns.tokens_per_chunk
    # Every accepted input form gives the published keys.
    for form in (
        tokens,
        tuple(tokens),
        np.array(tokens, dtype=np.int64),
        np.array(tokens, dtype=np.uint32),
        np.array(tokens, dtype=">u4"),
        np.array(tokens, dtype=np.uint64),
    ):
        assert [k.hex() for k in chunk_keys(form, ns)] == expected, type(form)


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_published_vector_matches_independent_reference(vector: dict[str, Any]) -> None:
    tokens = _vector_tokens(vector)
    assert _ref_seed_material(vector["namespace"]).hex() == vector["seed_material"]
    assert [k.hex() for k in _ref_keys(tokens, vector["namespace"])] == vector["keys"]


@pytest.mark.skipif(shutil.which("b2sum") is None, reason="coreutils b2sum not installed")
def test_published_vectors_match_coreutils_b2sum() -> None:
    # A BLAKE2b implementation that is not Python's: the vectors are not just our code's echo.
    def b2sum(data: bytes) -> str:
        out = subprocess.run(["b2sum", "-l", "128"], input=data, capture_output=True, check=True)
        return out.stdout.split()[0].decode()

    for vector in VECTORS:
        seed_hex = b2sum(bytes.fromhex(vector["seed_material"]))
        assert seed_hex == vector["namespace_id"], vector["name"]
        size = vector["namespace"]["tokens_per_chunk"]
        tokens = _vector_tokens(vector)
        prev = bytes.fromhex(seed_hex)
        for i, expected in enumerate(vector["keys"]):
            chunk = struct.pack(f"<{size}I", *tokens[i * size : (i + 1) * size])
            prev = bytes.fromhex(b2sum(prev + chunk))
            assert prev.hex() == expected, (vector["name"], i)


# --- properties ---------------------------------------------------------------------------------

token_ids = st.integers(min_value=0, max_value=2**32 - 1)
small_token_ids = st.integers(min_value=0, max_value=300)  # small alphabet: repeated tokens, near-misses
texts = st.text(max_size=12)
namespaces = st.builds(
    KeyNamespace,
    model=st.text(min_size=1, max_size=12),
    cache_salt=texts,
    lora_name=texts,
    tokens_per_chunk=st.integers(min_value=1, max_value=6),
    kv_identity=texts,
)


@given(tokens=st.lists(st.one_of(token_ids, small_token_ids), max_size=40), ns=namespaces)
def test_keys_match_reference_for_every_input_form(tokens: list[int], ns: KeyNamespace) -> None:
    expected = _ref_keys(tokens, _fields(ns))
    assert len(expected) == num_full_chunks(len(tokens), ns.tokens_per_chunk)
    assert chunk_keys(tokens, ns) == expected
    assert chunk_keys(tuple(tokens), ns) == expected
    assert chunk_keys(np.array(tokens, dtype=np.int64), ns) == expected
    assert chunk_keys(np.array(tokens, dtype=np.uint32), ns) == expected
    assert all(len(k) == CHUNK_KEY_BYTES for k in expected)


@given(
    tokens=st.lists(small_token_ids, min_size=1, max_size=40),
    ns=namespaces,
    data=st.data(),
)
def test_key_depends_on_every_earlier_token_and_no_later_one(
    tokens: list[int], ns: KeyNamespace, data: st.DataObject
) -> None:
    position = data.draw(st.integers(min_value=0, max_value=len(tokens) - 1), label="position")
    new_value = data.draw(token_ids.filter(lambda t: t != tokens[position]), label="new value")
    changed = [*tokens[:position], new_value, *tokens[position + 1 :]]
    before, after = chunk_keys(tokens, ns), chunk_keys(changed, ns)
    assert len(before) == len(after)
    first_changed = position // ns.tokens_per_chunk
    # Keys of chunks that end before the change are untouched; the chunk holding it and all later
    # chunks get new keys (a change in the partial tail changes nothing).
    for i, (old, new) in enumerate(zip(before, after, strict=True)):
        if i < first_changed:
            assert old == new, (i, position)
        else:
            assert old != new, (i, position)


@given(
    prefix=st.lists(small_token_ids, max_size=30),
    tail_a=st.lists(small_token_ids, max_size=10),
    tail_b=st.lists(small_token_ids, max_size=10),
    ns=namespaces,
)
def test_equal_prefixes_give_equal_keys(
    prefix: list[int], tail_a: list[int], tail_b: list[int], ns: KeyNamespace
) -> None:
    shared = len(prefix) // ns.tokens_per_chunk
    keys_a, keys_b = chunk_keys(prefix + tail_a, ns), chunk_keys(prefix + tail_b, ns)
    assert keys_a[:shared] == keys_b[:shared] == chunk_keys(prefix, ns)
    # Keys agree exactly as far as the token chunks agree.
    common = 0
    while (
        common < min(len(keys_a), len(keys_b))
        and (prefix + tail_a)[common * ns.tokens_per_chunk : (common + 1) * ns.tokens_per_chunk]
        == (prefix + tail_b)[common * ns.tokens_per_chunk : (common + 1) * ns.tokens_per_chunk]
    ):
        common += 1
    assert keys_a[:common] == keys_b[:common]
    assert all(a != b for a, b in zip(keys_a[common:], keys_b[common:], strict=False))


@given(tokens=st.lists(token_ids, max_size=40), ns=namespaces, data=st.data())
def test_chain_continued_from_any_chunk_key_equals_the_whole_prompt(
    tokens: list[int], ns: KeyNamespace, data: st.DataObject
) -> None:
    whole = chunk_keys(tokens, ns)
    size = ns.tokens_per_chunk
    packed = pack_token_ids(tokens)
    assert bytes(packed) == struct.pack(f"<{len(tokens)}I", *tokens)
    assert chain_chunk_keys(ns.seed(), packed, size) == whole
    done = data.draw(st.integers(min_value=0, max_value=len(whole)), label="chunks before the cut")
    prev = whole[done - 1] if done else ns.seed()
    assert chain_chunk_keys(prev, bytes(packed[done * size * 4 :]), size) == whole[done:]


@pytest.mark.parametrize(
    ("prev_key", "packed", "size", "error", "fragment"),
    [
        (b"\x00" * 15, b"", 4, ValueError, "16-byte"),
        ("00" * 16, b"", 4, ValueError, "16-byte"),
        (b"\x00" * 16, b"\x00" * 6, 4, ValueError, "6 bytes"),
        (b"\x00" * 16, b"", 0, ValueError, "tokens_per_chunk"),
    ],
)
def test_chain_rejects_a_bad_start_key_byte_count_or_chunk_size(
    prev_key: Any, packed: bytes, size: int, error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=re.escape(fragment)):
        chain_chunk_keys(prev_key, packed, size)


@settings(max_examples=300)
@given(a=namespaces, b=namespaces, tokens=st.lists(small_token_ids, min_size=6, max_size=36))
def test_different_namespaces_never_share_keys(a: KeyNamespace, b: KeyNamespace, tokens: list[int]) -> None:
    assume(a != b)
    assert a.seed() != b.seed()
    assert a.namespace_id() != b.namespace_id()
    keys_a, keys_b = chunk_keys(tokens, a), chunk_keys(tokens, b)
    assert keys_a and keys_b
    assert set(keys_a).isdisjoint(keys_b)


_STRING_FIELDS = ["model", "cache_salt", "lora_name", "kv_identity"]


@given(
    ns=namespaces,
    index=st.integers(min_value=0, max_value=len(_STRING_FIELDS) - 2),
    head=st.text(min_size=1, max_size=6),
    moved=st.text(min_size=1, max_size=3),
    tail=texts,
)
def test_moving_a_field_boundary_changes_the_namespace(
    ns: KeyNamespace, index: int, head: str, moved: str, tail: str
) -> None:
    # (head + moved, tail) vs (head, moved + tail) in two neighbouring string fields: the plain
    # concatenation is equal, the length-prefixed encoding must not be.
    field, following = _STRING_FIELDS[index], _STRING_FIELDS[index + 1]
    a = msgspec.structs.replace(ns, **{field: head + moved, following: tail})
    b = msgspec.structs.replace(ns, **{field: head, following: moved + tail})
    assert a.seed_material() != b.seed_material()
    assert a.seed() != b.seed()


def test_field_boundary_pairs_are_distinct_namespaces() -> None:
    pairs = [
        (KeyNamespace("ab"), KeyNamespace("a", cache_salt="b")),
        (KeyNamespace("m", cache_salt="ab"), KeyNamespace("m", cache_salt="a", lora_name="b")),
        (KeyNamespace("m", lora_name="x"), KeyNamespace("m", kv_identity="x")),
        (KeyNamespace("m", tokens_per_chunk=256), KeyNamespace("m", tokens_per_chunk=257)),
    ]
    for a, b in pairs:
        assert a.seed_material() != b.seed_material()
        assert a.seed() != b.seed()


_CHILD = """
import json, random, sys
from kvgrid.common.hashing import KeyNamespace, chunk_keys
vectors = json.loads(sys.stdin.read())
rng = random.Random(7)
prompt = [rng.randrange(2**32) for _ in range(5000)]
out = {"hash_of_str": hash("kvgrid"), "keys": []}
for v in vectors:
    tokens = v["token_ids"] if "token_ids" in v else list(range(*v["token_ids_range"]))
    ns = KeyNamespace(**v["namespace"])
    out["keys"].append([k.hex() for k in chunk_keys(tokens, ns)])
    out["keys"].append([k.hex() for k in chunk_keys(prompt, ns)])
print(json.dumps(out))
"""


def test_keys_equal_across_processes_with_different_hash_seeds() -> None:
    runs = []
    for hash_seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD],
            input=json.dumps(VECTORS),
            capture_output=True,
            text=True,
            env=env,
            check=True,
            timeout=120,
        )
        runs.append(json.loads(proc.stdout))
    # The two children really had different str hashing, so equal keys prove independence from it.
    assert runs[0]["hash_of_str"] != runs[1]["hash_of_str"]
    assert runs[0]["keys"] == runs[1]["keys"]
    assert runs[0]["keys"][0::2] == [v["keys"] for v in VECTORS]
    # And this process agrees with both on the long pseudo-random prompt.
    import random

    rng = random.Random(7)
    prompt = [rng.randrange(2**32) for _ in range(5000)]
    here = [[k.hex() for k in chunk_keys(prompt, KeyNamespace(**v["namespace"]))] for v in VECTORS]
    assert runs[0]["keys"][1::2] == here


# --- bad input ----------------------------------------------------------------------------------

_NS = KeyNamespace("Qwen/Qwen3-8B", tokens_per_chunk=4)


@pytest.mark.parametrize(
    ("token_input", "error", "fragments"),
    [
        ([1, 2, -1, 4], ValueError, ["token_ids[2]", "-1", "2**32"]),
        ([1, 2**32, 3, 4], ValueError, ["token_ids[1]", "4294967296"]),
        ((5, 6, 7, 2**70), ValueError, ["token_ids[3]", str(2**70)]),
        ([1, 2, 3, 1.5], TypeError, ["token_ids[3]", "1.5", "float"]),
        ([1, 2.0, 3, 4], TypeError, ["token_ids[1]", "2.0", "float"]),
        (["7", 1, 2, 3], TypeError, ["token_ids[0]", "'7'", "str"]),
        ([1, None, 3, 4], TypeError, ["token_ids[1]", "None"]),
        (np.array([1, 2, -5, 4], dtype=np.int64), ValueError, ["token_ids[2]", "-5"]),
        (np.array([1, 2, 3, 2**32 + 9], dtype=np.uint64), ValueError, ["token_ids[3]", "4294967305"]),
        (np.array([0, -128], dtype=np.int8), ValueError, ["token_ids[1]", "-128"]),
        (np.array([1.0, 2.0, 3.0, 4.0]), TypeError, ["float64", "1.0"]),
        (np.array([True, False, True, True]), TypeError, ["bool"]),
        (np.array([[1, 2], [3, 4]]), ValueError, ["1-D", "(2, 2)"]),
        (np.array([1, "x"], dtype=object), TypeError, ["token_ids[1]", "'x'"]),
        (b"\x01\x00\x00\x00", TypeError, ["bytes"]),
        ("1234", TypeError, ["str", "'1234'"]),
        (None, TypeError, ["NoneType"]),
        ({1, 2, 3, 4}, TypeError, ["set"]),
    ],
    ids=repr,
)
def test_bad_tokens_raise_naming_the_value(
    token_input: Any, error: type[Exception], fragments: list[str]
) -> None:
    with pytest.raises(error) as excinfo:
        chunk_keys(token_input, _NS)
    message = str(excinfo.value)
    for fragment in fragments:
        assert fragment in message, message


def test_bad_namespace_argument() -> None:
    with pytest.raises(TypeError, match="namespace must be a KeyNamespace, got dict"):
        chunk_keys([1, 2, 3, 4], {"model": "m"})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "fragments"),
    [
        ({"model": "m", "tokens_per_chunk": 0}, ValueError, ["tokens_per_chunk", "0"]),
        ({"model": "m", "tokens_per_chunk": -256}, ValueError, ["tokens_per_chunk", "-256"]),
        ({"model": "m", "tokens_per_chunk": 2**32}, ValueError, ["tokens_per_chunk", "4294967296"]),
        ({"model": "m", "tokens_per_chunk": True}, TypeError, ["tokens_per_chunk", "True", "bool"]),
        ({"model": "m", "tokens_per_chunk": 256.0}, TypeError, ["tokens_per_chunk", "256.0"]),
        ({"model": "m", "tokens_per_chunk": "256"}, TypeError, ["tokens_per_chunk", "'256'"]),
        ({"model": ""}, ValueError, ["model", "''"]),
        ({"model": 7}, TypeError, ["model", "7", "int"]),
        ({"model": b"m"}, TypeError, ["model", "b'm'", "bytes"]),
        ({"model": "m", "cache_salt": None}, TypeError, ["cache_salt", "None"]),
        ({"model": "m", "lora_name": 3}, TypeError, ["lora_name", "3"]),
        ({"model": "m", "kv_identity": ["bf16"]}, TypeError, ["kv_identity", "['bf16']"]),
        ({"model": "m", "cache_salt": "bad\ud800"}, ValueError, ["cache_salt", "UTF-8"]),
    ],
    ids=repr,
)
def test_bad_namespace_fields_raise_naming_field_and_value(
    kwargs: dict[str, Any], error: type[Exception], fragments: list[str]
) -> None:
    with pytest.raises(error) as excinfo:
        KeyNamespace(**kwargs)
    message = str(excinfo.value)
    for fragment in fragments:
        assert fragment in message, message


def test_namespace_defaults_and_msgspec_round_trip() -> None:
    ns = KeyNamespace("Qwen/Qwen3-8B", cache_salt="租户-a", lora_name="sql", kv_identity="bf16")
    assert ns.tokens_per_chunk == DEFAULT_TOKENS_PER_CHUNK == 256
    assert len(ns.seed()) == CHUNK_KEY_BYTES == 16
    assert re.fullmatch(r"[0-9a-f]{32}", ns.namespace_id())
    encoded = msgspec.json.encode(ns)
    decoded = msgspec.json.decode(encoded, type=KeyNamespace)
    assert decoded == ns and decoded.namespace_id() == ns.namespace_id()
    assert hash(decoded) == hash(ns)  # frozen: usable as a dict key
    with pytest.raises(msgspec.ValidationError, match="tokens_per_chunk"):
        msgspec.json.decode(b'{"model": "m", "tokens_per_chunk": 0}', type=KeyNamespace)
    with pytest.raises(AttributeError):
        ns.model = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("n_tokens", "size", "expected"),
    [(0, 256, 0), (255, 256, 0), (256, 256, 1), (131_072, 256, 512), (9, 4, 2)],
)
def test_num_full_chunks(n_tokens: int, size: int, expected: int) -> None:
    assert num_full_chunks(n_tokens, size) == expected
    assert len(chunk_keys(list(range(n_tokens)), KeyNamespace("m", tokens_per_chunk=size))) == expected


@pytest.mark.parametrize(
    ("args", "error", "fragment"),
    [
        ((-1, 4), ValueError, "-1"),
        ((4, 0), ValueError, "0"),
        ((4.0, 4), TypeError, "4.0"),
        ((4, True), TypeError, "True"),
    ],
)
def test_num_full_chunks_rejects_bad_input(
    args: tuple[Any, Any], error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=re.escape(fragment)):
        num_full_chunks(*args)


# --- benchmark command --------------------------------------------------------------------------


def test_bench_hashing_command_reports_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "hashing", "--tokens", "1000", "--repeat", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["chunks"] == 3 and report["token_bytes"] == 3 * 256 * 4
    assert set(report["results"]) == {"numpy_int64", "list_int", "raw_blake2b"}
    for row in report["results"].values():
        assert row["us_per_prompt"] > 0 and row["mb_per_s"] > 0 and row["ratio_to_raw"] > 0
    assert report["results"]["raw_blake2b"]["ratio_to_raw"] == 1.0


def test_bench_hashing_command_text_and_bad_args(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "hashing", "--tokens", "600", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "600 tokens -> 2 chunks" in out and "MB/s" in out and "ratio" in out
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "hashing", "--tokens", "100"])
    assert exit_info.value.code == 2
    assert "--tokens 100 is less than one chunk" in capsys.readouterr().err
