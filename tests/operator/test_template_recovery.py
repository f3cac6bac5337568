"""The stable pod template when the status names none (wiped, or restored from a backup
without it): read from the Deployments the resource owns (operator/model_operator/
template_recovery.py), so that the one holding every ready pod is not drained; and the
stable Deployment, which the spec no longer renders while another template rolls out
(or failed), created again from its snapshot when it is deleted."""

from __future__ import annotations

import random
from typing import Any

from model_operator.manifests import TEMPLATE_DIGEST, template_digest, template_label
from model_operator.pods import PodView
from model_operator.spec import ModelDeploymentSpec, parse_spec
from model_operator.template_pass import TemplatePass, plan_templates
from model_operator.template_recovery import inferred_stable, keep_stable
from model_operator.template_rollout import (
    CANARY,
    FAILED,
    TemplateRef,
    TemplateRollout,
    plan_template,
)

UID = "md-uid"


def spec() -> ModelDeploymentSpec:
    return parse_spec({
        "model": "mlp", "version": "v1", "image": "server:1", "replicas": 4,
        "store": {"pvc": "models"}, "allowUnsigned": True,
        "canary": {"percent": 25, "pauseSeconds": 60}, "rollout": {"batchSize": 1},
    })  # fmt: skip


class Deployments:
    """The GETs of the Deployments that could be the stable one: ``live`` by name, each
    with its stamped digest (``None``: none), owned by ``owner``."""

    def __init__(self, live: dict[str, str | None], owner: str = UID) -> None:
        self.live, self.owner = live, owner

    async def request(self, method: str, path: str, *_: Any) -> Any:
        name = path.rsplit("/", 1)[-1]
        if method != "GET" or name not in self.live:
            return None
        stamped = self.live[name]
        meta: dict[str, Any] = {"ownerReferences": [{"controller": True, "uid": self.owner}]}
        if stamped is not None:
            meta["annotations"] = {TEMPLATE_DIGEST: stamped}
        return {"metadata": meta}


def ready(count: int, template: str | None) -> list[PodView]:
    return [
        PodView(f"{template or 'first'}-{i}", ready=True, template=template) for i in range(count)
    ]


async def test_a_wiped_status_keeps_the_deployment_that_holds_the_ready_pods() -> None:
    """Every pod on mlp-<digest>, which runs the spec's template; the status lost
    ``template`` and ``currentVersion``: mlp-<digest> stays stable, nothing drains."""
    given = spec()
    digest = template_digest("mlp", "ml", given)
    own = f"mlp-{template_label(digest)}"
    api = Deployments({"mlp": None, own: None})
    pods = ready(4, template_label(digest))
    passed = await plan_templates(api, "mlp", "ml", given, {}, pods, None, UID)  # type: ignore[arg-type]
    assert passed.plan.stable == TemplateRef(own, digest)
    assert passed.plan.replicas == {own: 4} and passed.plan.draining == ()
    assert passed.plan.state is None and passed.rendered() == own


async def test_a_deployment_of_another_tool_is_never_taken_for_the_stable_one() -> None:
    given = spec()
    digest = template_digest("mlp", "ml", given)
    api = Deployments({f"mlp-{template_label(digest)}": digest}, owner="another-uid")
    passed = await plan_templates(api, "mlp", "ml", given, {}, [], None, UID)  # type: ignore[arg-type]
    assert passed.plan.stable == TemplateRef("mlp", digest)


def test_without_the_specs_template_the_deployment_with_most_ready_pods_is_stable() -> None:
    new, old, other = "n" * 16, "o" * 16, "p" * 16
    pods = ready(3, "oooooooooo") + ready(1, "pppppppppp")
    stamped = {"mlp": None, "mlp-oooooooooo": old, "mlp-pppppppppp": other}
    assert inferred_stable("mlp", new, stamped, pods) == TemplateRef("mlp-oooooooooo", old)
    # an older operator's, unstamped: known by its digest's head; the spec's rolls out
    unstamped = {"mlp": None, "mlp-oooooooooo": None}
    stable = inferred_stable("mlp", new, unstamped, pods)
    assert stable == TemplateRef("mlp-oooooooooo", "oooooooooo")
    plan = plan_template(
        "mlp", spec(), new, stable, None, None, pods, 0.0, random.Random(1), None, False
    )
    assert plan.state is not None and plan.state.stage == CANARY
    assert plan.replicas["mlp-oooooooooo"] == 4 and plan.state.target.digest == new
    # the first Deployment, unstamped (an upgrade): the spec's template, as before
    assert inferred_stable("mlp", new, {"mlp": None}, ready(2, None)) == TemplateRef("mlp", new)
    assert inferred_stable("mlp", new, {"mlp": None}, []) is None
    # a stamp that says it runs the spec's template wins a tie of ready pods, or none
    tie = pods + ready(3, None)
    assert inferred_stable("mlp", new, {**stamped, "mlp": new}, tie) == TemplateRef("mlp", new)
    assert inferred_stable("mlp", new, {**stamped, "mlp": new}, []) == TemplateRef("mlp", new)


