"""Where a ModelDeployment's pods run and what they ask for: ``spec.pod`` (node selector,
tolerations, affinity, topology spread, priority and runtime class, image pull secrets,
the pods' own labels and annotations, the ServiceAccount's annotations) and the
containers' resources beside the server's (``spec.resources``: the GPU's resource name,
the sidecar's and the init container's requirements).

The core types (Toleration, Affinity, TopologySpreadConstraint, LocalObjectReference,
ResourceRequirements) are the API server's own schemas, inlined into the CRD by
``tools/core_schemas.py``: the API server judges their fields. The operator checks their
shape here (an object, a list of objects), and everything that is its own rule: the
operator's labels and annotations cannot be overridden, names and quantities are well
formed. The pod template then repeats what the spec says; the Deployment's own
validation is the last word on the core types' values.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from model_rollout_contract import defaults
from model_rollout_contract.annotations import DOMAIN

# a label's or an annotation's key: an optional DNS subdomain prefix and "/", then a name
# of at most 63 characters (the CRD's CEL rule repeats it: a test compares them)
QUALIFIED_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
LABEL_VALUE_MAX = 63
MAX_KEYS = 64  # labels, annotations, nodeSelector entries: bounds the CRD's CEL cost
# the labels the operator puts on every pod (manifests.labels); its selector is one of them
OPERATOR_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/managed-by",
)
OWN_PREFIX = f"{DOMAIN}/"  # every label and annotation in the operator's domain is its own
# an extended resource's name (the GPU's): a domain outside kubernetes.io, "/", a name
RESOURCE_NAME = re.compile(
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)
RESOURCE_NAME_MAX = 253
NATIVE_DOMAIN = "kubernetes.io/"  # Kubernetes' own resources: never an extended one
# a quantity as the core types' schema has it (Kubernetes' own: signs and n/u/m suffixes)
K8S_QUANTITY = re.compile(
    r"(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?"
)
# a quantity's parts, for its value (the API server rewrites quantities in its canonical
# form, "1024Mi" as "1Gi": cluster compares them by value; a request is at most its limit)
_QUANTITY = re.compile(
    r"([+-]?(?:\d+\.?\d*|\.\d+))(?:[eE]([+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]))?"
)
_SUFFIXES = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{
        s: Decimal(10) ** e
        for s, e in zip("numkMGTPE", (-9, -6, -3, 3, 6, 9, 12, 15, 18), strict=True)
    },
}
# a PriorityClass's or RuntimeClass's name: a DNS subdomain
CLASS_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
CLASS_NAME_MAX = 253
RESERVED_LABELS = (
    f"spec.pod.labels may not set the operator's own labels ({OWN_PREFIX}*,"
    f" {', '.join(OPERATOR_LABELS)}): its selector and its pods' identity"
)
RESERVED_ANNOTATIONS = (
    f"spec.pod.annotations may not set the operator's own annotations ({OWN_PREFIX}*):"
    " the pods' target versions and their sidecars' reports"
)
RESERVED_ACCOUNT_ANNOTATIONS = (
    f"spec.pod.serviceAccountAnnotations may not set the operator's own annotations ({OWN_PREFIX}*)"
)


@dataclass(frozen=True)
class PodSettings:
    """``spec.pod``: what the pod template carries beside what the operator writes."""

    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None
    # a constraint without a labelSelector gets the pods' selector (manifests)
    topology_spread: tuple[Mapping[str, Any], ...] = ()
    priority_class: str | None = None
    runtime_class: str | None = None
    image_pull_secrets: tuple[Mapping[str, Any], ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    service_account_annotations: Mapping[str, str] = field(default_factory=dict)


Requirements = Mapping[str, Mapping[str, str | int]]  # a container's resources:


def default_requirements() -> dict[str, dict[str, str | int]]:
    """The sidecar's and the init container's resources when the spec gives none."""
    return {
        "requests": dict(defaults.SIDECAR_REQUESTS),
        "limits": dict(defaults.SIDECAR_LIMITS),
    }


@dataclass(frozen=True)
class ContainerResources:
    """``spec.resources`` beyond the server's cpu, memory and GPU count."""

    gpu_resource: str = defaults.GPU_RESOURCE
    sidecar: Requirements = field(default_factory=default_requirements)
    prefetch: Requirements = field(default_factory=default_requirements)


def _object(raw: Mapping[str, Any], key: str, where: str, problems: list[str]) -> Any:
    value = raw.get(key)
    if value is not None and not isinstance(value, dict):
        problems.append(f"{where}{key} must be an object")
        return None
    return value


def _objects(raw: Mapping[str, Any], key: str, where: str, problems: list[str]) -> tuple[Any, ...]:
    value = raw.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        problems.append(f"{where}{key} must be a list of objects")
        return ()
    return tuple(value)


def _class_name(raw: Mapping[str, Any], key: str, where: str, problems: list[str]) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > CLASS_NAME_MAX or not CLASS_NAME.fullmatch(value):
        problems.append(
            f"{where}{key} must be the name of a class (a DNS subdomain: lower-case letters,"
            f" digits, '-' and '.', at most {CLASS_NAME_MAX}), not {value!r}"
        )
        return None
    return value


