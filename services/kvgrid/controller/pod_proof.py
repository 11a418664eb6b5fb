"""The controller's ``agent_pod_proof`` setting as the :class:`~kvgrid.common.pod_tokens.AgentPodProof`
its gRPC :class:`~kvgrid.common.authz.Authorizer` applies (docs/security.md, "Agent identity modes")."""

from __future__ import annotations

import logging

from kvgrid.common.pod_tokens import AgentPodProof, ReviewBudget, TokenFile, TokenReviewer, in_cluster_api_url
from kvgrid.controller.config import ControllerConfig

__all__ = ["pod_proof_for"]

log = logging.getLogger(__name__)


def pod_proof_for(cfg: ControllerConfig) -> AgentPodProof | None:
    """The pod proof of ``cfg`` (None without TLS, or with ``unverified``, logged as a warning).
    ValueError naming the setting when the API server's address, token or CA cannot be found."""
    if cfg.tls is None:
        return None
    if cfg.agent_pod_proof == "unverified":
        log.warning(
            "agent_pod_proof=unverified: an agent with the shared agent certificate may register, heartbeat "
            "and publish as any pod it claims first; set agent_pod_proof=token (pod ServiceAccount tokens) "
            "or certificate (per-pod certificates) so agents act only as their own pod (docs/security.md)"
        )
        return None
    if cfg.agent_pod_proof == "certificate":
        log.info("agent_pod_proof=certificate: agents must present per-pod certificates")
        return AgentPodProof("certificate")
    url = cfg.kube_api_url or in_cluster_api_url()
    reviewer = TokenReviewer(
        url,
        TokenFile(cfg.kube_api_token_file, "kube_api_token_file"),
        cfg.kube_api_ca_file,
        audience=cfg.agent_token_audience,
        cache_ttl_s=cfg.agent_token_cache_ms / 1000,
        timeout_s=cfg.kube_api_timeout_ms / 1000,
        budget=ReviewBudget(cfg.agent_token_reviews_per_s, cfg.agent_token_reviews_total_per_s),
    )
    log.info(
        "agent_pod_proof=token: agents with the shared certificate prove their pod by a ServiceAccount token "
        "of audience %r, verified by TokenReview at %s (verdicts kept %d ms; at most %g reviews/s per "
        "caller, %g in total)",
        cfg.agent_token_audience,
        url,
        cfg.agent_token_cache_ms,
        cfg.agent_token_reviews_per_s,
        cfg.agent_token_reviews_total_per_s,
    )
    return AgentPodProof("token", reviewer)
