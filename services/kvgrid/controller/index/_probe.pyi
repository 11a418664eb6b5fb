"""Types of the compiled loops in ``_probe.c`` (built by ``pip install`` where a C compiler exists);
``_rowloops.py`` has the same functions in Python."""

from _typeshed import ReadableBuffer as Buffer
from _typeshed import WriteableBuffer

def probe(
    state: Buffer, tab: Buffer, shift: int, side: Buffer, w: int, keys: Buffer, stop: bool, /
) -> tuple[list[int], list[int], list[int]]: ...
def probe_words(
    state: Buffer, tab: Buffer, shift: int, side: Buffer, w: int, keys: Buffer, stop: bool, /
) -> bytes: ...
def match_words(words: Buffer, w: int, eligible: Buffer, max_pods: int, /) -> bytes: ...
def insert(
    state: WriteableBuffer,
    tab: WriteableBuffer,
    shift: int,
    side: WriteableBuffer,
    w: int,
    head: int,
    slot: int,
    tier: int,
    keys: Buffer,
    /,
) -> tuple[int, int, int, int, int, int]: ...
def remove(
    state: WriteableBuffer,
    tab: WriteableBuffer,
    shift: int,
    side: WriteableBuffer,
    w: int,
    head: int,
    slot: int,
    tier: int,
    keys: Buffer,
    /,
) -> tuple[int, int, int, int]: ...
def place(
    state: WriteableBuffer, tab: WriteableBuffer, shift: int, rows: Buffer, states: Buffer, /
) -> None: ...
