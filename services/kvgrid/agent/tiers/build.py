"""The agent's tier chain from its config: disk (``tier_disk_path``) then the object store
(``tier_s3_endpoint``); None when neither is set (tiers are off by default). Records an earlier
run left on disk are indexed by ``TierChain.reindex``, which the agent calls once its callbacks are
wired."""

from __future__ import annotations

import logging

from kvgrid.agent.config import AgentConfig
from kvgrid.agent.tiers.disk import DiskBlobStore
from kvgrid.agent.tiers.tier import Tier, TierChain

__all__ = ["build_tier_chain"]

log = logging.getLogger(__name__)


def build_tier_chain(config: AgentConfig) -> TierChain | None:
    tiers: list[Tier] = []
    if config.tier_disk_path:
        tiers.append(Tier(DiskBlobStore(config.tier_disk_path), config.tier_disk_size))
    if config.tier_s3_endpoint:
        from kvgrid.agent.tiers.s3 import S3BlobStore, load_credentials  # minio only when used

        scheme, _, host = config.tier_s3_endpoint.partition("://")
        s3 = S3BlobStore(
            host.rstrip("/"),
            config.tier_s3_bucket,
            prefix=config.tier_s3_prefix,
            credentials=load_credentials(config.tier_s3_credentials_dir),
            secure=scheme == "https",
            region=config.tier_s3_region,
            part_size=config.tier_s3_part_size,
            max_retries=config.tier_s3_max_retries,
            backoff_s=config.tier_s3_retry_backoff_ms / 1000.0,
        )
        tiers.append(Tier(s3, config.tier_s3_size))
    if not tiers:
        return None
    log.info("lower tiers: %s", ", ".join(f"{t.name} ({t.capacity_bytes} bytes)" for t in tiers))
    return TierChain(tiers)
