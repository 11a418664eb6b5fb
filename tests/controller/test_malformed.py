"""Malformed protobuf sent to any ControllerService method is INVALID_ARGUMENT.

grpcio's own deserializer answers INTERNAL ("Exception deserializing request!"); the server toolkit
(:mod:`kvgrid.common.rpc`) parses requests itself. This loops over every method of the service
descriptor, so a method added later is covered too, and sends bytes that are not a valid message.
"""

from __future__ import annotations

import grpc
import pytest

from kvgrid.api.v1 import controller_pb2
from kvgrid.controller.service import SERVICE_NAME, Server

_METHODS = list(controller_pb2.DESCRIPTOR.services_by_name["ControllerService"].methods)
# Field 1, length-delimited, claims 5 bytes but only 2 follow: no message parses this.
_BAD = b"\x0a\x05ab"


def _identity(b: bytes) -> bytes:
    return b


@pytest.mark.parametrize("method", _METHODS, ids=lambda m: m.name)
def test_malformed_request_is_invalid_argument(server: Server, method: object) -> None:
    from google.protobuf.descriptor import MethodDescriptor

    assert isinstance(method, MethodDescriptor)
    path = f"/{SERVICE_NAME}/{method.name}"
    with grpc.insecure_channel(server.address) as ch, pytest.raises(grpc.RpcError) as ei:
        if method.client_streaming and method.server_streaming:
            call = ch.stream_stream(path, request_serializer=_identity, response_deserializer=_identity)
            list(call(iter([_BAD]), timeout=5))
        elif method.server_streaming:
            call_us = ch.unary_stream(path, request_serializer=_identity, response_deserializer=_identity)
            list(call_us(_BAD, timeout=5))
        else:
            call_uu = ch.unary_unary(path, request_serializer=_identity, response_deserializer=_identity)
            call_uu(_BAD, timeout=5)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
    assert "malformed" in (ei.value.details() or ""), ei.value.details()


def test_every_method_is_covered() -> None:
    assert {m.name for m in _METHODS} >= {
        "RegisterAgent",
        "Heartbeat",
        "PublishEvents",
        "SnapshotIndex",
        "MatchPrefix",
        "BatchMatchPrefix",
        "Score",
        "BatchScore",
        "ListAgents",
        "GetStats",
    }
