"""The router's request parsing and pod -> URL mapping (no engine needed)."""

from __future__ import annotations

import pytest

from kvgrid.client import KnownPod
from kvgrid.router.config import RouterConfig
from kvgrid.router.pods import Target, check_engine_urls, targets
from kvgrid.router.requests import BadRequest, routing_request


def test_completion_text_and_token_prompts() -> None:
    r = routing_request("completion", {"model": "m", "prompt": "hello", "cache_salt": "t1"})
    assert (r.token_ids, r.tokenize_body, r.cache_salt) == (None, {"prompt": "hello", "model": "m"}, "t1")
    r = routing_request("completion", {"model": "m", "prompt": [5, 6, 7]})
    assert r.token_ids == (5, 6, 7) and r.tokenize_body is None
    # A batch is routed by its first prompt.
    assert routing_request("completion", {"prompt": [[9, 8], [1]]}).token_ids == (9, 8)
    assert routing_request("completion", {"prompt": ["a", "b"]}).tokenize_body == {"prompt": "a"}


def test_chat_keeps_every_field_that_changes_tokens() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "add_generation_prompt": False,
        "chat_template_kwargs": {"x": 1},
        "temperature": 0,  # not a tokenization field
    }
    r = routing_request("chat", body)
    assert r.tokenize_body == {
        "model": "m",
        "messages": body["messages"],
        "add_generation_prompt": False,
        "chat_template_kwargs": {"x": 1},
    }


@pytest.mark.parametrize(
    ("kind", "body", "names"),
    [
        ("completion", [1, 2], "expected a JSON object"),
        ("completion", {"model": "m"}, "'prompt' is missing"),
        ("completion", {"prompt": 5}, "'prompt' 5: expected a string"),
        ("completion", {"prompt": [1, -1]}, "'prompt' [1, -1]"),
        ("completion", {"prompt": "x", "model": 3}, "'model' 3: expected a string"),
        ("completion", {"prompt": "x", "cache_salt": 1}, "'cache_salt' 1: expected a string"),
        ("completion", {"prompt": "x", "stream": "yes"}, "'stream' 'yes': expected true or false"),
        ("chat", {"messages": []}, "'messages' []: expected a non-empty list"),
        ("chat", {"messages": "hi"}, "'messages' 'hi'"),
    ],
)
def test_bad_requests_name_the_field(kind: str, body: object, names: str) -> None:
    with pytest.raises(BadRequest) as e:
        routing_request(kind, body)  # type: ignore[arg-type]
    assert names in str(e.value)


def test_targets_from_agent_address_and_engine_urls() -> None:
    pods = [
        KnownPod("uid-a", "pod-a", "10.0.0.5:50062"),
        KnownPod("uid-b", "pod-b", "[fd00::7]:50062"),
        KnownPod("uid-c", "pod-c", "10.0.0.9:50062"),
        KnownPod("pod-c"),  # a static entry naming pod-c by name: same URL, dropped
        KnownPod("uid-x"),  # no address, no mapping: not routable
    ]
    urls = {"uid-a": "http://a.example:9000/", "pod-c": "http://c.example:8000"}
    assert targets(pods, urls, 8000) == [
        Target("uid-a", "http://a.example:9000"),
        Target("uid-b", "http://[fd00::7]:8000"),
        Target("uid-c", "http://c.example:8000"),
    ]


@pytest.mark.parametrize("url", ["10.0.0.5:8000", "ftp://h:1", "http://h:8000/v1"])
def test_bad_engine_urls_are_named(url: str) -> None:
    with pytest.raises(ValueError, match=f"engine_urls\\['p'\\] = '{url}'"):
        check_engine_urls({"p": url})


def test_namespace_matches_the_connector_identity() -> None:
    cfg = RouterConfig(model_name="", chunk_size=64, kv_dtype="bfloat16", tensor_parallel_size=2)
    ns = cfg.namespace("llama")
    assert (ns.model, ns.tokens_per_chunk) == ("llama", 64)
    assert ns.kv_identity == "dtype=bfloat16;layout=auto;rank=0/2;tp=2;pp=1"
