"""The router's aiohttp application: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health``.

Per completion request: parse the routing fields (400 on a bad body, the process keeps serving),
take the prompt's token ids (given, or from a pod's ``/tokenize``), rank the pods with
:class:`kvgrid.client.PodRanker` (``Score``; least-loaded/round-robin while the controller is
away), and forward to the best pod, failing over to the next (``upstream.forward``). The answer
carries ``X-Kvgrid-Pod`` (the pod that served it) and ``X-Kvgrid-Route`` (``score``, ``fallback``,
``+failover`` when the first pod failed).

Invariants: a controller outage never turns into a 5xx; a 400 from the router names the field and
what was expected; gRPC calls (blocking) run in worker threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from typing import Any, Literal

import aiohttp
from aiohttp import web

from kvgrid.client import PodRanker, RankedPod, Ranking
from kvgrid.router.config import RouterConfig
from kvgrid.router.pods import Target, targets
from kvgrid.router.requests import BadRequest, routing_request
from kvgrid.router.tokens import TokenizeError, tokenize
from kvgrid.router.upstream import forward

__all__ = ["make_app"]

log = logging.getLogger(__name__)

RANKER_KEY = web.AppKey("ranker", PodRanker)
SESSION_KEY = web.AppKey("session", aiohttp.ClientSession)


def _error(status: int, message: str) -> web.Response:
    """An OpenAI-style error body (what vLLM answers too)."""
    kind = {400: "BadRequestError", 503: "ServiceUnavailable"}.get(status, "Error")
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


class Router:
    def __init__(self, cfg: RouterConfig, ranker: PodRanker) -> None:
        self.cfg = cfg
        self.ranker = ranker
        self._tokenize_turn = itertools.count()  # spreads /tokenize calls over the pods

    def session(self, request: web.Request) -> aiohttp.ClientSession:
        return request.app[SESSION_KEY]

    async def known_targets(self) -> list[Target]:
        """Routable pods, least loaded first; the round-robin turn is left to the routing decision
        (``rank``), so one request advances it once."""
        pods = await asyncio.to_thread(self.ranker.pods)
        return targets(
            self.ranker.fallback_order(pods, rotate=False), self.cfg.engine_urls, self.cfg.engine_port
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, "completion", "/v1/completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, "chat", "/v1/chat/completions")

    async def _route(
        self, request: web.Request, kind: Literal["completion", "chat"], path: str
    ) -> web.StreamResponse:
        body = await request.read()
        try:
            parsed = json.loads(body)
        except ValueError as e:
            return _error(400, f"request body is not valid JSON ({e}): expected an OpenAI {kind} request")
        try:
            rr = routing_request(kind, parsed)
            namespace = self._namespace(rr.model)
        except BadRequest as e:
            return _error(400, str(e))
        known = await self.known_targets()
        if not known:
            return _error(
                503,
                "no vLLM pod known: the controller lists no agent with an engine URL and engine_urls "
                "is empty",
            )
        token_ids: list[int] | None = list(rr.token_ids) if rr.token_ids is not None else None
        if token_ids is None and rr.tokenize_body is not None:
            try:
                token_ids = await self._tokenize(request, known, rr.tokenize_body)
            except BadRequest as e:
                return _error(400, str(e))
        if token_ids is not None:
            ranking = await asyncio.to_thread(
                self.ranker.rank, token_ids, namespace=namespace, cache_salt=rr.cache_salt
            )
        else:  # no pod could tokenize: route by load; forwarding reports what the pods say
            pods = self.ranker.fallback_order(await asyncio.to_thread(self.ranker.pods))
            ranking = Ranking(tuple(RankedPod(p) for p in pods), "fallback")
        chosen = targets((r.pod for r in ranking.pods), self.cfg.engine_urls, self.cfg.engine_port)
        chosen = chosen[: self.cfg.max_attempts]
        if ranking.pods and log.isEnabledFor(logging.DEBUG):
            best = ranking.pods[0]
            log.debug(
                "%s: %d tokens, %d chunks -> %s by %s (gpu %d, l1 %d, l2 %d, peer %d chunks)",
                path, len(token_ids or ()), ranking.num_query_chunks, best.pod.pod_uid, ranking.source,
                best.gpu_chunks, best.l1_chunks, best.l2_chunks, best.peer_chunks,
            )  # fmt: skip
        return await forward(request, self.session(request), self.ranker, chosen, path, body, ranking.source)

    def _namespace(self, model: str) -> Any:
        if not self.cfg.model_name and not model:
            raise BadRequest(
                "'model' is missing: expected the model name (the router's model_name is not set, so the "
                "request's model names the key namespace)"
            )
        return self.cfg.namespace(model)

    async def _tokenize(
        self, request: web.Request, known: list[Target], body: dict[str, Any]
    ) -> list[int] | None:
        """Token ids from the first pod that tokenizes, pods taken in turn; None when none could."""
        start = next(self._tokenize_turn) % len(known)
        for target in [*known[start:], *known[:start]][: self.cfg.max_attempts]:
            try:
                return await tokenize(self.session(request), target.url, body)
            except TokenizeError as e:
                if e.bad_request:
                    raise BadRequest(f"the engine rejected the prompt: {e}") from None
                log.warning("tokenize on %s failed: %s", target.pod_uid, e)
        return None

    async def models(self, request: web.Request) -> web.StreamResponse:
        known = (await self.known_targets())[: self.cfg.max_attempts]
        if not known:
            return _error(503, "no vLLM pod known: the controller lists no agent and engine_urls is empty")
        return await forward(
            request, self.session(request), self.ranker, known, "/v1/models", None, "fallback"
        )

    async def health(self, request: web.Request) -> web.Response:
        known = await self.known_targets()
        return web.json_response(
            {"status": "ok", "pods": len(known), "controller": self.ranker.controller_error or "ok"}
        )


def make_app(cfg: RouterConfig, ranker: PodRanker, *, max_body_bytes: int = 64 << 20) -> web.Application:
    """The application; its client session to the pods opens on startup and closes on cleanup."""
    app = web.Application(client_max_size=max_body_bytes)
    app[RANKER_KEY] = ranker
    router = Router(cfg, ranker)

    async def session_ctx(app: web.Application) -> Any:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s)
        # No decompression and no connection limit per host: bytes pass through as the pod sends them.
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(
            timeout=timeout, auto_decompress=False, connector=connector
        ) as session:
            app[SESSION_KEY] = session
            yield

    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/chat/completions", router.chat)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/health", router.health)
    return app
