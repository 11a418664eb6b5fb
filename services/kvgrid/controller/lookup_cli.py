"""Ask a controller which pods hold a prefix, list agents, show stats (``kvgrid lookup``)."""

from __future__ import annotations

import argparse
import os

import grpc
from rich.console import Console
from rich.table import Table

from kvgrid.api.client import controller_stub
from kvgrid.api.v1 import common_pb2, controller_pb2
from kvgrid.common.tls import CONTROLLER_SERVER_NAME

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--controller", default="127.0.0.1:50061", help="controller host:port")
    parser.add_argument("--timeout", type=float, default=5.0, help="RPC deadline in seconds")
    for name, what in (
        ("cert", "PEM client certificate (a router identity, e.g. /etc/kvgrid/tls/tls.crt)"),
        ("key", "PEM private key of --tls-cert-file"),
        ("ca", "PEM CA bundle that signs the controller's certificate"),
    ):
        env = f"KVGRID_TLS_{name.upper()}_FILE"
        parser.add_argument(
            f"--tls-{name}-file",
            default=os.environ.get(env, ""),
            help=f"{what}; all three TLS files for mTLS, none for plaintext (env {env})",
        )
    parser.add_argument(
        "--tls-server-name",
        default=CONTROLLER_SERVER_NAME,
        help="name the controller's certificate must carry (default: %(default)s)",
    )
    sub = parser.add_subparsers(dest="what", metavar="WHAT", required=True)
    for name, help_text in (("match", "leading chunks per pod and tier"), ("score", "pods ranked by TTFT")):
        p = sub.add_parser(name, help=help_text)
        q = p.add_mutually_exclusive_group(required=True)
        q.add_argument("--text", help="prompt text; tokenized as UTF-8 bytes unless --tokenizer is given")
        q.add_argument("--tokens", help="comma-separated token ids")
        q.add_argument("--keys", help="comma-separated hex chunk keys (needs --namespace-id or --model)")
        p.add_argument("--tokenizer", default="", help="Hugging Face tokenizer name/path for --text")
        p.add_argument("--model", default="", help="KeyNamespace.model")
        p.add_argument("--cache-salt", default="")
        p.add_argument("--lora-name", default="")
        p.add_argument("--tokens-per-chunk", type=int, default=256)
        p.add_argument("--kv-identity", default="")
        p.add_argument("--namespace-id", default="", help="hex namespace id (with --keys)")
        p.add_argument("--pods", default="", help="comma-separated candidate pod UIDs")
        if name == "score":
            p.add_argument(
                "--reserve", action="store_true", help="record a speculative entry for the best pod"
            )
    sub.add_parser("agents", help="registered agents, leases and entry counts")
    sub.add_parser("stats", help="index size, ingest and resync counters")


def _tokens(args: argparse.Namespace) -> list[int]:
    if args.tokens is not None:
        try:
            return [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            raise SystemExit(f"--tokens {args.tokens!r:.60}: expected comma-separated integers") from None
    if args.tokenizer:
        from transformers import AutoTokenizer

        return list(AutoTokenizer.from_pretrained(args.tokenizer).encode(args.text))
    return list(args.text.encode())


def _request(args: argparse.Namespace) -> controller_pb2.MatchPrefixRequest:
    req = controller_pb2.MatchPrefixRequest(candidate_pod_uids=[p for p in args.pods.split(",") if p])
    if args.model:
        req.namespace.CopyFrom(
            common_pb2.KeyNamespace(
                model=args.model,
                cache_salt=args.cache_salt,
                lora_name=args.lora_name,
                tokens_per_chunk=args.tokens_per_chunk,
                kv_identity=args.kv_identity,
            )
        )
    if args.keys is not None:
        try:
            req.chunk_keys.keys.extend(bytes.fromhex(k.strip()) for k in args.keys.split(",") if k.strip())
        except ValueError:
            raise SystemExit(f"--keys {args.keys!r:.60}: expected comma-separated hex") from None
        req.namespace_id = args.namespace_id
    else:
        if not args.model:
            raise SystemExit("--model is required with --text/--tokens (it names the key namespace)")
        req.token_ids.ids.extend(_tokens(args))
    return req


def run(args: argparse.Namespace) -> int:
    console = Console()
    stub = controller_stub(
        args.controller,
        cert_file=args.tls_cert_file,
        key_file=args.tls_key_file,
        ca_file=args.tls_ca_file,
        server_name=args.tls_server_name,
    )
    try:
        if args.what == "match":
            m = stub.MatchPrefix(_request(args), timeout=args.timeout)
            title = f"{m.num_query_chunks} query chunks; other pods: {m.peer_fetchable_chunks} from peers"
            t = Table(title=title)
            for col in ("pod", "name", "GPU", "L1", "L2", "peer", "total"):
                t.add_column(col, justify="left" if col in ("pod", "name") else "right")
            for p in m.matches:
                t.add_row(
                    p.pod_uid,
                    p.pod_name,
                    str(p.gpu_chunks),
                    str(p.l1_chunks),
                    str(p.l2_chunks),
                    str(p.peer_chunks),
                    str(p.gpu_chunks + p.l1_chunks + p.l2_chunks + p.peer_chunks),
                )
            console.print(t)
        elif args.what == "score":
            s = stub.Score(
                controller_pb2.ScoreRequest(match=_request(args), reserve=args.reserve), timeout=args.timeout
            )
            t = Table(title=f"{s.num_query_chunks} query chunks, best first")
            cols = ("pod", "GPU", "L1", "L2", "peer", "TTFT ms", "L1 ms", "L2 ms", "peer ms", "prefill ms")
            for col in (*cols, "queue ms"):
                t.add_column(col, justify="left" if col == "pod" else "right")
            for e in s.scores:
                p = e.match
                t.add_row(
                    p.pod_uid,
                    str(p.gpu_chunks),
                    str(p.l1_chunks),
                    str(p.l2_chunks),
                    str(p.peer_chunks),
                    f"{e.estimated_ttft_ms:.2f}",
                    f"{e.l1_transfer_ms:.2f}",
                    f"{e.l2_transfer_ms:.2f}",
                    f"{e.peer_transfer_ms:.2f}",
                    f"{e.prefill_ms:.2f}",
                    f"{e.queue_ms:.2f}",
                )
            console.print(t)
        elif args.what == "agents":
            r = stub.ListAgents(controller_pb2.ListAgentsRequest(), timeout=args.timeout)
            t = Table(title=f"{len(r.agents)} agents")
            for col in (
                "pod uid",
                "name",
                "node",
                "epoch",
                "address",
                "chunks",
                "last seq",
                "lease ms",
                "running",
                "waiting",
            ):
                t.add_column(col, overflow="fold")  # never hide part of a UID or an address
            for a in r.agents:
                t.add_row(
                    a.pod.pod_uid,
                    a.pod.pod_name,
                    a.pod.node_name,
                    str(a.pod.epoch),
                    a.pod.agent_address,
                    str(a.num_chunks),
                    str(a.last_sequence),
                    str(a.lease_remaining_ms),
                    str(a.load.running_requests),
                    str(a.load.waiting_requests),
                )
            console.print(t)
        else:
            st = stub.GetStats(controller_pb2.GetStatsRequest(), timeout=args.timeout)
            t = Table(title=f"controller {args.controller}")
            t.add_column("stat")
            t.add_column("value", justify="right")
            for field, value in st.ListFields():
                t.add_row(field.name, str(value))
            console.print(t)
    except grpc.RpcError as e:
        console.print(f"[red]{e.code().name}[/red]: {e.details()}")
        return 1
    return 0
