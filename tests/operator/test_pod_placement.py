"""Where the pods run and what they ask for (issue 32, item 1): ``spec.pod`` rendered into
the pod template, resources for every container (defaults for the sidecars and init
containers, the GPU's resource name), the operator's own labels and annotations kept
its own, what the spec drops removed from the live children, and a pod the scheduler
cannot place as a condition that says why. On a real scheduler:
``test_control_plane_placement.py``."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kopf
import kubernetes_validate
import pytest
import yaml

from model_operator import cluster, handlers
from model_operator.config import OperatorConfig
from model_operator.manifests import (
    ACCOUNT_DIGEST,
    SPEC_KEYS,
    TEMPLATE_DIGEST,
    children,
    deployment,
    digest,
    labels,
    pod_rbac,
    template_digest,
)
from model_operator.placement import OPERATOR_LABELS, OWN_PREFIX
from model_operator.pods import PodView, pod_view
from model_operator.spec import SpecError, parse_spec
from model_operator.status import schedulable_condition
from model_rollout_contract import defaults
from tests.support.crd_validation import ResourceSchema

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "deploy" / "crds" / "modeldeployment.yaml"
SCHEMA = ResourceSchema.load(CRD)
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}]}
            ]
        }
    }
}
POD = {
    "nodeSelector": {"node.example.com/pool": "gpu"},
    "tolerations": [GPU_TOLERATION],
    "affinity": AFFINITY,
    "topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
         "whenUnsatisfiable": "ScheduleAnyway"},
    ],
    "priorityClassName": "serving-high",
    "runtimeClassName": "nvidia",
    "imagePullSecrets": [{"name": "registry"}],
    "labels": {"team": "vision", "example.com/tier": "gold"},
    "annotations": {"prometheus.io/scrape": "true"},
    "serviceAccountAnnotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/models"},
}  # fmt: skip


def example(**changes: Any) -> dict[str, Any]:
    [doc] = yaml.safe_load_all((ROOT / "examples" / "modeldeployment.yaml").read_text())
    doc["spec"].update(copy.deepcopy(changes))
    return dict(doc)


def pod_spec(**changes: Any) -> dict[str, Any]:
    spec = parse_spec(example(**changes)["spec"])
    return dict(deployment("resnet", "ml", spec)["spec"]["template"])


def containers(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = template["spec"]
    return {c["name"]: c for c in [*spec["initContainers"], *spec["containers"]]}


def test_spec_pod_reaches_the_pod_template() -> None:
    template = pod_spec(pod=POD)
    spec = template["spec"]
    assert spec["nodeSelector"] == POD["nodeSelector"]
    assert spec["tolerations"] == [GPU_TOLERATION]
    assert spec["affinity"] == AFFINITY
    assert (spec["priorityClassName"], spec["runtimeClassName"]) == ("serving-high", "nvidia")
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    # a spread constraint without a labelSelector counts this deployment's pods
    [spread] = spec["topologySpreadConstraints"]
    assert spread["labelSelector"] == {
        "matchLabels": {"serving.model-rollout.io/deployment": "resnet"}
    }
    assert spread["topologyKey"] == "topology.kubernetes.io/zone"
    meta = template["metadata"]
    assert meta["labels"]["team"] == "vision" and meta["labels"]["example.com/tier"] == "gold"
    assert meta["labels"]["serving.model-rollout.io/deployment"] == "resnet"  # still there
    assert meta["annotations"] == {
        "prometheus.io/scrape": "true",
        ACCOUNT_DIGEST: digest(POD["serviceAccountAnnotations"]),
    }
    spec_obj = parse_spec(example(pod=POD)["spec"])
    [account] = [o for o in pod_rbac("resnet", "ml", spec_obj) if o["kind"] == "ServiceAccount"]
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].endswith("models")


def test_the_placement_examples_children_are_valid_kubernetes_objects() -> None:
    [doc] = yaml.safe_load_all(
        (ROOT / "examples" / "modeldeployment-gpu-placement.yaml").read_text()
    )
    spec = parse_spec(doc["spec"])
    for obj in children("ranker", "ml-serving", spec, spec.version):
        kubernetes_validate.validate(obj, "1.37.0", strict=True)
    [deployment_] = [o for o in children("ranker", "ml", spec, "v1") if o["kind"] == "Deployment"]
    pod = deployment_["spec"]["template"]["spec"]
    assert pod["tolerations"] == doc["spec"]["pod"]["tolerations"]


def test_a_spec_without_pod_settings_writes_none_of_them() -> None:
    template = pod_spec()
    for key in ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints",
                "priorityClassName", "runtimeClassName", "imagePullSecrets"):  # fmt: skip
        assert key not in template["spec"], key
    assert "annotations" not in template["metadata"]


def test_every_container_has_resources_with_limits() -> None:
    """A namespace whose LimitRange or quota requires limits admits the pods: the server
    has the spec's, the sidecars and init containers the contract's defaults."""
    tenants = {
        "secretName": "t",
        "models": [{"name": "acme", "tenant": "acme", "model": "m", "version": "v1"}],
    }
    found = containers(pod_spec(tenants=tenants))
    assert set(found) == {"prefetch", "prefetch-acme", "server", "sidecar", "sidecar-acme"}
    default = {
        "requests": dict(defaults.SIDECAR_REQUESTS),
        "limits": dict(defaults.SIDECAR_LIMITS),
    }
    for name in ("prefetch", "prefetch-acme", "sidecar", "sidecar-acme"):
        assert found[name]["resources"] == default, name
    server = found["server"]["resources"]
    assert server["limits"] == {"nvidia.com/gpu": 1, "memory": "16Gi"}  # the example's
    assert server["requests"] == {"memory": "16Gi"}


def test_the_sidecars_and_init_containers_resources_replace_the_default_whole() -> None:
    sidecar = {"limits": {"cpu": "2", "memory": "1Gi"}}
    prefetch = {"requests": {"cpu": "1"}, "limits": {"cpu": "4", "memory": "2Gi"}}
    found = containers(
        pod_spec(resources={"gpu": 1, "memory": "16Gi", "sidecar": sidecar, "prefetch": prefetch})
    )
    assert found["sidecar"]["resources"] == sidecar
    assert found["prefetch"]["resources"] == prefetch


@pytest.mark.parametrize(
    ("resources", "limits"),
    [
        ({"gpu": 2}, {"nvidia.com/gpu": 2}),
        ({"gpu": 1, "gpuResource": "nvidia.com/mig-1g.10gb"}, {"nvidia.com/mig-1g.10gb": 1}),
        ({"gpu": 0, "gpuResource": "nvidia.com/mig-1g.10gb"}, None),
    ],
)
def test_the_gpu_count_and_resource_name_are_the_specs(
    resources: dict[str, Any], limits: dict[str, Any] | None
) -> None:
    server = containers(pod_spec(resources=resources))["server"]["resources"]
    assert server.get("limits") == limits


REFUSED = {
    "an operator label": (
        {"pod": {"labels": {"serving.model-rollout.io/deployment": "other"}}},
        "spec.pod.labels may not set the operator's own labels",
    ),
    "the managed-by label": (
        {"pod": {"labels": {"app.kubernetes.io/managed-by": "me"}}},
        "spec.pod.labels may not set the operator's own labels",
    ),
    "an operator annotation": (
        {"pod": {"annotations": {"serving.model-rollout.io/target-version": "v9"}}},
        "spec.pod.annotations may not set the operator's own annotations",
    ),
    "an account annotation in the operator's domain": (
        {"pod": {"serviceAccountAnnotations": {"serving.model-rollout.io/x": "y"}}},
        "spec.pod.serviceAccountAnnotations may not set the operator's own annotations",
    ),
    "a label key with a space": (
        {"pod": {"labels": {"bad key": "x"}}},
        "spec.pod.labels: keys must be qualified names",
    ),
    "a GPU in kubernetes.io": (
        {"resources": {"gpuResource": "kubernetes.io/gpu"}},
        "spec.resources.gpuResource must be an extended resource",
    ),
}


@pytest.mark.parametrize(
    ("node_selector", "words"),
    [
        ({"pool": "gpu a100"}, "spec.pod.nodeSelector: values must be label values"),
        ({"bad key": "gpu"}, "spec.pod.nodeSelector: keys must be qualified names"),
    ],
)
def test_a_node_selector_that_is_no_label_selection_is_refused_naming_it(
    node_selector: dict[str, str], words: str
) -> None:
    """The CRD takes the core type's schema (any strings); the Deployment would be
    refused in the middle of a pass (ApiRefused, every rollout step held) in words about
    spec.template: the operator says it as for spec.pod.labels."""
    with pytest.raises(SpecError) as caught:
        parse_spec(example(pod={"nodeSelector": node_selector})["spec"])
    assert any(words in p for p in caught.value.problems), caught.value.problems


@pytest.mark.parametrize("case", REFUSED.values(), ids=REFUSED.keys())
def test_the_operators_own_names_are_refused_by_both_sides(case: tuple[dict, str]) -> None:
    change, words = case
    doc = example(**change)
    refusal = SCHEMA.problems(doc)
    assert refusal and words in refusal[0], refusal
    with pytest.raises(SpecError) as caught:
        parse_spec(doc["spec"])
    assert any(words in p for p in caught.value.problems), caught.value.problems


def test_the_operators_labels_are_the_ones_refused() -> None:
    spec = parse_spec(example()["spec"])
    for key in labels("resnet", spec):
        assert key.startswith(OWN_PREFIX) or key in OPERATOR_LABELS, key


def _live(obj: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(obj)


def _patch(obj: dict[str, Any]) -> dict[str, Any]:
    """What cluster.apply sends before the removals (metadata and the mutable fields)."""
    meta = obj["metadata"]
    patch: dict[str, Any] = {
        "metadata": {k: meta[k] for k in ("labels", "annotations") if k in meta}
    }
    patch.update({k: obj[k] for k in ("spec",) if k in obj})
    return patch


def _deployment(**changes: Any) -> dict[str, Any]:
    return deployment("resnet", "ml", parse_spec(example(**changes)["spec"]))


def test_what_the_spec_drops_is_removed_from_the_live_deployment() -> None:
    """A merge patch alone only adds: a node selector key, an affinity rule, a label or an
    annotation the spec no longer gives would stay on the Deployment (and its pods)."""
    live = _live(_deployment(pod=POD))
    live["spec"]["template"]["metadata"].setdefault("annotations", {})[
        "kubectl.kubernetes.io/restartedAt"
    ] = "2026-12-06T09:00:00Z"  # kubectl rollout restart's: not the operator's
    changed = {**POD, "nodeSelector": {"node.example.com/pool": "h100"}, "labels": {"team": "x"}}
    del changed["affinity"], changed["annotations"]
    patch = cluster.with_removals(live, _patch(_deployment(pod=changed)), "Deployment")
    template = patch["spec"]["template"]
    assert template["spec"]["nodeSelector"] == {"node.example.com/pool": "h100"}
    assert template["spec"]["affinity"] is None
    assert template["metadata"]["labels"]["example.com/tier"] is None
    assert template["metadata"]["labels"]["team"] == "x"
    annotations = template["metadata"]["annotations"]
    mine = {k: v for k, v in annotations.items() if k != ACCOUNT_DIGEST}
    assert mine == {"prometheus.io/scrape": None}  # restartedAt left alone
    assert not cluster._contains(live, patch)
    # applied, the next pass finds nothing to change
    applied = _merge(live, patch)
    again = cluster.with_removals(applied, _patch(_deployment(pod=changed)), "Deployment")
    assert cluster._contains(applied, again)


def test_account_annotations_the_spec_drops_are_removed() -> None:
    spec = parse_spec(example(pod=POD)["spec"])
    [account] = [o for o in pod_rbac("resnet", "ml", spec) if o["kind"] == "ServiceAccount"]
    live = _live(account)
    live["metadata"]["annotations"]["other.example.com/keep"] = "yes"
    plain = parse_spec(example()["spec"])
    [now] = [o for o in pod_rbac("resnet", "ml", plain) if o["kind"] == "ServiceAccount"]
    patch = cluster.with_removals(live, _patch(now), "ServiceAccount")
    annotations = patch["metadata"]["annotations"]
    assert annotations["eks.amazonaws.com/role-arn"] is None
    assert "other.example.com/keep" not in annotations and SPEC_KEYS in annotations


def _merge(live: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies a merge patch."""
    if not isinstance(patch, dict):
        return patch
    out = dict(live) if isinstance(live, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(out.get(key), value)
    return out


UNSCHEDULABLE = {
    "type": "PodScheduled",
    "status": "False",
    "reason": "Unschedulable",
    "message": "0/2 nodes are available: 1 node(s) didn't match Pod's node affinity/selector,"
    " 1 node(s) had untolerated taint(s).",
}


def test_a_pod_the_scheduler_cannot_place_is_a_condition_that_says_why() -> None:
    pending = pod_view({"metadata": {"name": "mlp-a"}, "status": {"conditions": [UNSCHEDULABLE]}})
    other = pod_view({"metadata": {"name": "mlp-b"}, "status": {"conditions": [UNSCHEDULABLE]}})
    placed = pod_view({
        "metadata": {"name": "mlp-c"},
        "status": {"conditions": [{"type": "PodScheduled", "status": "True"}]},
    })  # fmt: skip
    assert placed.unscheduled is None
    condition = schedulable_condition([pending, other, placed], 100.0, [])
    assert (condition["type"], condition["status"], condition["reason"]) == (
        "PodsSchedulable", "False", "Unschedulable",
    )  # fmt: skip
    assert condition["message"] == (
        f"pod mlp-a cannot be scheduled: {UNSCHEDULABLE['message']} (and 1 more pods)"
    )
    fine = schedulable_condition([placed, PodView("mlp-d")], 100.0, [condition])
    assert (fine["status"], fine["reason"]) == ("True", "Scheduled")
    # a tenant track's view of the pod keeps it
    from model_rollout_contract.tracks import track_keys

    assert pending.of_track(track_keys("acme")).unscheduled == pending.unscheduled


def test_placement_another_tool_wrote_is_left_alone_and_costs_no_write() -> None:
    """A mutating webhook on Deployments (Kyverno's pod policies are applied to pod
    templates too) that adds image pull secrets or tolerations re-adds them on every
    update: removing what the spec never gave would fight it with a write on each pass.
    What the spec gave and dropped is still removed."""
    live = _live(_deployment())
    webhook = {"imagePullSecrets": [{"name": "mirror"}], "tolerations": [GPU_TOLERATION]}
    live["spec"]["template"]["spec"].update(copy.deepcopy(webhook))
    patch = cluster.with_removals(live, _patch(_deployment()), "Deployment")
    assert "imagePullSecrets" not in patch["spec"]["template"]["spec"]
    assert cluster._contains(live, patch)
    given = _live(_deployment(pod={"tolerations": [GPU_TOLERATION]}))
    patch = cluster.with_removals(given, _patch(_deployment()), "Deployment")
    assert patch["spec"]["template"]["spec"]["tolerations"] is None


class _LiveDeployment:
    """One Deployment the resource owns, as :func:`cluster.apply` reads and patches it."""

    def __init__(self, live: dict[str, Any]) -> None:
        self.live, self.patches = live, []  # type: list[dict[str, Any]]

    async def request(self, method: str, path: str, body: Any = None, *_: Any) -> Any:
        assert method == "GET", method
        return self.live

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> Any:
        self.patches.append(patch)
        return self.live


def _stamped(**changes: Any) -> dict[str, Any]:
    """The Deployment as the operator applies it: stamped with its template's digest."""
    spec = parse_spec(example(**changes)["spec"])
    body = deployment("resnet", "ml", spec)
    body["metadata"]["annotations"][TEMPLATE_DIGEST] = template_digest("resnet", "ml", spec)
    body["metadata"]["ownerReferences"] = [{"controller": True, "uid": "md-uid"}]
    return body


async def test_a_webhooks_addition_to_a_list_the_spec_gives_is_left_alone() -> None:
    """The spec gives a toleration and a GPU operator's webhook appends its own to the
    Deployment's template: the lists differ on every pass, and each write would take the
    webhook's away for the webhook to add it back. The template the operator rendered is
    unchanged (its stamped digest): nothing is written. A real change still is."""
    spot = {"key": "spot", "operator": "Exists", "effect": "NoSchedule"}
    live = _live(_stamped(pod={"tolerations": [GPU_TOLERATION]}))
    live["spec"]["template"]["spec"]["tolerations"].append(spot)  # the webhook's
    api = _LiveDeployment(live)
    again = _stamped(pod={"tolerations": [GPU_TOLERATION]})
    assert await cluster.apply(api, again) is cluster.ApplyResult.UNCHANGED  # type: ignore[arg-type]
    assert api.patches == []
    changed = _stamped(image="server:2", pod={"tolerations": [GPU_TOLERATION]})
    assert await cluster.apply(api, changed) is cluster.ApplyResult.UPDATED  # type: ignore[arg-type]
    [patch] = api.patches
    assert patch["spec"]["template"]["spec"]["containers"][0]["image"] == "server:2"
    scaled = _stamped(replicas=7, pod={"tolerations": [GPU_TOLERATION]})
    api.patches.clear()
    assert await cluster.apply(api, scaled) is cluster.ApplyResult.UPDATED  # type: ignore[arg-type]
    assert "template" not in api.patches[0]["spec"] and api.patches[0]["spec"]["replicas"] == 7


async def test_a_hand_edit_of_the_live_template_is_repaired_though_the_stamp_stayed() -> None:
    """``kubectl edit`` of the Deployment's image (or a toleration taken away) keeps the
    stamped digest: the pods must still go back to the spec's template, as any drift does;
    only what another tool added to the template is left alone."""
    live = _live(_stamped(pod={"tolerations": [GPU_TOLERATION]}))
    live["spec"]["template"]["spec"]["containers"][0]["image"] = "server:hand-edited"
    api = _LiveDeployment(live)
    again = _stamped(pod={"tolerations": [GPU_TOLERATION]})
    assert await cluster.apply(api, again) is cluster.ApplyResult.UPDATED  # type: ignore[arg-type]
    [patch] = api.patches
    image = patch["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == again["spec"]["template"]["spec"]["containers"][0]["image"]
    removed = _live(again)
    removed["spec"]["template"]["spec"]["tolerations"] = []
    api = _LiveDeployment(removed)
    assert await cluster.apply(api, again) is cluster.ApplyResult.UPDATED  # type: ignore[arg-type]
    assert api.patches[0]["spec"]["template"]["spec"]["tolerations"] == [GPU_TOLERATION]


def test_a_pod_affinity_term_without_a_label_selector_counts_this_deployments_pods() -> None:
    """Kubernetes matches a pod affinity term without a labelSelector with no pod at all:
    the docs' one-pod-per-node anti-affinity would do nothing. As a topology spread
    constraint, such a term gets the pods' selector; one with its own keeps it."""
    term = {"topologyKey": "kubernetes.io/hostname"}
    own = {"topologyKey": "zone", "labelSelector": {"matchLabels": {"app": "cache"}}}
    affinity = {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 100, "podAffinityTerm": term}
            ],
            "requiredDuringSchedulingIgnoredDuringExecution": [term, own],
        },
        "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]},
    }
    rendered = pod_spec(pod={"affinity": affinity})["spec"]["affinity"]
    mine = {"matchLabels": {"serving.model-rollout.io/deployment": "resnet"}}
    anti = rendered["podAntiAffinity"]
    [preferred] = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred["podAffinityTerm"] == {**term, "labelSelector": mine}
    assert anti["requiredDuringSchedulingIgnoredDuringExecution"] == [
        {**term, "labelSelector": mine},
        own,
    ]
    [near] = rendered["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert near == {**term, "labelSelector": mine}
    assert affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0] == term


