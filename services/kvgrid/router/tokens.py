"""Token ids of a prompt from a vLLM pod's own ``/tokenize`` endpoint.

Why a pod and not a local tokenizer: ``/tokenize`` runs the engine's tokenizer and, for chats, the
engine's chat template with the request's own template options, so the ids are the ones the engine
will hash into chunk keys -- by construction, for every model and template. The cost is one extra
HTTP round trip to a pod (docs/router.md, "Tokenization", gives the measured figure).

Invariants: :func:`tokenize` returns the ids or raises :class:`TokenizeError`; a 4xx answer from
the pod means the request itself is bad (``bad_request`` set, its message passed to the client),
anything else (connect error, 5xx, a malformed answer) means this pod could not tokenize and the
caller may try another.
"""

from __future__ import annotations

from typing import Any

import aiohttp

__all__ = ["TokenizeError", "tokenize"]


class TokenizeError(Exception):
    def __init__(self, message: str, *, bad_request: bool = False, status: int = 0) -> None:
        super().__init__(message)
        self.bad_request = bad_request
        self.status = status


async def tokenize(session: aiohttp.ClientSession, base_url: str, body: dict[str, Any]) -> list[int]:
    """POST ``body`` (a vLLM TokenizeCompletionRequest or TokenizeChatRequest) to ``base_url``/tokenize."""
    url = base_url.rstrip("/") + "/tokenize"
    try:
        async with session.post(url, json=body) as resp:
            text = await resp.text()
            if 400 <= resp.status < 500:
                raise TokenizeError(_message(text), bad_request=True, status=resp.status)
            if resp.status != 200:
                raise TokenizeError(f"{url} answered {resp.status}: {text[:200]}", status=resp.status)
            try:
                data = await resp.json(content_type=None)
                tokens = data["tokens"]
            except (ValueError, KeyError, TypeError):
                raise TokenizeError(f"{url} answered without a 'tokens' list: {text[:200]}") from None
    except (aiohttp.ClientError, TimeoutError) as e:
        raise TokenizeError(f"{url}: {type(e).__name__}: {e}") from None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise TokenizeError(f"{url} answered a 'tokens' that is not a list of ints")
    return tokens


def _message(text: str) -> str:
    """vLLM's error JSON ({"error": {"message": ...}}) -> its message; other text as it is."""
    import json

    try:
        data = json.loads(text)
        err = data.get("error", data) if isinstance(data, dict) else data
        msg = err.get("message") if isinstance(err, dict) else None
        return str(msg) if msg else text[:500]
    except ValueError:
        return text[:500]
