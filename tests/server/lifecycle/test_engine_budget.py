"""Memory budget, eviction and swaps around loads in progress (issue 13): the budget holds
across models and loads in progress, a failed load leaves the rollback target loaded and
the gauges count only what is loaded, unloaded versions lose their metric series, and a
rollback never waits for a load."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import generate_latest

from model_rollout_contract.manifest import Manifest, sha256_bytes
from model_server.app import SERVER, ModelServer
from model_server.backends.onnxruntime_backend import OnnxRuntimeBackend
from model_server.config import ModelSpec, ServerConfig
from model_server.errors import Conflict, LoadRefused, MemoryBudgetExceeded, NotReady
from model_server.lifecycle.engine_manager import EngineManager
from model_server.lifecycle.model_slot import VersionState, VersionStatus
from model_server.lifecycle.repository import ModelRepository
from model_server.observability.audit import AuditLog
from model_server.observability.metrics import ServerMetrics
from tests.support.server import (
    ADMIN,
    GatedBackend,
    Version,
    add_version,
    ask,
    infer_body,
    infer_on,
    output_of,
)

X = np.ones((1, 8), np.float32)


def per_version(version: Version) -> int:
    return int(version.path.stat().st_size * OnnxRuntimeBackend.memory_factor)


def manager_for(root: Path, models: list[str], retain: int, budget: int) -> EngineManager:
    manager = EngineManager(
        GatedBackend(), ModelRepository(root), ServerMetrics(), AuditLog(), retain=retain,
        memory_budget_bytes=budget,
    )  # fmt: skip
    for model in models:
        manager.register(model)
    return manager


def gauges(manager: EngineManager) -> list[str]:
    text = generate_latest(manager.metrics.registry).decode()
    names = (
        "model_server_version_serving{",
        "model_server_versions_loaded{",
        "model_server_memory_bytes{",
    )
    return sorted(line for line in text.splitlines() if line.startswith(names))


def corrupt_version(root: Path, model: str, version: str, size: int) -> None:
    """A version whose manifest matches its bytes, which are not a model."""
    data = b"\x08\x07not an onnx model" + b"\0" * size
    path = root / model / version / "model.onnx"
    path.parent.mkdir(parents=True)
    path.write_bytes(data[:size])
    manifest = Manifest(model, version, "model.onnx", sha256_bytes(data[:size]), size)
    (path.parent / "manifest.json").write_bytes(manifest.to_bytes())


async def test_two_loads_at_once_never_hold_more_than_the_budget(tmp_path: Path) -> None:
    a1 = add_version(tmp_path, "a", "v1", seed=1)
    for model in ("a", "b"):
        add_version(tmp_path, model, "v1", seed=1)
        add_version(tmp_path, model, "v2", seed=2)
    one = per_version(a1)
    budget = 2 * one + one * 3 // 2  # both v1 and room for one more version, not two
    manager = manager_for(tmp_path, ["a", "b"], retain=2, budget=budget)
    backend = manager.backend
    assert isinstance(backend, GatedBackend)
    await manager.load("a", "v1")
    await manager.load("b", "v1")
    backend.gate.clear()  # both loads would now stay in their warm-up
    loads = [asyncio.create_task(manager.load(m, "v2")) for m in ("a", "b")]
    done, _ = await asyncio.wait(loads, return_when=asyncio.FIRST_COMPLETED)
    [refused] = done  # at once: the other one's estimate is reserved
    assert isinstance(refused.exception(), MemoryBudgetExceeded), refused
    assert "reserved by loads in progress" in str(refused.exception())
    assert manager.budget.reserved_bytes == one
    backend.gate.set()
    outcomes = await asyncio.gather(*loads, return_exceptions=True)
    assert sum(not isinstance(o, BaseException) for o in outcomes) == 1, outcomes
    assert manager.total_memory_bytes() <= budget and manager.budget.reserved_bytes == 0
    manager.close()


async def test_a_failed_load_leaves_the_rollback_target_loaded(tmp_path: Path) -> None:
    v1 = add_version(tmp_path, "mlp", "v1", seed=1)
    v2 = add_version(tmp_path, "mlp", "v2", seed=2)
    corrupt_version(tmp_path, "mlp", "v3", v1.path.stat().st_size)
    # the double buffer and a little: v3 fits only if the retained v1 leaves memory
    manager = manager_for(tmp_path, ["mlp"], retain=2, budget=per_version(v1) * 5 // 2)
    await manager.load("mlp", "v1")
    await manager.load("mlp", "v2")
    before = gauges(manager)
    with pytest.raises(LoadRefused, match="failed to load"):
        await manager.load("mlp", "v3")
    slot = manager.slot("mlp")
    assert [v.version for v in slot.loaded()] == ["v1", "v2"]
    assert slot.states()["v1"] == VersionStatus(VersionState.READY, "retained for rollback")
    assert slot.states()["v3"].state is VersionState.UNAVAILABLE
    assert gauges(manager) == before  # v3 never counted, v1 counted again
    result = await manager.rollback("mlp")  # to v1, instantly: it is held
    assert (result.to_version, result.instant) == ("v1", True)
    served, out = await infer_on(manager, "mlp", {"input": X})
    np.testing.assert_allclose(out["output"], v1.expected(X), atol=1e-5)
    assert served.sha256 == v1.sha256
    assert manager.total_memory_bytes() <= manager.budget.limit_bytes  # type: ignore[operator]
    assert v2.sha256 in {v.sha256 for v in slot.loaded()}
    manager.close()


async def test_unloaded_versions_lose_their_metric_series(tmp_path: Path) -> None:
    for i in (1, 2, 3):
        add_version(tmp_path, "mlp", f"v{i}", seed=i)
    manager = manager_for(tmp_path, ["mlp"], retain=2, budget=10**9)
    for version in ("v1", "v2", "v3"):
        await manager.load("mlp", version)
    corrupt_version(tmp_path, "mlp", "v4", 100)
    with pytest.raises(LoadRefused):
        await manager.load("mlp", "v4")
    held = sum(v.memory_bytes for v in manager.slot("mlp").loaded())
    assert gauges(manager) == [
        f'model_server_memory_bytes{{model="mlp"}} {float(held)}',
        'model_server_version_serving{model="mlp",version="v2"} 0.0',
        'model_server_version_serving{model="mlp",version="v3"} 1.0',
        'model_server_versions_loaded{model="mlp"} 2.0',
    ]
    manager.close()


@pytest.fixture
async def gated_client(tmp_path: Path, repo) -> TestClient:  # type: ignore[no-untyped-def]
    token = tmp_path / "admin-token"
    token.write_text(ADMIN["Authorization"].removeprefix("Bearer "))
    config = ServerConfig(
        repository=repo[0], models=[ModelSpec("mlp", "v1")], admin_token_file=token,
        control_socket=tmp_path / "control.sock", retain=2,
    )  # fmt: skip
    async with TestClient(TestServer(ModelServer(config, GatedBackend()).make_app())) as client:
        yield client


async def test_a_rollback_never_waits_for_a_load_in_progress(
    gated_client: TestClient, repo
) -> None:
    client, versions = gated_client, repo[1]
    server = client.app[SERVER]
    sock = server.config.control_socket
    backend = server.manager.backend
    assert (await client.post("/v1/reload?target_version=v2", headers=ADMIN)).status == 200
    backend.gate.clear()  # v3's warm-up now waits for the gate
    v3 = versions["v3"]
    load = asyncio.create_task(
        ask(sock, {"op": "load", "model": "mlp", "version": "v3", "path": str(v3.path),
                   "sha256": v3.sha256})
    )  # fmt: skip
    while server.manager.slot("mlp").states().get("v3") is None:
        await asyncio.sleep(0.01)  # the load has begun
    over_socket = asyncio.create_task(ask(sock, {"op": "rollback", "model": "mlp"}))
    done, _ = await asyncio.wait([load, over_socket], return_when=asyncio.FIRST_COMPLETED)
    assert done == {over_socket}, "the rollback waited for the load"
    assert over_socket.result()["ok"] and over_socket.result()["to"] == "v1"
    over_http = asyncio.create_task(client.post("/v1/rollback", headers=ADMIN))
    done, _ = await asyncio.wait([load, over_http], return_when=asyncio.FIRST_COMPLETED)
    assert done == {over_http}, "the rollback waited for the load"
    assert (await over_http.result().json())["to"] == "v2"
    backend.gate.set()
    answer = await load  # overtaken: loaded, but not swapped in over the rollback
    assert (answer["ok"], answer["code"]) == (False, "conflict"), answer
    assert "not swapped in" in answer["error"]
    response = await client.post("/v2/models/mlp/infer", json=infer_body(X))
    np.testing.assert_allclose(
        output_of(await response.json()), versions["v2"].expected(X), atol=1e-4
    )
    assert [v.version for v in server.manager.slot("mlp").loaded()] == ["v1", "v2"]


# --- versions still running requests hold memory (issue 13 follow-up) ----------------


def open_versions(manager: EngineManager, model: str) -> list[str]:
    """The versions whose engines are open: loaded, or dropped and still running."""
    slot = manager.slot(model)
    return sorted(v.version for v in [*slot.loaded(), *slot.draining()])


async def test_dropped_versions_still_running_requests_count_in_the_budget(
    tmp_path: Path,
) -> None:
    """The reviewer's reproduction: with --retain 1, v1 and v2 are dropped from the slot
    while a request pins each, so both stay open; loading v3 beside them would hold three
    engines against a budget of two and a half."""
    versions = [add_version(tmp_path, "m", f"v{i}", seed=i) for i in (1, 2, 3)]
    one = per_version(versions[0])
    manager = manager_for(tmp_path, ["m"], retain=1, budget=one * 5 // 2)
    slot = manager.slot("m")
    await manager.load("m", "v1")
    with slot.pin():  # a long request on v1
        await manager.load("m", "v2")  # v1 dropped, open for its request
        with slot.pin():  # a long request on v2
            with pytest.raises(MemoryBudgetExceeded, match="still running requests"):
                await manager.load("m", "v3")
            assert manager.total_memory_bytes() == 2 * one
            assert slot.current is not None and slot.current.version == "v2"
            assert open_versions(manager, "m") == ["v1", "v2"]
    assert open_versions(manager, "m") == ["v2"]  # v1's request ended
    assert manager.total_memory_bytes() == one
    await manager.load("m", "v3")  # room now
    assert open_versions(manager, "m") == ["v3"]
    manager.close()


async def test_a_retained_version_running_requests_is_not_room(tmp_path: Path) -> None:
    """Evicting a retained version that a request pins frees nothing until the request
    ends: the budget must not count it as room (two open engines plus the new one)."""
    versions = [add_version(tmp_path, "m", f"v{i}", seed=i) for i in (1, 2, 3)]
    one = per_version(versions[0])
    manager = manager_for(tmp_path, ["m"], retain=2, budget=one * 5 // 2)
    slot = manager.slot("m")
    await manager.load("m", "v1")
    with slot.pin():  # v1 serves a long request, then is retained beside v2
        await manager.load("m", "v2")
        with pytest.raises(MemoryBudgetExceeded):
            await manager.load("m", "v3")
        assert [v.version for v in slot.loaded()] == ["v1", "v2"]  # nothing evicted
    await manager.load("m", "v3")  # v1 unpinned: evicted to make room, and freed
    assert open_versions(manager, "m") == ["v2", "v3"]
    assert manager.total_memory_bytes() <= one * 5 // 2
    manager.close()


def tenant_manager(root: Path, models: list[str], caps: dict[str, int]) -> EngineManager:
    manager = EngineManager(
        GatedBackend(), ModelRepository(root), ServerMetrics(), AuditLog(), retain=2,
        tenant_memory_caps=caps,
    )  # fmt: skip
    for model in models:
        manager.register(model)
    return manager


async def test_a_tenants_models_hold_at_most_its_cap_while_another_tenant_loads(
    tmp_path: Path,
) -> None:
    for model in ("acme/a", "acme/b", "globex/a"):
        for seed, version in enumerate(("v1", "v2", "v3")):
            one = per_version(add_version(tmp_path, model, version, seed=seed + 1))
    manager = tenant_manager(
        tmp_path, ["acme/a", "acme/b", "globex/a"], {"acme": one * 7 // 2}
    )  # acme: room for 3.5 versions; globex: no cap (and no server budget)
    backend = manager.backend
    assert isinstance(backend, GatedBackend)
    for model in ("acme/a", "acme/b", "globex/a"):
        await manager.load(model, "v1")
    backend.gate.clear()  # loads now stay in their warm-up
    first = asyncio.create_task(manager.load("acme/a", "v2"))
    await asyncio.sleep(0.05)
    with pytest.raises(MemoryBudgetExceeded, match="tenant acme's models hold") as refused:
        await manager.load("acme/b", "v2")  # 2 held + 1 reserved + 1 > 3.5
    assert "its loads in progress" in str(refused.value)
    other = asyncio.create_task(manager.load("globex/a", "v2"))  # another tenant: not held up
    backend.gate.set()
    await asyncio.gather(first, other)
    assert manager.budget._reserved_by == {"acme": 0}
    assert sorted(v.version for v in manager.slot("globex/a").loaded()) == ["v1", "v2"]
    # near its cap, acme's next load makes room from its own model's retained version
    # (v1) only: v2 stays for a rollback, acme/b and globex keep theirs
    await manager.load("acme/a", "v3")
    assert sorted(v.version for v in manager.slot("acme/a").loaded()) == ["v2", "v3"]
    assert [v.version for v in manager.slot("acme/b").loaded()] == ["v1"]
    assert sorted(v.version for v in manager.slot("globex/a").loaded()) == ["v1", "v2"]
    assert manager.memory_bytes("acme") <= one * 7 // 2


async def test_a_tenant_memory_cap_comes_from_the_tenants_file(tmp_path: Path) -> None:
    import yaml

    one = per_version(add_version(tmp_path / "models", "acme/mlp", "v1", seed=1))
    add_version(tmp_path / "models", "acme/mlp", "v2", seed=2)
    tenants = tmp_path / "tenants.yaml"
    cap_mb = one * 3 / 2 / 2**20  # one version and a half
    entry = {"api_key": "k", "models": ["mlp"], "memory_mb": cap_mb}
    tenants.write_text(yaml.safe_dump({"tenants": {"acme": entry}}))
    server = ModelServer(ServerConfig(repository=tmp_path / "models", tenants_file=tenants))
    async with TestClient(TestServer(server.make_app())):
        manager = server.manager
        assert [v.version for v in manager.slot("acme/mlp").loaded()] == ["v2"]  # the newest
        with pytest.raises(MemoryBudgetExceeded, match="memory cap of"):
            await manager.load("acme/mlp", "v1")  # v2 serves, so it cannot make room
        assert manager.slot("acme/mlp").current.version == "v2"  # type: ignore[union-attr]
    for bad in (0, -1, "x", True, float("nan"), float("inf")):
        entry["memory_mb"] = bad
        tenants.write_text(yaml.safe_dump({"tenants": {"acme": entry}}))
        with pytest.raises(ValueError, match="memory_mb"):
            ModelServer(ServerConfig(repository=tmp_path / "models", tenants_file=tenants))


async def test_an_unload_during_a_load_that_made_room_keeps_the_model_unloaded(
    tmp_path: Path,
) -> None:
    """Issue 27: v3's load evicts the retained v1 for the budget; an unload arrives while
    v3 warms up. The overtaken load must not bring v1 back (held, and a rollback to it)."""
    versions = [add_version(tmp_path, "m", f"v{i}", seed=i) for i in (1, 2, 3)]
    manager = manager_for(tmp_path, ["m"], retain=2, budget=per_version(versions[0]) * 5 // 2)
    backend, slot = manager.backend, manager.slot("m")
    assert isinstance(backend, GatedBackend)
    await manager.load("m", "v1")
    await manager.load("m", "v2")
    backend.gate.clear()  # v3's warm-up now waits for the gate
    load = asyncio.create_task(manager.load("m", "v3"))
    while slot.states()["v1"].state is VersionState.READY:
        await asyncio.sleep(0.01)  # v1 evicted to make room for v3
    assert [v.version for v in slot.unload_all("unloaded on request")] == ["v2"]
    backend.gate.set()
    with pytest.raises(Conflict, match="not swapped in"):
        await load
    await asyncio.gather(*manager._restoring)
    assert slot.loaded() == [] and slot.current is None
    assert manager.total_memory_bytes() == 0
    with pytest.raises(Conflict, match="no retained"):
        await manager.rollback("m")
    with pytest.raises(Conflict, match="no retained"):
        await manager.rollback("m", "v1")
    with pytest.raises(NotReady):
        await infer_on(manager, "m", {"input": X})
    manager.close()


async def test_a_version_without_manifest_or_digest_is_refused_and_the_old_one_serves(
    tmp_path: Path,
) -> None:
    """Issue 27: a version directory without manifest.json was loaded unchecked (and its
    sha shown as if verified). Without a manifest or a digest in the request it is
    refused; with the digest it loads."""
    v1 = add_version(tmp_path, "m", "v1", seed=1)
    v2 = add_version(tmp_path, "m", "v2", seed=2, manifest=False)
    manager = manager_for(tmp_path, ["m"], retain=2, budget=10**9)
    await manager.load("m", "v1")
    with pytest.raises(LoadRefused, match="no manifest"):
        await manager.load("m", "v2")
    with pytest.raises(LoadRefused, match="no manifest"):
        await manager.load("m", "v2", path=v2.path)
    slot = manager.slot("m")
    assert slot.current is not None and slot.current.sha256 == v1.sha256
    assert slot.states()["v2"].state is VersionState.UNAVAILABLE
    await manager.load("m", "v2", expected_sha256=v2.sha256)  # an explicit digest
    assert slot.current.version == "v2"
    manager.close()
