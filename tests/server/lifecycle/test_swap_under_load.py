"""Hot swap and rollback under concurrent load: no request fails, and every answer comes
wholly from one version (checked against numpy reference outputs)."""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest
from aiohttp.test_utils import TestClient

from model_server.app import ModelServer
from tests.support.server import ADMIN, infer_body, which_version

WORKERS = 12
REQUESTS_PER_WORKER = 40


async def _load(
    client: TestClient, versions, stop: asyncio.Event, seen: Counter, failures: list, worker: int
) -> None:
    rng = np.random.default_rng(worker)
    for _ in range(REQUESTS_PER_WORKER):
        x = rng.standard_normal((int(rng.integers(1, 5)), 8)).astype(np.float32)
        response = await client.post("/v2/models/mlp/infer", json=infer_body(x))
        if response.status != 200:
            failures.append((response.status, await response.text()))
            continue
        seen[which_version(versions, x, await response.json())] += 1
        await asyncio.sleep(0)


@pytest.mark.parametrize("retain", [1, 2])
async def test_swap_and_rollback_under_load_lose_no_request(
    client: TestClient, model_server: ModelServer, repo, retain: int
) -> None:
    _, versions = repo
    model_server.manager.slot("mlp").retain = retain
    seen: Counter = Counter()
    failures: list = []
    stop = asyncio.Event()
    load = [
        asyncio.create_task(_load(client, versions, stop, seen, failures, w))
        for w in range(WORKERS)
    ]
    await asyncio.sleep(0.05)
    swap = await client.post("/v1/reload?target_version=v2", headers=ADMIN)
    assert swap.status == 200, await swap.text()
    await asyncio.sleep(0.05)
    if retain > 1:
        back = await client.post("/v1/rollback", headers=ADMIN)
    else:  # nothing retained: going back is a full reload of v1
        back = await client.post("/v1/reload?target_version=v1", headers=ADMIN)
    assert back.status == 200, await back.text()
    await asyncio.gather(*load)

    assert failures == []
    assert sum(seen.values()) == WORKERS * REQUESTS_PER_WORKER
    assert seen["v1"] > 0 and seen["v2"] > 0, seen
    slot = model_server.manager.slot("mlp")
    assert slot.current is not None and slot.current.version == "v1"
    if retain == 1:  # v1 then v2 were dropped from memory, each after its last request
        assert slot.closed_versions == ["v1", "v2"]
        assert all(v.in_flight == 0 for v in slot.loaded())
