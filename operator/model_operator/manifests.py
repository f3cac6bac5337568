"""Kubernetes objects a ModelDeployment owns, as plain dicts (pure functions).

The pod template never carries the model version: versions move by per-pod annotations
(read by the sidecar through the Downward API) and the ConfigMap default, so changing
``spec.version`` never changes the template and never restarts a pod.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from model_rollout_contract import argv, defaults
from model_rollout_contract.annotations import DEPLOYMENT_LABEL, DOMAIN, MODEL_LABEL, TEMPLATE_LABEL
from model_rollout_contract.cli import SIDECAR_ENV_PREFIX, env_name
from model_rollout_contract.defaults import SERVER_GRPC_PORT, SERVER_PORT, SIDECAR_METRICS_PORT
from model_rollout_contract.pins import pins_text
from model_rollout_contract.tracks import track_keys

from .admission_policy import sidecar_service_account
from .placement import Requirements
from .spec import ModelDeploymentSpec, TenantModelSpec

SPEC_HASH = f"{DOMAIN}/spec-hash"
# the pod template's digest of the ServiceAccount's annotations: IRSA's webhook writes the
# role into a pod when it is created, so a new role replaces the pods, as any spec.pod change
ACCOUNT_DIGEST = f"{DOMAIN}/account-annotations"
# the sidecar reads its pod's name and namespace (Downward API env) as these flags
SIDECAR_POD_NAME = env_name(SIDECAR_ENV_PREFIX, "--pod-name")
SIDECAR_POD_NAMESPACE = env_name(SIDECAR_ENV_PREFIX, "--pod-namespace")
# the API credentials, only in the containers that call the API (the sidecar, and the init
# container, which reads its pod's annotations): where in-cluster clients look for them
API_ACCESS_VOLUME = "kube-api-access"
API_ACCESS_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# the projected token's lifetime: the kubelet renews it at 80% of this, and the sidecar's
# client reads the file again at most a minute after (kubernetes_asyncio's in-cluster config)
TOKEN_SECONDS = 3600
# every container runs as the images' unprivileged user (``serving``, Dockerfile.server)
RUN_AS = 10001
# the server's own volumes (never mounted by the sidecar): what it loads from its engine
# cache and what it records cannot be written by whoever can write the shared volume
SERVER_ONLY_VOLUMES = {
    "engine-cache": argv.ENGINE_CACHE,
    "audit-log": argv.AUDIT_DIR,
    "server-tmp": argv.TMP_DIR,  # JSON worker processes, TensorRT builds without a cache
}


def labels(name: str, spec: ModelDeploymentSpec) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "model-server",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": "model-rollout-operator",
        DEPLOYMENT_LABEL: name,
        MODEL_LABEL: spec.model,
    }


def selector(name: str) -> dict[str, str]:
    return {DEPLOYMENT_LABEL: name}


def selector_text(name: str) -> str:
    """:func:`selector` as a label selector string: ``.status.selector``, which the scale
    subresource hands to a HorizontalPodAutoscaler (and KEDA) to find the pods."""
    return ",".join(f"{key}={value}" for key, value in sorted(selector(name).items()))


def _sidecar_args(
    spec: ModelDeploymentSpec, tenant: TenantModelSpec | None = None, index: int = 0
) -> argv.SidecarArgs:
    """The sidecar's arguments for the deployment's model, or for the ``index``-th tenant
    model (a named track: its own annotations, metrics port and, maybe, keys)."""
    return argv.SidecarArgs(
        tenant.key if tenant else spec.model,
        spec.store.sidecar_url,
        store_id=spec.store.id,
        # a valid spec has the key, or says allowUnsigned; a tenant's own key is always used
        signed=not spec.allow_unsigned or bool(tenant and tenant.signing_public_key_secret),
        retain=spec.retain_versions,
        start_jitter_seconds=spec.sidecar.start_jitter_seconds,
        backoff_base_seconds=spec.sidecar.backoff_base_seconds,
        backoff_max_seconds=spec.sidecar.backoff_max_seconds,
        max_concurrent_downloads=spec.sidecar.max_concurrent_downloads,
        track=tenant.track if tenant else None,
        own_keys=bool(tenant and tenant.signing_public_key_secret),
        metrics_port=SIDECAR_METRICS_PORT + (index + 1 if tenant else 0),
        log=spec.logging,
    )


def _tenant_sidecars(
    spec: ModelDeploymentSpec,
    image: str,
    mounts: list[dict[str, Any]],
    control_mount: dict[str, Any],
    api_mount: dict[str, Any],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(init containers, containers, volumes) of the tenant models: a pre-pull and a
    sidecar each, so each tenant has its own loading channel; a tenant's own signing key
    replaces the deployment's in its containers only."""
    inits, sidecars, volumes = [], [], []
    for i, tenant in enumerate(spec.tenant_models):
        args = _sidecar_args(spec, tenant, i)
        own = list(mounts)
        if tenant.signing_public_key_secret:
            volume = f"keys-{tenant.track}"
            secret = {"secretName": tenant.signing_public_key_secret}
            volumes.append({"name": volume, "secret": secret})
            own = [m for m in own if m["name"] != "signing-key"]
            path = argv.keys_dir(tenant.track, own_keys=True)
            own.append({"name": volume, "mountPath": path, "readOnly": True})
        common = {
            "image": image,
            "env": _sidecar_env(spec),
            "securityContext": container_security_context(),
        }
        inits.append({
            "name": f"prefetch-{tenant.track}",
            "args": argv.sidecar_argv("init", args),
            **common,
            "resources": requirements(spec.containers.prefetch),
            "volumeMounts": [*own, api_mount],
        })  # fmt: skip
        sidecars.append({
            "name": f"sidecar-{tenant.track}",
            "args": argv.sidecar_argv("watch", args),
            **common,
            "resources": requirements(spec.containers.sidecar),
            "ports": [{"name": f"sidecar-m{i + 1}", "containerPort": args.metrics_port}],
            "volumeMounts": [*own, control_mount, api_mount],
        })  # fmt: skip
    return inits, sidecars, volumes


