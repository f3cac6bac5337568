"""Does a version exist in the model store? Checked before a rollout starts."""

from __future__ import annotations

import asyncio
from enum import Enum

from model_server.manifest import MANIFEST_NAME
from model_sidecar.store import ObjectMissing, StoreError, open_store, version_key

from .spec import ModelDeploymentSpec


class VersionCheck(Enum):
    PRESENT = "present"
    MISSING = "missing"
    UNREACHABLE = "unreachable"
    SKIPPED = "skipped"  # a PVC store is not reachable from the operator


async def check_version(spec: ModelDeploymentSpec) -> tuple[VersionCheck, str]:
    if not spec.store.url:
        return VersionCheck.SKIPPED, "store is a volume; not checked by the operator"
    try:
        store = open_store(spec.store.url, spec.store.endpoint)
        key = version_key(spec.model, spec.version, MANIFEST_NAME)
        await asyncio.to_thread(store.read, key)
    except ObjectMissing:
        return VersionCheck.MISSING, (
            f"version {spec.version} of {spec.model} is not in "
            f"{spec.store.url} (no {MANIFEST_NAME})"
        )
    except (StoreError, ValueError) as exc:
        return VersionCheck.UNREACHABLE, f"model store {spec.store.url} unreachable: {exc}"
    return VersionCheck.PRESENT, "ok"
