"""What an OpenAI request body says about routing; the body itself is forwarded unchanged.

Invariants: :func:`routing_request` either returns a :class:`RoutingRequest` or raises
:class:`BadRequest` whose message names the field, the value (cut short) and what was expected;
it never modifies the body. A batch prompt (a list of prompts) is routed by its first prompt.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = ["CHAT_TOKENIZE_FIELDS", "BadRequest", "RoutingRequest", "routing_request"]

# Fields of a chat request that change its token ids: passed to vLLM's /tokenize as they are, so the
# chat template is applied exactly as the chat endpoint applies it.
CHAT_TOKENIZE_FIELDS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "tools",
)


class BadRequest(ValueError):
    """The request cannot be routed; the message is the HTTP 400 answer."""


class RoutingRequest(msgspec.Struct, frozen=True):
    kind: Literal["completion", "chat"]
    model: str
    cache_salt: str
    token_ids: tuple[int, ...] | None
    """The prompt's token ids when the request gives them (completions only), else None."""
    tokenize_body: dict[str, Any] | None
    """The body for vLLM's /tokenize when ``token_ids`` is None."""


def _cut(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_token_list(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in value)
    )


def _common(body: Any, kind: str) -> tuple[str, str]:
    if not isinstance(body, dict):
        raise BadRequest(f"request body {_cut(body)}: expected a JSON object")
    model = body.get("model", "")
    if not isinstance(model, str):
        raise BadRequest(f"'model' {_cut(model)}: expected a string")
    salt = body.get("cache_salt", "")
    if salt is None:
        salt = ""
    if not isinstance(salt, str):
        raise BadRequest(f"'cache_salt' {_cut(salt)}: expected a string")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(f"'stream' {_cut(stream)}: expected true or false")
    return model, salt


def routing_request(kind: Literal["completion", "chat"], body: Any) -> RoutingRequest:
    """The routing view of a ``/v1/completions`` (``kind="completion"``) or ``/v1/chat/completions``
    body (parsed JSON)."""
    model, salt = _common(body, kind)
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest(f"'messages' {_cut(messages)}: expected a non-empty list of message objects")
        chat = {k: body[k] for k in CHAT_TOKENIZE_FIELDS if k in body}
        return RoutingRequest("chat", model, salt, None, {"model": model, **chat} if model else chat)
    if "prompt" not in body:
        raise BadRequest("'prompt' is missing: expected a string, a list of token ids, or a list of either")
    prompt = body["prompt"]
    first = prompt[0] if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else prompt
    if isinstance(first, list) and _is_token_list(first):
        return RoutingRequest("completion", model, salt, tuple(first), None)
    if isinstance(first, str):
        tok: dict[str, Any] = {"prompt": first}
        if model:
            tok["model"] = model
        if "add_special_tokens" in body:
            tok["add_special_tokens"] = body["add_special_tokens"]
        return RoutingRequest("completion", model, salt, None, tok)
    raise BadRequest(
        f"'prompt' {_cut(prompt)}: expected a string, a non-empty list of token ids (0 <= id < 2**32), "
        "or a list of either"
    )