def termination_grace_seconds(drain_seconds: float) -> int:
    """The preStop pause, the drain, then the last in-flight requests: the contract's
    grace period, longer by as much as the spec's drain is."""
    return (
        defaults.PRESTOP_SLEEP_SECONDS + math.ceil(drain_seconds) + defaults.INFLIGHT_GRACE_SECONDS
    )


def pod_security_context() -> dict[str, Any]:
    """Pod Security "restricted": not root, and the container runtime's seccomp profile."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,  # the volumes are the group's: every container can use them
        "fsGroupChangePolicy": "OnRootMismatch",  # a large store volume is not chowned each time
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    """No privilege escalation, no capabilities, and nothing written outside the pod's
    volumes (the root filesystem is read-only)."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
    }


def api_access_volume() -> dict[str, Any]:
    """What the kubelet would mount everywhere with automountServiceAccountToken (a
    bounded, rotated token, the cluster's CA, the namespace), as a volume to mount where
    it is needed only."""
    return {
        "name": API_ACCESS_VOLUME,
        "projected": {
            "defaultMode": 0o444,
            "sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": TOKEN_SECONDS}},
                {
                    "configMap": {
                        "name": "kube-root-ca.crt",
                        "items": [{"key": "ca.crt", "path": "ca.crt"}],
                    }
                },
                {
                    "downwardAPI": {
                        "items": [
                            {
                                "path": "namespace",
                                "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"},
                            }
                        ]
                    }
                },
            ],
        },
    }


def _sidecar_env(spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": SIDECAR_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {
            "name": SIDECAR_POD_NAMESPACE,
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        },
    ]
    if spec.store.endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": spec.store.endpoint})
    return env + _credentials_env(spec)


# the store credentials, key by key: a Secret loaded whole (envFrom) could also set any
# MODEL_SIDECAR_* flag of the sidecar
STORE_CREDENTIAL_KEYS = {
    "AWS_ACCESS_KEY_ID": False,  # key -> optional
    "AWS_SECRET_ACCESS_KEY": False,
    "AWS_SESSION_TOKEN": True,
}


