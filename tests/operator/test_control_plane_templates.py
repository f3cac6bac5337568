"""A change of the server image on a real API server (issue 32): a staged rollout of the
pod template, canary then batches, between two Deployments, never with fewer ready pods
than asked for; rolled back by editing the image back, which reuses the old Deployment
(on the kubelet stand-in, the sidecars' reports faked)."""

from __future__ import annotations

from typing import Any

from model_operator.manifests import template_digest
from model_operator.spec import parse_spec
from model_rollout_contract.annotations import PROMOTE
from model_rollout_e2e.control_plane import ControlPlane
from tests.support.control_plane_operator import (
    Operator,
    ReportingSidecars,
    get,
    model_deployment,
    settled_on,
    wait_for,
)


def _md(control_plane: ControlPlane, namespace: str) -> dict[str, Any]:
    return get(control_plane.kubectl, "md", "mlp", "-n", namespace) or {}


def _status(control_plane: ControlPlane, namespace: str) -> dict[str, Any]:
    return dict(_md(control_plane, namespace).get("status") or {})


class Watched:
    """What each poll saw: the servers' images of the pods that are ready."""

    def __init__(self, control_plane: ControlPlane, namespace: str) -> None:
        self.control_plane, self.namespace = control_plane, namespace
        self.ready_counts: list[int] = []

    def images(self) -> dict[str, str]:
        pods = self.control_plane.kubectl.get("pods", "-n", self.namespace)["items"]
        ready = {
            p["metadata"]["name"]: next(
                c["image"] for c in p["spec"]["containers"] if c["name"] == "server"
            )
            for p in pods
            if not p["metadata"].get("deletionTimestamp")
            and any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in (p.get("status") or {}).get("conditions") or []
            )
        }
        self.ready_counts.append(len(ready))
        return ready

    def rollout(self) -> dict[str, Any]:
        self.images()
        return dict(_status(self.control_plane, self.namespace).get("templateRollout") or {})

    def held(self) -> dict[str, Any] | None:
        rollout = self.rollout()
        status = _status(self.control_plane, self.namespace)
        reasons = {c["type"]: c["reason"] for c in status.get("conditions") or []}
        waiting = rollout.get("stage") == "canary" and reasons["Progressing"] == "AwaitingPromotion"
        return rollout if waiting else None

    def on(self, image: str, deployment: str) -> bool:
        status = _status(self.control_plane, self.namespace)
        images = self.images()
        return (
            status.get("templateRollout") is None
            and (status.get("template") or {}).get("deployment") == deployment
            and sorted(images.values()) == [image] * 4
            and status.get("phase") == "Available"
        )


def test_an_image_change_is_a_staged_rollout_and_an_edit_back_rolls_it_back(
    control_plane: ControlPlane, namespace: str, node_agent: Any, operator: Operator
) -> None:
    admin = control_plane.kubectl
    sidecars = ReportingSidecars(control_plane, namespace, "v1").start()
    watched = Watched(control_plane, namespace)
    body = model_deployment(
        namespace, replicas=4, store={"url": "s3://models/resnet50"},
        canary={"percent": 25, "manualPromote": True}, rollout={"batchSize": 2},
    )  # fmt: skip
    try:
        admin.apply(body)
        settled = lambda: settled_on(_status(control_plane, namespace), "v1", 4)  # noqa: E731
        wait_for("v1 everywhere", settled, operator)
        old_image = body["spec"]["image"]
        new_image = f"{old_image}-next"
        changed = {**body["spec"], "image": new_image}
        digest = template_digest("mlp", namespace, parse_spec(changed))
        new_deployment = f"mlp-{digest[:10]}"
        admin("patch", "md", "mlp", "-n", namespace, "--type=merge", "-p",
              f'{{"spec": {{"image": "{new_image}"}}}}')  # fmt: skip

        held = wait_for("the canary of the new template held", watched.held, operator)
        assert held["kind"] == "template" and held["to"]["deployment"] == new_deployment
        images = watched.images()
        assert sorted(images.values()) == [old_image] * 3 + [new_image]
        replicas = {
            name: (get(admin, "deployment", name, "-n", namespace) or {})["spec"]["replicas"]
            for name in ("mlp", new_deployment)
        }
        assert replicas == {"mlp": 3, new_deployment: 1}
        assert _status(control_plane, namespace)["phase"] == "Canary"

        admin("annotate", "md", "mlp", "-n", namespace, f"{PROMOTE}={held['promoteWith']}")
        wait_for("every pod on the new image",
                 lambda: watched.on(new_image, new_deployment), operator)  # fmt: skip
        assert (get(admin, "deployment", "mlp", "-n", namespace) or {})["spec"]["replicas"] == 0
        assert PROMOTE not in (_md(control_plane, namespace)["metadata"].get("annotations") or {})

        admin("patch", "md", "mlp", "-n", namespace, "--type=merge", "-p",
              f'{{"spec": {{"image": "{old_image}"}}}}')  # fmt: skip
        back = wait_for("the canary of the old template held", watched.held, operator)
        assert back["to"]["deployment"] == "mlp"  # the old Deployment, reused
        admin("annotate", "md", "mlp", "-n", namespace, f"{PROMOTE}={back['promoteWith']}")
        wait_for("every pod back on the old image", lambda: watched.on(old_image, "mlp"), operator)
        assert min(watched.ready_counts) >= 4, watched.ready_counts  # never fewer ready
        assert _status(control_plane, namespace)["versions"] == {"v1": 4}
    finally:
        sidecars.stop()
