"""End to end, two tenants on the same pods, on a real control plane: the operator (a
process, as its ServiceAccount), the pods of its Deployment run by the node agent as
processes (a sidecar per tenant model) and a volume store (a PersistentVolume). Tenant
acme's model is rolled a1 -> a2 (canary, then every pod) and back, on its own, while
tenant globex keeps serving g1 under load with 0 failed requests and no answer from
acme's model, and the deployment's own model stays on v1. globex calls with JWTs (the
issuer's JWKS a Secret the operator mounts, spec.tenants.jwt), acme with its API key; no
pod is replaced or restarted. The node agent refreshes Downward API files every 60 s, as
a real kubelet does."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric import ed25519
from jwt.algorithms import OKPAlgorithm

from model_rollout_contract.argv import JWKS_DIR, JWKS_KEY, TENANTS_DIR
from model_rollout_contract.tracks import DEFAULT_TRACK, track_keys
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.onnx_models import write_mlp
from model_rollout_e2e.scenario import Scenario, StoreSetup, available
from model_sidecar.publish import publish
from tests.support.e2e import deployed, pods_of

pytestmark = [pytest.mark.slow]
REPLICAS = 2
BODY = {"inputs": [{"name": "input", "shape": [1, 8], "datatype": "FP32", "data": [1.0] * 8}]}


ISSUER, AUDIENCE = "https://issuer.test", "model-api"


def token(key: ed25519.Ed25519PrivateKey, tenant: str) -> str:
    now = int(time.time())
    claims = {"iss": ISSUER, "aud": AUDIENCE, "tenant": tenant, "iat": now, "exp": now + 900}
    return jwt.encode(claims, key, "EdDSA", headers={"kid": "issuer-1"})


def tenant_models(acme_version: str) -> list[dict[str, str]]:
    return [
        {"name": "acme-mlp", "tenant": "acme", "model": "mlp", "version": acme_version},
        {"name": "globex-mlp", "tenant": "globex", "model": "mlp", "version": "g1"},
    ]


def tenant_available(track: str, version: str) -> Any:
    def check(status: dict[str, Any]) -> bool:
        tenant = (status.get("tenants") or {}).get(track) or {}
        return bool(available(version, REPLICAS)(tenant))

    return check


async def answers(urls: list[str], key: str, stop: asyncio.Event, out: list[tuple[int, str]]):  # type: ignore[no-untyped-def]
    """Requests with ``key`` round the pods until ``stop``: (status, version answered)."""
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        i = 0
        while not stop.is_set():
            url = urls[i % len(urls)]
            i += 1
            try:
                async with session.post(
                    f"{url}/v2/models/mlp/infer", json=BODY, headers=headers
                ) as response:
                    answer = await response.json()
                    out.append((response.status, str(answer.get("model_version"))))
            except (aiohttp.ClientError, TimeoutError) as exc:
                out.append((0, f"{type(exc).__name__}: {exc}"))
            await asyncio.sleep(0.01)


async def test_a_tenants_rollout_and_rollback_leave_the_other_tenant_serving(
    tmp_path: Path, control_plane: ControlPlane
) -> None:
    tenants_dir = tmp_path / "tenants"
    tenants_dir.mkdir()
    (tenants_dir / "tenants.yaml").write_text(
        yaml.safe_dump(
            {
                "tenants": {
                    "acme": {"api_key": "key-acme", "models": ["mlp"]},
                    "globex": {"api_key": "key-globex", "models": ["mlp"]},
                }
            }
        )
    )
    issuer_key = ed25519.Ed25519PrivateKey.generate()
    jwks_dir = tmp_path / "jwks"
    jwks_dir.mkdir()
    jwk = {**OKPAlgorithm.to_jwk(issuer_key.public_key(), as_dict=True), "kid": "issuer-1"}
    (jwks_dir / JWKS_KEY).write_text(json.dumps({"keys": [jwk]}))
    scenario = Scenario(
        StoreSetup.local(tmp_path / "store"),
        mounts={TENANTS_DIR: tenants_dir, JWKS_DIR: jwks_dir},
        cluster=control_plane,
    )
    scenario.publish("v1", seed=1)
    tenant_versions = [("acme/mlp", "a1", 11), ("acme/mlp", "a2", 12), ("globex/mlp", "g1", 21)]
    for model, version, seed in tenant_versions:
        path = scenario.work / "build" / model / version / "model.onnx"
        write_mlp(path, seed, in_dim=scenario.in_dim)
        publish(scenario.store.store, model, version, path, scenario.keys / "signing.key")
    acme_phases: list[str] = []

    def record(status: dict[str, Any]) -> None:
        phase = ((status.get("tenants") or {}).get("acme-mlp") or {}).get("phase")
        if phase and (not acme_phases or acme_phases[-1] != phase):
            acme_phases.append(phase)

    async with scenario.running():
        await deployed(
            scenario,
            "v1",
            REPLICAS,
            180,
            canary={"percent": 50, "pauseSeconds": 1},
            rollout={"batchSize": 1, "jitterSeconds": 0.2},
            tenants={
                "secretName": "model-tenants",
                "models": tenant_models("a1"),
                "jwt": {"issuer": ISSUER, "audience": AUDIENCE, "jwksSecret": "issuer-jwks"},
            },
        )
        await scenario.wait(tenant_available("acme-mlp", "a1"), 60)
        await scenario.wait(tenant_available("globex-mlp", "g1"), 60)
        urls, lives = await pods_of(scenario, REPLICAS)
        stop = asyncio.Event()
        globex: list[tuple[int, str]] = []
        acme: list[tuple[int, str]] = []
        traffic = [
            asyncio.create_task(answers(urls, token(issuer_key, "globex"), stop, globex)),
            asyncio.create_task(answers(urls, "key-acme", stop, acme)),
        ]
        await asyncio.sleep(1)

        await scenario.patch({"spec": {"tenants": {"models": tenant_models("a2")}}})
        status = await scenario.wait(tenant_available("acme-mlp", "a2"), 120, record)
        assert "Canary" in acme_phases and acme_phases[-1] == "Available", acme_phases
        acme_status = status["tenants"]["acme-mlp"]
        assert (acme_status["currentVersion"], acme_status["previousVersion"]) == ("a2", "a1")
        assert acme_status["model"] == "acme/mlp"
        assert acme_status["history"][0]["version"] == "a2"
        assert acme_status["history"][0]["result"] == "Succeeded"

        await scenario.patch({"spec": {"tenants": {"models": tenant_models("a1")}}})
        status = await scenario.wait(tenant_available("acme-mlp", "a1"), 60, record)
        assert status["tenants"]["acme-mlp"]["rollout"]["fast"] is True  # a pointer swap
        await asyncio.sleep(1)
        stop.set()
        await asyncio.gather(*traffic)

        assert globex and [a for a in globex if a[0] != 200] == [], globex[:5]
        assert Counter(v for _, v in globex) == {"g1": len(globex)}  # never acme's model
        assert [a for a in acme if a[0] != 200] == [], acme[:5]
        acme_versions = Counter(v for _, v in acme)
        assert set(acme_versions) == {"a1", "a2"}, acme_versions  # never globex's model
        # acme's token reaches acme's model only; one its issuer did not sign, nothing
        forged = token(ed25519.Ed25519PrivateKey.generate(), "globex")
        async with aiohttp.ClientSession() as session:
            for credential, expected in ((token(issuer_key, "acme"), 200), (forged, 401)):
                for url in urls:
                    async with session.post(
                        f"{url}/v2/models/mlp/infer",
                        json=BODY,
                        headers={"Authorization": f"Bearer {credential}"},
                    ) as response:
                        answer = await response.json()
                        assert response.status == expected, answer
                        if expected == 200:
                            assert answer["model_version"] == "a1", answer
        # the deployment's own model and globex's rollout were never touched
        assert status["currentVersion"] == "v1" and status["versions"] == {"v1": REPLICAS}
        assert status["tenants"]["globex-mlp"]["history"][0]["version"] == "g1"
        assert len(status["tenants"]["globex-mlp"]["history"]) == 1
        assert await scenario.pod_lives() == lives  # the same pods, no container restarted
        for pod in await scenario.pod_objects():
            annotations = pod["metadata"]["annotations"]
            assert annotations[DEFAULT_TRACK.target] == "v1"
            assert annotations[track_keys("globex-mlp").target] == "g1"
            assert annotations[track_keys("acme-mlp").target] == "a1"
        events = await scenario.events()
        messages = [e.get("message", "") for e in events]
        assert any(m.startswith("tenant acme, model mlp (acme-mlp): ") for m in messages), messages[
            -10:
        ]
