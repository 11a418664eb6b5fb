"""The chart's lower-tier values (``agent.tiers``): ``helm template`` renders flags the real
``kvgrid agent`` parser turns into the tier config, mounts the disk tier's volume (emptyDir, hostPath
or a PVC) and the object store's credentials Secret where those flags point, and refuses values
that contradict each other with a message naming them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvgrid.agent.config import AgentConfig
from kvgrid.common.config import parse_byte_size
from tests.deploy.chart import K8S_VERSIONS, RELEASE, container, find, literal_env, template, validate
from tests.deploy.test_chart import _parse_kvgrid
from tests.deploy.test_values import _fails

TP2 = {"vllm": {"enabled": True, "gpus": 2, "extraArgs": ["--tensor-parallel-size", "2"]}}
TIERS: dict[str, Any] = {
    "examples": TP2,
    "agent": {
        "sidecarsPerPod": 2,
        "tiers": {
            "promotion": "sync",
            "disk": {"path": "/var/cache/kvgrid/", "size": "100GiB"},
            "s3": {
                "endpoint": "https://s3.example:9000",
                "bucket": "kv",
                "prefix": "prod",
                "region": "eu-1",
                "size": "1TiB",
                "credentialsSecret": "s3-creds",
            },
        },
    },
}


def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod: dict[str, Any] = find(docs, "Deployment", f"{RELEASE}-kvgrid-vllm")["spec"]["template"]["spec"]
    return pod


def _volume(pod: dict[str, Any], name: str) -> dict[str, Any] | None:
    found = [v for v in pod["volumes"] if v["name"] == name]
    return found[0] if found else None


def _mounts(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in c["volumeMounts"]}


def test_tier_values_build_a_real_agent_config_with_the_volumes_mounted(
    helm: list[str], tmp_path: Path
) -> None:
    docs = _template(helm, TIERS, tmp_path)
    for version in K8S_VERSIONS:
        for doc in docs:
            validate(doc, version)
    pod = _pod(docs)
    for i in range(2):
        agent = container(pod, f"kvgrid-agent-{i}")
        cfg = _parse_kvgrid(agent, AgentConfig, literal_env(agent))
        assert cfg.tier_promotion == "sync"
        assert cfg.tier_disk_path == f"/var/cache/kvgrid/agent-{i}"  # one directory per agent
        assert cfg.tier_disk_size == 100 << 30
        assert (cfg.tier_s3_endpoint, cfg.tier_s3_bucket, cfg.tier_s3_prefix) == (
            "https://s3.example:9000",
            "kv",
            "prod",
        )
        assert (cfg.tier_s3_region, cfg.tier_s3_size) == ("eu-1", 1 << 40)
        mounts = _mounts(agent)
        # The disk tier's directory lies on its volume; the credentials directory is the Secret.
        assert cfg.tier_disk_path.startswith(mounts["kvgrid-tier-disk"]["mountPath"] + "/")
        assert mounts["kvgrid-tier-s3"] == {
            "name": "kvgrid-tier-s3",
            "mountPath": cfg.tier_s3_credentials_dir,
            "readOnly": True,
        }
    # The engine itself mounts neither.
    assert not {"kvgrid-tier-disk", "kvgrid-tier-s3"} & set(_mounts(container(pod, "vllm")))
    disk = _volume(pod, "kvgrid-tier-disk")
    assert disk is not None
    assert disk["emptyDir"]["sizeLimit"] == int(2 * parse_byte_size("100GiB") * 1.1)  # both agents + 10 %
    assert _volume(pod, "kvgrid-tier-s3") == {
        "name": "kvgrid-tier-s3",
        "secret": {"secretName": "s3-creds", "defaultMode": 0o440},
    }


def test_tiers_are_off_by_default(helm: list[str], tmp_path: Path) -> None:
    docs = _template(helm, {"examples": {"vllm": {"enabled": True}}}, tmp_path)
    pod = _pod(docs)
    agent = container(pod, "kvgrid-agent")
    cfg = _parse_kvgrid(agent, AgentConfig, literal_env(agent))
    assert (cfg.tier_disk_path, cfg.tier_s3_endpoint, cfg.tier_promotion) == ("", "", "async")
    assert not any(a.startswith(("--tier-disk", "--tier-s3")) for a in agent["args"])
    assert _volume(pod, "kvgrid-tier-disk") is None and _volume(pod, "kvgrid-tier-s3") is None


@pytest.mark.parametrize(
    ("volume", "rendered"),
    [
        (
            {"type": "hostPath", "hostPath": "/mnt/nvme/kvgrid"},
            {"hostPath": {"path": "/mnt/nvme/kvgrid", "type": "DirectoryOrCreate"}},
        ),
        (
            {"type": "persistentVolumeClaim", "claimName": "kv-disk"},
            {"persistentVolumeClaim": {"claimName": "kv-disk"}},
        ),
    ],
)
def test_disk_tier_on_a_host_path_or_a_claim(
    helm: list[str], tmp_path: Path, volume: dict[str, str], rendered: dict[str, Any]
) -> None:
    values = {
        "examples": {"vllm": {"enabled": True}},
        "agent": {"tiers": {"disk": {"path": "/cache", "size": "2TiB", "volume": volume}}},
    }
    docs = _template(helm, values, tmp_path)
    for doc in docs:
        validate(doc)
    pod = _pod(docs)
    assert _volume(pod, "kvgrid-tier-disk") == {"name": "kvgrid-tier-disk", **rendered}
    agent = container(pod, "kvgrid-agent")
    cfg = _parse_kvgrid(agent, AgentConfig, literal_env(agent))
    assert (cfg.tier_disk_path, cfg.tier_disk_size) == ("/cache", 2 << 40)
    assert _mounts(agent)["kvgrid-tier-disk"]["mountPath"] == "/cache"
    assert _volume(pod, "kvgrid-tier-s3") is None and not cfg.tier_s3_endpoint


@pytest.mark.parametrize(
    ("tiers", "texts", "schema"),
    [
        (
            {"s3": {"endpoint": "http://seaweedfs:8333"}},
            ["agent.tiers.s3.endpoint=http://seaweedfs:8333 needs agent.tiers.s3.bucket"],
            False,
        ),
        (
            {"disk": {"path": "/cache", "volume": {"type": "hostPath"}}},
            ["agent.tiers.disk.volume.type=hostPath needs agent.tiers.disk.volume.hostPath"],
            False,
        ),
        (
            {"disk": {"path": "/cache", "volume": {"type": "persistentVolumeClaim"}}},
            ["agent.tiers.disk.volume.type=persistentVolumeClaim needs agent.tiers.disk.volume.claimName"],
            False,
        ),
        ({"s3": {"endpoint": "seaweedfs:8333", "bucket": "b"}}, ["/agent/tiers/s3/endpoint"], True),
        ({"disk": {"path": "cache"}}, ["/agent/tiers/disk/path"], True),
        ({"promotion": "lazy"}, ["/agent/tiers/promotion", "one of 'async', 'sync'"], True),
        (
            {"disk": {"path": "/cache", "volume": {"type": "nfs"}}},
            ["/agent/tiers/disk/volume/type", "must be one of"],
            True,
        ),
    ],
)
def test_contradicting_tier_values_are_refused(
    helm: list[str], tmp_path: Path, tiers: dict[str, Any], texts: list[str], schema: bool
) -> None:
    _fails(
        helm,
        tmp_path,
        {"examples": {"vllm": {"enabled": True}}, "agent": {"tiers": tiers}},
        *texts,
        schema=schema,
    )


def _template(helm: list[str], values: dict[str, Any], tmp_path: Path) -> list[dict[str, Any]]:
    return template(helm, values, tmp_path)
