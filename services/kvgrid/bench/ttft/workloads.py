"""Request streams of ``kvgrid bench serve``: multi-turn chat shaped by the Mooncake conversation
trace, and LMCache's multi-round QA.

A workload is planned in full when it is built: every session's turns, their prompt token ids, their
answers and the think time after each turn follow from the seed alone; :meth:`Workload.start` then
lays the arrivals out at a request rate. The bench drives it in closed loop from its step loop with
a monotonic clock (real or simulated): :meth:`Workload.next_ready` hands out the requests whose time
has come, :meth:`Workload.complete` reports one finished, and only then is the session's next turn
scheduled, ``think`` seconds later.

Invariants:

* **Determinism.** The same config gives the same requests (ids, token ids, ``max_tokens``) and,
  for the same rate, start time and completion times, the same arrival times. Another seed gives
  other token ids, lengths, turn counts and arrivals.
* **Prefix sharing is real.** Each piece of content (a system prompt, a user message, an answer, a
  document, a question) has its own token ids drawn from the seed and the piece's identity, so
  equal content is equal tokens and distinct content shares no prefix (barring chance). A chat
  turn's prompt is exactly the previous turn's prompt + the previous answer + a new user message,
  and every session starts with one of the shared system prompts; a QA round's prompt starts
  with its user's document (and, with ``history``, that user's earlier questions and answers).
* **Answers are the workload's.** The answer of a turn is a token sequence of the turn's output
  length fixed up front (``Request.answer_token_ids``). The bench generates exactly ``max_tokens``
  tokens (forced, or ``ignore_eos``), and the next turn's prompt appends the workload's answer,
  not what the engine sampled: prompts, and so the prefix reuse, do not depend on the model.
* **Fits the model.** Every prompt + its ``max_tokens`` is at most ``max_model_len``; token ids lie
  in ``[1, vocab_size)``.

The chat workload's shape comes from :data:`TRACE_SHAPE`, statistics of the trace that
:meth:`TraceShape.from_trace` derives (embedded, so the bench needs no trace file): sessions are
chains of requests whose block hashes extend an earlier request's beyond the shared system prompt;
turns per session, the system prompts, user message and answer lengths are drawn from the trace's
distributions, with lengths scaled from the trace's context (131072 tokens) to ``max_model_len``;
session starts replay the trace's per-bucket start counts (its burstiness), time-scaled to the rate.
The rate is an offered rate: in closed loop, sessions waiting for answers and think times can only
hold requests back.
"""

from __future__ import annotations

import heapq
import json
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np

__all__ = [
    "TRACE_SHAPE",
    "ChatConfig",
    "ChatWorkload",
    "QAConfig",
    "QAWorkload",
    "Request",
    "TraceShape",
    "Workload",
]

Arrival = Literal["trace", "poisson", "uniform"]
_ARRIVALS: tuple[str, ...] = ("trace", "poisson", "uniform")
TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake trace
_QUANTILES = 101  # percentiles 0..100 of each length distribution
_B36 = "0123456789abcdefghijklmnopqrstuvwxyz"


class Request(msgspec.Struct, frozen=True, kw_only=True):
    """One request for the engine, handed out by :meth:`Workload.next_ready`."""

    request_id: str  # "chat-s{session}-t{turn}" / "qa-u{user}-r{round}"
    session_id: int  # chat session or QA user
    turn: int  # 0-based turn (chat) or round (QA) within the session
    prompt_token_ids: list[int]
    max_tokens: int  # generate exactly this many tokens (the answer's length)
    arrival_s: float  # earliest start: its arrival slot, and the previous turn's completion + think
    answer_token_ids: list[int]  # the answer the session's next prompt appends (len == max_tokens)
    # leading prompt tokens an earlier request of the plan already had (the session's history, a
    # system prompt an earlier session used, the user's document): what a cache keeping all would hit
    prefix_tokens: int


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


# ---------------------------------------------------------------------------------------------------
# The trace's shape


