"""``kubectl model pause``, ``resume`` and ``promote --full`` end to end on a real API
server: the real operator process, the tools run as a user bound to the chart's
rollout-editor role (the editor admission policy judging each patch), and simulated pods
(their sidecars' reports faked as the sidecar writes them), as ``test_day2_operator.py``
sets them up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model_rollout_contract.annotations import PROMOTE
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.simulated_sidecar import SimulatedModelContainers, model_store_claim
from tests.operator.test_day2_operator import (  # noqa: F401 - fixtures used by name
    REPLICAS,
    SIDECARS,
    WAIT,
    Day2,
    admin,
    available,
    awaiting_promotion,
    cluster,
    namespace,
    operator,
)
from tests.support.cli import EDITOR, Admin, bound_user
from tests.support.control_plane_operator import Operator, model_deployment


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


def held_by_pause(version: str) -> Any:
    def held(s: dict[str, Any]) -> bool:
        return (
            (s.get("rollout") or {}).get("toVersion") == version
            and condition(s, "Progressing").get("reason") == "Paused"
            and condition(s, "Paused").get("status") == "True"
        )

    return held


async def test_a_paused_rollout_waits_for_resume_and_promote_full_finishes_it(
    cluster: ControlPlane,  # noqa: F811
    namespace: str,  # noqa: F811
    admin: Admin,  # noqa: F811
    operator: Operator,  # noqa: F811
    node_agents: Any,
    tmp_path: Path,
) -> None:
    pods = node_agents(sidecars=SIDECARS).runtime
    assert isinstance(pods, SimulatedModelContainers)
    user = bound_user(cluster, namespace, "release-bot", EDITOR)
    day2 = Day2(admin, user, pods, operator, tmp_path)
    cluster.kubectl.apply(*model_store_claim(namespace))
    cluster.kubectl.apply(
        model_deployment(
            namespace, model="mlp", replicas=REPLICAS,
            canary={"percent": 50, "manualPromote": True},
            rollout={"batchSize": 1, "jitterSeconds": 600},
        )
    )  # fmt: skip
    await day2.wait("v1 available", available("v1"))

    code, out, err = await day2.plugin("pause", "mlp")
    assert code == 0 and "paused" in out, (out, err)
    status = await day2.wait("paused", lambda s: condition(s, "Paused").get("status") == "True")
    assert "no rollout is held now" in condition(status, "Paused")["message"]

    # a new version while paused: its rollout starts, and holds before its canary
    await admin.patch("mlp", {"spec": {"version": "v2"}})
    status = await day2.wait("v2 held by the pause", held_by_pause("v2"))
    assert status["phase"] == "Canary" and status["rollout"].get("pausedAt")
    assert day2.serving() == {"v1"} and status["versions"] == {"v1": REPLICAS}
    code, out, err = await day2.plugin("status", "mlp")
    assert code == 0 and "Canary (Paused)" in out and "Paused:      yes" in out, (out, err)

    code, out, err = await day2.plugin("resume", "mlp")
    assert code == 0, (out, err)
    await day2.wait("v2 held at its canary", awaiting_promotion("v2"))
    assert day2.serving() == {"v1", "v2"}

    # promote --full: no canary hold, no batches of 1 with 600 s of jitter between them
    code, out, err = await day2.plugin("promote", "mlp", "--full", "--wait", "--timeout", WAIT)
    assert code == 0 and "fully promoted" in out and "result: Succeeded" in out, (out, err)
    assert day2.serving() == {"v2"}
    status = await day2.status()
    assert status["rollout"]["full"] is True and status["currentVersion"] == "v2"
    assert condition(status, "Paused")["status"] == "False"
    reasons = [e.get("reason") for e in await admin.events()]
    for reason in ("RolloutPaused", "RolloutResumed", "FullyPromoted"):
        assert reasons.count(reason) == 1, reasons
    annotations = (await admin.read())["metadata"].get("annotations") or {}
    assert PROMOTE not in annotations, annotations  # cleared once used
    log = operator.log_path.read_text()
    assert "Traceback" not in log and "forbidden" not in log.lower(), log[-3000:]