@pytest.mark.parametrize(
    ("container", "given", "words"),
    [
        ("sidecar", {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}},
         "spec.resources.sidecar.requests.cpu (2) exceeds its limit (1)"),
        ("prefetch", {"requests": {"memory": "1Gi"}, "limits": {"memory": "512Mi"}},
         "spec.resources.prefetch.requests.memory (1Gi) exceeds its limit (512Mi)"),
    ],
)  # fmt: skip
def test_a_request_above_its_limit_is_refused_naming_the_field(
    container: str, given: dict[str, Any], words: str
) -> None:
    """The Deployment would be refused (``spec.template.spec.containers[1].resources
    .requests: Invalid value``), a message that names neither the ModelDeployment's field
    nor which container: the operator says which, as for its other checks."""
    doc = example(resources={"gpu": 1, "memory": "16Gi", container: given})
    with pytest.raises(SpecError) as caught:
        parse_spec(doc["spec"])
    assert any(words in p for p in caught.value.problems), caught.value.problems
    fine = {"requests": {"cpu": "500m"}, "limits": {"cpu": "1", "memory": "1Gi"}}
    parse_spec(example(resources={"gpu": 1, container: fine})["spec"])


def test_a_node_selector_key_another_tool_added_is_left_alone() -> None:
    """The node selector is a map the spec shares, as the template's labels: the keys the
    spec drops are removed, another tool's (a webhook's architecture key) never."""
    two = {"node.example.com/pool": "gpu", "node.example.com/zone": "a"}
    live = _live(_deployment(pod={"nodeSelector": two}))
    live["spec"]["template"]["spec"]["nodeSelector"]["kubernetes.io/arch"] = "amd64"
    same = cluster.with_removals(live, _patch(_deployment(pod={"nodeSelector": two})), "Deployment")
    assert cluster._contains(live, same)
    one = _patch(_deployment(pod={"nodeSelector": {"node.example.com/pool": "gpu"}}))
    patch = cluster.with_removals(live, one, "Deployment")
    assert patch["spec"]["template"]["spec"]["nodeSelector"] == {
        "node.example.com/pool": "gpu",
        "node.example.com/zone": None,
    }


