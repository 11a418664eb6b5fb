"""The peer data plane: chunk bytes on TCP sockets of their own, with gRPC ``FetchChunks`` as the
control plane (``peer_data_plane=socket``).

The protocol, its security modes and invariants are described in
:mod:`~kvgrid.agent.peers.dataplane.protocol`. The modules, each importing only those above it:

- ``protocol``: wire constants, stream and security-mode negotiation, :class:`StreamFailure`
- ``keys``: per-ticket subkeys, hello tag, chunk MAC, AES-GCM nonce and associated data
- ``sockets``: tuning, connect, bounded exact receives, the helper thread that overlaps hashing
- ``tls_contexts``: the data port's mutual-TLS contexts
- ``tickets``: :class:`Ticket`, what one FetchChunks call may fetch
- ``checksummed``, ``mac``, ``aead``: each mode's framing, send and receive side
- ``server``: :class:`DataPlaneServer`, the data port
- ``client``: :func:`fetch_streams`, a ticket's connections on the fetching side

Nothing is re-exported here: import from the module that defines a name.
"""
