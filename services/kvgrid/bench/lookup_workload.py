"""The workload of ``kvgrid bench lookup``: a multi-turn chat fleet and the queries a router asks.

``prompts`` shared system prompts; conversations, each pinned to one of ``pods`` pods, each its
system prompt followed by ``turns`` turns of ``turn_chunks`` chunks. Every pod holds the system
prompts it serves and its conversations in L1; the latest turn of each conversation and the system
prompts are also in its GPU tier. Agents publish one admit event per turn (and per prompt and tier).

Queries are what a router asks when a request arrives, in a fixed mix (:data:`QUERY_MIX`):

- ``next_turn``: a conversation's whole history plus its *new, uncached* turn (a partial hit that
  reaches the GPU tier: the last cached turn is on GPU);
- ``edit``: the history up to an earlier turn plus a new turn (a partial hit on L1 only);
- ``new_conversation``: a known system prompt plus a new turn (hit on the prompt only);
- ``miss``: nothing cached (the first chunk is unknown).

Chunk keys are random 16-byte strings (kvgrid's keys are cryptographic hashes). Peers that hash
token blocks themselves get each chunk as 4 tokens taken from its key (:func:`chunk_tokens`), so
every system answers the same prefix questions. Invariant: the same arguments and seed give the
same workload in every process.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence

import msgspec

__all__ = ["QUERY_MIX", "TOKENS_PER_CHUNK", "Query", "Workload", "chunk_tokens"]

QUERY_MIX = (("next_turn", 0.5), ("edit", 0.2), ("new_conversation", 0.2), ("miss", 0.1))
TOKENS_PER_CHUNK = 4  # tokens a peer hashes per chunk (derived from the key)
_TOKENS = struct.Struct("<4I")


def chunk_tokens(keys: Sequence[bytes]) -> list[int]:
    """The token ids peers see for ``keys``: 4 per chunk, from the key's bytes (31-bit ids)."""
    out: list[int] = []
    for k in keys:
        out += (t & 0x7FFF_FFFF for t in _TOKENS.unpack(k))
    return out


class Query(msgspec.Struct, frozen=True):
    kind: str
    keys: list[bytes]


class Conversation(msgspec.Struct, frozen=True):
    pod: int
    prompt: int
    turns: list[list[bytes]]


class Workload:
    """Conversations, per-pod admit events and query samples (see the module docstring)."""

    def __init__(
        self,
        pods: int,
        chunks: int,
        prompts: int = 4,
        prompt_chunks: int = 16,
        turns: int = 6,
        turn_chunks: int = 8,
        seed: int = 7,
    ) -> None:
        rng = random.Random(seed)
        self.pods, self.turn_chunks = pods, turn_chunks
        self.prompts = [[rng.randbytes(16) for _ in range(prompt_chunks)] for _ in range(prompts)]
        n_conv = -(-max(0, chunks - prompts * prompt_chunks) // (turns * turn_chunks))
        self.convs = [
            Conversation(
                rng.randrange(pods),
                rng.randrange(prompts),
                [[rng.randbytes(16) for _ in range(turn_chunks)] for _ in range(turns)],
            )
            for _ in range(n_conv)
        ]
        self._rng = random.Random(seed + 1)

    def events(self) -> dict[int, list[tuple[str, list[bytes]]]]:
        """Per pod, its admit events in arrival order: ``(tier, keys)`` with tier "l1" or "gpu"."""
        out: dict[int, list[tuple[str, list[bytes]]]] = {p: [] for p in range(self.pods)}
        served: set[tuple[int, int]] = set()
        for c in self.convs:
            if (c.pod, c.prompt) not in served:
                served.add((c.pod, c.prompt))
                out[c.pod] += [("l1", self.prompts[c.prompt]), ("gpu", self.prompts[c.prompt])]
            out[c.pod] += [("l1", t) for t in c.turns]
            out[c.pod].append(("gpu", c.turns[-1]))
        return out

    def chains(self) -> dict[int, list[tuple[bytes | None, list[bytes]]]]:
        """Per pod, each block run it stores once (system prompt, then each turn) with the key of
        the chunk before it (None for a prompt): the ``parent`` that engine KV events carry."""
        out: dict[int, list[tuple[bytes | None, list[bytes]]]] = {p: [] for p in range(self.pods)}
        served: set[tuple[int, int]] = set()
        for c in self.convs:
            prompt = self.prompts[c.prompt]
            if (c.pod, c.prompt) not in served:
                served.add((c.pod, c.prompt))
                out[c.pod].append((None, prompt))
            parent = prompt[-1]
            for t in c.turns:
                out[c.pod].append((parent, t))
                parent = t[-1]
        return out

    def queries(self, n: int) -> list[Query]:
        """``n`` queries drawn from :data:`QUERY_MIX` (a fresh draw on every call)."""
        rng = self._rng
        kinds = [k for k, _ in QUERY_MIX]
        weights = [w for _, w in QUERY_MIX]
        out = []
        for kind in rng.choices(kinds, weights, k=n):
            new_turn = [rng.randbytes(16) for _ in range(self.turn_chunks)]
            c = self.convs[rng.randrange(len(self.convs))]
            prompt = self.prompts[c.prompt]
            if kind == "next_turn":
                keys = prompt + [k for t in c.turns for k in t] + new_turn
            elif kind == "edit":
                upto = rng.randrange(1, len(c.turns))
                keys = prompt + [k for t in c.turns[:upto] for k in t] + new_turn
            elif kind == "new_conversation":
                keys = prompt + new_turn
            else:
                keys = [rng.randbytes(16) for _ in range(len(prompt))] + new_turn
            out.append(Query(kind, keys))
        return out
