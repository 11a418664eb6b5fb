"""The Pod Security Standards, checked on pod specs the way Pod Security admission does.

Written from the published profiles, https://kubernetes.io/docs/concepts/security/pod-security-standards/
(the rules of the current policy version, Kubernetes 1.33+): every control of the Baseline profile,
then the controls Restricted adds. Each finding is "<control>: <field path>: <what is wrong>", the
control named as in the published tables, so a failing test says which rule a pod breaks.

Not modelled: the relaxations for pods in a user namespace (``hostUsers: false``) and for
``spec.os.name: windows`` pods; the chart renders neither. Versions older than the one a rule was
added in are not distinguished (the newest, strictest list is used).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Baseline, "Capabilities": additions beyond this list are disallowed.
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
        "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
    }
)  # fmt: skip
# Baseline, "Sysctls": the safe set (names added up to policy version 1.32).
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem",
    }
)  # fmt: skip
# Baseline, "SELinux": allowed seLinuxOptions.type values ("" and undefined too).
SELINUX_TYPES = frozenset({"container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
# Restricted, "Volume Types": the only volume sources allowed.
RESTRICTED_VOLUME_SOURCES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
SECCOMP_OK = frozenset({"RuntimeDefault", "Localhost"})
APPARMOR_OK = frozenset({"RuntimeDefault", "Localhost"})

POD_KINDS = frozenset(
    {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "ReplicationController", "Job"}
)


def pod_templates(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(``Kind/name``, pod metadata, pod spec) of every pod a manifest list would create."""
    for d in docs:
        name = f"{d['kind']}/{d['metadata']['name']}"
        if d["kind"] in POD_KINDS:
            tpl = d["spec"]["template"]
            yield name, tpl.get("metadata") or {}, tpl["spec"]
        elif d["kind"] == "CronJob":
            tpl = d["spec"]["jobTemplate"]["spec"]["template"]
            yield name, tpl.get("metadata") or {}, tpl["spec"]
        elif d["kind"] == "Pod":
            yield name, d.get("metadata") or {}, d["spec"]


