"""``kvgrid.bench.ttft.workloads``: the request streams of ``kvgrid bench serve``.

The closed loop is driven here by a discrete-event loop over simulated time (no wall clock): a
request is served ``service_s`` after it is handed out, as the bench's step loop would see it.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvgrid.bench.ttft.workloads import (
    TRACE_SHAPE,
    ChatConfig,
    ChatWorkload,
    QAConfig,
    QAWorkload,
    Request,
    TraceShape,
    Workload,
)

TRACE = Path(__file__).resolve().parents[3] / "shared/data/traces/mooncake_conversation_trace.jsonl"


def _run(
    w: Workload, rate: float, service_s: float = 0.0, t0: float = 100.0
) -> tuple[list[Request], dict[str, float]]:
    """Serve every request ``service_s`` after it is handed out; the requests in hand-out order and
    each one's completion time."""
    w.start(rate, now=t0)
    served: list[Request] = []
    finished: dict[str, float] = {}
    busy: list[tuple[float, str]] = []
    while not w.done:
        upcoming = [t for t in (w.next_time(), busy[0][0] if busy else None) if t is not None]
        assert upcoming, "the loop stalled: nothing scheduled and nothing in flight"
        now = min(upcoming)
        while busy and busy[0][0] <= now:
            _, rid = heapq.heappop(busy)
            w.complete(rid, now)
            finished[rid] = now
        for r in w.next_ready(now):
            assert r.arrival_s <= now
            served.append(r)
            heapq.heappush(busy, (now + service_s, r.request_id))
    return served, finished


def _by_session(reqs: list[Request]) -> dict[int, list[Request]]:
    out: dict[int, list[Request]] = {}
    for r in sorted(reqs, key=lambda r: (r.session_id, r.turn)):
        out.setdefault(r.session_id, []).append(r)
    return out


def _trie_size(prompts: list[list[int]]) -> int:
    """Distinct prefixes of the prompts, counted on a token trie."""
    root: dict[int, dict] = {}
    n = 0
    for p in prompts:
        node = root
        for tok in p:
            if tok not in node:
                node[tok] = {}
                n += 1
            node = node[tok]
    return n


# -- determinism


@pytest.mark.parametrize(
    "make",
    [
        lambda seed: ChatWorkload(ChatConfig(max_model_len=1024, sessions=40, seed=seed)),
        lambda seed: QAWorkload(QAConfig(max_model_len=512, users=4, rounds=3, seed=seed)),
    ],
    ids=["chat", "qa"],
)
def test_same_seed_same_requests_other_seed_other_requests(make: Callable[[int], Workload]) -> None:
    a, b, c = make(3), make(3), make(4)
    ra, fa = _run(a, rate=20.0, service_s=0.05)
    rb, fb = _run(b, rate=20.0, service_s=0.05)
    rc, _ = _run(c, rate=20.0, service_s=0.05)
    assert ra == rb and fa == fb  # ids, tokens, max_tokens and arrival times
    assert a.describe() == b.describe()
    assert list(a.planned()) == list(b.planned())
    first = {r.request_id: r for r in rc}
    assert any(
        first[r.request_id].prompt_token_ids != r.prompt_token_ids for r in ra if r.request_id in first
    )
    assert [r.arrival_s for r in ra] != [r.arrival_s for r in rc]


def test_chat_other_seed_other_shape() -> None:
    a = ChatWorkload(ChatConfig(max_model_len=2048, sessions=60, seed=1))
    b = ChatWorkload(ChatConfig(max_model_len=2048, sessions=60, seed=2))
    turns = lambda w: [r.turn for r in w.planned()]  # noqa: E731
    lens = lambda w: [len(r.prompt_token_ids) for r in w.planned()]  # noqa: E731
    assert turns(a) != turns(b) and lens(a) != lens(b)


# -- chat


def test_chat_turn_extends_previous_prompt_and_answer_exactly() -> None:
    w = ChatWorkload(ChatConfig(max_model_len=4096, sessions=120, seed=5))
    sessions = _by_session(list(w.planned()))
    multi = 0
    for turns in sessions.values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        for r in turns:
            assert len(r.answer_token_ids) == r.max_tokens >= 1
        for prev, cur in itertools.pairwise(turns):
            history = prev.prompt_token_ids + prev.answer_token_ids
            assert cur.prompt_token_ids[: len(history)] == history
            assert len(cur.prompt_token_ids) > len(history)  # + a new user message
            assert cur.prefix_tokens == len(history)
            multi += 1
    assert multi > 20  # the trace's turn counts give follow-up turns