class TraceShape(msgspec.Struct, frozen=True, kw_only=True):
    """Statistics of a Mooncake-format trace that shape the chat workload.

    Sessions: the system prompt of a request is its deepest leading block prefix whose trie node has
    at least ``fanout`` children (conversations branch there); a request continues the latest
    earlier request that shares at least one block beyond the system prompt, else it starts a
    session. Lengths are tokens; quantiles are the percentiles 0..100 (rounded).
    """

    requests: int
    sessions: int
    turns_histogram: dict[int, int]  # turns per session -> sessions
    system_prompts: int  # distinct system prompts used by more than one session
    system_prompt_tokens: int  # their mean length (full blocks)
    shared_system_prompt_fraction: float  # requests whose system prompt another session uses too
    extends_fraction: float  # continuations that keep all of the previous prompt's full blocks
    truncated_fraction: float  # continuations whose prompt grew less than the previous answer
    mean_input_tokens: float
    mean_output_tokens: float
    context_tokens: int  # power of two >= the longest input + output: the model context of the trace
    first_user_tokens: list[int]  # first turn's input beyond the system prompt (quantiles)
    followup_user_tokens: list[int]  # a later turn's input beyond previous prompt + answer, when > 0
    output_tokens: list[int]
    median_turn_gap_s: float  # from a turn's arrival to its continuation's (think + service)
    bucket_s: float  # the timestamps' resolution
    session_starts: list[int]  # sessions started per bucket, over the whole trace

    @property
    def mean_turns(self) -> float:
        return self.requests / self.sessions

    @property
    def duration_s(self) -> float:
        return self.bucket_s * len(self.session_starts)

    @classmethod
    def from_trace(cls, path: str | Path, *, fanout: int = 16) -> TraceShape:
        """Derive the shape from a Mooncake trace (JSON lines: ``timestamp`` ms, ``input_length``,
        ``output_length``, ``hash_ids`` of 512-token blocks)."""
        _check(fanout >= 2, f"fanout={fanout}: expected at least 2 (children of a system prompt)")
        rows: list[tuple[int, int, int, list[int]]] = []
        with Path(path).open() as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                    rows.append(
                        (int(r["timestamp"]), int(r["input_length"]), int(r["output_length"]), r["hash_ids"])
                    )
                except (KeyError, TypeError, ValueError) as e:
                    raise ValueError(
                        f"{path}:{n}: expected a JSON object with timestamp, input_length, "
                        f"output_length, hash_ids: {e}"
                    ) from e
        _check(len(rows) >= 2, f"{path}: {len(rows)} requests; expected at least 2")
        rows.sort(key=lambda r: r[0])
        # A trie over the block prefixes: node id per (parent node, block), and children per node.
        node_of: dict[tuple[int, int], int] = {}
        children: list[int] = [0]  # node 0 = the empty prefix
        paths: list[list[int]] = []
        for _, _, _, hashes in rows:
            path_nodes, node = [], 0
            for h in hashes:
                nxt = node_of.get((node, h))
                if nxt is None:
                    nxt = node_of[(node, h)] = len(children)
                    children.append(0)
                    children[node] += 1
                path_nodes.append(nxt)
                node = nxt
            paths.append(path_nodes)
        latest: dict[int, int] = {}  # node -> latest request through it
        session_of: list[int] = []
        sessions = 0
        sys_node: list[int] = []  # system prompt node per request (0 = none)
        sys_depth: list[int] = []
        first_user, followup, gaps = [], [], []
        extends = truncated = continuations = 0
        for i, (ts, inp, _, _) in enumerate(rows):
            nodes = paths[i]
            depth = max((d + 1 for d, nd in enumerate(nodes) if children[nd] >= fanout), default=0)
            parent = -1
            for d in range(len(nodes) - 1, depth - 1, -1):  # >= 1 block beyond the system prompt
                if nodes[d] in latest:
                    parent = latest[nodes[d]]
                    shared = d + 1
                    break
            if parent < 0:
                session_of.append(sessions)
                sessions += 1
                first_user.append(max(1, inp - depth * TRACE_BLOCK_TOKENS))
            else:
                session_of.append(session_of[parent])
                continuations += 1
                p_ts, p_in, p_out, p_hashes = rows[parent]
                extends += shared >= len(p_hashes) - 1
                grew = inp - p_in - p_out
                if grew > 0:
                    followup.append(grew)
                else:
                    truncated += 1
                gaps.append((ts - p_ts) / 1e3)
            sys_node.append(nodes[depth - 1] if depth else 0)
            sys_depth.append(depth)
            for nd in nodes:
                latest[nd] = i
        turns = Counter(Counter(session_of).values())
        users_of_sys: dict[int, set[int]] = {}
        for s, nd in zip(session_of, sys_node, strict=True):
            if nd:
                users_of_sys.setdefault(nd, set()).add(s)
        shared_sys = {nd for nd, ss in users_of_sys.items() if len(ss) > 1}
        shared_req = [i for i, nd in enumerate(sys_node) if nd in shared_sys]
        stamps = sorted({r[0] for r in rows})
        bucket_ms = float(np.median(np.diff(stamps))) if len(stamps) > 1 else 1000.0
        t0 = rows[0][0]
        starts = np.zeros(int((rows[-1][0] - t0) // bucket_ms) + 1, dtype=np.int64)
        seen: set[int] = set()
        for i, r in enumerate(rows):
            if session_of[i] not in seen:
                seen.add(session_of[i])
                starts[int((r[0] - t0) // bucket_ms)] += 1
        inputs = np.array([r[1] for r in rows], dtype=np.float64)
        outputs = np.array([r[2] for r in rows], dtype=np.float64)

        def q(values: list[int] | np.ndarray) -> list[int]:
            pct = np.percentile(np.asarray(values, dtype=np.float64), np.linspace(0, 100, _QUANTILES))
            return [round(float(v)) for v in pct]

        return cls(
            requests=len(rows),
            sessions=sessions,
            turns_histogram=dict(sorted(turns.items())),
            system_prompts=len(shared_sys),
            system_prompt_tokens=round(
                TRACE_BLOCK_TOKENS * float(np.mean([sys_depth[i] for i in shared_req]))
            )
            if shared_req
            else 0,
            shared_system_prompt_fraction=round(len(shared_req) / len(rows), 4),
            extends_fraction=round(extends / max(continuations, 1), 4),
            truncated_fraction=round(truncated / max(continuations, 1), 4),
            mean_input_tokens=round(float(inputs.mean()), 1),
            mean_output_tokens=round(float(outputs.mean()), 1),
            context_tokens=1 << math.ceil(math.log2(float((inputs + outputs).max()))),
            first_user_tokens=q(first_user),
            followup_user_tokens=q(followup or [1]),
            output_tokens=q(np.maximum(outputs, 1)),
            median_turn_gap_s=round(float(np.median(gaps)), 1) if gaps else 0.0,
            bucket_s=bucket_ms / 1e3,
            session_starts=[int(c) for c in starts],
        )


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split()]


def _b36(text: str) -> list[int]:
    return [_B36.index(c) for c in text]


# TraceShape.from_trace("mooncake_conversation_trace.jsonl") (kvcache-ai/Mooncake FAST'25 release,
# the conversation trace: 12,031 requests, one hour); tests/ttft/test_workloads.py re-derives it.
TRACE_SHAPE = TraceShape(
    requests=12031,
    sessions=7373,
    turns_histogram={
        1: 5114,
        2: 1311,
        3: 464,
        4: 200,
        5: 117,
        6: 55,
        7: 27,
        8: 26,
        9: 10,
        10: 16,
        11: 5,
        12: 2,
        13: 4,
        14: 2,
        15: 5,
        16: 4,
        17: 4,
        18: 1,
        19: 1,
        21: 1,
        22: 1,
        25: 1,
        27: 1,
        43: 1,
    },
    system_prompts=1,
    system_prompt_tokens=512,
    shared_system_prompt_fraction=1.0,
    extends_fraction=0.8499,
    truncated_fraction=0.1885,
    mean_input_tokens=12035.1,
    mean_output_tokens=342.6,
    context_tokens=131072,
    first_user_tokens=_ints(
        "379 382 383 383 384 385 386 388 389 391 393 396 401 409 419 431 453 482 512 548 580 621 "
        "672 724 775 824 880 954 1025 1117 1245 1366 1526 1778 2023 2255 2523 2785 3025 3235 3401 "
        "3566 3708 3835 3933 4075 4225 4348 4504 4620 4752 4915 5109 5286 5470 5676 5901 6136 "
        "6367 6627 6906 7194 7438 7727 7997 8316 8665 8996 9387 9764 10259 10613 11084 11561 "
        "12006 12544 13107 13504 14050 14782 15359 16052 16679 17508 18174 18925 19877 20974 "
        "22386 23810 25047 26975 28716 31213 33870 37982 42546 51260 66614 89356 125683"
    ),
    followup_user_tokens=_ints(
        "1 4 5 5 6 6 6 7 7 7 8 8 8 9 9 9 10 10 10 11 11 11 12 12 13 13 14 14 15 15 16 17 17 18 19 "
        "20 21 22 23 24 25 26 28 29 30 32 34 37 39 44 46 52 56 62 68 74 83 94 106 119 134 152 177 "
        "205 230 267 297 340 371 412 462 514 573 664 751 910 1112 1329 1719 1985 2209 2529 2898 "
        "3193 3422 3647 3901 4104 4334 4688 5048 5482 6005 6626 7110 7897 9012 10336 13061 19027 "
        "91467"
    ),
    output_tokens=_ints(
        "1 3 3 5 8 10 13 15 18 21 24 27 31 34 39 46 56 66 79 90 100 111 122 133 144 156 169 182 "
        "193 204 213 220 230 239 247 256 265 272 278 284 291 298 305 311 317 322 328 333 339 345 "
        "350 356 361 366 370 375 380 385 390 395 399 403 408 413 418 423 427 432 438 443 447 452 "
        "457 461 466 472 477 483 491 497 504 511 519 527 535 543 551 561 571 583 597 612 628 648 "
        "670 698 738 800 892 1119 2000"
    ),
    median_turn_gap_s=123.0,
    bucket_s=3.0,
    session_starts=_b36(
        "aj098f465b588i0668764c0bo04bm06c07924d045e0d08999i057j068f88080ca090c905e067h0i8308480977a"
        "85c068b586554b08575068a6g089079252b404b045650e580b0f03a7f60670d06630398e0862442c0477464904"
        "3e40656053e4063d04a8a0e089486h608589l20ab657977e0a5059a74558570f0b43437805860d0580802bf0a4"
        "a82973480c40529586380535bk090f60742c042475344055d0g05c047036b0463280a09a7065a4506277727g03"
        "4d08b04890c508h0f0b0a45i0b77e0h0h0a0f08a0b0705a90b028k0d70874b0960e040c60c07i0a77603c03666"
        "b0869g0c91b03958765416247g0d0d04d068632634e060740734b79678ba7ia50784cc8046g08798095261i707"
        "b05b66h08462448072654d095908a56789c990c054e055c90453868e0c07397d0680566h90af7a705490a053a6"
        "h40b872e0c0455805b0a07858b9c0i0a056480778b04b0545a607l80m02c0665f70829b0a0778c09f083327636"
        "8a6385f0480c08cd06c70446b0a720644c0d086ca0a07a4a055c0904a858g720b6605e0ba708a754964cf07976"
        "d65022ba70c0d078689089775f40666f0f0779a024635693490g605d0c058087dc08g0b6b0547b058805d0476g"
        "06a9e07b404690i0i06565d04a5af037516e0933b95a7i0744b5090834646a8a9049554d093650d05e08d0d0i5"
        "09475c05780d0f09e0c047b0b043f083c2660965e9575c03f0556e07a067356h07i08068088d650d0b7g70j0c0"
        "a08506768685f037d06ab79h06c0567738ab0c0h06al0h07a573b03802da056840e7cn9026e07047a5368a0i07"
        "g87078c0h"
    ),
)


# ---------------------------------------------------------------------------------------------------
# Configs

# Keys of the seeded streams: each piece of content or randomness has its own.
_SYSTEM, _SESSION, _LENGTHS, _THINK, _ARRIVAL, _DOCUMENT, _QUESTION, _ANSWER, _QA_SYSTEM = range(1, 10)


def _check_common(max_model_len: int, vocab_size: int, seed: int, think_time_s: float, arrival: str) -> None:
    _check(max_model_len >= 2, f"max_model_len={max_model_len}: expected at least 2 tokens")
    _check(vocab_size >= 2, f"vocab_size={vocab_size}: expected at least 2 (token ids are in [1, vocab))")
    _check(seed >= 0, f"seed={seed}: expected a non-negative integer")
    _check(
        math.isfinite(think_time_s) and think_time_s >= 0,
        f"think_time_s={think_time_s}: expected a finite mean >= 0 seconds",
    )
    _check(arrival in _ARRIVALS, f"arrival={arrival!r}: expected one of {', '.join(_ARRIVALS)}")


def _check_optional(name: str, value: int | None, low: int) -> None:
    _check(value is None or value >= low, f"{name}={value}: expected None (the default) or >= {low}")


class ChatConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Multi-turn chat shaped by :data:`TRACE_SHAPE`; ``None`` = derived from the trace."""

    max_model_len: int = 8192  # the model's context: prompt + max_tokens never exceeds it
    vocab_size: int = 32000  # token ids are in [1, vocab_size)
    sessions: int = 200
    seed: int = 0
    think_time_s: float = 1.0  # mean of the exponential think time after each turn (0 = none)
    arrival: Arrival = "trace"  # session starts: the trace's burst shape, Poisson or evenly spaced
    length_scale: float | None = None  # token lengths x this; None = max_model_len / trace context
    system_prompts: int | None = None  # shared system prompts; None = the trace's count
    system_prompt_tokens: int | None = None  # None = the trace's, scaled (at least 1)
    max_output_tokens: int | None = None  # cap of an answer; None = the trace's longest, scaled
    max_turns: int | None = None  # cap of a session's turns; None = the trace's longest

    def __post_init__(self) -> None:
        _check_common(self.max_model_len, self.vocab_size, self.seed, self.think_time_s, self.arrival)
        _check(self.sessions >= 1, f"sessions={self.sessions}: expected at least 1")
        _check(
            self.length_scale is None or (math.isfinite(self.length_scale) and self.length_scale > 0),
            f"length_scale={self.length_scale}: expected None (max_model_len / trace context) or > 0",
        )
        _check_optional("system_prompts", self.system_prompts, 1)
        _check_optional("system_prompt_tokens", self.system_prompt_tokens, 0)
        _check_optional("max_output_tokens", self.max_output_tokens, 1)
        _check_optional("max_turns", self.max_turns, 1)


class QAConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Multi-round QA (LMCache's benchmark shape): ``users`` each ask ``rounds`` questions about their
    own document, round-robin over users; ``None`` = a share of ``max_model_len``."""

    max_model_len: int = 8192
    vocab_size: int = 32000
    users: int = 8
    rounds: int = 8
    seed: int = 0
    think_time_s: float = 1.0  # mean exponential think time of a user after an answer (0 = none)
    arrival: Arrival = "uniform"  # question slots: evenly spaced at the rate, Poisson or trace-shaped
    document_tokens: int | None = None  # per user; None = max_model_len / 2
    question_tokens: int | None = None  # None = max_model_len / 64 (at least 1)
    answer_tokens: int | None = None  # max_tokens of every round; None = max_model_len / 64 (>= 1)
    system_prompt_tokens: int = 0  # one system prompt before every document (0 = none)
    history: bool = False  # a round's prompt carries the user's earlier questions and answers

    def __post_init__(self) -> None:
        _check_common(self.max_model_len, self.vocab_size, self.seed, self.think_time_s, self.arrival)
        _check(self.users >= 1, f"users={self.users}: expected at least 1")
        _check(self.rounds >= 1, f"rounds={self.rounds}: expected at least 1")
        _check_optional("document_tokens", self.document_tokens, 1)
        _check_optional("question_tokens", self.question_tokens, 1)
        _check_optional("answer_tokens", self.answer_tokens, 1)
        _check(
            self.system_prompt_tokens >= 0,
            f"system_prompt_tokens={self.system_prompt_tokens}: expected >= 0 (0 = none)",
        )


# ---------------------------------------------------------------------------------------------------
# The plan and the closed loop


class _Turn(msgspec.Struct, frozen=True):
    segments: tuple[tuple[int, int], ...]  # slices of the session's tokens, concatenated = the prompt
    answer: tuple[int, int]  # slice of the session's tokens
    prefix_tokens: int
    think_s: float  # after this turn completes, before the next is ready

    @property
    def prompt_tokens(self) -> int:
        return sum(e - s for s, e in self.segments)


class _Session(msgspec.Struct, frozen=True):
    tokens: np.ndarray  # int32; every turn's prompt and answer are slices of it
    turns: list[_Turn]
    shared_head: int  # leading tokens an earlier session already has (a shared system prompt)


def _tokens(seed: int, key: tuple[int, ...], n: int, vocab_size: int) -> np.ndarray:
    """The token ids of one piece of content: a function of the seed and the piece's identity."""
    return np.random.default_rng([seed, *key]).integers(1, vocab_size, n, dtype=np.int32)


def _arrival_times(
    n: int, rate: float, arrival: str, rng: np.random.Generator, shape: TraceShape
) -> np.ndarray:
    """``n`` arrival offsets (seconds, sorted, the first 0) at a mean of ``rate`` per second."""
    if n == 0 or math.isinf(rate):
        return np.zeros(n)
    if arrival == "uniform":
        return np.arange(n) / rate
    if arrival == "poisson":
        return np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / rate, n - 1))])
    # "trace": the trace's session starts per bucket, cycled, each bucket (scaled so that the mean
    # rate is ``rate``) holding its count of arrivals at uniform positions.
    counts = np.asarray(shape.session_starts, dtype=np.int64)
    width = counts.sum() / len(counts) / rate
    cycles = -(-n // int(counts.sum()))
    counts = np.tile(counts, cycles)
    buckets = np.repeat(np.arange(len(counts)), counts)[:n]
    times = np.sort((buckets + rng.random(n)) * width)
    return times - times[0]  # the first arrives at the start


class Workload:
    """A planned workload and its closed loop; build one with :class:`ChatWorkload` or
    :class:`QAWorkload`. Not thread-safe: drive it from one loop."""

    kind: str = ""
    _id_format: str = ""

    def __init__(self, sessions: list[_Session], *, seed: int, arrival: str, vocab_size: int) -> None:
        self._sessions = sessions
        self._seed = seed
        self._arrival = arrival
        self._vocab_size = vocab_size
        self._ids = {
            self._id_format.format(s=s, t=t): (s, t)
            for s, sess in enumerate(sessions)
            for t in range(len(sess.turns))
        }
        self._slots: list[np.ndarray] = []
        self._heap: list[tuple[float, int, int]] = []
        self._in_flight: dict[str, tuple[int, int]] = {}
        self._completed = 0
        self._started = False

    # -- the plan

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def num_requests(self) -> int:
        return len(self._ids)

    def _request(self, s: int, t: int, arrival_s: float) -> Request:
        sess = self._sessions[s]
        turn = sess.turns[t]
        a0, a1 = turn.answer
        return Request(
            request_id=self._id_format.format(s=s, t=t),
            session_id=s,
            turn=t,
            prompt_token_ids=np.concatenate([sess.tokens[a:b] for a, b in turn.segments]).tolist(),
            max_tokens=a1 - a0,
            arrival_s=arrival_s,
            answer_token_ids=sess.tokens[a0:a1].tolist(),
            prefix_tokens=turn.prefix_tokens,
        )

    def planned(self) -> Iterator[Request]:
        """Every request of the plan, session by session, turn by turn (``arrival_s`` 0: no timing)."""
        for s, sess in enumerate(self._sessions):
            for t in range(len(sess.turns)):
                yield self._request(s, t, 0.0)

    def working_set_tokens(self) -> int:
        """Distinct prefix tokens of all prompts (each shared system prompt, document and turn
        history once): what a cache holding everything the workload can reuse would hold."""
        total = 0
        for sess in self._sessions:
            covered: list[tuple[int, int]] = sorted({seg for turn in sess.turns for seg in turn.segments})
            end = 0
            for a, b in covered:  # union of the slices
                total += max(0, b - max(a, end))
                end = max(end, b)
            total -= sess.shared_head
        return total

    def describe(self) -> dict[str, float | int | str]:
        """A summary: sessions, requests, prompt lengths and how much of them is reusable."""
        prompts = [turn.prompt_tokens for sess in self._sessions for turn in sess.turns]
        shared = sum(turn.prefix_tokens for sess in self._sessions for turn in sess.turns)
        outputs = [turn.answer[1] - turn.answer[0] for sess in self._sessions for turn in sess.turns]
        return {
            "kind": self.kind,
            "sessions": self.num_sessions,
            "requests": self.num_requests,
            "mean_turns": round(self.num_requests / self.num_sessions, 3),
            "max_turns": max(len(sess.turns) for sess in self._sessions),
            "mean_prompt_tokens": round(float(np.mean(prompts)), 1),
            "max_prompt_tokens": max(prompts),
            "mean_max_tokens": round(float(np.mean(outputs)), 1),
            "shared_prefix_fraction": round(shared / sum(prompts), 4),
            "working_set_tokens": self.working_set_tokens(),
            "arrival": self._arrival,
            "seed": self._seed,
            "vocab_size": self._vocab_size,
        }

    # -- the closed loop

    def _first_slots(self, rate: float) -> list[np.ndarray]:
        """Per session, the arrival slot (seconds from the start) of each turn; -inf = none (the
        turn is ready when the previous one completed and its think time passed)."""
        raise NotImplementedError

    def start(self, rate: float, now: float = 0.0) -> None:
        """Lay the arrivals out at ``rate`` requests per second (``math.inf``: all at once) from
        ``now`` and forget any earlier run; the closed loop may hold the rate back."""
        _check(rate > 0 and not math.isnan(rate), f"rate={rate}: expected requests per second > 0 (or inf)")
        _check(math.isfinite(now), f"now={now}: expected a finite clock reading in seconds")
        self._slots = [slots + now for slots in self._first_slots(rate)]
        self._heap = [(float(slots[0]), s, 0) for s, slots in enumerate(self._slots)]
        heapq.heapify(self._heap)
        self._in_flight = {}
        self._completed = 0
        self._started = True

    def _require_started(self, what: str) -> None:
        if not self._started:
            raise RuntimeError(f"{what}: call start(rate) first")

    def next_ready(self, now: float) -> list[Request]:
        """The requests whose time has come by ``now``, in arrival order; each is handed out once."""
        self._require_started("next_ready")
        out: list[Request] = []
        while self._heap and self._heap[0][0] <= now:
            ready, s, t = heapq.heappop(self._heap)
            req = self._request(s, t, ready)
            self._in_flight[req.request_id] = (s, t)
            out.append(req)
        return out

    def next_time(self) -> float | None:
        """When the next request becomes ready, None while none is scheduled (all handed out, or
        the rest wait for completions)."""
        self._require_started("next_time")
        return self._heap[0][0] if self._heap else None

    def complete(self, request_id: str, now: float) -> None:
        """``request_id`` finished at ``now``: its session's next turn is ready at
        ``max(its slot, now + think)``."""
        self._require_started("complete")
        st = self._in_flight.pop(request_id, None)
        if st is None:
            raise ValueError(
                f"complete({request_id!r}): not in flight; expected a request id handed out by "
                "next_ready and not completed yet"
            )
        s, t = st
        self._completed += 1
        turns = self._sessions[s].turns
        if t + 1 < len(turns):
            ready = max(float(self._slots[s][t + 1]), now + turns[t].think_s)
            heapq.heappush(self._heap, (ready, s, t + 1))

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def completed(self) -> int:
        return self._completed

    @property
    def done(self) -> bool:
        """Every request handed out and completed."""
        return self._started and self._completed == self.num_requests


# ---------------------------------------------------------------------------------------------------
# Multi-turn chat


class ChatWorkload(Workload):
    """Multi-turn chat over shared system prompts, shaped by ``shape`` (default: the Mooncake trace).

    Session ``s`` draws its turn count from the trace's turns per session (capped by ``max_turns``),
    one system prompt, and per turn a user message (the trace's first-turn input beyond the system
    prompt, then its growth per turn beyond the previous answer) and an answer length (the trace's
    outputs), all scaled by ``length_scale`` and capped by ``max_output_tokens``. Turn 0's prompt is
    system prompt + user message (the message cut to fit); turn k's is turn k-1's prompt + its answer
    + a new message; the session ends early where a prompt + ``max_output_tokens`` would exceed
    ``max_model_len``. Session starts come at ``rate / mean turns`` per second.
    """

    kind = "chat"
    _id_format = "chat-s{s}-t{t}"

    def __init__(self, config: ChatConfig | None = None, shape: TraceShape = TRACE_SHAPE) -> None:
        cfg = config or ChatConfig()
        self.config = cfg
        self.shape = shape
        scale = cfg.length_scale if cfg.length_scale is not None else cfg.max_model_len / shape.context_tokens
        self.length_scale = scale
        self.system_prompts = cfg.system_prompts or max(1, shape.system_prompts)
        self.system_prompt_tokens = (
            cfg.system_prompt_tokens
            if cfg.system_prompt_tokens is not None
            else max(1, round(shape.system_prompt_tokens * scale))
        )
        self.max_output_tokens = cfg.max_output_tokens or max(1, round(max(shape.output_tokens) * scale))
        self.max_turns = cfg.max_turns or max(shape.turns_histogram)
        room = cfg.max_model_len - self.max_output_tokens - self.system_prompt_tokens
        _check(
            room >= 1,
            f"max_model_len={cfg.max_model_len}: expected more than system_prompt_tokens="
            f"{self.system_prompt_tokens} + max_output_tokens={self.max_output_tokens} (a turn needs a "
            "user message of at least one token)",
        )
        sys_tokens = [
            _tokens(cfg.seed, (_SYSTEM, j), self.system_prompt_tokens, cfg.vocab_size)
            for j in range(self.system_prompts)
        ]
        turn_counts = np.array(sorted(shape.turns_histogram), dtype=np.int64)
        turn_p = np.array([shape.turns_histogram[k] for k in turn_counts], dtype=np.float64)
        turn_cdf = np.cumsum(turn_p) / turn_p.sum()

        first_q, followup_q, output_q = (
            np.asarray(q, dtype=np.float64)
            for q in (shape.first_user_tokens, shape.followup_user_tokens, shape.output_tokens)
        )

        def draw(rng: np.random.Generator, quantiles: np.ndarray, n: int, cap: int) -> list[int]:
            x = np.interp(rng.random(n), np.linspace(0.0, 1.0, len(quantiles)), quantiles)
            return [int(v) for v in np.clip(np.rint(x * scale), 1, cap)]

        sessions: list[_Session] = []
        used: set[int] = set()
        self._system_of: list[int] = []  # system prompt per session
        for s in range(cfg.sessions):
            rng = np.random.default_rng([cfg.seed, _LENGTHS, s])
            pick = min(int(np.searchsorted(turn_cdf, rng.random(), side="right")), len(turn_counts) - 1)
            n_turns = min(int(turn_counts[pick]), self.max_turns)
            j = int(rng.integers(self.system_prompts))
            sys_len = self.system_prompt_tokens
            users = draw(rng, first_q, 1, room) + draw(rng, followup_q, n_turns - 1, room)
            outs = draw(rng, output_q, n_turns, self.max_output_tokens)
            thinks = (
                np.random.default_rng([cfg.seed, _THINK, s]).exponential(cfg.think_time_s, n_turns)
                if cfg.think_time_s > 0
                else np.zeros(n_turns)
            )
            head = sys_len if j in used else 0
            used.add(j)
            self._system_of.append(j)
            turns: list[_Turn] = []
            prompt = sys_len + users[0]
            for k in range(n_turns):
                if k and prompt + self.max_output_tokens > cfg.max_model_len:
                    break
                prefix = head if k == 0 else turns[-1].segments[0][1] + outs[k - 1]
                turns.append(_Turn(((0, prompt),), (prompt, prompt + outs[k]), prefix, float(thinks[k])))
                if k + 1 < n_turns:
                    prompt += outs[k] + users[k + 1]
            end = turns[-1].answer[1]
            tokens = np.concatenate(
                [sys_tokens[j], _tokens(cfg.seed, (_SESSION, s), end - sys_len, cfg.vocab_size)]
            )
            sessions.append(_Session(tokens, turns, head))
        super().__init__(sessions, seed=cfg.seed, arrival=cfg.arrival, vocab_size=cfg.vocab_size)

    def _first_slots(self, rate: float) -> list[np.ndarray]:
        session_rate = rate * self.num_sessions / self.num_requests
        rng = np.random.default_rng([self.config.seed, _ARRIVAL])
        starts = _arrival_times(self.num_sessions, session_rate, self.config.arrival, rng, self.shape)
        out = []
        for sess, t0 in zip(self._sessions, starts, strict=True):
            slots = np.full(len(sess.turns), -math.inf)
            slots[0] = t0
            out.append(slots)
        return out

    def describe(self) -> dict[str, float | int | str]:
        d = super().describe()
        d.update(
            max_model_len=self.config.max_model_len,
            length_scale=round(self.length_scale, 6),
            system_prompts=self.system_prompts,
            system_prompt_tokens=self.system_prompt_tokens,
            max_output_tokens=self.max_output_tokens,
            think_time_s=self.config.think_time_s,
        )
        users = Counter(self._system_of)
        shared = sum(1 for j in self._system_of if users[j] > 1 and self.system_prompt_tokens)
        d["system_prompt_shared_fraction"] = round(shared / self.num_sessions, 4)
        return d


# ---------------------------------------------------------------------------------------------------
# Multi-round QA


class QAWorkload(Workload):
    """LMCache's multi-round QA: request ``k`` is round ``k // users`` of user ``k % users``, its slot
    ``k``-th in the arrival sequence at ``rate`` per second; it is ready at its slot once the user's
    previous round completed and the user's think time passed. A round's prompt is the system prompt
    (if any) + the user's document (+ with ``history``, the user's earlier questions and answers) + a
    new question."""

    kind = "qa"
    _id_format = "qa-u{s}-r{t}"

    def __init__(self, config: QAConfig | None = None) -> None:
        cfg = config or QAConfig()
        self.config = cfg
        self.document_tokens = cfg.document_tokens or cfg.max_model_len // 2
        self.question_tokens = cfg.question_tokens or max(1, cfg.max_model_len // 64)
        self.answer_tokens = cfg.answer_tokens or max(1, cfg.max_model_len // 64)
        base = cfg.system_prompt_tokens + self.document_tokens
        q, a = self.question_tokens, self.answer_tokens
        longest = base + (cfg.rounds if cfg.history else 1) * (q + a)
        _check(
            longest <= cfg.max_model_len,
            f"max_model_len={cfg.max_model_len}: expected at least system_prompt_tokens + document_tokens "
            f"+ {'rounds x ' if cfg.history else ''}(question_tokens + answer_tokens) = {longest} "
            f"(system {cfg.system_prompt_tokens}, document {self.document_tokens}, question {q}, answer {a}"
            f"{f', {cfg.rounds} rounds of history' if cfg.history else ''})",
        )
        system = _tokens(cfg.seed, (_QA_SYSTEM,), cfg.system_prompt_tokens, cfg.vocab_size)
        sessions: list[_Session] = []
        for u in range(cfg.users):
            parts = [system, _tokens(cfg.seed, (_DOCUMENT, u), self.document_tokens, cfg.vocab_size)]
            for r in range(cfg.rounds):
                parts.append(_tokens(cfg.seed, (_QUESTION, u, r), q, cfg.vocab_size))
                parts.append(_tokens(cfg.seed, (_ANSWER, u, r), a, cfg.vocab_size))
            thinks = (
                np.random.default_rng([cfg.seed, _THINK, u]).exponential(cfg.think_time_s, cfg.rounds)
                if cfg.think_time_s > 0
                else np.zeros(cfg.rounds)
            )
            head = cfg.system_prompt_tokens if u else 0
            turns = []
            for r in range(cfg.rounds):
                q0 = base + r * (q + a)
                if cfg.history:
                    segments: tuple[tuple[int, int], ...] = ((0, q0 + q),)
                    prefix = q0 if r else head
                else:
                    segments = ((0, base), (q0, q0 + q))
                    prefix = base if r else head
                turns.append(_Turn(segments, (q0 + q, q0 + q + a), prefix, float(thinks[r])))
            sessions.append(_Session(np.concatenate(parts), turns, head))
        super().__init__(sessions, seed=cfg.seed, arrival=cfg.arrival, vocab_size=cfg.vocab_size)

    def _first_slots(self, rate: float) -> list[np.ndarray]:
        n, users = self.num_requests, self.config.users
        rng = np.random.default_rng([self.config.seed, _ARRIVAL])
        times = _arrival_times(n, rate, self.config.arrival, rng, TRACE_SHAPE)
        return [times[u::users].copy() for u in range(users)]

    def describe(self) -> dict[str, float | int | str]:
        d = super().describe()
        d.update(
            max_model_len=self.config.max_model_len,
            document_tokens=self.document_tokens,
            question_tokens=self.question_tokens,
            answer_tokens=self.answer_tokens,
            system_prompt_tokens=self.config.system_prompt_tokens,
            history=self.config.history,
            think_time_s=self.config.think_time_s,
        )
        return d