def _string_map(
    raw: Mapping[str, Any], key: str, where: str, problems: list[str], *, label_values: bool
) -> dict[str, str]:
    """A map of qualified keys to strings (label values, when ``label_values``)."""
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        problems.append(f"{where}{key} must be an object of strings")
        return {}
    if len(value) > MAX_KEYS:
        problems.append(f"{where}{key} holds at most {MAX_KEYS} entries")
    bad_keys = sorted(k for k in value if not QUALIFIED_KEY.fullmatch(k))
    if bad_keys:
        problems.append(
            f"{where}{key}: keys must be qualified names ([prefix/]name), not {bad_keys}"
        )
    if label_values:
        bad = sorted(
            k for k, v in value.items() if len(v) > LABEL_VALUE_MAX or not LABEL_VALUE.fullmatch(v)
        )
        if bad:
            problems.append(
                f"{where}{key}: values must be label values (at most {LABEL_VALUE_MAX}"
                f" letters, digits, '-', '_' and '.'), not those of {bad}"
            )
    return dict(value)


def parse_pod(raw: Any, problems: list[str]) -> PodSettings:
    """``spec.pod``; every problem found is added to ``problems``."""
    where = "spec.pod."
    if raw is None:
        return PodSettings()
    if not isinstance(raw, dict):
        problems.append("spec.pod must be an object")
        return PodSettings()
    # node labels: what the Deployment's validation asks of them, said of this field
    node_selector = _string_map(raw, "nodeSelector", where, problems, label_values=True)
    labels = _string_map(raw, "labels", where, problems, label_values=True)
    if any(k.startswith(OWN_PREFIX) or k in OPERATOR_LABELS for k in labels):
        problems.append(RESERVED_LABELS)
    annotations = _string_map(raw, "annotations", where, problems, label_values=False)
    if any(k.startswith(OWN_PREFIX) for k in annotations):
        problems.append(RESERVED_ANNOTATIONS)
    account = _string_map(raw, "serviceAccountAnnotations", where, problems, label_values=False)
    if any(k.startswith(OWN_PREFIX) for k in account):
        problems.append(RESERVED_ACCOUNT_ANNOTATIONS)
    return PodSettings(
        node_selector=node_selector,
        tolerations=_objects(raw, "tolerations", where, problems),
        affinity=_object(raw, "affinity", where, problems),
        topology_spread=_objects(raw, "topologySpreadConstraints", where, problems),
        priority_class=_class_name(raw, "priorityClassName", where, problems),
        runtime_class=_class_name(raw, "runtimeClassName", where, problems),
        image_pull_secrets=_objects(raw, "imagePullSecrets", where, problems),
        labels=labels,
        annotations=annotations,
        service_account_annotations=account,
    )


def _requirements(raw: Mapping[str, Any], key: str, problems: list[str]) -> Requirements | None:
    """A container's ``resources:`` (limits and requests: maps of quantities), or
    ``None`` when the spec gives none (the defaults apply)."""
    where = f"spec.resources.{key}"
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        problems.append(f"{where} must be an object (limits, requests)")
        return None
    out: dict[str, dict[str, str | int]] = {}
    for part in ("limits", "requests"):
        amounts = value.get(part)
        if amounts is None:
            continue
        if not isinstance(amounts, dict):
            problems.append(f"{where}.{part} must be an object of quantities")
            continue
        bad = sorted(name for name, amount in amounts.items() if not _is_quantity(amount))
        if bad:
            problems.append(
                f'{where}.{part}: {bad} must be quantities such as "500m", "1Gi" or a whole number'
            )
        out[part] = dict(amounts)
    _above_limits(where, out, problems)
    return out


def quantity(value: Any) -> Decimal | None:
    """A Kubernetes resource quantity's value ("500m", "1Gi", "2", 2, "1e3"), ``None``
    for anything else."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        return None
    found = _QUANTITY.fullmatch(str(value))
    if found is None:
        return None
    number, exponent, suffix = found.groups()
    try:
        scale = (
            Decimal(10) ** int(exponent) if exponent else _SUFFIXES.get(suffix or "", Decimal(1))
        )
        return Decimal(number) * scale
    except InvalidOperation:
        return None


def _above_limits(where: str, given: Requirements, problems: list[str]) -> None:
    """A request above its limit: the API server refuses the Deployment, in words that
    name its container's index (``containers[1].resources.requests``), not the field."""
    limits, requests = given.get("limits") or {}, given.get("requests") or {}
    for name in sorted(set(limits) & set(requests)):
        asked, most = quantity(requests[name]), quantity(limits[name])
        if asked is not None and most is not None and asked > most:
            problems.append(
                f"{where}.requests.{name} ({requests[name]}) exceeds its limit ({limits[name]})"
            )


def _is_quantity(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (
        isinstance(value, str) and bool(K8S_QUANTITY.fullmatch(value))
    )


def parse_resources(raw: Mapping[str, Any], problems: list[str]) -> ContainerResources:
    """``spec.resources``' fields for the GPU's name and the other containers."""
    gpu = raw.get("gpuResource", defaults.GPU_RESOURCE)
    if (
        not isinstance(gpu, str)
        or len(gpu) > RESOURCE_NAME_MAX
        or not RESOURCE_NAME.fullmatch(gpu)
        or NATIVE_DOMAIN in gpu
    ):
        problems.append(
            "spec.resources.gpuResource must be an extended resource's name, domain/name"
            f" outside kubernetes.io (nvidia.com/gpu, nvidia.com/mig-1g.10gb), not {gpu!r}"
        )
        gpu = defaults.GPU_RESOURCE
    sidecar = _requirements(raw, "sidecar", problems)
    prefetch = _requirements(raw, "prefetch", problems)
    return ContainerResources(
        gpu_resource=gpu,
        sidecar=default_requirements() if sidecar is None else sidecar,
        prefetch=default_requirements() if prefetch is None else prefetch,
    )