def test_chat_system_prompts_are_shared_across_sessions() -> None:
    w = ChatWorkload(ChatConfig(max_model_len=4096, sessions=60, system_prompts=3, system_prompt_tokens=40))
    firsts = [r for r in w.planned() if r.turn == 0]
    heads = Counter(tuple(r.prompt_token_ids[:40]) for r in firsts)
    assert len(heads) == 3 and min(heads.values()) > 1
    # past the system prompt, sessions differ from the first token on
    assert len({r.prompt_token_ids[40] for r in firsts}) > 50
    # a first turn reuses its system prompt when an earlier session used it
    seen: set[tuple[int, ...]] = set()
    for r in firsts:
        head = tuple(r.prompt_token_ids[:40])
        assert r.prefix_tokens == (40 if head in seen else 0)
        seen.add(head)
    assert w.describe()["system_prompt_shared_fraction"] == 1.0

    # the trace's default: one system prompt of its length, scaled, in every session
    d = ChatWorkload(ChatConfig(max_model_len=8192, sessions=30))
    n = d.system_prompt_tokens
    assert n == round(TRACE_SHAPE.system_prompt_tokens * 8192 / TRACE_SHAPE.context_tokens) == 32
    assert len({tuple(r.prompt_token_ids[:n]) for r in d.planned()}) == 1


@pytest.mark.parametrize("max_model_len", [64, 512, 8192])
def test_lengths_fit_the_model_and_tokens_the_vocab(max_model_len: int) -> None:
    vocab = 1000
    chat = ChatWorkload(ChatConfig(max_model_len=max_model_len, sessions=300, vocab_size=vocab, max_turns=50))
    qa = QAWorkload(QAConfig(max_model_len=max_model_len, users=3, rounds=4, vocab_size=vocab, history=True))
    longest = 0
    for w in (chat, qa):
        for r in w.planned():
            assert len(r.prompt_token_ids) + r.max_tokens <= max_model_len
            toks = np.asarray(r.prompt_token_ids + r.answer_token_ids)
            assert toks.min() >= 1 and toks.max() < vocab
            longest = max(longest, len(r.prompt_token_ids))
    # the cut binds: some prompts come close to the context
    assert longest + chat.max_output_tokens > 0.75 * max_model_len


def test_chat_lengths_scale_with_the_context() -> None:
    small = ChatWorkload(ChatConfig(max_model_len=1024, sessions=200)).describe()
    large = ChatWorkload(ChatConfig(max_model_len=8192, sessions=200)).describe()
    ratio = float(large["mean_prompt_tokens"]) / float(small["mean_prompt_tokens"])
    assert 5 < ratio < 10  # 8x the context, minus the cut of long sessions
    assert large["max_output_tokens"] == round(max(TRACE_SHAPE.output_tokens) / 16)


def test_chat_describe_and_working_set() -> None:
    w = ChatWorkload(ChatConfig(max_model_len=512, sessions=40, system_prompts=2, system_prompt_tokens=16))
    d = w.describe()
    reqs = list(w.planned())
    assert d["sessions"] == 40 and d["requests"] == len(reqs)
    assert d["mean_prompt_tokens"] == round(float(np.mean([len(r.prompt_token_ids) for r in reqs])), 1)
    shared = sum(r.prefix_tokens for r in reqs) / sum(len(r.prompt_token_ids) for r in reqs)
    assert d["shared_prefix_fraction"] == round(shared, 4)
    assert 0 < shared < 1
    assert w.working_set_tokens() == _trie_size([r.prompt_token_ids for r in reqs])


# -- multi-round QA


@pytest.mark.parametrize("history", [False, True])
def test_qa_round_robin_and_document_reuse(history: bool) -> None:
    cfg = QAConfig(
        max_model_len=1024,
        users=4,
        rounds=3,
        document_tokens=200,
        question_tokens=10,
        answer_tokens=6,
        system_prompt_tokens=8,
        history=history,
        think_time_s=0.0,
    )
    w = QAWorkload(cfg)
    served, _ = _run(w, rate=50.0, service_s=0.001)
    assert [r.request_id for r in served] == [f"qa-u{k % 4}-r{k // 4}" for k in range(12)]
    docs = {u: turns[0].prompt_token_ids[:208] for u, turns in _by_session(served).items()}
    assert len({tuple(d[:8]) for d in docs.values()}) == 1  # the system prompt
    assert len({tuple(d[8:]) for d in docs.values()}) == 4  # a document per user
    for u, turns in _by_session(served).items():
        for r in turns:
            assert r.prompt_token_ids[:208] == docs[u]
            assert r.max_tokens == 6
            assert r.prefix_tokens == (8 if u else 0) or r.turn
        for prev, cur in itertools.pairwise(turns):
            if history:
                assert cur.prompt_token_ids[:-10] == prev.prompt_token_ids + prev.answer_token_ids
                assert cur.prefix_tokens == len(cur.prompt_token_ids) - 10
            else:
                assert len(cur.prompt_token_ids) == 218 and cur.prefix_tokens == 208
                assert cur.prompt_token_ids[208:] != prev.prompt_token_ids[208:]
    assert w.working_set_tokens() == _trie_size([r.prompt_token_ids for r in served])
    expected = 8 + 4 * (200 + (3 * 10 + 2 * 6 if history else 3 * 10))
    assert w.working_set_tokens() == expected


