"""Run the router (``kvgrid router``): an OpenAI-compatible proxy that routes by the controller's Score."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import TYPE_CHECKING

from kvgrid.common.config import ConfigError, add_config_arguments, config_from_args
from kvgrid.router.config import ENV_PREFIX, RouterConfig

if TYPE_CHECKING:
    from kvgrid.client import PodRanker

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level", default="INFO", help="logging level (default INFO; DEBUG logs each route)"
    )
    add_config_arguments(parser, RouterConfig, env_prefix=ENV_PREFIX)


class _SettingError(Exception):
    """A setting refused before the router listens (exit code 2)."""


def _ranker(cfg: RouterConfig) -> PodRanker:
    from kvgrid.client import PodRanker

    namespace = cfg.namespace(cfg.model_name or "-")  # per request when model_name is empty
    return PodRanker(
        cfg.controller,
        namespace,
        tls_cert_file=cfg.tls_cert_file,
        tls_key_file=cfg.tls_key_file,
        tls_ca_file=cfg.tls_ca_file,
        tls_server_name=cfg.tls_server_name,
        timeout_s=cfg.score_timeout_s,
        reserve=cfg.reserve,
        static_pods=list(cfg.engine_urls),
        agents_refresh_s=cfg.agents_refresh_s,
        retry_s=cfg.controller_retry_s,
        lookup_address=cfg.lookup_address,
    )


async def _serve(cfg: RouterConfig) -> None:
    from aiohttp import web

    from kvgrid.router.app import make_app
    from kvgrid.router.pods import check_engine_urls

    try:
        check_engine_urls(cfg.engine_urls)
        ranker = _ranker(cfg)
    except ValueError as e:  # names the setting (engine_urls, the TLS files, lookup_address)
        raise _SettingError(str(e)) from None
    runner = web.AppRunner(make_app(cfg, ranker), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else cfg.port
    pods = len(await asyncio.to_thread(ranker.pods))
    via = f" via its lookup listener {cfg.lookup_address}" if cfg.lookup_address else " over gRPC"
    print(
        f"kvgrid router listening on http://{cfg.host}:{port} "
        f"(controller {cfg.controller}{via}, {pods} pods known)",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        ranker.close()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = config_from_args(RouterConfig, args, env_prefix=ENV_PREFIX)
    except ConfigError as e:
        print(f"kvgrid router: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(cfg))
    except _SettingError as e:
        print(f"kvgrid router: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from kvgrid.cli import main

    sys.exit(main(["router", *sys.argv[1:]]))