def _credentials_env(spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    if not spec.store.credentials_secret:
        return []
    return [
        {
            "name": key,
            "valueFrom": {
                "secretKeyRef": {
                    "name": spec.store.credentials_secret,
                    "key": key,
                    **({"optional": True} if optional else {}),
                }
            },
        }
        for key, optional in STORE_CREDENTIAL_KEYS.items()
    ]


def _volumes(
    name: str, spec: ModelDeploymentSpec
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    models_dir = {"sizeLimit": spec.model_storage} if spec.model_storage is not None else {}
    volumes: list[dict[str, Any]] = [
        {"name": "models", "emptyDir": models_dir},
        {"name": "control", "emptyDir": {}},
        {
            "name": "podinfo",
            "downwardAPI": {
                "items": [
                    {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}}
                ]
            },
        },
        {"name": "rollout-config", "configMap": {"name": f"{name}-rollout"}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "models", "mountPath": argv.MODELS_DIR},
        {"name": "podinfo", "mountPath": argv.PODINFO_DIR, "readOnly": True},
        {"name": "rollout-config", "mountPath": argv.CONFIG_DIR, "readOnly": True},
    ]
    if spec.signing_public_key_secret:
        volumes.append(
            {
                "name": "signing-key",
                # every *.pem entry is a trusted key: two during a rotation
                "secret": {"secretName": spec.signing_public_key_secret},
            }
        )
        mounts.append({"name": "signing-key", "mountPath": argv.KEYS_DIR, "readOnly": True})
    if spec.store.pvc:
        volumes.append(
            {
                "name": "store",
                "persistentVolumeClaim": {"claimName": spec.store.pvc, "readOnly": True},
            }
        )
        mounts.append({"name": "store", "mountPath": argv.STORE_DIR, "readOnly": True})
    return volumes, mounts


def _resources(spec: ModelDeploymentSpec) -> dict[str, Any]:
    limits: dict[str, Any] = {}
    requests: dict[str, Any] = {}
    if spec.gpus:
        limits[spec.containers.gpu_resource] = spec.gpus
    for key, value in (("cpu", spec.cpu), ("memory", spec.memory)):
        if value:
            limits[key] = requests[key] = value
    out: dict[str, Any] = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def requirements(given: Requirements) -> dict[str, Any]:
    """A container's ``resources:`` as the spec (or the contract's defaults) gives it."""
    return {part: dict(amounts) for part, amounts in given.items() if amounts}


def placement(name: str, spec: ModelDeploymentSpec) -> dict[str, Any]:
    """The pod spec's fields that ``spec.pod`` sets (only those: an absent one is not
    written, and the :data:`SPEC_KEYS` record removes it from a live Deployment once it
    was given). A topology
    spread constraint or a pod affinity term without a labelSelector counts this
    deployment's pods."""
    pod = spec.pod
    own = {"matchLabels": selector(name)}
    spread = [{"labelSelector": own, **constraint} for constraint in pod.topology_spread]
    fields: dict[str, Any] = {
        "nodeSelector": dict(pod.node_selector),
        "tolerations": [dict(t) for t in pod.tolerations],
        "affinity": _own_pod_terms(dict(pod.affinity or {}), own),
        "topologySpreadConstraints": spread,
        "priorityClassName": pod.priority_class,
        "runtimeClassName": pod.runtime_class,
        "imagePullSecrets": [dict(s) for s in pod.image_pull_secrets],
    }
    return {key: value for key, value in fields.items() if value}


def _own_pod_terms(affinity: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """``affinity`` with ``own`` as the labelSelector of each pod (anti-)affinity term
    that has none: Kubernetes matches such a term with no pod, so the usual one-pod-per-
    node anti-affinity written without one would do nothing."""

    def term(given: Any) -> Any:
        return {"labelSelector": own, **given} if isinstance(given, dict) else given

    out = dict(affinity)
    for kind in ("podAffinity", "podAntiAffinity"):
        rules = out.get(kind)
        if not isinstance(rules, dict):
            continue
        rules = dict(rules)
        required = rules.get("requiredDuringSchedulingIgnoredDuringExecution")
        if isinstance(required, list):
            rules["requiredDuringSchedulingIgnoredDuringExecution"] = [term(t) for t in required]
        preferred = rules.get("preferredDuringSchedulingIgnoredDuringExecution")
        if isinstance(preferred, list):
            rules["preferredDuringSchedulingIgnoredDuringExecution"] = [
                {**p, "podAffinityTerm": term(p.get("podAffinityTerm"))}
                if isinstance(p, dict) and "podAffinityTerm" in p
                else p
                for p in preferred
            ]
        out[kind] = rules
    return out


# what of the children the operator owns whole, by kind: an object loses the keys the
# spec dropped (a merge patch alone only adds and changes: cluster.apply); a field the spec
# gave before and gives no more is removed by the SPEC_KEYS record (the template's spec
# path), so that one only another tool wrote (a mutating webhook's) is left alone
OWNED_FIELDS: dict[str, tuple[tuple[str, ...], ...]] = {
    "Deployment": tuple(
        ("spec", "template", "spec", key)
        for key in (
            "tolerations",
            "affinity",
            "topologySpreadConstraints",
            "priorityClassName",
            "runtimeClassName",
            "imagePullSecrets",
        )
    ),
}


# maps the operator shares with others (the pod template's annotations hold kubectl
# rollout restart's; an account's, a cloud's): the keys the spec gave are recorded in this
# annotation of the child, so that those the spec drops later are removed (cluster.apply)
# and nobody else's are
SPEC_KEYS = f"{DOMAIN}/spec-keys"
# on a pod template's Deployment: the digest of the template it runs (template_digest), as
# the operator rendered it (template_pass): which template it is, whatever its name
TEMPLATE_DIGEST = f"{DOMAIN}/template-digest"


def spec_keys(maps: Mapping[tuple[str, ...], Iterable[str]]) -> str:
    """The :data:`SPEC_KEYS` record: each map's path (dotted) and the keys it was given."""
    return json.dumps({".".join(path): sorted(keys) for path, keys in maps.items()}, sort_keys=True)


def _jwt_args(spec: ModelDeploymentSpec) -> argv.JwtArgs | None:
    jwt = spec.jwt
    if jwt is None:
        return None
    return argv.JwtArgs(
        jwt.issuer, jwt.audience, jwt.jwks_url, jwt.algorithms, jwt.tenant_claim,
        jwt.leeway_seconds,
    )  # fmt: skip


def _batch_models(spec: ModelDeploymentSpec) -> tuple[str, ...]:
    """The models opted in to batching: a batch size above 0 opts the deployment's model
    in, and each tenant model whose entry says ``batching``."""
    if not spec.server.batching.max_batch_size:
        return ()
    return (spec.model, *(t.key for t in spec.tenant_models if t.batching))


def _max_rows(spec: ModelDeploymentSpec) -> tuple[tuple[str, int], ...]:
    """The models' configured rows per request (the others' are derived by the server)."""
    configured = [(spec.model, spec.server.max_rows_per_request)]
    configured += [(t.key, t.max_rows_per_request) for t in spec.tenant_models]
    return tuple((key, rows) for key, rows in configured if rows)


TEMPLATE_LABEL_DIGITS = 10  # of a pod template's digest, in its Deployment's name


def template_label(template_digest: str) -> str:
    """The :data:`TEMPLATE_LABEL` of a pod template's pods: its digest's head."""
    return template_digest[:TEMPLATE_LABEL_DIGITS]


def deployment_name(name: str, template: str | None) -> str:
    """The Deployment of a pod template: the ModelDeployment's name for the first, else
    ``<name>-<template>`` (its :func:`template_label`, :data:`TEMPLATE_LABEL` on its pods)."""
    return f"{name}-{template}" if template else name


def template_of(name: str, deployment: str) -> str | None:
    """The template label of the pods of ``deployment`` (the inverse of
    :func:`deployment_name`; none: the first Deployment's)."""
    return None if deployment == name else deployment.removeprefix(f"{name}-")


def template_digest(name: str, namespace: str, spec: ModelDeploymentSpec) -> str:
    """The digest of the pod template ``spec`` renders (without a template label): a
    change of it is a template rollout (:mod:`.template_rollout`)."""
    return digest(deployment(name, namespace, spec)["spec"]["template"])


def deployment(
    name: str, namespace: str, spec: ModelDeploymentSpec, template: str | None = None
) -> dict[str, Any]:
    """The Deployment of the pod template ``spec`` renders; ``template``: its label, for
    any Deployment but the first (:func:`deployment_name`)."""
    volumes, mounts = _volumes(name, spec)
    control_mount = {"name": "control", "mountPath": argv.CONTROL_DIR}
    api_mount = {"name": API_ACCESS_VOLUME, "mountPath": API_ACCESS_DIR, "readOnly": True}
    volumes.append(api_access_volume())
    sidecar_image = spec.sidecar_image or spec.image
    server_args = argv.server_argv(
        argv.ServerArgs(
            spec.model,
            backend=spec.backend,
            retain=spec.retain_versions,
            tenants=bool(spec.tenants_secret),
            drain_seconds=spec.server.drain_seconds,
            inflight_grace_seconds=defaults.INFLIGHT_GRACE_SECONDS,
            precision=spec.precision,
            max_batch_size=spec.server.batching.max_batch_size,
            max_queue_delay_us=spec.server.batching.max_queue_delay_us,
            batch_models=_batch_models(spec),
            max_rows=_max_rows(spec),
            jwt=_jwt_args(spec),
            processes=spec.server.processes,
            log=spec.logging,
        )
    )
    sidecar_args = _sidecar_args(spec)
    # the server parses untrusted input: it reads the model volume (never writes it), has
    # the socket and volumes of its own, and no token
    server_mounts = [
        {"name": "models", "mountPath": argv.MODELS_DIR, "readOnly": True},
        control_mount,
        *({"name": n, "mountPath": path} for n, path in SERVER_ONLY_VOLUMES.items()),
    ]
    volumes += [{"name": n, "emptyDir": {}} for n in SERVER_ONLY_VOLUMES]
    if spec.tenants_secret:
        volumes.append({"name": "tenants", "secret": {"secretName": spec.tenants_secret}})
        server_mounts.append({"name": "tenants", "mountPath": argv.TENANTS_DIR, "readOnly": True})
    if spec.jwt is not None and spec.jwt.jwks_secret is not None:
        # a Secret volume (not subPath), so the kubelet's update of a rotated key reaches
        # the server, which re-reads the file when it changes
        items = [{"key": argv.JWKS_KEY, "path": argv.JWKS_KEY}]
        secret = {"secretName": spec.jwt.jwks_secret, "items": items}
        volumes.append({"name": "jwks", "secret": secret})
        server_mounts.append({"name": "jwks", "mountPath": argv.JWKS_DIR, "readOnly": True})
    tenant_inits, tenant_sidecars, tenant_volumes = _tenant_sidecars(
        spec, sidecar_image, mounts, control_mount, api_mount
    )
    volumes += tenant_volumes
    pod_labels = labels(name, spec)
    own_selector = selector(name)
    if template:
        pod_labels[TEMPLATE_LABEL] = own_selector[TEMPLATE_LABEL] = template
    body: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": deployment_name(name, template),
            "namespace": namespace,
            "labels": pod_labels,
        },
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": own_selector},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": spec.rollout.max_unavailable, "maxSurge": 1},
            },
            "template": {
                "metadata": pod_metadata(pod_labels, spec),
                "spec": {
                    "serviceAccountName": sidecar_service_account(name),
                    "automountServiceAccountToken": False,  # mounted where needed only
                    "securityContext": pod_security_context(),
                    "terminationGracePeriodSeconds": termination_grace_seconds(
                        spec.server.drain_seconds
                    ),
                    "initContainers": [
                        {
                            "name": "prefetch",
                            "image": sidecar_image,
                            "args": argv.sidecar_argv("init", sidecar_args),
                            "env": _sidecar_env(spec),
                            "securityContext": container_security_context(),
                            "resources": requirements(spec.containers.prefetch),
                            "volumeMounts": [*mounts, api_mount],
                        },
                        *tenant_inits,
                    ],
                    "containers": [
                        {
                            "name": "server",
                            "image": spec.image,
                            "args": server_args,
                            "securityContext": container_security_context(),
                            "ports": [
                                {"name": "http", "containerPort": SERVER_PORT},
                                {"name": "grpc", "containerPort": SERVER_GRPC_PORT},
                            ],
                            "readinessProbe": {
                                "httpGet": {"path": "/v2/health/ready", "port": "http"},
                                "periodSeconds": 2,
                            },
                            "livenessProbe": {
                                "httpGet": {"path": "/v2/health/live", "port": "http"},
                                "periodSeconds": 10,
                            },
                            # endpoints stop routing here before SIGTERM starts the drain
                            "lifecycle": {
                                "preStop": {"sleep": {"seconds": defaults.PRESTOP_SLEEP_SECONDS}}
                            },
                            "resources": _resources(spec),
                            "volumeMounts": server_mounts,
                        },
                        {
                            "name": "sidecar",
                            "image": sidecar_image,
                            "args": argv.sidecar_argv("watch", sidecar_args),
                            "env": _sidecar_env(spec),
                            "securityContext": container_security_context(),
                            "ports": [
                                {"name": "sidecar-metrics", "containerPort": SIDECAR_METRICS_PORT}
                            ],
                            "resources": requirements(spec.containers.sidecar),
                            "volumeMounts": [*mounts, control_mount, api_mount],
                        },
                        *tenant_sidecars,
                    ],
                    "volumes": volumes,
                    **placement(name, spec),
                },
            },
        },
    }
    template_annotations = body["spec"]["template"]["metadata"].get("annotations") or {}
    given: dict[tuple[str, ...], Iterable[str]] = {
        ("spec", "template", "metadata", "labels"): spec.pod.labels,
        ("spec", "template", "metadata", "annotations"): template_annotations,
        ("spec", "template", "spec", "nodeSelector"): spec.pod.node_selector,
        # the pod spec's fields spec.pod set: only those are removed once it drops them
        ("spec", "template", "spec"): placement(name, spec),
    }
    body["metadata"]["annotations"] = {
        SPEC_HASH: digest(body["spec"]),
        SPEC_KEYS: spec_keys(given),
    }
    return body


