"""The engine's side of the agent: what runs inside the vLLM engine process to talk to its agent.

``client.py`` (:class:`~kvgrid.engine.client.AgentClient`: gRPC and the hot path), ``hotpath.py``
(the hot path's client), ``tensors.py`` (the engine's KV tensors described for RegisterKVCaches).
Imports point one way: ``connector -> engine -> common``; the agent never imports this package
(what both ends share -- the hot path's frames, result types, dtype and GPU names -- lives in
:mod:`kvgrid.common`).
"""