def test_a_spec_that_drops_every_pod_setting_removes_them_all() -> None:
    live = _live(_deployment(pod=POD))
    patch = cluster.with_removals(live, _patch(_deployment()), "Deployment")
    template = patch["spec"]["template"]
    for key in ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints",
                "priorityClassName", "runtimeClassName", "imagePullSecrets"):  # fmt: skip
        assert template["spec"][key] is None, key
    applied = _merge(live, patch)
    again = cluster.with_removals(applied, _patch(_deployment()), "Deployment")
    assert cluster._contains(applied, again)


FAILED_CREATE = {
    "type": "ReplicaFailure",
    "status": "True",
    "reason": "FailedCreate",
    "message": 'pods "resnet-7f9c-x2k" is forbidden: no PriorityClass with name serving-hgih'
    " was found",
}


class _Deployments:
    """The one GET :func:`cluster.pods_refused` makes."""

    def __init__(self, conditions: list[dict[str, Any]], owner: str = "md-uid") -> None:
        self.conditions = conditions
        self.owner = owner
        self.paths: list[str] = []

    async def request(self, method: str, path: str, *_: Any) -> Any:
        self.paths.append(f"{method} {path}")
        refs = [{"controller": True, "uid": self.owner}]
        return {"metadata": {"ownerReferences": refs}, "status": {"conditions": self.conditions}}


