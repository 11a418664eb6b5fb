"""Forward one HTTP request to the first pod that takes it; stream the answer back unchanged.

Invariants:
- A pod that fails to connect, times out connecting, or answers 5xx is skipped and the next target
  is tried; nothing has been sent to the client yet when that happens. Once the answer's status
  line is in (2xx-4xx), the answer is the client's: status, headers (less hop-by-hop ones) and body
  bytes as the pod sent them (no decompression: the session is made with ``auto_decompress=False``),
  SSE streams included. A failure after that cuts the client's stream; it is never retried.
- Every attempt counts as in flight on its pod while it lasts (the fallback order's load).
- When every target fails the client gets 502 with each pod's error.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import aiohttp
from aiohttp import web

from kvgrid.client import PodRanker
from kvgrid.router.pods import Target

__all__ = ["HOP_BY_HOP", "forward"]

log = logging.getLogger(__name__)

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
    }
)


def _headers(headers: aiohttp.typedefs.LooseHeaders) -> dict[str, str]:
    return {k: v for k, v in dict(headers).items() if k.lower() not in HOP_BY_HOP}


async def forward(
    request: web.Request,
    session: aiohttp.ClientSession,
    ranker: PodRanker,
    targets: Sequence[Target],
    path: str,
    body: bytes | None,
    route: str,
) -> web.StreamResponse:
    """Send ``request`` (method, headers, ``body``) to ``path`` on each target in turn."""
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
    headers.pop("Content-Length", None)
    errors: list[str] = []
    for i, target in enumerate(targets):
        with ranker.in_flight(target.pod_uid):
            try:
                resp = await session.request(request.method, target.url + path, data=body, headers=headers)
            except (aiohttp.ClientError, TimeoutError) as e:
                errors.append(f"{target.pod_uid} ({target.url}): {type(e).__name__}: {e}")
                log.warning("pod %s failed (%s); %s", target.pod_uid, errors[-1], _next(targets, i))
                continue
            async with resp:
                if resp.status >= 500:
                    text = (await resp.read())[:300].decode(errors="replace")
                    errors.append(f"{target.pod_uid} ({target.url}): HTTP {resp.status}: {text}")
                    log.warning("pod %s answered %d; %s", target.pod_uid, resp.status, _next(targets, i))
                    continue
                out = web.StreamResponse(
                    status=resp.status, reason=resp.reason, headers=_headers(resp.headers)
                )
                out.headers["X-Kvgrid-Pod"] = target.pod_uid
                out.headers["X-Kvgrid-Route"] = route if i == 0 else f"{route}+failover"
                await out.prepare(request)
                try:
                    async for chunk in resp.content.iter_any():
                        await out.write(chunk)
                    await out.write_eof()
                except (aiohttp.ClientError, ConnectionResetError) as e:
                    # Too late to fail over: the client has part of the answer. Closing both sides
                    # tells the client (a cut stream) and vLLM (the request is aborted).
                    log.warning("answer from pod %s cut short: %s: %s", target.pod_uid, type(e).__name__, e)
                    if request.transport is not None:
                        request.transport.close()
                return out
    return web.json_response(
        {
            "error": {
                "message": f"no vLLM pod took the request ({len(targets)} tried): " + "; ".join(errors),
                "type": "BadGateway",
                "code": 502,
            }
        },
        status=502,
    )


def _next(targets: Sequence[Target], i: int) -> str:
    return f"trying {targets[i + 1].pod_uid}" if i + 1 < len(targets) else "no pod left to try"