def test_qa_defaults_are_shares_of_the_context() -> None:
    w = QAWorkload(QAConfig(max_model_len=8192))
    assert (w.document_tokens, w.question_tokens, w.answer_tokens) == (4096, 128, 128)
    d = w.describe()
    assert d["requests"] == 64 and d["mean_prompt_tokens"] == 4224


# -- rates and think times


@pytest.mark.parametrize("arrival", ["trace", "poisson", "uniform"])
def test_chat_mean_request_rate(arrival: str) -> None:
    w = ChatWorkload(
        ChatConfig(max_model_len=512, sessions=2000, arrival=arrival, think_time_s=0.2)  # type: ignore[arg-type]
    )
    served, _ = _run(w, rate=8.0, service_s=0.05)
    times = np.array([r.arrival_s for r in served])
    rate = (len(times) - 1) / (times.max() - times.min())
    assert rate == pytest.approx(8.0, rel=0.1)


def test_chat_trace_arrivals_are_burstier_than_poisson() -> None:
    def dispersion(arrival: str) -> float:
        w = ChatWorkload(ChatConfig(max_model_len=256, sessions=2000, arrival=arrival))  # type: ignore[arg-type]
        w.start(2.0)
        starts = np.array([w._slots[s][0] for s in range(w.num_sessions)])
        # sessions per window of the trace's resolution (3 s of the trace, scaled to the rate)
        per_bucket = sum(TRACE_SHAPE.session_starts) / len(TRACE_SHAPE.session_starts)
        window = per_bucket / (2.0 * w.num_sessions / w.num_requests)
        counts = np.bincount((starts // window).astype(int))
        return float(counts.var() / counts.mean())

    assert dispersion("trace") > 2.5  # the trace's: 3.75
    assert dispersion("poisson") < 1.5


def test_qa_rate_is_held_back_by_the_closed_loop() -> None:
    cfg = QAConfig(max_model_len=512, users=5, rounds=20, think_time_s=0.0)
    fast, _ = _run(QAWorkload(cfg), rate=10.0, service_s=0.01)
    gaps = np.diff([r.arrival_s for r in fast])
    assert np.allclose(gaps, 0.1)  # uniform slots at the rate
    # a user's answer takes 2 s: each user asks at most every 2 s, 2.5 requests/s overall
    slow, _ = _run(QAWorkload(cfg), rate=10.0, service_s=2.0)
    times = np.array([r.arrival_s for r in slow])
    assert (len(times) - 1) / (times.max() - times.min()) == pytest.approx(2.5, rel=0.05)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ChatWorkload(ChatConfig(max_model_len=2048, sessions=400, think_time_s=3.0, max_turns=50)),
        lambda: QAWorkload(QAConfig(max_model_len=512, users=20, rounds=20, think_time_s=3.0)),
    ],
    ids=["chat", "qa"],
)
def test_think_time_after_completion_is_honored(make: Callable[[], Workload]) -> None:
    w = make()
    served, finished = _run(w, rate=50.0, service_s=0.5)
    thinks = []
    for turns in _by_session(served).values():
        for prev, cur in itertools.pairwise(turns):
            done = finished[prev.request_id]
            assert cur.arrival_s > done  # never before the previous turn completed + think
            thinks.append(cur.arrival_s - done)
    # at 50 requests/s the slots are no constraint: the gap is the think time, exponential, mean 3 s
    assert len(thinks) > 150
    assert np.mean(thinks) == pytest.approx(3.0, rel=0.15)


def test_next_turn_not_ready_before_completion_plus_think() -> None:
    w = ChatWorkload(ChatConfig(max_model_len=8192, sessions=1, max_turns=3, think_time_s=2.0, seed=11))
    assert w.num_requests >= 2
    w.start(1.0, now=10.0)
    first = w.next_ready(10.0)
    assert [r.request_id for r in first] == ["chat-s0-t0"] and first[0].arrival_s == 10.0
    assert w.next_time() is None and w.next_ready(1e9) == []  # waits for the completion
    w.complete("chat-s0-t0", 12.0)
    ready_at = w.next_time()
    assert ready_at is not None and ready_at > 12.0
    assert w.next_ready(math.nextafter(ready_at, 0.0)) == []
    (second,) = w.next_ready(ready_at)
    assert second.request_id == "chat-s0-t1" and second.arrival_s == ready_at
    with pytest.raises(ValueError, match="chat-s0-t0"):
        w.complete("chat-s0-t0", 13.0)  # already completed


