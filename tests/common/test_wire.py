"""kvgrid.common.wire and kvgrid.common.identity: protobuf <-> msgspec conversions."""

from __future__ import annotations

import time

import msgspec
import pytest

from kvgrid.api.v1 import agent_pb2, common_pb2
from kvgrid.common import wire
from kvgrid.common.groups import EngineGroupInfo
from kvgrid.common.hashing import KeyNamespace
from kvgrid.common.identity import MAX_EPOCH, PodIdentity, new_epoch

POD = PodIdentity(
    pod_uid="6f1c2a9e-1111-2222-3333-444455556666",
    pod_name="vllm-0",
    namespace="inference",
    node_name="gpu-node-3",
    epoch=(1 << 62) + 12345,
    agent_address="10.0.0.7:50051",
)


def test_key_namespace_round_trip_through_bytes() -> None:
    ns = KeyNamespace(
        model="meta-llama/Llama-3.1-8B",
        cache_salt="tenant-a",
        lora_name="sql",
        tokens_per_chunk=512,
        kv_identity="bf16/LBNHC/tp0of2",
    )
    msg = wire.key_namespace_to_proto(ns)
    back = wire.key_namespace_from_proto(common_pb2.KeyNamespace.FromString(msg.SerializeToString()))
    assert back == ns
    assert back.namespace_id() == ns.namespace_id()


def test_key_namespace_unset_fields_decode_to_defaults() -> None:
    back = wire.key_namespace_from_proto(common_pb2.KeyNamespace(model="m"))
    assert back == KeyNamespace(model="m")
    assert back.tokens_per_chunk == 256


def test_key_namespace_without_model_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"namespace: .*model"):
        wire.key_namespace_from_proto(common_pb2.KeyNamespace())


def test_pod_identity_round_trip_through_bytes() -> None:
    msg = wire.pod_identity_to_proto(POD)
    back = wire.pod_identity_from_proto(common_pb2.PodIdentity.FromString(msg.SerializeToString()))
    assert back == POD
    assert back.holder_id == f"{POD.pod_uid}/{POD.epoch}"


def test_pod_identity_rejects_empty_uid_and_huge_epoch() -> None:
    with pytest.raises(ValueError, match="pod: pod_uid=''"):
        wire.pod_identity_from_proto(common_pb2.PodIdentity())
    with pytest.raises(ValueError, match=f"epoch={1 << 63}"):
        wire.pod_identity_from_proto(common_pb2.PodIdentity(pod_uid="u", epoch=1 << 63))


def test_pod_identity_msgpack_missing_fields_get_defaults() -> None:
    old = msgspec.msgpack.encode({"pod_uid": "u", "epoch": 5})
    assert msgspec.msgpack.decode(old, type=PodIdentity) == PodIdentity("u", epoch=5)


def test_pod_identity_from_downward_api_env() -> None:
    env = {"POD_UID": "uid-1", "POD_NAME": "p", "POD_NAMESPACE": "ns", "NODE_NAME": "n"}
    before = time.time_ns() // 1_000_000
    a = PodIdentity.from_env(env, agent_address="1.2.3.4:5")
    b = PodIdentity.from_env(env)
    assert (a.pod_uid, a.pod_name, a.namespace, a.node_name) == ("uid-1", "p", "ns", "n")
    assert a.agent_address == "1.2.3.4:5"
    # Every start gets its own epoch; the high bits are the start time in milliseconds.
    assert a.epoch != b.epoch
    assert 0 < a.epoch <= MAX_EPOCH
    assert before <= a.epoch >> 20 <= time.time_ns() // 1_000_000
    assert PodIdentity.from_env(env, epoch=7).epoch == 7


def test_pod_identity_outside_kubernetes_uses_host_name() -> None:
    ident = PodIdentity.from_env({})
    assert ident.pod_uid.startswith("local-") and len(ident.pod_uid) > len("local-")
    assert ident.pod_name == ident.node_name == ident.pod_uid.removeprefix("local-")
    assert ident.namespace == ""


def test_new_epoch_is_63_bit_and_distinct() -> None:
    epochs = {new_epoch() for _ in range(1000)}
    # Calls within one millisecond differ in 20 random bits: a few birthday collisions at most.
    assert len(epochs) >= 990
    assert all(0 <= e <= MAX_EPOCH for e in epochs)


def test_engine_group_infos_through_a_real_request() -> None:
    infos = [EngineGroupInfo(0, (0, 2), 16), EngineGroupInfo(1, (1,), 32, sw_size_tokens=1024)]
    req = agent_pb2.RegisterKVCachesRequest(
        instance_id="i",
        engine_groups=wire.engine_group_infos_to_proto(infos),
        namespace=wire.key_namespace_to_proto(KeyNamespace(model="m")),
    )
    got = agent_pb2.RegisterKVCachesRequest.FromString(req.SerializeToString())
    assert wire.engine_group_infos_from_proto(got.engine_groups) == infos
    assert wire.key_namespace_from_proto(got.namespace) == KeyNamespace(model="m")


def test_block_ids_round_trip() -> None:
    ids = [[10, 11], [], [20, 21, 22]]
    req = agent_pb2.StoreRequest(block_ids=wire.block_ids_to_proto(ids))
    got = agent_pb2.StoreRequest.FromString(req.SerializeToString())
    assert wire.block_ids_from_proto(got.block_ids) == ids


def test_controller_event_kinds_are_the_wire_values() -> None:
    from kvgrid.api.v1 import controller_pb2
    from kvgrid.controller.ingest import EventKind

    assert {k.name: int(k) for k in EventKind} == {
        "ADMIT": controller_pb2.EVENT_KIND_ADMIT,
        "EVICT": controller_pb2.EVENT_KIND_EVICT,
        "CLEAR": controller_pb2.EVENT_KIND_CLEAR,
    }


def test_bad_messages_raise_invalid_argument_naming_the_field() -> None:
    from kvgrid.common.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match=r"^pod: "):
        wire.pod_identity_from_proto(common_pb2.PodIdentity())
    with pytest.raises(InvalidArgument, match=r"^namespace: "):
        wire.key_namespace_from_proto(common_pb2.KeyNamespace())
    with pytest.raises(InvalidArgument, match="sw_size_tokens=-5"):
        wire.engine_group_infos_from_proto(
            [
                common_pb2.EngineGroupInfo(
                    engine_group_id=0, tokens_per_block=16, layer_indices=[0], sw_size_tokens=-5
                )
            ]
        )
