"""The connector's configuration (``kv_connector_extra_config``) and its identity in a vLLM engine.

:class:`KVGridConnectorConfig` is what the operator writes; :class:`ConnectorIdentity` is what
both halves of the connector derive from it and from vLLM's config once, at construction: which
agent each worker rank talks to, as which instance, and the key namespace of every rank. Keys of
one rank never match another rank's (each holds a different shard of the KV), nor another dtype's,
layout's, model's, cache salt's or LoRA adapter's -- except for MLA under tensor parallelism, whose
latent KV is the same on every TP rank: there every rank shares rank 0's namespace, only rank 0
stores, and every rank loads the same chunks (``replicated_kv``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from kvgrid.common.hashing import KeyNamespace
from kvgrid.connector.chunk_policy import kv_identity
from kvgrid.connector.vllm_specs import tokens_per_block

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "ConnectorIdentity",
    "KVGridConnectorConfig",
    "connector_identity",
    "parse_connector_config",
]


def _d(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class KVGridConnectorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The keys of ``kv_connector_extra_config`` (every one optional)."""

    agent_socket: Annotated[
        str,
        _d(
            "The kvgrid agent's Unix socket (it serves the engine API only there). '{rank}' and "
            "'{dp_rank}' are replaced by the worker's rank and the engine's data-parallel rank (one "
            "agent per GPU); the scheduler asks every rank's agent"
        ),
    ] = "/run/kvgrid/agent.sock"
    chunk_size: Annotated[
        int,
        _d("Tokens per cached chunk; a multiple of every KV cache group's block size"),
        msgspec.Meta(gt=0),
    ] = 256
    pin_ttl_ms: Annotated[
        int,
        _d("How long a Lookup pins the chunks it found until they are loaded (ms); 0 = the agent's default"),
        msgspec.Meta(ge=0),
    ] = 0
    rpc_timeout_s: Annotated[float, _d("Deadline of each worker-side agent call (s)"), msgspec.Meta(gt=0)] = (
        30.0
    )
    lookup_timeout_s: Annotated[
        float,
        _d(
            "Deadline of the scheduler's Lookup (s): vLLM's scheduler waits no longer for an agent "
            "that hangs (a peer fetch inside the Lookup must fit: the agent's --peer-fetch-timeout-ms)"
        ),
        msgspec.Meta(gt=0),
    ] = 2.0
    model_name: Annotated[
        str, _d("Model name in the key namespace; empty = vLLM's --model (the weights path or id)")
    ] = ""
    instance_id: Annotated[
        str,
        _d("This engine worker's id at the agent; '{engine_id}', '{dp_rank}' and '{rank}' are replaced"),
    ] = "{engine_id}-dp{dp_rank}-r{rank}"
    kv_identity: Annotated[
        str, _d("Extra text folded into the key namespace (anything else that changes KV bytes)")
    ] = ""
    layout_hints: Annotated[
        dict[str, str | int],
        _d('Layout hints for every layer (kvgrid.common.layouts), e.g. {"backend": "FLASHINFER"}'),
    ] = msgspec.field(default_factory=dict)
    layerwise: Annotated[
        bool,
        _d(
            "Load inside the step, through vLLM's layer hooks: a layer's attention waits only for its "
            "own KV, and stores start once the last layer's KV is written. One-group models only "
            "(hybrid models keep asynchronous loads)"
        ),
    ] = False
    layerwise_stages: Annotated[
        int,
        _d(
            "Layer-wise loads copied by the engine (engine_copies): the layers move in this many stages "
            "of consecutive layers, in order, and a layer's attention waits only for its own stage, so "
            "loading the next stage overlaps this one's compute (1: the first layer waits for all). "
            "More stages start the compute sooner; each costs the engine's thread a DMA call per chunk "
            "and a scatter launch (~0.5 ms per stage at 8k tokens on the H200: 8 beat 32 there)"
        ),
        msgspec.Meta(ge=1),
    ] = 8
    async_store: Annotated[
        bool | None,
        _d(
            "wait_for_save returns at once and the step's stores land in the background (the first "
            "token is not held up by the copy); vLLM keeps a finished request's blocks until its "
            "stores landed (no step waits), and a step waits only for stores of preempted requests. "
            "Unset: on for CUDA engines, off for CPU ones (tests see a stored prefix at once)"
        ),
    ] = None
    engine_copies: Annotated[
        bool | None,
        _d(
            "Loads and stores run the transfer kernels in the engine's own process and CUDA context, "
            "over the agent's L1 through its shared file (agent option l1_shared_dir): the engine's "
            "compute loses 1-2 % to a transfer instead of 17-22 % from the agent's context. Unset: on "
            "for CUDA engines whose agent shares its L1; a CPU engine copies itself only when set to true"
        ),
    ] = None
    lease_at_lookup: Annotated[
        bool,
        _d(
            "With engine copies: the scheduler's Lookup leases the hits (when every hit's bytes are "
            "already in L1), so a load needs no Retrieve round trip: a request's agent calls take 0.55 "
            "of the time on the H200 host, and an 8k-token layer-wise hit starts its copy ~1 ms sooner. "
            "false: every load Retrieves (the lease is then taken at load time)"
        ),
    ] = True
    save_decode_tokens: Annotated[
        bool,
        _d(
            "Also store chunks filled by generated tokens (multi-turn chats: the next turn repeats the "
            "answer); a decode chunk is stored the step after its last token's KV is computed"
        ),
    ] = False
    shm_dir: Annotated[
        str,
        _d(
            "CPU engines only: the directory (a tmpfs the agent can read, e.g. a shared /dev/shm) "
            "where the connector allocates vLLM's KV cache so the agent can map it"
        ),
    ] = "/dev/shm"
    reregister_interval_s: Annotated[
        float,
        _d("After the agent restarted (or was away), how often the worker registers again (s)"),
        msgspec.Meta(gt=0),
    ] = 1.0

    def engine_copies_on(self, cuda: bool) -> bool:
        """Whether the workers copy loads and stores themselves: ``engine_copies``, or when unset,
        on CUDA."""
        return cuda if self.engine_copies is None else self.engine_copies

    def async_store_on(self, cuda: bool) -> bool:
        """Whether stores land in the background: ``async_store``, or when unset, on CUDA."""
        return cuda if self.async_store is None else self.async_store