def _containers(spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for i, c in enumerate(spec.get(field) or []):
            yield f"spec.{field}[{i}]({c.get('name', '?')})", c


def _sc(obj: dict[str, Any]) -> dict[str, Any]:
    return obj.get("securityContext") or {}


def baseline(metadata: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    """Violations of the Baseline profile."""
    out: list[str] = []
    pod_sc = _sc(spec)
    containers = list(_containers(spec))
    # HostProcess
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("HostProcess: spec.securityContext.windowsOptions.hostProcess: must be false or unset")
    for path, c in containers:
        if (_sc(c).get("windowsOptions") or {}).get("hostProcess"):
            out.append(
                f"HostProcess: {path}.securityContext.windowsOptions.hostProcess: must be false or unset"
            )
    # Host Namespaces
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            out.append(f"Host Namespaces: spec.{field}: must be false or unset")
    # Privileged Containers
    for path, c in containers:
        if _sc(c).get("privileged"):
            out.append(f"Privileged Containers: {path}.securityContext.privileged: must be false or unset")
    # Capabilities
    for path, c in containers:
        extra = set((_sc(c).get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        if extra:
            out.append(f"Capabilities: {path}.securityContext.capabilities.add: {sorted(extra)} not allowed")
    # HostPath Volumes
    for i, v in enumerate(spec.get("volumes") or []):
        if "hostPath" in v:
            out.append(f"HostPath Volumes: spec.volumes[{i}]({v.get('name')}).hostPath: must be unset")
    # Host Ports
    for path, c in containers:
        for j, port in enumerate(c.get("ports") or []):
            if port.get("hostPort"):
                out.append(f"Host Ports: {path}.ports[{j}].hostPort: must be 0 or unset")
    # AppArmor
    for key, value in (metadata.get("annotations") or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            out.append(f"AppArmor: metadata.annotations[{key}]: {value!r} not allowed")
    for path, sc in [("spec", pod_sc), *((p, _sc(c)) for p, c in containers)]:
        kind = (sc.get("appArmorProfile") or {}).get("type")
        if kind is not None and kind not in APPARMOR_OK:
            out.append(f"AppArmor: {path}.securityContext.appArmorProfile.type: {kind!r} not allowed")
    # SELinux
    for path, sc in [("spec", pod_sc), *((p, _sc(c)) for p, c in containers)]:
        se = sc.get("seLinuxOptions") or {}
        if se.get("type") not in (None, "", *SELINUX_TYPES):
            out.append(f"SELinux: {path}.securityContext.seLinuxOptions.type: {se['type']!r} not allowed")
        for field in ("user", "role"):
            if se.get(field):
                out.append(f"SELinux: {path}.securityContext.seLinuxOptions.{field}: must be unset")
    # /proc Mount Type
    for path, c in containers:
        if _sc(c).get("procMount") not in (None, "Default"):
            out.append(f"/proc Mount Type: {path}.securityContext.procMount: must be Default or unset")
    # Seccomp (Baseline: anything but Unconfined)
    for path, sc in [("spec", pod_sc), *((p, _sc(c)) for p, c in containers)]:
        kind = (sc.get("seccompProfile") or {}).get("type")
        if kind is not None and kind not in SECCOMP_OK:
            out.append(f"Seccomp: {path}.securityContext.seccompProfile.type: {kind!r} not allowed")
    # Sysctls
    for i, s in enumerate(pod_sc.get("sysctls") or []):
        if s.get("name") not in SAFE_SYSCTLS:
            out.append(
                f"Sysctls: spec.securityContext.sysctls[{i}].name: {s.get('name')!r} not in the safe set"
            )
    return out


def restricted(metadata: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    """Violations of the Restricted profile (Baseline's included)."""
    out = baseline(metadata, spec)
    pod_sc = _sc(spec)
    containers = list(_containers(spec))
    # Volume Types
    for i, v in enumerate(spec.get("volumes") or []):
        sources = set(v) - {"name"}
        if not sources <= RESTRICTED_VOLUME_SOURCES:
            bad = sorted(sources - RESTRICTED_VOLUME_SOURCES)
            out.append(f"Volume Types: spec.volumes[{i}]({v.get('name')}): {bad} not allowed")
    # Privilege Escalation: must be explicitly false on every container.
    for path, c in containers:
        if _sc(c).get("allowPrivilegeEscalation") is not False:
            out.append(
                f"Privilege Escalation: {path}.securityContext.allowPrivilegeEscalation: must be false"
            )
    # Running as Non-root: pod true (containers may then leave it unset), else each container true.
    pod_non_root = pod_sc.get("runAsNonRoot")
    if pod_non_root is False:
        out.append("Running as Non-root: spec.securityContext.runAsNonRoot: must be true")
    for path, c in containers:
        value = _sc(c).get("runAsNonRoot")
        if value is False or (value is None and pod_non_root is not True):
            out.append(
                f"Running as Non-root: {path}.securityContext.runAsNonRoot: must be true (or the pod's)"
            )
    # Running as Non-root user: runAsUser never 0.
    for path, sc in [("spec", pod_sc), *((p, _sc(c)) for p, c in containers)]:
        if sc.get("runAsUser") == 0:
            out.append(f"Running as Non-root user: {path}.securityContext.runAsUser: must not be 0")
    # Seccomp: RuntimeDefault or Localhost on the pod, or on every container.
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    for path, c in containers:
        kind = (_sc(c).get("seccompProfile") or {}).get("type")
        if kind is None and pod_seccomp not in SECCOMP_OK:
            out.append(
                f"Seccomp: {path}.securityContext.seccompProfile.type: "
                "must be RuntimeDefault or Localhost (or the pod's)"
            )
    # Capabilities: drop ALL, add only NET_BIND_SERVICE.
    for path, c in containers:
        caps = _sc(c).get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"Capabilities: {path}.securityContext.capabilities.drop: must include ALL")
        extra = set(caps.get("add") or []) - {"NET_BIND_SERVICE"}
        if extra:
            out.append(
                f"Capabilities: {path}.securityContext.capabilities.add: "
                f"only NET_BIND_SERVICE, not {sorted(extra)}"
            )
    return out
