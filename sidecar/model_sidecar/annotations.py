"""Names shared by the operator, the sidecar and the harness that plays the kubelet."""

from __future__ import annotations

import json

DOMAIN = "serving.model-rollout.io"
TARGET_VERSION = f"{DOMAIN}/target-version"  # written by the operator, per pod
PREVIOUS_VERSION = f"{DOMAIN}/previous-version"  # pre-pulled for instant rollback
SIDECAR_STATUS = f"{DOMAIN}/sidecar-status"  # JSON written by the sidecar


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
