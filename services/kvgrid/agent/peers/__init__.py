"""Peer fetch: copying chunks another agent holds in its L1 into this agent's L1 (docs/agent.md,
"Peer fetch" and "Peer data plane").

A Lookup that stops at a missing chunk asks the controller who holds the next ones and fetches them
from the holder with ``FetchChunks`` (mTLS): the bytes come as parts of that gRPC stream or, with a
ticket it hands out, on the holder's data port. A chunk becomes visible only once every byte
arrived and verified; a failing peer never fails a Lookup.

The modules, one job each (imports point down this list, never up; nothing is re-exported here):

- ``guard``: what the agent's TCP port lets one caller have (tenants, streams, serving deadline)
- ``metrics``: the ``kvgrid_agent_peer_*`` instruments and Health's counters
- ``errors``: :class:`PeerError` and its reason labels
- ``dataplane/``: the socket data plane (protocol, keys, tickets, the three framings, server,
  client)
- ``sender``: serving ``FetchChunks`` (:class:`ChunkSender`)
- ``directory``: who holds what (the controller's MatchPrefix and ListAgents; :func:`choose_peers`)
- ``grpc_stream``, ``socket_stream``: the two receive paths of a fetch
- ``fetcher``: the fetch itself (:class:`PeerFetcher`: candidates, stitching, sync or async landing)
"""
