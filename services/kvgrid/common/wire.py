"""The protobuf <-> msgspec conversions every service shares; service code converts through here.

Protobuf is the wire, msgspec the in-process form. Conversions are lossless both ways, and a
field the sender did not set decodes to the msgspec default (proto3 cannot tell 0 from absent for
plain scalars, so 0 in a field whose valid values are positive means "absent"). A message that
does not convert raises :class:`~kvgrid.common.errors.InvalidArgument` (a ValueError) naming the
field. Conversions of one service's own messages live beside it (``kvgrid.controller.wire``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from kvgrid.api.v1 import common_pb2
from kvgrid.common.errors import InvalidArgument, client_input
from kvgrid.common.groups import EngineGroupInfo
from kvgrid.common.groups import from_proto as _groups_from_proto
from kvgrid.common.groups import to_proto as engine_group_infos_to_proto
from kvgrid.common.hashing import KeyNamespace
from kvgrid.common.identity import PodIdentity

__all__ = [
    "block_ids_from_proto",
    "block_ids_to_proto",
    "engine_group_infos_from_proto",
    "engine_group_infos_to_proto",
    "key_namespace_from_proto",
    "key_namespace_to_proto",
    "pod_identity_from_proto",
    "pod_identity_to_proto",
]


def _default(struct_type: type[msgspec.Struct], name: str) -> object:
    for f in msgspec.structs.fields(struct_type):
        if f.name == name:
            return f.default
    raise AssertionError(f"{struct_type.__name__} has no field {name}")


def key_namespace_to_proto(ns: KeyNamespace) -> common_pb2.KeyNamespace:
    return common_pb2.KeyNamespace(
        model=ns.model,
        cache_salt=ns.cache_salt,
        lora_name=ns.lora_name,
        tokens_per_chunk=ns.tokens_per_chunk,
        kv_identity=ns.kv_identity,
    )


def key_namespace_from_proto(msg: common_pb2.KeyNamespace) -> KeyNamespace:
    """``tokens_per_chunk`` 0 (unset) becomes the KeyNamespace default; an empty model is rejected."""
    tokens_per_chunk = msg.tokens_per_chunk or _default(KeyNamespace, "tokens_per_chunk")
    try:
        return KeyNamespace(
            model=msg.model,
            cache_salt=msg.cache_salt,
            lora_name=msg.lora_name,
            tokens_per_chunk=tokens_per_chunk,  # type: ignore[arg-type]
            kv_identity=msg.kv_identity,
        )
    except ValueError as e:
        raise InvalidArgument(f"namespace: {e}") from None


def engine_group_infos_from_proto(msgs: Iterable[common_pb2.EngineGroupInfo]) -> list[EngineGroupInfo]:
    """:func:`kvgrid.common.groups.from_proto`; a message it rejects raises InvalidArgument."""
    with client_input():
        return _groups_from_proto(msgs)


def pod_identity_to_proto(pod: PodIdentity) -> common_pb2.PodIdentity:
    return common_pb2.PodIdentity(
        pod_uid=pod.pod_uid,
        pod_name=pod.pod_name,
        namespace=pod.namespace,
        node_name=pod.node_name,
        epoch=pod.epoch,
        agent_address=pod.agent_address,
    )


def pod_identity_from_proto(msg: common_pb2.PodIdentity) -> PodIdentity:
    """Raises InvalidArgument for an unset/empty ``pod_uid`` or an epoch of 2**63 or more."""
    try:
        return PodIdentity(
            pod_uid=msg.pod_uid,
            pod_name=msg.pod_name,
            namespace=msg.namespace,
            node_name=msg.node_name,
            epoch=msg.epoch,
            agent_address=msg.agent_address,
        )
    except ValueError as e:
        raise InvalidArgument(f"pod: {e}") from None


def block_ids_to_proto(block_ids: Iterable[Sequence[int]]) -> list[common_pb2.BlockIds]:
    """One ``BlockIds`` per engine group (or per info, after expansion)."""
    return [common_pb2.BlockIds(ids=ids) for ids in block_ids]


def block_ids_from_proto(msgs: Iterable[common_pb2.BlockIds]) -> list[list[int]]:
    return [list(m.ids) for m in msgs]
