"""Registered engine instances: one engine worker's KV tensors as the agent opened them, the kernel
groups rebuilt from them (its :class:`~kvgrid.agent.transfer.ChunkMover`), its namespace, its
events, and whether its process still lives."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvgrid.agent.transfer import ChunkMover, DoneSignal
from kvgrid.common.errors import InvalidArgument
from kvgrid.common.groups import EngineGroupInfo
from kvgrid.common.hashing import KeyNamespace

__all__ = ["EngineInstance", "TransferTotals", "UnknownInstanceError", "process_start_time"]


class UnknownInstanceError(InvalidArgument):
    """The request names an instance id that is not registered (never was, or was cleaned up);
    INVALID_ARGUMENT on the wire (the engine passed an id it never registered)."""


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` (clock ticks since boot) or None if it is not visible or a zombie.

    Comparing it with the value seen at registration tells a live engine from a reused pid.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Fields after the parenthesised command name (which may contain spaces): state is field 3,
    # starttime field 22.
    rest = stat[stat.rfind(b")") + 2 :].split()
    if not rest or rest[0] in (b"Z", b"X"):
        return None
    return int(rest[19])


@dataclass
class TransferTotals:
    """Chunks moved since start (Health reports them; the metrics carry the detail)."""

    retrieved_chunks: int = 0
    stored_chunks: int = 0


@dataclass
class EngineInstance:
    instance_id: str
    engine_pid: int
    pid_start_time: int | None
    namespace: KeyNamespace
    namespace_id: str
    groups: list[EngineGroupInfo]
    tensors: list[torch.Tensor]
    mover: ChunkMover
    registered_at: float = field(default_factory=time.time)
    fence: torch.cuda.Event | None = None
    """The engine's interprocess fence event (CUDA engines that sent one): transfers sent with
    ``after_fence`` start on the GPU once the engine's stream has passed its last record."""
    done: DoneSignal | None = None
    """The engine's done event: a Retrieve with ``signal_done`` answers once its copies are queued
    and records it after them."""

    def wait_event(self, after_fence: bool) -> torch.cuda.Event | None:
        """The event a transfer waits for; InvalidArgument when the engine asks for a fence it
        never registered."""
        if not after_fence:
            return None
        if self.fence is None:
            raise InvalidArgument(
                f"after_fence=true but instance {self.instance_id!r} registered no fence_event; "
                "expected RegisterKVCaches with an interprocess CUDA event first"
            )
        return self.fence

    @property
    def layout_id(self) -> str:
        return self.mover.layout_id

    @property
    def bytes_per_chunk(self) -> int:
        return self.mover.bytes_per_chunk

    @property
    def tokens_per_chunk(self) -> int:
        return self.namespace.tokens_per_chunk

    def alive(self) -> bool:
        if self.pid_start_time is None:
            return True  # not tracked (pid not visible from the agent)
        return process_start_time(self.engine_pid) == self.pid_start_time
