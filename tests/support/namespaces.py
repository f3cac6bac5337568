"""Namespaces a test owns on the session's control plane."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

from model_rollout_e2e.control_plane import ControlPlane


@contextlib.contextmanager
def namespace_of_its_own(cluster: ControlPlane, prefix: str) -> Iterator[str]:
    """A new namespace, deleted afterwards with whatever the test left in it.

    Deleted without waiting: a Terminating namespace admits no new pod, so no Deployment
    the test left can refill a later test's node while the namespace controller empties it.
    """
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        cluster.kubectl.run("delete", "namespace", name, "--wait=false")
