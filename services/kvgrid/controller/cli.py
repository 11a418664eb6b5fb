"""Run the lookup/controller service (``kvgrid controller``): its gRPC server and, when
``lookup_port`` is set, the lean lookup listener (:mod:`kvgrid.controller.lookup_server`) on the same
host, with the gRPC side's TLS files and authorization policy (mTLS when TLS is on; otherwise
plaintext, loopback unless ``insecure_plaintext_on_network``). The "listening" line is printed once
both listen; a listener that cannot start stops the whole process (exit 2, naming the setting)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import TYPE_CHECKING

from kvgrid.common.config import ConfigError, add_config_arguments, config_from_args
from kvgrid.controller.config import ControllerConfig

if TYPE_CHECKING:
    from kvgrid.controller.core import Controller
    from kvgrid.controller.lookup_server import LookupServer

__all__ = ["add_arguments", "run", "start_lookup_listener"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    add_config_arguments(parser, ControllerConfig)


def start_lookup_listener(cfg: ControllerConfig, ctl: Controller) -> LookupServer | None:
    """The lean lookup listener of ``cfg`` serving ``ctl`` (None when ``lookup_port`` is 0): on the
    listen host, mTLS with the ``tls_*`` files and the gRPC ``POLICY`` when TLS is on. ValueError
    naming ``lookup_port`` when it cannot bind."""
    if not cfg.lookup_port:
        return None
    from kvgrid.common.authz import Authorizer
    from kvgrid.controller.lookup_server import LookupServer, server_ssl_context
    from kvgrid.controller.service import POLICY

    host = cfg.listen.rpartition(":")[0]
    tls = cfg.tls
    try:
        return LookupServer(
            ctl,
            f"{host}:{cfg.lookup_port}",
            ssl_context=server_ssl_context(tls) if tls is not None else None,
            authorizer=Authorizer.for_settings(POLICY, cfg) if tls is not None else None,
            insecure_plaintext_on_network=cfg.insecure_plaintext_on_network,
        )
    except ValueError as e:
        raise ValueError(f"lookup_port={cfg.lookup_port}: the lookup listener cannot start: {e}") from None


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = config_from_args(ControllerConfig, args)
    except ConfigError as e:
        print(f"kvgrid controller: {e}", file=sys.stderr)
        return 2
    from kvgrid.common.telemetry import setup_telemetry
    from kvgrid.controller.service import serve

    # Never raises for a telemetry setting: a bad one is logged and that exporter left out.
    telemetry = setup_telemetry(
        "kvgrid-controller",
        prometheus_port=cfg.prometheus_port or None,
        otlp_endpoint=cfg.otlp_endpoint or None,
    )
    done = threading.Event()

    def _stop(signum: int, _frame: object) -> None:
        done.set()

    # Handlers before the "listening" line: a supervisor may stop us as soon as it sees it.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    server = serve(cfg, telemetry=telemetry)
    try:
        lookup = start_lookup_listener(cfg, server.controller)
    except ValueError as e:
        server.stop()
        telemetry.shutdown()
        print(f"kvgrid controller: {e}", file=sys.stderr)
        return 2
    extra = ""
    if lookup is not None:
        extra = f"; lookup listener on {lookup.address} ({'mTLS' if lookup.tls else 'plaintext'})"
    print(f"kvgrid controller listening on {server.address} (index: {cfg.index_backend}){extra}", flush=True)
    done.wait()
    if lookup is not None:
        lookup.stop()
    server.stop()
    telemetry.shutdown()
    return 0


if __name__ == "__main__":
    from kvgrid.cli import main

    sys.exit(main(["controller", *sys.argv[1:]]))