async def test_a_wiped_status_mid_canary_keeps_the_serving_deployment_stable() -> None:
    """The status lost ``template`` while the spec's template was a canary (1 pod of 4)
    or had failed (its Deployment kept at 0 pods): the Deployment stamped with the spec's
    template is not taken for the stable one over the one serving every other ready pod,
    which would move all pods onto an unjudged (or failed) template with no canary."""
    given = spec()
    digest = template_digest("mlp", "ml", given)
    target = f"mlp-{template_label(digest)}"
    for canary in (1, 0):  # a canary running, a failed one drained
        api = Deployments({"mlp": "o" * 16, target: digest})
        pods = ready(4 - canary, None) + ready(canary, template_label(digest))
        passed = await plan_templates(api, "mlp", "ml", given, {}, pods, None, UID)  # type: ignore[arg-type]
        assert passed.plan.stable == TemplateRef("mlp", "o" * 16)
        assert passed.plan.state is not None and passed.plan.state.stage == CANARY
        assert passed.plan.replicas["mlp"] == 4 - canary


def test_the_rendered_deployment_carries_its_templates_digest() -> None:
    given = spec()
    digest = template_digest("mlp", "ml", given)
    plan = plan_template(
        "mlp", given, digest, None, None, None, [], 0.0, random.Random(1), None, False
    )
    body = TemplatePass("mlp", digest, plan).deployment("mlp", "ml", given)
    assert body["metadata"]["annotations"][TEMPLATE_DIGEST] == digest


class Recorded:
    """Deployments by name (``None``: gone), and what was created."""

    def __init__(self, live: dict[str, dict[str, Any] | None]) -> None:
        self.live, self.created = live, []  # type: list[dict[str, Any]]

    async def request(self, method: str, path: str, body: Any = None, *_: Any) -> Any:
        if method == "POST":
            self.created.append(body)
            self.live[body["metadata"]["name"]] = body
            return body
        return self.live.get(path.rsplit("/", 1)[-1])


def owned(body: dict[str, Any]) -> dict[str, Any]:
    body["metadata"]["ownerReferences"] = [{"controller": True, "uid": UID}]
    return body


async def test_a_stable_deployment_deleted_after_a_failed_rollout_is_created_again() -> None:
    """The rollout to mlp-bbbbbbbbbb failed: mlp serves, and the spec renders only the new
    template. mlp, deleted by hand, is created again from the snapshot the status kept
    of it, with every pod; the failed target is left to drain."""
    given = spec()
    new = template_digest("mlp", "ml", given)
    old = "a" * 16
    failed = TemplateRollout(
        TemplateRef("mlp", old), TemplateRef(f"mlp-{template_label(new)}", new), FAILED, 0.0, 0
    )
    plan = plan_template(
        "mlp", given, new, TemplateRef("mlp", old), None, failed, [], 9.0, random.Random(1),
        None, False,
    )  # fmt: skip
    rendered = TemplatePass("mlp", new, plan).rendered()
    assert rendered is None and plan.replicas["mlp"] == 4
    template = {"spec": {"containers": [{"name": "server", "image": "server:0"}]}}
    meta = {"name": "mlp", "annotations": {TEMPLATE_DIGEST: old, "x": "y"}}
    live = owned({"metadata": meta, "spec": {"replicas": 4, "template": template}})
    api = Recorded({"mlp": live})
    kept, again = await keep_stable(api, "ml", "mlp", given, plan, rendered, None, UID, owned)  # type: ignore[arg-type]
    assert not again and kept is not None and kept["deployment"] == "mlp"
    assert kept["annotations"] == {TEMPLATE_DIGEST: old}  # the operator's own only
    api.live["mlp"] = None  # kubectl delete deployment mlp
    kept, again = await keep_stable(api, "ml", "mlp", given, plan, rendered, kept, UID, owned)  # type: ignore[arg-type]
    assert again and kept is not None
    [created] = api.created
    assert created["metadata"]["name"] == "mlp" and created["spec"]["replicas"] == 4
    assert created["spec"]["template"] == live["spec"]["template"]
    assert created["metadata"]["annotations"][TEMPLATE_DIGEST] == old
    assert created["spec"]["selector"] == {
        "matchLabels": {"serving.model-rollout.io/deployment": "mlp"}
    }
    # rendered from the spec again (the rollout over): no snapshot is kept
    done = await keep_stable(api, "ml", "mlp", given, plan, "mlp", kept, UID, owned)  # type: ignore[arg-type]
    assert done == (None, False)