def parse_connector_config(extra: Mapping[str, Any] | None) -> KVGridConnectorConfig:
    """``kv_connector_extra_config`` -> config; ValueError naming the bad key or value."""
    try:
        return msgspec.convert(dict(extra or {}), KVGridConnectorConfig, strict=False)
    except msgspec.ValidationError as e:
        raise ValueError(
            f"kv_connector_extra_config {dict(extra or {})!r}: {e}; expected keys "
            f"{list(KVGridConnectorConfig.__struct_fields__)}"
        ) from None


class ConnectorIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """Who this connector instance is (derived once; both halves share the derivation)."""

    rank: int
    """This worker's rank (0 on the scheduler side)."""
    world_size: int
    dcp_size: int
    instance_id: str
    agent_address: str
    instance_ids: tuple[str, ...]
    """Every worker rank's instance id at its agent (the scheduler looks up on all of them)."""
    agent_addresses: tuple[str, ...]
    """Every worker rank's agent."""
    replicated_kv: bool
    """Every rank holds the same KV (MLA under TP): one namespace, rank 0 stores for all."""
    model_name: str
    tokens_per_chunk: int
    tokens_per_block: tuple[int, ...]
    """Tokens one block id covers, per KV cache group."""
    kv_identities: tuple[str, ...]
    """``KeyNamespace.kv_identity`` of every worker rank."""

    def namespace(self, rank: int, cache_salt: str = "", lora_name: str = "") -> KeyNamespace:
        """The key namespace of worker ``rank`` for a request with this salt and LoRA adapter."""
        return KeyNamespace(
            model=self.model_name,
            cache_salt=cache_salt,
            lora_name=lora_name,
            tokens_per_chunk=self.tokens_per_chunk,
            kv_identity=self.kv_identities[rank],
        )


def _format(template: str, what: str, **values: object) -> str:
    try:
        return template.format(**values)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"kv_connector_extra_config {what}={template!r}: bad placeholder ({e}); expected only "
            f"{['{' + k + '}' for k in values]}"
        ) from None


