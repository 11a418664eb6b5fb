"""Holder id <-> small slot number for :class:`~kvgrid.controller.index.memory.MemoryIndex`.

Invariants: ``by_holder`` and ``by_slot`` are inverse maps; a released slot is reused, lowest
first; ``version`` changes with every change of the table (callers cache per version).
"""

from __future__ import annotations

__all__ = ["Slots"]


class Slots:
    """Holder id <-> small slot number; freed slots are reused (lowest first)."""

    def __init__(self) -> None:
        self.by_holder: dict[str, int] = {}
        self.by_slot: dict[int, str] = {}
        self._free: list[int] = []
        self.version = 0  # bumped on every change of the table (callers cache per version)

    def get_or_assign(self, holder: str) -> int:
        slot = self.by_holder.get(holder)
        if slot is None:
            if self._free:
                self._free.sort()
                slot = self._free.pop(0)
            else:
                slot = len(self.by_holder)
            self.by_holder[holder] = slot
            self.by_slot[slot] = holder
            self.version += 1
        return slot

    def release(self, holder: str) -> int | None:
        slot = self.by_holder.pop(holder, None)
        if slot is not None:
            del self.by_slot[slot]
            self._free.append(slot)
            self.version += 1
        return slot