# -- the trace


def test_trace_shape_statistics_are_sane() -> None:
    s = TRACE_SHAPE
    assert s.requests == 12031 and s.sessions == 7373
    assert 1.2 < s.mean_turns < 3
    assert sum(s.turns_histogram.values()) == s.sessions
    assert sum(k * v for k, v in s.turns_histogram.items()) == s.requests
    assert s.turns_histogram[1] < s.sessions  # some conversations go on
    assert sum(s.session_starts) == s.sessions
    assert s.system_prompts >= 1 and s.system_prompt_tokens >= 512
    assert 0 < s.shared_system_prompt_fraction <= 1
    for q in (s.first_user_tokens, s.followup_user_tokens, s.output_tokens):
        assert len(q) == 101 and all(a <= b for a, b in itertools.pairwise(q)) and q[0] >= 1
    assert s.context_tokens >= s.first_user_tokens[-1] + s.system_prompt_tokens
    assert s.output_tokens[50] < s.mean_input_tokens  # chat: long prompts, short answers
    assert s.duration_s == pytest.approx(3537, abs=3)


@pytest.mark.skipif(not TRACE.is_file(), reason=f"no trace at {TRACE}")
def test_embedded_shape_is_the_trace() -> None:
    assert TraceShape.from_trace(TRACE) == TRACE_SHAPE


def test_trace_sessions_from_hash_prefixes(tmp_path: Path) -> None:
    # Block 0 is a system prompt under which 3 conversations branch (fanout 3); conversation A
    # continues twice (once truncated), B once, C never; D has no shared system prompt.
    rows = [
        (0, 1200, 10, [0, 1, 2]),  # A1
        (0, 700, 20, [0, 5]),  # B1
        (3000, 1600, 30, [0, 1, 2, 3]),  # A2: extends A1
        (3000, 800, 5, [0, 6]),  # C1
        (6000, 1000, 5, [0, 5, 7]),  # B2: extends B1
        (6000, 1000, 5, [9, 8]),  # D1
        (9000, 1620, 5, [0, 1, 2, 3, 4]),  # A3: grew by less than A2's answer
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h}) + "\n"
            for t, i, o, h in rows
        )
    )
    s = TraceShape.from_trace(path, fanout=3)
    assert (s.requests, s.sessions) == (7, 4)
    assert s.turns_histogram == {1: 2, 2: 1, 3: 1}
    assert s.system_prompts == 1 and s.system_prompt_tokens == 512
    assert s.shared_system_prompt_fraction == round(6 / 7, 4)
    assert s.session_starts == [2, 1, 1, 0]
    assert s.bucket_s == 3.0
    assert s.truncated_fraction == round(1 / 3, 4)
    assert s.context_tokens == 2048
    # with fanout 4 there is no system prompt: block 0 makes A, B and C one conversation
    assert TraceShape.from_trace(path, fanout=4).sessions == 2


# -- validation


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: ChatConfig(sessions=0), "sessions=0"),
        (lambda: ChatConfig(vocab_size=1), "vocab_size=1"),
        (lambda: ChatConfig(think_time_s=-1.0), "think_time_s=-1.0"),
        (lambda: ChatConfig(arrival="bursty"), "arrival='bursty'"),  # type: ignore[arg-type]
        (lambda: ChatConfig(length_scale=0.0), "length_scale=0.0"),
        (lambda: ChatConfig(seed=-1), "seed=-1"),
        (lambda: ChatWorkload(ChatConfig(max_model_len=40, system_prompt_tokens=40)), "max_model_len=40"),
        (lambda: QAConfig(users=0), "users=0"),
        (lambda: QAConfig(document_tokens=0), "document_tokens=0"),
        (lambda: QAWorkload(QAConfig(max_model_len=512, document_tokens=500)), "max_model_len=512"),
        (lambda: QAWorkload(QAConfig(max_model_len=512, history=True, rounds=20)), "rounds"),
        (lambda: QAWorkload().start(0.0), "rate=0.0"),
        (lambda: TraceShape.from_trace(TRACE, fanout=1), "fanout=1"),
    ],
)
def test_bad_parameters_name_the_value(build: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        build()


def test_loop_calls_need_a_start() -> None:
    w = QAWorkload(QAConfig(max_model_len=512, users=1, rounds=1))
    with pytest.raises(RuntimeError, match="start"):
        w.next_ready(0.0)
    w.start(math.inf)
    (r,) = w.next_ready(0.0)
    with pytest.raises(ValueError, match="qa-u9-r9"):
        w.complete("qa-u9-r9", 1.0)
    w.complete(r.request_id, 1.0)
    assert w.done and w.next_time() is None
