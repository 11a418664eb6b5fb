"""The certificate source never changes on an upgrade unless a value changes it.

``tls.provider=auto`` picks cert-manager or the chart's own CA at install and records the pick in
the ConfigMap ``<release>-kvgrid-tls-source``; later renders read it back (``lookup``) and keep it,
also after cert-manager's CRDs appear. Releases installed before the record are read from their
Secrets. ``helm template`` has no cluster, so ``lookup`` finds nothing there: the install pick is
tested by rendering, and the upgrade decision by feeding ``kvgrid.tlsAutoChoice`` (the part of
``kvgrid.tlsAutoProvider`` after its lookups) what ``lookup`` would return, from a template added
to a copy of the chart, and through helm's own lookups (``helm template --dry-run=server``) against
a fake read-only API server (tests/deploy/fake_apiserver.py) holding what an earlier render made.
Not run here: a real API server (helm upgrade on a cluster, cert-manager itself).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.chart import CHART, NAMESPACE, RELEASE, find, run, template, validate, values_args
from tests.deploy.fake_apiserver import fake_apiserver
from tests.deploy.test_tls import EXAMPLE

SOURCE = f"{RELEASE}-kvgrid-tls-source"


def _source(docs: list[dict[str, Any]]) -> dict[str, str] | None:
    found = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == SOURCE]
    return found[0]["data"] if found else None


def _issued_by(docs: list[dict[str, Any]]) -> str:
    kinds = {d["kind"] for d in docs}
    secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    if "Certificate" in kinds:
        assert f"{RELEASE}-kvgrid-ca" not in secrets
        return "cert-manager"
    assert f"{RELEASE}-kvgrid-ca" in secrets
    return "helm"


# --- what an install renders and records -------------------------------------------------------


@pytest.mark.parametrize(
    ("provider", "crds", "expected"),
    [
        ("auto", True, "cert-manager"),
        ("auto", False, "helm"),
        ("helm", True, "helm"),
        ("cert-manager", True, "cert-manager"),
    ],
)
def test_the_source_in_use_is_recorded(
    helm: list[str], tmp_path: Path, provider: str, crds: bool, expected: str
) -> None:
    docs = template(helm, {"tls": {"provider": provider}, **EXAMPLE}, tmp_path, crds=crds)
    for doc in docs:
        validate(doc)
    assert _issued_by(docs) == expected
    assert _source(docs) == {"provider": expected, "requested": provider}
    record = find(docs, "ConfigMap", SOURCE)
    assert record["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE


@pytest.mark.parametrize(
    "values",
    [
        {"tls": {"enabled": False}, "networkPolicy": {"enabled": False}},
        {"tls": {"provider": "existingSecrets", "existingSecrets": {"controller": "c", "agent": "a"}}},
    ],
)
def test_nothing_is_recorded_without_a_source_auto_could_pick(
    helm: list[str], tmp_path: Path, values: dict[str, Any]
) -> None:
    assert _source(template(helm, values, tmp_path)) is None


def test_an_explicit_provider_wins_over_the_cluster(helm: list[str], tmp_path: Path) -> None:
    """The way to switch: set tls.provider. helm with cert-manager present, cert-manager without."""
    docs = template(helm, {"tls": {"provider": "helm"}}, tmp_path, crds=True)
    assert _issued_by(docs) == "helm" and _source(docs) == {"provider": "helm", "requested": "helm"}
    docs = template(helm, {"tls": {"provider": "cert-manager"}}, tmp_path, crds=False)
    assert _issued_by(docs) == "cert-manager"


# --- what auto decides on an upgrade, from what lookup finds -------------------------------------


def _record(provider: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": SOURCE},
        "data": {"provider": provider},
    }


def _chart_secret(name: str) -> dict[str, Any]:
    labels = {"app.kubernetes.io/managed-by": "Helm", "app.kubernetes.io/instance": RELEASE}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "labels": labels}}


def _cert_manager_secret(name: str) -> dict[str, Any]:
    annotations = {
        "cert-manager.io/certificate-name": name,
        "cert-manager.io/issuer-name": f"{RELEASE}-kvgrid-ca",
    }
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "annotations": annotations}}


ROUTER, CA = f"{RELEASE}-kvgrid-router-tls", f"{RELEASE}-kvgrid-ca"
DASHBOARDS = f"{RELEASE}-kvgrid-dashboards"
# (case, what lookup returns: recorded ConfigMap, router Secret, CA Secret,
#  whether the cluster serves cert-manager, the answer)
UPGRADES: list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any], bool, str]] = [
    # The reported bug: installed on the chart's CA, then cert-manager's CRDs appeared.
    (
        "recorded helm, cert-manager appeared",
        _record("helm"),
        _chart_secret(ROUTER),
        _chart_secret(CA),
        True,
        "helm",
    ),
    (
        "recorded cert-manager",
        _record("cert-manager"),
        _cert_manager_secret(ROUTER),
        {},
        True,
        "cert-manager",
    ),
    # The record wins over what the Secrets look like (it follows the last explicit choice).
    (
        "recorded helm, secrets of cert-manager",
        _record("helm"),
        _cert_manager_secret(ROUTER),
        {},
        True,
        "helm",
    ),
    # Releases installed before the record existed: their Secrets tell.
    ("legacy chart CA, cert-manager appeared", {}, _chart_secret(ROUTER), _chart_secret(CA), True, "helm"),
    ("legacy chart CA secret only", {}, {}, _chart_secret(CA), True, "helm"),
    ("legacy cert-manager", {}, _cert_manager_secret(ROUTER), _cert_manager_secret(CA), True, "cert-manager"),
    ("legacy cert-manager, own issuer", {}, _cert_manager_secret(ROUTER), {}, True, "cert-manager"),
    # Nothing there yet: an install picks by the cluster.
    ("install with cert-manager", {}, {}, {}, True, "cert-manager"),
    ("install without cert-manager", {}, {}, {}, False, "helm"),
    ("unreadable record", _record("vault"), {}, {}, False, "helm"),
    # cert-manager's CRDs went away: still the chart's CA when it was the source.
    ("recorded helm, no cert-manager", _record("helm"), _chart_secret(ROUTER), {}, False, "helm"),
]


def _choice_chart(tmp_path: Path, cases: list[dict[str, Any]]) -> Path:
    """A copy of the chart with a template printing kvgrid.tlsAutoChoice for each case."""
    chart = tmp_path / "kvgrid"
    shutil.copytree(CHART, chart)
    probe = (
        "{{- $cases := `" + json.dumps(cases) + "` | fromJsonArray }}\n"
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: choices\ndata:\n"
        "{{- range $i, $c := $cases }}\n"
        '  {{ printf "case%d" $i }}: {{ include "kvgrid.tlsAutoChoice" '
        '(dict "recorded" $c.recorded "router" $c.router "ca" $c.ca "certManager" $c.certManager '
        '"record" "' + SOURCE + '") | quote }}\n'
        "{{- end }}\n"
    )
    (chart / "templates" / "zz-choice-probe.yaml").write_text(probe)
    return chart


def _choices(helm: list[str], tmp_path: Path, cases: list[dict[str, Any]]) -> list[str]:
    docs = template(helm, {}, tmp_path, chart=_choice_chart(tmp_path, cases))
    data = find(docs, "ConfigMap", "choices")["data"]
    return [data[f"case{i}"] for i in range(len(cases))]


def test_auto_keeps_the_source_in_use(helm: list[str], tmp_path: Path) -> None:
    cases = [
        {"recorded": rec, "router": router, "ca": ca, "certManager": cm}
        for _, rec, router, ca, cm, _ in UPGRADES
    ]
    got = dict(zip([u[0] for u in UPGRADES], _choices(helm, tmp_path, cases), strict=True))
    assert got == {u[0]: u[5] for u in UPGRADES}


@pytest.mark.parametrize(
    ("recorded", "router"),
    [(_record("cert-manager"), _cert_manager_secret(ROUTER)), ({}, _cert_manager_secret(ROUTER))],
    ids=["recorded", "legacy"],
)
def test_auto_refuses_to_leave_cert_manager_on_its_own(
    helm: list[str], tmp_path: Path, recorded: dict[str, Any], router: dict[str, Any]
) -> None:
    chart = _choice_chart(
        tmp_path, [{"recorded": recorded, "router": router, "ca": {}, "certManager": False}]
    )
    proc = run([*helm, "template", RELEASE, str(chart), "-n", NAMESPACE, *values_args({}, tmp_path)])
    assert proc.returncode != 0
    assert "auto never switches the source on its own" in proc.stderr, proc.stderr
    assert "set tls.provider=helm" in proc.stderr


# --- the same through helm's real lookups, against a fake API server ----------------------------


def _render_on(
    helm: list[str], tmp_path: Path, objects: list[dict[str, Any]], cert_manager: bool, values: dict[str, Any]
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """``helm template --dry-run=server`` against a cluster holding ``objects``: lookup reads them."""
    work = tmp_path / f"cluster-{len(list(tmp_path.glob('cluster-*')))}"
    work.mkdir()
    with fake_apiserver(work, objects, NAMESPACE, cert_manager) as (kubeconfig, log):
        proc = subprocess.run(
            [*helm, "template", RELEASE, str(CHART), "-n", NAMESPACE, "--dry-run=server",
             "--disable-openapi-validation", *values_args(values, work)],
            capture_output=True, text=True, timeout=120, check=False,
            env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        )  # fmt: skip
    return proc, log


def _docs(proc: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def _applied(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chart's own Secrets and ConfigMaps of a render, as the API server holds them after helm
    applied them (helm's ownership annotations included)."""
    owner = {"meta.helm.sh/release-name": RELEASE, "meta.helm.sh/release-namespace": NAMESPACE}
    return [
        {
            **d,
            "metadata": {
                **d["metadata"],
                "namespace": NAMESPACE,
                "annotations": {**d["metadata"].get("annotations", {}), **owner},
            },
        }
        for d in docs
        if d["kind"] in ("Secret", "ConfigMap")
    ]


