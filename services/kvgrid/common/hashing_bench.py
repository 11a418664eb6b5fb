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
from typing import Any

import numpy as np

from kvgrid.common.hashing import CHUNK_KEY_BYTES, KeyNamespace, chunk_keys, num_full_chunks

_VOCAB = 151_936  # a real vocabulary size (Qwen), so ids use the upper bytes as real prompts do
_WARMUP = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=131_072, help="prompt length in tokens (default 128k)")
    parser.add_argument("--tokens-per-chunk", type=int, default=256, help="chunk size (default 256)")
    parser.add_argument("--repeat", type=int, default=50, help="timed runs per case; the median is reported")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


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
    for name in ("tokens", "tokens_per_chunk", "repeat"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    namespace = KeyNamespace(model="kvgrid-bench/model", tokens_per_chunk=args.tokens_per_chunk)
    chunks = num_full_chunks(args.tokens, args.tokens_per_chunk)
    if chunks == 0:
        raise ValueError(f"--tokens {args.tokens} is less than one chunk of {args.tokens_per_chunk} tokens")

    token_array = np.random.default_rng(args.seed).integers(0, _VOCAB, size=args.tokens, dtype=np.int64)
    token_list = token_array.tolist()
    hashed = token_array[: chunks * args.tokens_per_chunk].astype("<u4").tobytes()
    nbytes = len(hashed)

    keys = chunk_keys(token_array, namespace)
    if len(keys) != chunks or keys != chunk_keys(token_list, namespace):
        raise RuntimeError("chunk_keys gave different keys for the numpy and list forms of one prompt")

    raw = _median_seconds(lambda: blake2b(hashed, digest_size=CHUNK_KEY_BYTES).digest(), args.repeat)
    cases = {
        "numpy_int64": _median_seconds(lambda: chunk_keys(token_array, namespace), args.repeat),
        "list_int": _median_seconds(lambda: chunk_keys(token_list, namespace), args.repeat),
    }
    results: dict[str, Any] = {
        "tokens": args.tokens,
        "tokens_per_chunk": args.tokens_per_chunk,
        "chunks": chunks,
        "token_bytes": nbytes,
        "repeat": args.repeat,
        "results": {name: _row(s, nbytes, raw) for name, s in cases.items()}
        | {"raw_blake2b": _row(raw, nbytes, raw)},
    }
    if args.json:
        print(json.dumps(results, indent=2))
        return 0

    print(
        f"chunk keys: {args.tokens} tokens -> {chunks} chunks of {args.tokens_per_chunk} "
        f"({nbytes} token bytes hashed), median of {args.repeat} runs"
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
