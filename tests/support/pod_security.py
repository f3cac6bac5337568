"""The Kubernetes Pod Security Standards, "restricted" profile (which includes
"baseline"), as a check of a pod spec, field by field, written from the standard's list
(https://kubernetes.io/docs/concepts/security/pod-security-standards/, policy version
"latest"). ``violations`` returns one line per field that breaks a control; an empty list
means the API server's ``pod-security.kubernetes.io/enforce: restricted`` would admit it."""

from __future__ import annotations

from typing import Any

# baseline: capabilities a container may add (restricted: NET_BIND_SERVICE only)
BASELINE_CAPABILITIES = frozenset(
    {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
     "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
)  # fmt: skip
RESTRICTED_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
SAFE_SYSCTLS = frozenset(
    {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
     "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
     "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
     "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
     "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}
)  # fmt: skip
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t",
                           "container_engine_t"})  # fmt: skip
RESTRICTED_VOLUME_SOURCES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
     "projected", "secret"}
)  # fmt: skip
APPARMOR_TYPES = frozenset({"RuntimeDefault", "Localhost"})
SECCOMP_TYPES = frozenset({"RuntimeDefault", "Localhost"})


def _containers(pod: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{kind}[{c.get('name', i)}]", c)
        for kind in ("initContainers", "containers", "ephemeralContainers")
        for i, c in enumerate(pod.get(kind) or [])
    ]


def _baseline(pod: dict[str, Any], annotations: dict[str, str]) -> list[str]:
    found = []
    pod_sc = pod.get("securityContext") or {}
    # HostProcess
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        found.append("spec.securityContext.windowsOptions.hostProcess must be unset or false")
    # host namespaces
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            found.append(f"spec.{field} must be unset or false")
    # HostPath volumes
    for volume in pod.get("volumes") or []:
        if "hostPath" in volume:
            found.append(f"spec.volumes[{volume.get('name')}].hostPath must be unset")
    # sysctls
    for sysctl in pod_sc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            found.append(f"spec.securityContext.sysctls[{sysctl.get('name')}] is not safe")
    # AppArmor, SELinux and seccomp at the pod's level
    found += _profiles("spec.securityContext", pod_sc)
    for key, value in annotations.items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
            value in ("runtime/default",) or value.startswith("localhost/")
        ):
            found.append(f"metadata.annotations[{key}] must be runtime/default or localhost/*")
    for where, c in _containers(pod):
        sc = c.get("securityContext") or {}
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            found.append(f"{where}.securityContext.windowsOptions.hostProcess must be unset")
        if sc.get("privileged"):
            found.append(f"{where}.securityContext.privileged must be unset or false")
        added = set((sc.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            found.append(f"{where}.securityContext.capabilities.add has {added}")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                found.append(f"{where}.ports[{port.get('name')}].hostPort must be unset or 0")
        if sc.get("procMount", "Default") != "Default":
            found.append(f"{where}.securityContext.procMount must be unset or Default")
        found += _profiles(f"{where}.securityContext", sc)
    return found


def _profiles(where: str, sc: dict[str, Any]) -> list[str]:
    found = []
    apparmor = (sc.get("appArmorProfile") or {}).get("type")
    if apparmor is not None and apparmor not in APPARMOR_TYPES:
        found.append(f"{where}.appArmorProfile.type must be RuntimeDefault or Localhost")
    selinux = sc.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in SELINUX_TYPES:
        found.append(f"{where}.seLinuxOptions.type {selinux.get('type')!r} is not allowed")
    for field in ("user", "role"):
        if selinux.get(field):
            found.append(f"{where}.seLinuxOptions.{field} must be unset")
    seccomp = (sc.get("seccompProfile") or {}).get("type")
    if seccomp is not None and seccomp not in SECCOMP_TYPES:
        found.append(f"{where}.seccompProfile.type must not be {seccomp}")
    return found


def _restricted(pod: dict[str, Any]) -> list[str]:
    found = []
    pod_sc = pod.get("securityContext") or {}
    # volume types
    for volume in pod.get("volumes") or []:
        sources = set(volume) - {"name"}
        if not sources <= RESTRICTED_VOLUME_SOURCES:
            found.append(f"spec.volumes[{volume.get('name')}] uses {sources}")
    containers = _containers(pod)
    # running as non-root: the pod says so, or every container does; none says otherwise
    pod_nonroot = pod_sc.get("runAsNonRoot") is True
    if pod_sc.get("runAsUser") == 0:
        found.append("spec.securityContext.runAsUser must not be 0")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type") in SECCOMP_TYPES
    for where, c in containers:
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"{where}.securityContext.allowPrivilegeEscalation must be false")
        nonroot = sc.get("runAsNonRoot")
        if nonroot is False or (nonroot is None and not pod_nonroot):
            found.append(f"{where}.securityContext.runAsNonRoot must be true (here or the pod's)")
        if sc.get("runAsUser") == 0:
            found.append(f"{where}.securityContext.runAsUser must not be 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if seccomp is None and not pod_seccomp:
            found.append(f"{where}: seccompProfile RuntimeDefault or Localhost (here or pod's)")
        capabilities = sc.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            found.append(f"{where}.securityContext.capabilities.drop must include ALL")
        added = set(capabilities.get("add") or [])
        if added - RESTRICTED_CAPABILITIES:
            found.append(f"{where}.securityContext.capabilities.add may hold NET_BIND_SERVICE only")
    return found


def violations(pod: dict[str, Any], annotations: dict[str, str] | None = None) -> list[str]:
    """Every field of ``pod`` (a pod spec) that breaks the "restricted" profile."""
    return _baseline(pod, annotations or {}) + _restricted(pod)
