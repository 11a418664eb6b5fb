"""Run the per-GPU kvgrid agent: L1 chunk cache, store/retrieve/lookup, events to the controller."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from types import FrameType

from kvgrid.agent.config import AgentConfig
from kvgrid.common.config import ConfigError, add_config_arguments, config_from_args

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run the per-GPU kvgrid agent. It serves AgentService on a Unix socket (for the engine's "
        "connector) and on TCP (peers, the controller's snapshot pulls), keeps an L1 chunk cache in "
        "one pool allocated at start, and streams admit/evict events to the controller when "
        "--controller-address is set. Pod identity comes from the POD_UID, POD_NAME, POD_NAMESPACE "
        "and NODE_NAME env vars (Kubernetes downward API)."
    )
    add_config_arguments(parser, AgentConfig)


def _pod_resource() -> dict[str, str]:
    """OpenTelemetry resource attributes of this agent's pod (downward-API env vars), so spans and
    metrics of two agents tell which is which."""
    names = {
        "POD_UID": "k8s.pod.uid",
        "POD_NAME": "k8s.pod.name",
        "POD_NAMESPACE": "k8s.namespace.name",
        "NODE_NAME": "k8s.node.name",
    }
    return {attr: os.environ[env] for env, attr in names.items() if os.environ.get(env)}


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(AgentConfig, args)
    except ConfigError as e:
        print(f"kvgrid agent: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from kvgrid.agent.service import AgentServer
    from kvgrid.common.telemetry import setup_telemetry

    # Never raises for a telemetry setting: a bad one is logged and that exporter left out.
    telemetry = setup_telemetry(
        "kvgrid-agent",
        prometheus_port=cfg.prometheus_port or None,
        otlp_endpoint=cfg.otlp_endpoint or None,
        resource_attributes=_pod_resource(),
    )
    server = AgentServer(cfg, meter=telemetry.meter, tracer=telemetry.tracer)
    # Handlers go in before the "serving" line: a SIGTERM right after it must stop cleanly.
    done = threading.Event()

    def _stop(signum: int, frame: FrameType | None) -> None:
        done.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        server.start()
    except ValueError as e:
        print(f"kvgrid agent: {e}", file=sys.stderr)
        telemetry.shutdown()
        return 2
    assert server.core is not None
    # One machine-readable line so scripts and tests know where the agent listens.
    print(
        json.dumps(
            {
                "event": "serving",
                "uds_path": server.uds_path,
                "tcp_port": server.tcp_port,
                "pod_uid": server.core.pod.pod_uid,
                "epoch": server.core.pod.epoch,
                "l1_capacity_bytes": server.core.pool.capacity_bytes,
            }
        ),
        flush=True,
    )
    done.wait()
    server.stop()
    telemetry.shutdown()
    return 0