def pod_metadata(own_labels: dict[str, str], spec: ModelDeploymentSpec) -> dict[str, Any]:
    """The pod template's labels (the spec's, then the operator's: the spec cannot name
    them) and annotations (the spec's, and :data:`ACCOUNT_DIGEST` where the account has
    some: the operator's others are set on each pod later)."""
    meta: dict[str, Any] = {"labels": {**spec.pod.labels, **own_labels}}
    annotations = dict(spec.pod.annotations)
    if spec.pod.service_account_annotations:
        annotations[ACCOUNT_DIGEST] = digest(dict(spec.pod.service_account_annotations))
    if annotations:
        meta["annotations"] = annotations
    return meta


def service(name: str, namespace: str, spec: ModelDeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name, spec)},
        "spec": {
            "selector": selector(name),
            "ports": [
                {"name": "http", "port": 80, "targetPort": "http"},
                {"name": "grpc", "port": SERVER_GRPC_PORT, "targetPort": "grpc"},
            ],
        },
    }


def configmap(
    name: str,
    namespace: str,
    spec: ModelDeploymentSpec,
    version: str,
    tenant_versions: Mapping[str, str] | None = None,
    pins: Mapping[str | None, Mapping[str, int]] | None = None,
) -> dict[str, Any]:
    """The default version of every track for pods created later: the deployment's model
    (``version``) and each tenant model's (``tenant_versions`` by track; a tenant model
    not in it: its spec version); and each track's pinned publish sequences (``pins`` by
    track, ``None`` the deployment's model's), which a pod reads before the operator
    annotates it."""
    held = tenant_versions or {}
    data = {argv.CONFIGMAP_VERSION_KEY: version}
    for tenant in spec.tenant_models:
        data[track_keys(tenant.track).configmap_key] = held.get(tenant.track, tenant.version)
    for track, pinned in (pins or {}).items():
        if pinned:
            data[track_keys(track).configmap_pins_key] = pins_text(pinned)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"{name}-rollout",
            "namespace": namespace,
            "labels": labels(name, spec),
        },
        "data": data,
    }