def test_an_upgrade_after_cert_manager_appeared_keeps_the_charts_ca(helm: list[str], tmp_path: Path) -> None:
    """The reported bug, through real lookups: installed without cert-manager, upgraded with it."""
    proc, _ = _render_on(helm, tmp_path, [], cert_manager=False, values=EXAMPLE)
    installed = _docs(proc)
    assert _issued_by(installed) == "helm"
    assert _source(installed) == {"provider": "helm", "requested": "auto"}
    ca = find(installed, "Secret", CA)["data"]

    proc, log = _render_on(helm, tmp_path, _applied(installed), cert_manager=True, values=EXAMPLE)
    upgraded = _docs(proc)
    assert _issued_by(upgraded) == "helm"  # no Certificates, the chart's Secrets stay
    assert find(upgraded, "Secret", CA)["data"] == ca  # and the same CA signs
    assert _source(upgraded) == {"provider": "helm", "requested": "auto"}
    # The lookups ran once for the whole render (kvgrid.tlsAutoProvider keeps its answer): one GET
    # more than of a ConfigMap no template looks up (helm itself GETs each object it would apply).
    gets = [log.count(f"GET /api/v1/namespaces/{NAMESPACE}/configmaps/{n}") for n in (SOURCE, DASHBOARDS)]
    assert gets[0] == gets[1] + 1, log


