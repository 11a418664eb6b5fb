"""The lookup listener as ``kvgrid controller`` starts it (``cli.start_lookup_listener``): mTLS
with the controller's files, every request authorized like the gRPC method of the same name, and
plaintext only on loopback unless the explicit insecure flag is given. Real TCP and TLS on loopback.

Who is refused where: a client without a certificate, or with one another CA signed, never gets past
the TLS handshake (the server requires a CA-signed client certificate; with TLS 1.3 the client learns
it on its first read, as an alert), so no frame is read. A CA-signed certificate whose identity the
authorizer does not accept (no kvgrid identity, another trust domain or namespace, a role the method's
policy does not list) completes the handshake -- it proves who it is -- and each request is answered
PERMISSION_DENIED with the authorizer's text, the same text gRPC sends for that caller.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import msgspec
import pytest

from kvgrid.api.v1 import common_pb2, controller_pb2
from kvgrid.common.authz import Authorizer, Policy
from kvgrid.common.identity import PodIdentity
from kvgrid.common.tls import CONTROLLER_SERVER_NAME, TlsFiles
from kvgrid.controller.cli import start_lookup_listener
from kvgrid.controller.config import ControllerConfig
from kvgrid.controller.index import IndexTier
from kvgrid.controller.lookup_server import (
    METHOD_BATCH_MATCH,
    METHOD_LIST_AGENTS,
    METHOD_MATCH,
    METHOD_SCORE,
    ClientSsl,
    LookupClient,
    LookupFailed,
    LookupServer,
    LookupUnavailable,
    server_ssl_context,
)
from kvgrid.controller.service import POLICY, Server, serve
from tests.conftest import _bind_free_port
from tests.controller.support import NS_ID, rand_keys
from tests.security.conftest import Pki, channel_as, tls_flags

PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED.value[0]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
KEYS = rand_keys(8)


def _files(d: Path) -> TlsFiles:
    return TlsFiles(str(d / "tls.crt"), str(d / "tls.key"), str(d / "ca.crt"))


def _client(address: str, who: Path, server_name: str = CONTROLLER_SERVER_NAME) -> LookupClient:
    return LookupClient(address, ssl_context=ClientSsl(_files(who)).context(), server_name=server_name)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_server(pki: Pki) -> Iterator[tuple[Server, LookupServer]]:
    cfg = ControllerConfig(
        listen="127.0.0.1:0",
        lookup_port=_bind_free_port(),
        lease_ttl_ms=600_000,
        **tls_flags(pki.controller()),
    )
    server = serve(cfg)
    lookup = start_lookup_listener(cfg, server.controller)
    assert lookup is not None and lookup.tls
    ctl = server.controller
    for uid, tier, n in (("pod-a", IndexTier.GPU, 3), ("pod-b", IndexTier.L1, 6), ("pod-c", IndexTier.L2, 8)):
        ctl.register(PodIdentity(uid, f"name-{uid}", epoch=1), [NS_ID], 0)
        ctl.index.add(f"{uid}/1", tier, KEYS[:n])
    yield server, lookup
    lookup.stop()
    server.stop()


def _match(keys: list[bytes]) -> controller_pb2.MatchPrefixRequest:
    return controller_pb2.MatchPrefixRequest(chunk_keys=common_pb2.ChunkKeys(keys=keys), namespace_id=NS_ID)


def _requests() -> list[tuple[int, str, bytes]]:
    """(listener method, gRPC method path, request bytes) of every method the listener serves."""
    svc = "/kvgrid.v1.ControllerService/"
    packed = controller_pb2.BatchMatchPrefixRequest(
        packed_chunk_keys=b"".join(KEYS[:5]), packed_query_chunks=[5], packed_namespace_id=NS_ID, compact=True
    )
    readable = controller_pb2.BatchMatchPrefixRequest(requests=[_match(KEYS), _match(KEYS[:2])])
    return [
        (METHOD_MATCH, svc + "MatchPrefix", _match(KEYS).SerializeToString()),
        (METHOD_MATCH, svc + "MatchPrefix", _match([rand_keys(1)[0], *KEYS]).SerializeToString()),
        (METHOD_BATCH_MATCH, svc + "BatchMatchPrefix", packed.SerializeToString()),
        (METHOD_BATCH_MATCH, svc + "BatchMatchPrefix", readable.SerializeToString()),
        (METHOD_SCORE, svc + "Score", controller_pb2.ScoreRequest(match=_match(KEYS)).SerializeToString()),
    ]


def test_router_gets_byte_identical_answers_over_mtls(
    tls_server: tuple[Server, LookupServer], pki: Pki
) -> None:
    server, lookup = tls_server
    client = _client(lookup.address, pki.router())
    with channel_as(server.address, pki.router(), CONTROLLER_SERVER_NAME) as ch:
        for method, path, body in _requests():
            want = ch.unary_unary(path)(body, timeout=5)
            assert client.call_raw(method, body) == want, path
        agents = controller_pb2.ListAgentsResponse.FromString(client.call_raw(METHOD_LIST_AGENTS, b""))
        assert sorted(a.pod.pod_uid for a in agents.agents) == ["pod-a", "pod-b", "pod-c"]
    score = client.score(controller_pb2.ScoreRequest(match=_match(KEYS)))
    assert {s.match.pod_uid for s in score.scores} >= {"pod-a", "pod-b", "pod-c"}  # real answers
    assert score.scores[0].match.l1_chunks + score.scores[0].match.gpu_chunks > 0
    client.close()


@pytest.mark.parametrize("who", ["none", "foreign_ca"])
def test_no_or_foreign_certificate_is_refused_at_the_handshake(
    tls_server: tuple[Server, LookupServer], pki: Pki, who: str
) -> None:
    _, lookup = tls_server
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cadata=pki.ca.pem.decode())
    if who == "foreign_ca":
        d = pki.foreign_agent()
        ctx.load_cert_chain(d / "tls.crt", d / "tls.key")
    before = lookup.ctl.rejected
    with pytest.raises(LookupUnavailable) as err:
        c = LookupClient(lookup.address, ssl_context=ctx)  # TLS 1.2 would fail here already
        c.call_raw(METHOD_MATCH, _match(KEYS).SerializeToString())
    assert err.value.status == UNAVAILABLE
    # The server aborts the handshake without an alert (asyncio's TLS), so the client sees its
    # connection closed before any answer; the text says what that means.
    assert err.value.detail == (
        f"lookup listener {lookup.address}: closed the connection before its first answer: it refuses "
        "a client certificate its CA did not sign, or none (tls_cert_file, tls_key_file, tls_ca_file)"
    )
    assert lookup.ctl.rejected == before  # no frame was ever read


@pytest.mark.parametrize("who", ["no_identity", "other_domain", "other_namespace"])
def test_unaccepted_identity_is_permission_denied_like_grpc(
    tls_server: tuple[Server, LookupServer], pki: Pki, who: str
) -> None:
    server, lookup = tls_server
    d = {
        "no_identity": pki.no_identity,
        "other_domain": pki.other_domain,
        "other_namespace": lambda: pki.in_namespace("someone-else", "router"),
    }[who]()
    client = _client(lookup.address, d)
    with channel_as(server.address, d, CONTROLLER_SERVER_NAME) as ch:
        for method, path, body in _requests():
            with pytest.raises(grpc.RpcError) as grpc_err:
                ch.unary_unary(path)(body, timeout=5)
            with pytest.raises(LookupFailed) as err:
                client.call_raw(method, body)
            assert grpc_err.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert (err.value.status, err.value.detail) == (PERMISSION_DENIED, grpc_err.value.details())
    client.close()


def test_every_role_the_grpc_policy_allows_is_allowed_and_no_other(
    tls_server: tuple[Server, LookupServer], pki: Pki
) -> None:
    """The listener enforces POLICY's entries: every read role of the chart (agent, controller,
    router) may call the four methods over gRPC, so it may over the listener."""
    _, lookup = tls_server
    body = {
        METHOD_MATCH: _match(KEYS).SerializeToString(),
        METHOD_BATCH_MATCH: controller_pb2.BatchMatchPrefixRequest(
            requests=[_match(KEYS)]
        ).SerializeToString(),
        METHOD_SCORE: controller_pb2.ScoreRequest(match=_match(KEYS)).SerializeToString(),
        METHOD_LIST_AGENTS: b"",
    }
    names = {METHOD_MATCH: "MatchPrefix", METHOD_BATCH_MATCH: "BatchMatchPrefix", METHOD_SCORE: "Score",
             METHOD_LIST_AGENTS: "ListAgents"}  # fmt: skip
    for role, d in (("agent", pki.agent()), ("controller", pki.controller()), ("router", pki.router())):
        client = _client(lookup.address, d)
        for method, b in body.items():
            assert role in POLICY.allowed[names[method]]
            client.call_raw(method, b)  # answered
        client.close()


def test_a_role_the_policy_does_not_list_is_permission_denied(
    tls_server: tuple[Server, LookupServer], pki: Pki
) -> None:
    server, _ = tls_server
    routers_only = Policy({"MatchPrefix": frozenset({"router"})})  # the others: nobody
    own = LookupServer(
        server.controller,
        "127.0.0.1:0",
        ssl_context=server_ssl_context(_files(pki.controller())),
        authorizer=Authorizer(routers_only, "cluster.local"),
    )
    try:
        agent = _client(own.address, pki.agent())
        with pytest.raises(LookupFailed) as err:
            agent.match(_match(KEYS))
        assert err.value.status == PERMISSION_DENIED
        assert "MatchPrefix needs a router identity; the caller " in err.value.detail
        assert "/role/agent' is a agent" in err.value.detail
        with pytest.raises(LookupFailed, match="Score needs a no identity"):
            agent.score(controller_pb2.ScoreRequest(match=_match(KEYS)))
        agent.close()
        router = _client(own.address, pki.router())
        assert router.match(_match(KEYS)).matches  # allowed, on its own connection
        with pytest.raises(LookupFailed, match="ListAgents needs a no identity"):
            router.list_agents()
        assert router.match(_match(KEYS)).matches  # a refusal keeps the connection serving
        router.close()
    finally:
        own.stop()


def test_client_checks_the_server_name(tls_server: tuple[Server, LookupServer], pki: Pki) -> None:
    _, lookup = tls_server
    with pytest.raises(LookupUnavailable, match="its certificate was not accepted"):
        _client(lookup.address, pki.router(), server_name="kvgrid-agent")


def test_mtls_listener_needs_an_authorizer_and_a_required_client_certificate(
    tls_server: tuple[Server, LookupServer], pki: Pki
) -> None:
    server, _ = tls_server
    ctx = server_ssl_context(_files(pki.controller()))
    with pytest.raises(ValueError, match="ssl_context given without authorizer"):
        LookupServer(server.controller, "127.0.0.1:0", ssl_context=ctx)
    import ssl

    ctx.verify_mode = ssl.CERT_OPTIONAL
    with pytest.raises(ValueError, match="expected CERT_REQUIRED"):
        LookupServer(server.controller, "127.0.0.1:0", ssl_context=ctx, authorizer=Authorizer(POLICY, "x"))


def test_plaintext_binds_loopback_only_unless_the_insecure_flag(
    tls_server: tuple[Server, LookupServer],
) -> None:
    server, _ = tls_server
    for host in ("0.0.0.0", "[::]"):
        with pytest.raises(ValueError, match="binds a loopback address unless given an mTLS ssl_context, or "
                                             "insecure_plaintext_on_network=true"):  # fmt: skip
            LookupServer(server.controller, f"{host}:0")
    # What kvgrid controller does: the listen check refuses the network host first, naming the flag.
    with pytest.raises(msgspec.ValidationError, match=r"listen='0\.0\.0\.0:50061' is not a loopback address"):
        msgspec.convert({"listen": "0.0.0.0:50061", "lookup_port": 50070}, ControllerConfig)
    cfg = ControllerConfig(
        listen="0.0.0.0:0", lookup_port=_bind_free_port(), insecure_plaintext_on_network=True
    )
    lookup = start_lookup_listener(cfg, server.controller)
    assert lookup is not None and not lookup.tls and lookup.address.startswith("0.0.0.0:")
    try:
        client = LookupClient(f"127.0.0.1:{lookup.address.rpartition(':')[2]}")
        assert client.match(_match(KEYS)).matches  # plaintext, no identity: every caller answered
        client.close()
    finally:
        lookup.stop()


def test_config_refuses_a_port_taken_by_another_listener() -> None:
    with pytest.raises(
        msgspec.ValidationError, match=r"lookup_port=50061: the same port as listen \(50061\)"
    ):
        msgspec.convert({"lookup_port": 50061}, ControllerConfig)
    with pytest.raises(msgspec.ValidationError, match=r"lookup_port=7: the same port as health_port \(7\)"):
        msgspec.convert({"lookup_port": 7, "health_port": 7}, ControllerConfig)
    assert ControllerConfig().lookup_port == 0  # off unless asked (the chart asks)


def test_a_taken_port_is_a_clear_error(tls_server: tuple[Server, LookupServer], pki: Pki) -> None:
    server, lookup = tls_server
    port = int(lookup.address.rpartition(":")[2])
    cfg = ControllerConfig(listen="127.0.0.1:0", lookup_port=port, **tls_flags(pki.controller()))
    with pytest.raises(ValueError, match=f"lookup_port={port}: the lookup listener cannot start: listen="):
        start_lookup_listener(cfg, server.controller)