# what the sidecar does with its pod: read it (init and watch), watch it (a watch request
# with a fieldSelector on its name is the verb watch, not list) and annotate it
SIDECAR_POD_VERBS = ("get", "watch", "patch")


def pod_rbac(name: str, namespace: str, spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    """The sidecar's account, as narrow as RBAC goes: its pod's name is not known when
    the Role is written (a Deployment's pods get random names later), so ``resourceNames``
    cannot pin it; the chart's admission policy (:mod:`.admission_policy`) confines the
    patch to the token's own pod and the sidecar's own annotation."""
    account = sidecar_service_account(name)
    meta = {"name": account, "namespace": namespace, "labels": labels(name, spec)}
    # the account's annotations (IRSA's role, workload identity's service account)
    given = dict(spec.pod.service_account_annotations)
    record = spec_keys({("metadata", "annotations"): given})
    annotated = {**meta, "annotations": {**given, SPEC_KEYS: record}}
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": annotated,
            "automountServiceAccountToken": False,  # the pod mounts a projected token
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": list(SIDECAR_POD_VERBS)}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
        },
    ]


def disruption_budget(name: str, namespace: str, spec: ModelDeploymentSpec) -> dict[str, Any]:
    """Voluntary evictions (a node drain) take at most as many pods at once as a rollout
    may have unavailable, and at least one, so a drain can always proceed."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name, spec)},
        "spec": {
            "selector": {"matchLabels": selector(name)},
            "maxUnavailable": max(1, spec.rollout.max_unavailable),
        },
    }


def children(
    name: str,
    namespace: str,
    spec: ModelDeploymentSpec,
    version: str,
    tenant_versions: Mapping[str, str] | None = None,
    pins: Mapping[str | None, Mapping[str, int]] | None = None,
) -> list[dict[str, Any]]:
    return [
        *pod_rbac(name, namespace, spec),
        configmap(name, namespace, spec, version, tenant_versions, pins),
        deployment(name, namespace, spec),
        service(name, namespace, spec),
        disruption_budget(name, namespace, spec),
    ]


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
