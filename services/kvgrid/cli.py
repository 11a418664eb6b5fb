"""The ``kvgrid`` command.

Each subcommand lives in the module that owns the work; this file only maps names to modules so
``kvgrid --help`` stays fast (modules, and torch, are imported only for the command that runs).
A module listed here exposes ``add_arguments(parser)`` and ``run(args) -> int``; the help text is
the second item of its entry below. Only commands that exist are listed. Benchmarks, the demo and
``kvgrid chaos`` live in ``kvgrid.bench`` (and ``kvgrid_kernels.bench``), which the runtime packages
never import: this table names them by string and they load only when their command runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help). Keep alphabetical.
COMMANDS: dict[str, tuple[str, str]] = {
    "agent": ("kvgrid.agent.cli", "run the per-GPU agent: L1 chunk cache, store/retrieve/lookup, events"),
    "chaos": (
        "kvgrid.bench.chaos",
        "the demo's workload on agents, a controller and Valkey under random faults (kill -9, SIGSTOP, "
        "cut connections, full or corrupt disk tier, S3 down); every loaded chunk checked bit for bit",
    ),
    "controller": ("kvgrid.controller.cli", "run the lookup/controller service (gRPC)"),
    "demo": (
        "kvgrid.bench.demo",
        "start a controller and two agents here and run a multi-turn chat workload "
        "(--engine vllm: real vLLM CPU engines, TTFT with and without kvgrid)",
    ),
    "lookup": ("kvgrid.controller.lookup_cli", "ask a controller: match a prefix, score pods, agents, stats"),
    "router": ("kvgrid.router.cli", "OpenAI-compatible proxy: each request to the pod Score ranks best"),
}

# kvgrid bench <name> -> (module, one-line help).
BENCHMARKS: dict[str, tuple[str, str]] = {
    "agent": ("kvgrid.bench.agent", "store/retrieve GB/s through the agent (gRPC + IPC) vs the kernel alone"),
    "checksum": (
        "kvgrid.bench.checksum",
        "chunk checksums (xxh3-128, blake2b, crc32): GB/s vs a memory copy of the same bytes",
    ),
    "hashing": ("kvgrid.bench.hashing", "chunk keys for a long prompt: µs and MB/s of token bytes"),
    "hotpath": (
        "kvgrid.bench.hotpath",
        "one request's agent calls: µs over the hot path vs gRPC vs bare socket round trips",
    ),
    "lookup": ("kvgrid.bench.lookup", "MatchPrefix ops/s, p50/p99 over gRPC, ingest rate, bytes/entry"),
    "p2p": (
        "kvgrid.bench.p2p",
        "peer chunk fetch GB/s between agent processes (data plane) vs a raw socket copy of the same bytes",
    ),
    "routing": (
        "kvgrid.bench.routing",
        "replay a production trace: Score vs round-robin, least-loaded, prefix routing (hits, TTFT, spread)",
    ),
    "serve": (
        "kvgrid.bench.ttft.serve",
        "many requests at once through vLLM's scheduler at rising rates: TTFT/ITL percentiles and "
        "throughput, vLLM's prefix cache alone vs + kvgrid",
    ),
    "tier": ("kvgrid.bench.tier", "disk tier write/read-back GB/s vs raw sequential I/O, same fs"),
    "transfer": (
        "kvgrid_kernels.bench.transfer",
        "KV transfer kernels: store/retrieve GB/s vs pinned memcpy",
    ),
    "ttft": (
        "kvgrid.bench.ttft.bench",
        "time to first token of a Llama-shaped engine through KVGridConnector: miss, hit, prefill, raw copy",
    ),
}


def _add_group(
    sub: argparse._SubParsersAction,
    registry: dict[str, tuple[str, str]],
    chosen: str | None,
    argv: Sequence[str] = (),
) -> None:
    for name, (module, help_text) in registry.items():
        parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            mod = importlib.import_module(module)
            # A command whose flags depend on one of its flags (`demo --engine`) sees the arguments.
            add_for_argv = getattr(mod, "add_arguments_for_argv", None)
            if add_for_argv is not None:
                add_for_argv(parser, argv)
            else:
                mod.add_arguments(parser)
            parser.set_defaults(_run=mod.run)


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgrid",
        description="kvgrid: disaggregated KV-cache service for LLM inference (agents, lookup, benchmarks).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    words = [a for a in argv if not a.startswith("-")]
    _add_group(sub, COMMANDS, words[0] if words else None, argv)
    bench = sub.add_parser(
        "bench", help="benchmarks that measure a limit in the same run and print the ratio"
    )
    bench.set_defaults(_help=bench.print_help)
    bench_sub = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    _add_group(bench_sub, BENCHMARKS, words[1] if len(words) > 1 and words[0] == "bench" else None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        getattr(args, "_help", parser.print_help)()  # `kvgrid bench` alone lists the benchmarks
        return 2
    try:
        return int(run(args) or 0)
    except (ValueError, TypeError) as exc:
        # Bad values reach users as one line naming the value, not a traceback.
        parser.exit(2, f"kvgrid: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
