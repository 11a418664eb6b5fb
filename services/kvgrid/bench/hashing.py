"""Chunk keys for a long prompt: µs per prompt and MB/s of token bytes, against raw BLAKE2b.

The limit is one ``hashlib.blake2b`` call over the same token bytes (no chaining, no per-chunk calls,
no validation or conversion): no implementation of the chained scheme can hash those bytes faster on
one core. ratio = our throughput / raw throughput.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from hashlib import blake2b
from typing import Annotated, Any

import msgspec
import numpy as np

from kvgrid.common.config import add_config_arguments, config_from_args
from kvgrid.common.hashing import CHUNK_KEY_BYTES, KeyNamespace, chunk_keys, num_full_chunks

_VOCAB = 151_936  # a real vocabulary size (Qwen), so ids use the upper bytes as real prompts do
_WARMUP = 3


ENV_PREFIX = "KVGRID_BENCH_HASHING_"


class HashingBenchConfig(msgspec.Struct, frozen=True, kw_only=True):
    """``kvgrid bench hashing``'s options, loaded like a service config (``kvgrid.common.config``):
    defaults < ``--config`` YAML < ``KVGRID_BENCH_HASHING_*`` env < flags."""

    tokens: Annotated[int, msgspec.Meta(description="prompt length in tokens")] = 131_072
    tokens_per_chunk: Annotated[int, msgspec.Meta(description="chunk size")] = 256
    repeat: Annotated[int, msgspec.Meta(description="timed runs per case; the median is reported")] = 50
    seed: Annotated[int, msgspec.Meta(description="seed of the random token ids")] = 0
    json: Annotated[bool, msgspec.Meta(description="print one JSON object instead of text")] = False

    def __post_init__(self) -> None:
        for name in ("tokens", "tokens_per_chunk", "repeat"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, HashingBenchConfig, env_prefix=ENV_PREFIX)


def _median_seconds(fn: Callable[[], object], repeat: int) -> float:
    for _ in range(_WARMUP):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _row(seconds: float, nbytes: int, raw_seconds: float) -> dict[str, float]:
    return {
        "us_per_prompt": seconds * 1e6,
        "mb_per_s": nbytes / seconds / 1e6,
        "ratio_to_raw": raw_seconds / seconds,
    }


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(HashingBenchConfig, args, env_prefix=ENV_PREFIX)
    namespace = KeyNamespace(model="kvgrid-bench/model", tokens_per_chunk=cfg.tokens_per_chunk)
    chunks = num_full_chunks(cfg.tokens, cfg.tokens_per_chunk)
    if chunks == 0:
        raise ValueError(f"--tokens {cfg.tokens} is less than one chunk of {cfg.tokens_per_chunk} tokens")

    token_array = np.random.default_rng(cfg.seed).integers(0, _VOCAB, size=cfg.tokens, dtype=np.int64)
    token_list = token_array.tolist()
    hashed = token_array[: chunks * cfg.tokens_per_chunk].astype("<u4").tobytes()
    nbytes = len(hashed)

    keys = chunk_keys(token_array, namespace)
    if len(keys) != chunks or keys != chunk_keys(token_list, namespace):
        raise RuntimeError("chunk_keys gave different keys for the numpy and list forms of one prompt")

    raw = _median_seconds(lambda: blake2b(hashed, digest_size=CHUNK_KEY_BYTES).digest(), cfg.repeat)
    cases = {
        "numpy_int64": _median_seconds(lambda: chunk_keys(token_array, namespace), cfg.repeat),
        "list_int": _median_seconds(lambda: chunk_keys(token_list, namespace), cfg.repeat),
    }
    results: dict[str, Any] = {
        "tokens": cfg.tokens,
        "tokens_per_chunk": cfg.tokens_per_chunk,
        "chunks": chunks,
        "token_bytes": nbytes,
        "repeat": cfg.repeat,
        "results": {name: _row(s, nbytes, raw) for name, s in cases.items()}
        | {"raw_blake2b": _row(raw, nbytes, raw)},
    }
    if cfg.json:
        print(json.dumps(results, indent=2))
        return 0

    print(
        f"chunk keys: {cfg.tokens} tokens -> {chunks} chunks of {cfg.tokens_per_chunk} "
        f"({nbytes} token bytes hashed), median of {cfg.repeat} runs"
    )
    labels = {
        "numpy_int64": "ours, numpy int64 input",
        "list_int": "ours, list[int] input",
        "raw_blake2b": "limit: one blake2b call, same bytes",
    }
    for name, row in results["results"].items():
        print(
            f"  {labels[name]:<38} {row['us_per_prompt']:10.1f} µs/prompt "
            f"{row['mb_per_s']:9.1f} MB/s   ratio {row['ratio_to_raw']:.2f}"
        )
    return 0