async def test_pods_the_api_server_refuses_to_create_are_a_condition_that_says_why() -> None:
    """A priority class that does not exist, a quota, an admission webhook: the ReplicaSet
    creates no pod, so no pod waits for a node and PodsSchedulable said all was well.
    The Deployment's ReplicaFailure condition says why: it is the condition's."""
    api = _Deployments([{"type": "Available", "status": "False"}, FAILED_CREATE])
    refused = await cluster.pods_refused(api, "ml", "resnet", "md-uid")  # type: ignore[arg-type]
    assert api.paths == ["GET /apis/apps/v1/namespaces/ml/deployments/resnet"]
    assert refused == FAILED_CREATE["message"]
    condition = schedulable_condition([], 100.0, [], refused=refused)
    assert (condition["status"], condition["reason"]) == ("False", "FailedCreate")
    assert condition["message"] == f"pods cannot be created: {FAILED_CREATE['message']}"
    healed = _Deployments([{**FAILED_CREATE, "status": "False"}])
    assert await cluster.pods_refused(healed, "ml", "resnet", "md-uid") is None  # type: ignore[arg-type]
    foreign = _Deployments([FAILED_CREATE], owner="another-tools-uid")  # same name, not ours
    assert await cluster.pods_refused(foreign, "ml", "resnet", "md-uid") is None  # type: ignore[arg-type]