def _group_tokens_per_block(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, dcp_size: int
) -> tuple[int, ...]:
    """Tokens one block id covers, per KV cache group (the legacy no-config form: one group of
    ``cache_config.block_size``)."""
    if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
        return tuple(tokens_per_block(g.kv_cache_spec, dcp_size) for g in kv_cache_config.kv_cache_groups)
    block_size = int(vllm_config.cache_config.block_size or 0)
    return (block_size,) if block_size > 0 else ()


def _model_name(vllm_config: VllmConfig) -> str:
    model_config = vllm_config.model_config
    if model_config is None or not model_config.model:
        raise ValueError(
            "KVGridConnector: vLLM has no model config; set kv_connector_extra_config "
            "model_name to name the model in the chunk-key namespace"
        )
    return str(model_config.model)


def _replicated_kv(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> bool:
    """MLA under tensor parallelism (no PP): the latent KV cache is not sharded by heads, so every TP
    rank computes and holds the same bytes."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    par = vllm_config.parallel_config
    if int(par.tensor_parallel_size) < 2 or int(par.pipeline_parallel_size) != 1:
        return False
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        return False
    return all(isinstance(g.kv_cache_spec, MLAAttentionSpec) for g in kv_cache_config.kv_cache_groups)


def _kv_identities(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig | None,
    world_size: int,
    extra: str,
    replicated: bool,
) -> tuple[str, ...]:
    dtype = str(vllm_config.cache_config.cache_dtype)
    if dtype == "auto" and vllm_config.model_config is not None:
        dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    layout = (kv_cache_config.kv_cache_layout if kv_cache_config is not None else None) or ""
    par = vllm_config.parallel_config
    return tuple(
        kv_identity(
            dtype=dtype,
            layout=layout,
            rank=0 if replicated else rank,
            world_size=world_size,
            tp_size=int(par.tensor_parallel_size),
            pp_size=int(par.pipeline_parallel_size),
            extra=extra,
        )
        for rank in range(world_size)
    )


def connector_identity(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig | None,
    config: KVGridConnectorConfig,
    *,
    is_worker: bool,
    engine_id: str,
) -> ConnectorIdentity:
    """Derive the identity; ValueError naming the config key when it cannot serve this engine."""
    par = vllm_config.parallel_config
    world_size = int(par.world_size)
    rank = int(par.rank) if is_worker else 0
    dp_rank = int(getattr(par, "data_parallel_rank", 0) or 0)
    dcp_size = int(getattr(par, "decode_context_parallel_size", 1) or 1)
    group_tpb = _group_tokens_per_block(vllm_config, kv_cache_config, dcp_size)
    _check_chunk_size(config.chunk_size, group_tpb)
    instance_ids = tuple(
        _format(config.instance_id, "instance_id", engine_id=engine_id, dp_rank=dp_rank, rank=r)
        for r in range(world_size)
    )
    addresses = tuple(
        _format(config.agent_socket, "agent_socket", dp_rank=dp_rank, rank=r) for r in range(world_size)
    )
    if len(set(zip(instance_ids, addresses, strict=True))) < world_size:
        raise ValueError(
            f"kv_connector_extra_config instance_id={config.instance_id!r}: worker ranks sharing an agent "
            f"need distinct instance ids; keep '{{rank}}' in it"
        )
    replicated = _replicated_kv(vllm_config, kv_cache_config)
    return ConnectorIdentity(
        rank=rank,
        world_size=world_size,
        dcp_size=dcp_size,
        instance_id=instance_ids[rank],
        agent_address=addresses[rank],
        instance_ids=instance_ids,
        agent_addresses=addresses,
        replicated_kv=replicated,
        model_name=config.model_name or _model_name(vllm_config),
        tokens_per_chunk=config.chunk_size,
        tokens_per_block=group_tpb,
        kv_identities=_kv_identities(
            vllm_config, kv_cache_config, world_size, config.kv_identity, replicated
        ),
    )


def _check_chunk_size(chunk_size: int, group_tokens_per_block: Sequence[int]) -> None:
    for g, tpb in enumerate(group_tokens_per_block):
        if chunk_size % tpb:
            raise ValueError(
                f"kv_connector_extra_config chunk_size={chunk_size}: expected a multiple of "
                f"KV cache group {g}'s {tpb} tokens per block"
            )
