"""Kubernetes objects a ModelDeployment owns, as plain dicts (pure functions).

The pod template never carries the model version: versions move by per-pod annotations
(read by the sidecar through the Downward API) and the ConfigMap default, so changing
``spec.version`` never changes the template and never restarts a pod.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from model_rollout_contract import argv
from model_rollout_contract.annotations import DEPLOYMENT_LABEL, DOMAIN, MODEL_LABEL
from model_rollout_contract.cli import SIDECAR_ENV_PREFIX, env_name
from model_rollout_contract.defaults import SERVER_PORT, SIDECAR_METRICS_PORT

from .spec import ModelDeploymentSpec

SPEC_HASH = f"{DOMAIN}/spec-hash"
# the sidecar reads its pod's name and namespace (Downward API env) as these flags
SIDECAR_POD_NAME = env_name(SIDECAR_ENV_PREFIX, "--pod-name")
SIDECAR_POD_NAMESPACE = env_name(SIDECAR_ENV_PREFIX, "--pod-namespace")


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


def _sidecar_args(spec: ModelDeploymentSpec) -> argv.SidecarArgs:
    return argv.SidecarArgs(
        spec.model,
        spec.store.sidecar_url,
        signed=bool(spec.signing_public_key_secret),
        retain=spec.retain_versions,
    )


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
    volumes: list[dict[str, Any]] = [
        {"name": "models", "emptyDir": {}},
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
                "secret": {
                    "secretName": spec.signing_public_key_secret,
                    "items": [{"key": "public.pem", "path": "public.pem"}],
                },
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
        limits["nvidia.com/gpu"] = spec.gpus
    for key, value in (("cpu", spec.cpu), ("memory", spec.memory)):
        if value:
            limits[key] = requests[key] = value
    out: dict[str, Any] = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def deployment(name: str, namespace: str, spec: ModelDeploymentSpec) -> dict[str, Any]:
    volumes, mounts = _volumes(name, spec)
    control_mount = {"name": "control", "mountPath": argv.CONTROL_DIR}
    sidecar_image = spec.sidecar_image or spec.image
    server_args = argv.server_argv(
        argv.ServerArgs(
            spec.model,
            backend=spec.backend,
            retain=spec.retain_versions,
            tenants=bool(spec.tenants_secret),
        )
    )
    sidecar_args = _sidecar_args(spec)
    server_mounts = [m for m in mounts if m["name"] == "models"] + [control_mount]
    if spec.tenants_secret:
        volumes.append({"name": "tenants", "secret": {"secretName": spec.tenants_secret}})
        server_mounts.append({"name": "tenants", "mountPath": argv.TENANTS_DIR, "readOnly": True})
    pod_labels = labels(name, spec)
    body: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": pod_labels},
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector(name)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": spec.rollout.max_unavailable, "maxSurge": 1},
            },
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "serviceAccountName": f"{name}-pod",
                    "initContainers": [
                        {
                            "name": "prefetch",
                            "image": sidecar_image,
                            "args": argv.sidecar_argv("init", sidecar_args),
                            "env": _sidecar_env(spec),
                            "volumeMounts": mounts,
                        }
                    ],
                    "containers": [
                        {
                            "name": "server",
                            "image": spec.image,
                            "args": server_args,
                            "ports": [{"name": "http", "containerPort": SERVER_PORT}],
                            "readinessProbe": {
                                "httpGet": {"path": "/v2/health/ready", "port": "http"},
                                "periodSeconds": 2,
                            },
                            "livenessProbe": {
                                "httpGet": {"path": "/v2/health/live", "port": "http"},
                                "periodSeconds": 10,
                            },
                            "resources": _resources(spec),
                            "volumeMounts": server_mounts,
                        },
                        {
                            "name": "sidecar",
                            "image": sidecar_image,
                            "args": argv.sidecar_argv("watch", sidecar_args),
                            "env": _sidecar_env(spec),
                            "ports": [
                                {"name": "sidecar-metrics", "containerPort": SIDECAR_METRICS_PORT}
                            ],
                            "volumeMounts": [*mounts, control_mount],
                        },
                    ],
                    "volumes": volumes,
                },
            },
        },
    }
    body["metadata"]["annotations"] = {SPEC_HASH: digest(body["spec"])}
    return body


def service(name: str, namespace: str, spec: ModelDeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name, spec)},
        "spec": {
            "selector": selector(name),
            "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
        },
    }


def configmap(name: str, namespace: str, spec: ModelDeploymentSpec, version: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"{name}-rollout",
            "namespace": namespace,
            "labels": labels(name, spec),
        },
        "data": {argv.CONFIGMAP_VERSION_KEY: version},
    }


def pod_rbac(name: str, namespace: str, spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    """Least privilege for the sidecar: read, watch and annotate pods of its namespace."""
    meta = {"name": f"{name}-pod", "namespace": namespace, "labels": labels(name, spec)}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            # follow its own pod (a fieldSelector watch needs list and watch) and report
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["pods"],
                    "verbs": ["get", "list", "watch", "patch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": f"{name}-pod",
            },
            "subjects": [{"kind": "ServiceAccount", "name": f"{name}-pod", "namespace": namespace}],
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
    name: str, namespace: str, spec: ModelDeploymentSpec, version: str
) -> list[dict[str, Any]]:
    return [
        *pod_rbac(name, namespace, spec),
        configmap(name, namespace, spec, version),
        deployment(name, namespace, spec),
        service(name, namespace, spec),
        disruption_budget(name, namespace, spec),
    ]


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
