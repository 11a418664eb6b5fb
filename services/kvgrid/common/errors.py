"""The typed errors kvgrid services raise to the caller; gRPC-free, so cores can raise them.

Every error a client can cause (bad input, unknown id, stale epoch, a limit) is a
:class:`KvgridError` subclass whose ``status`` names the gRPC status code it becomes. The mapping
to ``grpc.StatusCode`` lives in one place (:func:`kvgrid.common.rpc.status_of`); anything that is
*not* a :class:`KvgridError` (a numpy ``ValueError``, a bug) reaches the client as INTERNAL.

Code that validates client input raises these. Validators it calls that raise plain ``ValueError``
(shared helpers such as ``check_chunk_keys``) are wrapped in :func:`client_input`, which re-raises
their ``ValueError``/``TypeError`` as :class:`InvalidArgument` with the same text.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

__all__ = [
    "FailedPrecondition",
    "InvalidArgument",
    "KvgridError",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "Unavailable",
    "Unimplemented",
    "check_namespace_id",
    "client_input",
    "is_namespace_id",
    "within",
]


class KvgridError(Exception):
    """An error meant for the caller: ``str(self)`` is the message it sees, naming the bad value."""

    status: ClassVar[str] = "UNKNOWN"
    """Name of the ``grpc.StatusCode`` this error becomes."""


class InvalidArgument(KvgridError, ValueError):
    """The request is malformed or out of range (a ValueError too, for callers that catch those)."""

    status = "INVALID_ARGUMENT"


class NotFound(KvgridError):
    status = "NOT_FOUND"


class FailedPrecondition(KvgridError):
    """Well-formed, but the system is not in a state to run it (stale epoch, other layout...)."""

    status = "FAILED_PRECONDITION"


class ResourceExhausted(KvgridError):
    status = "RESOURCE_EXHAUSTED"


class PermissionDenied(KvgridError):
    """The caller's proven identity may not do this (wrong role, another pod's UID, a pod another
    identity registered)."""

    status = "PERMISSION_DENIED"


class Unimplemented(KvgridError):
    """The method exists but this listener does not serve it (e.g. the engine API over TCP)."""

    status = "UNIMPLEMENTED"


class Unavailable(KvgridError):
    """A dependency (a peer, the controller, an agent) cannot be reached right now; retry later."""

    status = "UNAVAILABLE"


@contextmanager
def client_input(where: str = "") -> Iterator[None]:
    """Treat ``ValueError``/``TypeError`` raised inside as the client's fault (INVALID_ARGUMENT),
    prefixed with ``where: `` when given. Wrap only code whose every such error is about the input."""
    try:
        yield
    except KvgridError:
        raise
    except (ValueError, TypeError) as e:
        raise InvalidArgument(f"{where}: {e}" if where else str(e)) from e


@contextmanager
def within(where: str) -> Iterator[None]:
    """Prefix the message of a :class:`KvgridError` raised inside with ``where: `` (same class), so
    an error about one item of a batch names the item (``requests[3]: ...``)."""
    try:
        yield
    except KvgridError as e:
        raise type(e)(f"{where}: {e}") from None


_HEX = frozenset("0123456789abcdef")


def is_namespace_id(s: str) -> bool:
    """True for a namespace id: 32 lowercase hex characters (``KeyNamespace.namespace_id()``)."""
    return len(s) == 32 and _HEX.issuperset(s)


def check_namespace_id(s: str, what: str, expected: str = "") -> str:
    """``s`` if it is a namespace id, else :class:`InvalidArgument` naming ``what`` (and, with
    ``expected``, what the id is needed for)."""
    if not is_namespace_id(s):
        tail = f" {expected}" if expected else ""
        raise InvalidArgument(f"{what}={s!r:.60}: expected the 32-char lowercase hex namespace id{tail}")
    return s
