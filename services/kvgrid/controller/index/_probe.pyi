"""Types of the compiled loops in ``_probe.c`` (built by ``pip install`` where a C compiler exists)."""

from collections.abc import Buffer

def probe(
    state: Buffer, tab: Buffer, stride: int, shift: int, w: int, keys: Buffer, stop: bool, /
) -> tuple[list[int], list[int]]: ...
def probe_words(
    state: Buffer, tab: Buffer, stride: int, shift: int, w: int, keys: Buffer, stop: bool, /
) -> bytes: ...
def match_words(words: Buffer, w: int, eligible: Buffer, max_pods: int, /) -> bytes: ...
def insert(
    state: Buffer, tab: Buffer, stride: int, shift: int, off: int, bit: int, keys: Buffer, /
) -> tuple[int, int, int]: ...
