"""Names on Kubernetes objects that more than one program reads or writes, and the file
format in which the kubelet projects a pod's annotations (Downward API)."""

from __future__ import annotations

import json

DOMAIN = "serving.model-rollout.io"

# pod annotations
TARGET_VERSION = f"{DOMAIN}/target-version"  # operator -> sidecar: the version to serve
PREVIOUS_VERSION = f"{DOMAIN}/previous-version"  # operator -> sidecar: pre-pulled for rollback
SIDECAR_STATUS = f"{DOMAIN}/sidecar-status"  # sidecar -> operator: a SidecarReport (JSON)

# ModelDeployment annotation: `kubectl annotate md NAME ...=<version>` promotes its canary
PROMOTE = f"{DOMAIN}/promote"

# labels the operator puts on what it creates
DEPLOYMENT_LABEL = f"{DOMAIN}/deployment"  # on pods: the ModelDeployment they belong to
MODEL_LABEL = f"{DOMAIN}/model"


def parse_downward_annotations(text: str) -> dict[str, str]:
    """Parse a Downward API ``metadata.annotations`` file: ``key="go-quoted value"`` lines."""
    result: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, raw = line.partition("=")
        if not sep or not key.strip():
            continue
        raw = raw.strip()
        try:
            value = json.loads(raw) if raw.startswith('"') else raw
        except json.JSONDecodeError:
            value = raw.strip('"')
        result[key.strip()] = str(value)
    return result


def format_downward_annotations(annotations: dict[str, str]) -> str:
    """What the kubelet writes for ``fieldPath: metadata.annotations`` (sorted, quoted)."""
    return "".join(f"{k}={json.dumps(v)}\n" for k, v in sorted(annotations.items()))
