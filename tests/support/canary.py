"""The canary tests' control-socket requests and readings (tests/server/canary)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from aiohttp.test_utils import TestClient

from tests.support.server import ADMIN_TOKEN, Version, ask, samples

GRPC_ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}  # gRPC metadata keys: lower case


def load_request(v: Version) -> dict[str, str]:
    return {"op": "load", "model": "mlp", "version": v.name, "path": str(v.path),
            "sha256": v.sha256}  # fmt: skip


def traffic(candidate: str | None, stable: str | None = "v1", percent: int = 0,
            shadow: int = 0) -> dict[str, object]:  # fmt: skip
    return {"op": "traffic", "model": "mlp", "stable": stable, "candidate": candidate,
            "traffic_percent": percent, "shadow_percent": shadow}  # fmt: skip


def load_with_policy(
    v: Version, stable: str = "v1", percent: int = 0, shadow: int = 0
) -> dict[str, object]:
    """A canary's load: ``v`` and the policy with it as its candidate, in one op."""
    return {**traffic(v.name, stable, percent, shadow), **load_request(v)}


async def canary_of_v2(sock: Path, repo, percent: int = 0, shadow: int = 0) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """v2 loaded beside v1 (now retained) and a policy splitting between them."""
    assert (await ask(sock, load_request(repo[1]["v2"])))["ok"]
    return await ask(sock, traffic("v2", percent=percent, shadow=shadow))


async def metrics(client: TestClient) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return samples(await (await client.get("/metrics")).text())


def batch(rng: np.random.Generator, rows: int = 3) -> np.ndarray:
    return rng.standard_normal((rows, 8)).astype(np.float32)
