"""Golden sets: a version is swapped in only if it answers its golden set within its
tolerances, and only a golden set its manifest binds (issue 11)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from aiohttp.test_utils import TestClient

from model_rollout_contract import canary
from model_rollout_e2e.onnx_models import INPUT_NAME, OUTPUT_NAME
from model_server.app import ModelServer
from tests.support.canary import load_request, metrics
from tests.support.server import ADMIN, Version, add_golden, add_version, ask, golden_npz, sample

GOLDEN_X = np.random.default_rng(21).standard_normal((5, 8)).astype(np.float32)


def golden_of(v: Version, shift: float = 0.0, **tolerance: float) -> bytes:
    expected = v.expected(GOLDEN_X)
    expected[2, 1] += shift
    return golden_npz({INPUT_NAME: GOLDEN_X}, {OUTPUT_NAME: expected}, **tolerance)


async def test_a_version_that_answers_its_golden_set_is_swapped_in(
    client: TestClient, repo, server_config
) -> None:
    v2, v3 = repo[1]["v2"], repo[1]["v3"]
    add_golden(v2, golden_of(v2))
    add_golden(v3, golden_of(v3, shift=1e-4, atol=1e-3, rtol=0.0))  # within its own tolerance
    assert (await ask(server_config.control_socket, load_request(v2)))["ok"]
    reply = await client.post("/v1/reload?target_version=v3", headers=ADMIN)  # path: its dir
    assert reply.status == 200, await reply.text()


@pytest.mark.parametrize("over", ["socket", "http"])
async def test_a_golden_mismatch_is_refused_and_the_old_version_serves(
    client: TestClient, model_server: ModelServer, repo, server_config, over: str
) -> None:
    v2 = repo[1]["v2"]
    add_golden(v2, golden_of(v2, shift=0.5))
    if over == "socket":
        answer = await ask(server_config.control_socket, load_request(v2))
        assert not answer["ok"]
        code, error = answer["code"], answer["error"]
    else:
        response = await client.post("/v1/reload?target_version=v2", headers=ADMIN)
        assert response.status == 422
        body = await response.json()
        code, error = body["code"], body["error"]
    assert code == "golden_mismatch"
    assert "mlp:v2 fails its golden set: output 'output' differs by up to 0.5" in error
    assert "at [2, 1]" in error and "1 of 20 values outside" in error
    slot = model_server.manager.slot("mlp")
    assert slot.current.version == "v1" and [v.version for v in slot.loaded()] == ["v1"]  # type: ignore[union-attr]
    assert sample(await metrics(client), "model_server_reload_failure_total", model="mlp",
                  reason="golden_mismatch") == 1  # fmt: skip


async def test_a_golden_set_that_does_not_match_its_manifest_is_refused(
    client: TestClient, model_server: ModelServer, repo, server_config
) -> None:
    sock = server_config.control_socket
    v2 = repo[1]["v2"]
    good = golden_of(v2)
    add_golden(v2, good, named=golden_of(v2, shift=1.0))  # the manifest names other bytes
    answer = await ask(sock, load_request(v2))
    assert (answer["ok"], answer["code"]) == (False, "load_refused"), answer
    assert "golden.npz has" in answer["error"] and "its manifest says" in answer["error"]
    (v2.path.parent / canary.GOLDEN_FILE).unlink()
    answer = await ask(sock, load_request(v2))
    assert answer["code"] == "load_refused" and "does not exist" in answer["error"]
    wrong_input = golden_npz({"x": GOLDEN_X}, {OUTPUT_NAME: v2.expected(GOLDEN_X)})
    add_golden(v2, wrong_input)
    answer = await ask(sock, load_request(v2))
    assert answer["code"] == "load_refused" and "the model takes ['input']" in answer["error"]
    add_golden(v2, b"not an npz")
    answer = await ask(sock, load_request(v2))
    assert answer["code"] == "load_refused" and "not a readable .npz" in answer["error"]
    assert model_server.manager.slot("mlp").current.version == "v1"  # type: ignore[union-attr]
    add_golden(v2, good)  # and with the right file, it loads
    assert (await ask(sock, load_request(v2)))["ok"]


async def test_a_golden_set_of_a_manifest_for_other_bytes_is_refused(
    client: TestClient, repo, server_config, tmp_path: Path
) -> None:
    """An announced file whose directory's manifest describes another model file: its
    golden set is not this file's, so the load is refused rather than judged by it."""
    v2 = repo[1]["v2"]
    add_golden(v2, golden_of(v2))
    other = add_version(tmp_path / "other", "mlp", "v2", seed=7)
    v2.path.write_bytes(other.path.read_bytes())
    answer = await ask(server_config.control_socket, {**load_request(v2), "sha256": other.sha256})
    assert answer["code"] == "load_refused" and "describes another model file" in answer["error"]
