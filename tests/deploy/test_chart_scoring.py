"""The chart's controller.scoring values: Score's L2 read cost reaches the controller as flags, and
the L2 tier follows the agents' tier values unless set (``helm template``)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvgrid.controller.config import ControllerConfig
from tests.deploy.chart import CHART, NAMESPACE, RELEASE, container, find, run, template, values_args

S3 = {"endpoint": "http://s3:9000", "bucket": "kv"}


def _controller_args(helm: list[str], values: dict[str, Any], tmp_path: Path) -> list[str]:
    docs = template(helm, values, tmp_path)
    pod = find(docs, "Deployment", f"{RELEASE}-kvgrid-controller")["spec"]["template"]["spec"]
    return list(container(pod, "controller")["args"])


@pytest.mark.parametrize(
    ("tiers", "scoring", "want"),
    [
        ({}, {}, "disk"),  # no lower tiers: the default
        ({"s3": S3}, {}, "object_store"),  # only an object store
        ({"disk": {"path": "/var/kvgrid/tier"}, "s3": S3}, {}, "disk"),  # disk first
        ({"s3": S3}, {"l2Tier": "disk", "l2DiskGbps": 2.5, "l2ObjectStoreGbps": 0.25}, "disk"),  # set
    ],
)
def test_l2_cost_flags(
    helm: list[str], tmp_path: Path, tiers: dict[str, Any], scoring: dict[str, Any], want: str
) -> None:
    args = _controller_args(helm, {"agent": {"tiers": tiers}, "controller": {"scoring": scoring}}, tmp_path)
    disk, store = scoring.get("l2DiskGbps", 4.8), scoring.get("l2ObjectStoreGbps", 0.5)
    assert f"--l2-tier={want}" in args
    assert f"--l2-disk-gbps={disk}" in args and f"--l2-object-store-gbps={store}" in args
    # the chart's defaults are the controller's
    defaults = ControllerConfig()
    assert (defaults.l2_disk_gbps, defaults.l2_object_store_gbps) == (4.8, 0.5)


def test_bad_l2_tier_is_refused(helm: list[str], tmp_path: Path) -> None:
    proc: subprocess.CompletedProcess[str] = run(
        [
            *helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
            *values_args({"controller": {"scoring": {"l2Tier": "tape", "l2DiskGbps": 0}}}, tmp_path),
        ]
    )  # fmt: skip
    assert proc.returncode != 0
    assert "/controller/scoring/l2Tier" in proc.stderr and "'disk', 'object_store'" in proc.stderr
    assert "/controller/scoring/l2DiskGbps" in proc.stderr