def test_a_new_account_role_replaces_the_pods() -> None:
    """IRSA's webhook writes the role (AWS_ROLE_ARN) into a pod when it is created: a new
    role-arn on the ServiceAccount alone leaves every running pod on the old role, and
    the pods a scaler adds on the new one. The template carries the account's
    annotations' digest, so the pods are replaced as for any other spec.pod change; a
    spec without them writes none (and one that drops them removes it)."""
    role = "eks.amazonaws.com/role-arn"
    one = _deployment(pod={"serviceAccountAnnotations": {role: "arn:aws:iam::1:role/a"}})
    two = _deployment(pod={"serviceAccountAnnotations": {role: "arn:aws:iam::1:role/b"}})
    assert one["spec"]["template"] != two["spec"]["template"]
    assert "annotations" not in _deployment()["spec"]["template"]["metadata"]
    patch = cluster.with_removals(_live(one), _patch(_deployment()), "Deployment")
    [(key, removed)] = patch["spec"]["template"]["metadata"]["annotations"].items()
    assert key.startswith(OWN_PREFIX) and removed is None


class _Cluster:
    """Objects by path for one whole pass (:func:`handlers.reconcile_pass`): created,
    patched and read back; the Deployment ``refused`` says its pods are refused."""

    def __init__(self, deployment_path: str, uid: str) -> None:
        refs = [{"controller": True, "uid": uid}]
        self.objects: dict[str, Any] = {
            deployment_path: {
                "metadata": {"name": "resnet", "ownerReferences": refs},
                "status": {"conditions": [FAILED_CREATE]},
            }
        }

    async def request(self, method: str, path: str, body: Any = None, *_: Any) -> Any:
        if method == "POST":
            self.objects[f"{path}/{body['metadata'].get('name')}"] = body
            return body
        return self.objects.get(path) if method == "GET" else {}

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> Any:
        return self.objects.get(path)


