"""Kubeconfig files for a test cluster: one context, its CA embedded by path, and either a
client certificate or a bearer token (a service account's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from model_rollout_e2e.cluster_pki import CertPair


def write_kubeconfig(
    path: Path,
    server: str,
    ca: Path,
    client: CertPair | None = None,
    token: str | None = None,
    namespace: str = "default",
) -> Path:
    if (client is None) == (token is None):
        raise ValueError("a kubeconfig needs exactly one of a client certificate or a token")
    user: dict[str, Any] = (
        {"client-certificate": str(client.cert), "client-key": str(client.key)}
        if client is not None
        else {"token": token}
    )
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "test", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": "user", "user": user}],
        "contexts": [
            {"name": "test", "context": {"cluster": "test", "user": "user", "namespace": namespace}}
        ],
        "current-context": "test",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path
