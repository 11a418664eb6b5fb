"""Run the lookup/controller service (``kvgrid controller``)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from kvgrid.common.config import ConfigError, add_config_arguments, config_from_args
from kvgrid.controller.config import ControllerConfig

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    add_config_arguments(parser, ControllerConfig)


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
    print(f"kvgrid controller listening on {server.address} (index: {cfg.index_backend})", flush=True)
    done.wait()
    server.stop()
    telemetry.shutdown()
    return 0


if __name__ == "__main__":
    from kvgrid.cli import main

    sys.exit(main(["controller", *sys.argv[1:]]))