async def test_pods_the_api_server_refuses_are_said_in_every_tenant_tracks_entry() -> None:
    """The pods are every track's: a refusal the resource's PodsSchedulable says
    (FailedCreate) is in each tenant model's entry too, not Scheduled there."""
    raw = {
        "model": "resnet", "version": "v1", "image": "server:1", "replicas": 2,
        "store": {"pvc": "models"}, "allowUnsigned": True,
        "tenants": {"secretName": "tenants", "models": [
            {"name": "acme-mlp", "tenant": "acme", "model": "mlp", "version": "a1"},
            {"name": "globex-mlp", "tenant": "globex", "model": "mlp", "version": "g1"},
        ]},
    }  # fmt: skip
    meta = {"name": "resnet", "namespace": "ml", "uid": "md-uid", "generation": 1}
    body = {"apiVersion": "serving.model-rollout.io/v1alpha1", "kind": "ModelDeployment",
            "metadata": meta, "spec": raw}  # fmt: skip
    api = _Cluster("/apis/apps/v1/namespaces/ml/deployments/resnet", "md-uid")
    memo = SimpleNamespace(config=OperatorConfig(check_store=False), api=api)
    logger = kopf.ObjectLogger(body=kopf.Body(body), settings=kopf.OperatorSettings())
    passed = await handlers.reconcile_pass(
        kopf.Body(body),
        {},
        "resnet",
        "ml",
        [],
        memo,
        logger,  # type: ignore[arg-type]
    )

    def schedulable(status: dict[str, Any]) -> tuple[str, str, str]:
        [found] = [c for c in status["conditions"] if c["type"] == "PodsSchedulable"]
        return found["status"], found["reason"], found["message"]

    refused = ("False", "FailedCreate", f"pods cannot be created: {FAILED_CREATE['message']}")
    assert schedulable(passed.status) == refused
    assert {t: schedulable(e) for t, e in passed.status["tenants"].items()} == {
        "acme-mlp": refused, "globex-mlp": refused,
    }  # fmt: skip