def test_a_release_from_before_the_record_keeps_its_source(helm: list[str], tmp_path: Path) -> None:
    proc, _ = _render_on(helm, tmp_path, [], cert_manager=False, values={})
    legacy = [o for o in _applied(_docs(proc)) if o["kind"] == "Secret"]  # no tls-source ConfigMap yet
    proc, _ = _render_on(helm, tmp_path, legacy, cert_manager=True, values={})
    upgraded = _docs(proc)
    assert _issued_by(upgraded) == "helm"
    assert _source(upgraded) == {"provider": "helm", "requested": "auto"}


def test_only_a_value_switches_the_source(helm: list[str], tmp_path: Path) -> None:
    proc, _ = _render_on(helm, tmp_path, [], cert_manager=False, values={})
    installed = _applied(_docs(proc))
    switched = {"tls": {"provider": "cert-manager"}}
    proc, _ = _render_on(helm, tmp_path, installed, cert_manager=True, values=switched)
    docs = _docs(proc)
    assert _issued_by(docs) == "cert-manager"
    assert _source(docs) == {"provider": "cert-manager", "requested": "cert-manager"}
    # Back to auto after the switch: the new record holds.
    record = [o for o in _applied(docs) if o["kind"] == "ConfigMap" and o["metadata"]["name"] == SOURCE]
    proc, _ = _render_on(helm, tmp_path, record, cert_manager=True, values={})
    assert _issued_by(_docs(proc)) == "cert-manager"


def test_an_install_picks_by_what_the_cluster_serves(helm: list[str], tmp_path: Path) -> None:
    for cert_manager, expected in ((True, "cert-manager"), (False, "helm")):
        proc, _ = _render_on(helm, tmp_path, [], cert_manager=cert_manager, values={})
        assert _issued_by(_docs(proc)) == expected


def test_cert_manager_gone_fails_instead_of_switching(helm: list[str], tmp_path: Path) -> None:
    record = {**_record("cert-manager"), "metadata": {"name": SOURCE, "namespace": NAMESPACE}}
    proc, _ = _render_on(helm, tmp_path, [record], cert_manager=False, values={})
    assert proc.returncode != 0
    assert f"ConfigMap {SOURCE} records it" in proc.stderr and "set tls.provider=helm" in proc.stderr, (
        proc.stderr
    )
