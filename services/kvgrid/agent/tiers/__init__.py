"""Tiers below L1: local disk and an S3-compatible object store (``docs/agent.md``, *Lower tiers*).

``base`` (record format, blob-store interface), ``disk`` and ``s3`` (one backend each), ``tier``
(capacity, LRU, verified reads, the background writer), ``build`` (from the agent config),
``metrics`` (``kvgrid_agent_tier_*``).
"""
