"""The chart's opt-in ClusterRoles for the day-2 tools (templates/user-roles.yaml):
``<release>-viewer`` for ``kubectl model status`` / ``history``,
``<release>-rollout-editor`` for promote, abort, retry, rollback and ``model-rollout
release``, and ``<release>-owner`` for those who write the resource itself. They render,
validate (kubernetes-validate, a real API server's dry run, ``helm lint``) and aggregate
into the built-in view / edit / admin roles when asked; and they are what the README
says, as real RBAC: ServiceAccounts bound to them the way the README binds them, on the
session's real API server, run the real tools (every call they make recorded by a proxy
in front of the server, which forwards everything), succeed where the README says and
get the API server's 403 otherwise; the server's own authorizer
(SelfSubjectAccessReview) allows each role exactly the README's verbs, and every rule of
the tools' roles is one the tools use. The chart's editor admission policy
(``model_operator.editor_policy``, issue 29) keeps the editor to ``spec.version``,
``spec.paused`` and the rollout annotations on the same server, while the owner, the
operator and the garbage collector keep their writes."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from aiohttp import web
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config

import model_rollout_cli
from model_operator import cluster as operator_cluster
from model_operator import editor_policy
from model_operator.constants import KOPF_FINALIZER
from model_operator.errors import ApiError
from model_operator.kube_client import KubeClient, load_configuration
from model_rollout_cli import kube
from model_rollout_cli.errors import API_ERROR, OK, TIMED_OUT, CliError
from model_rollout_cli.kube import GROUP, PLURAL, VERSION, Cluster, KubeOptions
from model_rollout_contract.annotations import ABORT, CHANGE_CAUSE, PROMOTE, RETRY
from model_rollout_contract.tracks import track_keys
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.identities import Identity
from model_rollout_e2e.onnx_models import write_mlp
from model_rollout_e2e.processes import wait_until
from tests.support.cli import (
    CHART,
    EDITOR,
    EDITOR_POLICY_DENIAL,
    OWNER,
    USER_ROLES,
    VIEWER,
    Admin,
    api_ssl,
    bound_user,
    intercepting_proxy,
    kubeconfig_through,
    run_tool,
    user_roles,
)
from tests.support.control_plane_operator import install_chart, role_without
from tests.support.helm_chart import lint_chart
from tests.support.namespaces import namespace_of_its_own
from tests.support.sidecar import make_keys

K8S_VERSION = "1.37.0"  # as tests/deploy/test_manifests.py
ENABLED = USER_ROLES
AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-{}"
READ_VERBS = {"get", "list", "watch"}


@dataclass(frozen=True)
class Call:
    """One API request as RBAC sees it (verb, API group, resource, subresource)."""

    verb: str
    group: str
    resource: str
    subresource: str = ""

    @property
    def rbac_resource(self) -> str:
        """As kube.py's ``Cluster._call`` names it: ``modeldeployments.<group>``, ``pods``."""
        return f"{self.resource}.{self.group}" if self.group else self.resource


# Every request the tools send, by the method of cli/model_rollout_cli/kube.py's Cluster
# that sends it: Cluster is the tools' only way to the API (checked below), so a new call
# there fails test_the_table_is_every_call_cluster_makes until it has a row here.
READ_CALLS = {
    # custom.get_namespaced_custom_object: every command; status --watch redraws and
    # follow.follow (--wait, release --wait) poll it
    "Cluster.get": Call("get", GROUP, PLURAL),
    # core.list_namespaced_pod (label selector): status's pods per version
    "Cluster.pods": Call("list", "", "pods"),
    # core.list_namespaced_event (field selector): status's events
    "Cluster.events": Call("list", "", "events"),
    # custom.list_namespaced_custom_object (list -A: list_cluster_custom_object): list
    "Cluster.deployments": Call("list", GROUP, PLURAL),
}
WRITE_CALLS = {
    # custom.patch_namespaced_custom_object, a merge patch: the annotations of promote,
    # abort, retry; annotations and spec.version of rollback and release (patch_read)
    "Cluster.patch": Call("patch", GROUP, PLURAL),
}
# kubectl's: `kubectl get modeldeployments [-w]`, which anyone who may view a rollout
# expects to run too (its list is the tools' `list` too)
KUBECTL_READS = {Call("list", GROUP, PLURAL), Call("watch", GROUP, PLURAL)}
# Not a rule: Cluster._crd_served's discovery (GET /apis/<group>/<version>, after a 404)
# is a non-resource URL that every authenticated user may read (system:discovery).
GET, PODS, EVENTS, LIST = (
    READ_CALLS["Cluster.get"],
    READ_CALLS["Cluster.pods"],
    READ_CALLS["Cluster.events"],
    READ_CALLS["Cluster.deployments"],
)
PATCH = WRITE_CALLS["Cluster.patch"]
# kubectl scale md: the owner's only (docs/autoscaling.md)
SCALE = {Call(v, GROUP, PLURAL, "scale") for v in ("get", "update", "patch")}


def granted(role: dict[str, Any]) -> set[Call]:
    """Every (verb, group, resource) the role's rules name (none of them uses ``*``)."""
    calls = set()
    for rule in role["rules"]:
        for verb in rule["verbs"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    name, _, sub = resource.partition("/")
                    calls.add(Call(verb, group, name, sub))
    return calls


def request_call(method: str, path: str, query: Mapping[str, str]) -> Call | None:
    """The RBAC attributes the API server derives from a request (as its
    RequestInfoFactory); ``None`` for a non-resource URL (discovery)."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"]:
        group, rest = (parts[1] if len(parts) > 1 else ""), parts[3:]
    else:
        return None
    if not rest:
        return None
    if rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else None
    subresource = rest[2] if len(rest) > 2 else ""
    if method in ("GET", "HEAD"):
        verb = "get" if name else ("watch" if query.get("watch") in ("true", "1") else "list")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())
    return Call(verb, group, resource, subresource)


@dataclass
class Recorder:
    """What the tools sent through the proxy, as RBAC sees each request, and which of
    those the API server refused (403)."""

    seen: list[Call] = field(default_factory=list)
    denied: list[Call] = field(default_factory=list)

    def answered(self, request: web.Request, status: int) -> None:
        call = request_call(request.method, request.path, request.query)
        if call is None:  # discovery: a non-resource URL
            return
        self.seen.append(call)
        if status == 403:
            self.denied.append(call)


HISTORY_V1 = {
    "version": "v1",
    "startedAt": "2026-12-02T08:00:00Z",
    "finishedAt": "2026-12-02T08:01:00Z",
    "result": "Succeeded",
    "reason": "2/2 pods serve v1",
    "triggeredBy": "spec.version edit",
}
CANARY_HELD = {  # v2's canary waits for `kubectl model promote`
    "phase": "Canary",
    "currentVersion": "v1",
    "versions": {"v1": 1, "v2": 1},
    "rollout": {"toVersion": "v2", "fromVersion": "v1", "stage": "canary", "startedAt": 1e9},
    "history": [
        {"version": "v2", "fromVersion": "v1", "startedAt": "2026-12-03T08:00:00Z",
         "result": "Progressing", "reason": "AwaitingPromotion"},
        HISTORY_V1,
    ],
}  # fmt: skip
FAILED = {  # v2's rollout failed: `kubectl model retry` runs it again
    "phase": "Degraded",
    "currentVersion": "v1",
    "versions": {"v1": 2},
    "rollout": {"toVersion": "v2", "fromVersion": "v1", "stage": "failed", "startedAt": 1e9},
    "history": [
        {"version": "v2", "fromVersion": "v1", "startedAt": "2026-12-03T08:00:00Z",
         "finishedAt": "2026-12-03T08:02:00Z", "result": "Failed", "reason": "sidecar refused"},
        HISTORY_V1,
    ],
}  # fmt: skip


async def model_deployment(admin: Admin, name: str, status: dict[str, Any]) -> None:
    spec = {"model": "mlp", "version": "v2", "replicas": 2, "canary": {"manualPromote": True}}
    await admin.create(name, spec)
    await admin.set_status(name, status)


@contextlib.asynccontextmanager
async def cluster_as(
    tools: ControlPlane, admin: Admin, tmp_path: Path, role: str
) -> AsyncIterator[tuple[Recorder, str]]:
    """ModelDeployments ``held`` (a canary to promote) and ``failed`` in the test's
    namespace; a user bound there to ``role`` (``kubectl create rolebinding
    --clusterrole``), its requests going through a recording proxy; the kubeconfig."""
    await model_deployment(admin, "held", CANARY_HELD)
    await model_deployment(admin, "failed", FAILED)
    user = bound_user(tools, admin.namespace, "user", role)
    recorder = Recorder()
    async with intercepting_proxy(
        tools.server, lambda _: None, api_ssl(tools), answered=recorder.answered
    ) as proxy:
        yield recorder, str(kubeconfig_through(user, proxy, tmp_path / f"config-{role}"))


async def calls_of(recorder: Recorder, program: str, *args: str) -> tuple[int, set[Call], str]:
    """Run a tool; its exit code, the calls it made, its output (for failures)."""
    before = len(recorder.seen)
    code, out, err = await run_tool(program, *args)
    return code, set(recorder.seen[before:]), out + err


@contextlib.asynccontextmanager
async def authorizer_of(identity: Identity) -> AsyncIterator[Any]:
    """``can(call, namespace)``: the API server's own answer to ``identity`` asking
    whether it may make ``call`` there (a SelfSubjectAccessReview)."""
    configuration = k8s.Configuration()
    await k8s_config.load_kube_config(
        config_file=str(identity.kubeconfig), client_configuration=configuration
    )
    async with k8s.ApiClient(configuration) as api:
        authorization = k8s.AuthorizationV1Api(api)

        async def can(call: Call, namespace: str) -> bool:
            attributes = {"verb": call.verb, "group": call.group, "resource": call.resource,
                          "subresource": call.subresource, "namespace": namespace}  # fmt: skip
            review = {"apiVersion": "authorization.k8s.io/v1",
                      "kind": "SelfSubjectAccessReview",
                      "spec": {"resourceAttributes": attributes}}  # fmt: skip
            answer = await authorization.create_self_subject_access_review(
                review, _preload_content=False
            )
            return bool(json.loads(await answer.read())["status"].get("allowed"))

        yield can


# ---------------------------------------------------------------- the table is the code's


def test_cluster_is_the_tools_only_way_to_the_api() -> None:
    """No module of the tools but kube.py imports a Kubernetes or HTTP client, so the
    calls of Cluster are all the calls the tools make."""
    clients = {"kubernetes", "urllib3", "requests", "aiohttp", "httpx", "http"}
    for path in sorted(Path(model_rollout_cli.__file__).parent.glob("*.py")):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.split(".")[0])
        if path.name != "kube.py":
            assert not imported & clients, f"{path.name} imports {imported & clients}"


def _cluster_calls() -> dict[str, tuple[str, str]]:
    """Each method of Cluster that sends a request, with the (verb, resource) it states
    to ``self._call`` (the words of its RBAC error): read from kube.py's source."""
    tree = ast.parse(Path(kube.__file__).read_text())
    [cluster] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Cluster"]
    found = {}
    for method in cluster.body:
        if not isinstance(method, ast.FunctionDef) or method.name.startswith("_"):
            continue
        for node in ast.walk(method):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "_call"
            ):
                verb, resource = node.args[:2]
                assert isinstance(verb, ast.Constant)
                named = (  # a constant of kube.py (RESOURCE), or a literal ("pods")
                    getattr(kube, resource.id)
                    if isinstance(resource, ast.Name)
                    else ast.literal_eval(resource)
                )
                found[f"Cluster.{method.name}"] = (verb.value, named)
    return found


def test_the_table_is_every_call_cluster_makes() -> None:
    table = READ_CALLS | WRITE_CALLS
    assert _cluster_calls() == {k: (c.verb, c.rbac_resource) for k, c in table.items()}
    public = {n for n, v in vars(Cluster).items() if callable(v) and not n.startswith("_")}
    # and nothing but those sends: patch_read is get then patch; close and until (the
    # deadline of every later call) send nothing
    assert public == {m.removeprefix("Cluster.") for m in table} | {
        "patch_read",
        "close",
        "until",
    }


# ---------------------------------------------------------------------------- rendering


def test_the_roles_are_opt_in() -> None:
    assert user_roles({}) == {}
    assert user_roles({"userRoles": {"create": False, "aggregateToBuiltin": True}}) == {}
    assert user_roles({"userRoles": None}) == {}  # no such values (an older release's)
    assert set(user_roles(ENABLED)) == {VIEWER, EDITOR, OWNER}


def test_the_roles_aggregate_into_view_and_edit_when_asked() -> None:
    roles = user_roles(ENABLED)  # aggregateToBuiltin: true by default
    labels = {n: r["metadata"]["labels"] for n, r in roles.items()}
    assert labels[VIEWER][AGGREGATE.format("view")] == "true"
    assert labels[EDITOR][AGGREGATE.format("edit")] == "true"  # edit aggregates into admin
    assert labels[OWNER][AGGREGATE.format("admin")] == "true"
    aggregations = {n: {k for k in ls if k.startswith("rbac.authorization.k8s.io/")}
                    for n, ls in labels.items()}  # fmt: skip
    assert aggregations == {VIEWER: {AGGREGATE.format("view")}, EDITOR: {AGGREGATE.format("edit")},
                            OWNER: {AGGREGATE.format("admin")}}  # fmt: skip
    alone = user_roles({"userRoles": {"create": True, "aggregateToBuiltin": False}})
    assert set(alone) == {VIEWER, EDITOR, OWNER}
    for role in alone.values():
        assert not [k for k in role["metadata"]["labels"] if k.startswith("rbac.authorization")]
        assert "aggregationRule" not in role


@pytest.mark.parametrize("aggregate", [True, False])
def test_the_roles_validate_and_lint(aggregate: bool) -> None:
    values = {"userRoles": {"create": True, "aggregateToBuiltin": aggregate}}
    for role in user_roles(values).values():
        kubernetes_validate.validate(role, K8S_VERSION, strict=True)
    assert lint_chart(CHART, values) == []


def test_the_api_server_takes_the_roles(tools: ControlPlane, tmp_path: Path) -> None:
    """A server-side dry run: the real API server validates and admits both (with and
    without aggregation), as ``helm install`` would send them."""
    for aggregate in (True, False):
        roles = user_roles({"userRoles": {"create": True, "aggregateToBuiltin": aggregate}})
        path = tmp_path / f"user-roles-{aggregate}.yaml"
        path.write_text(yaml.safe_dump_all(list(roles.values())))
        result = tools.kubectl.run("apply", "--dry-run=server", "-o", "json", "-f", str(path))
        assert result.code == 0, str(result)
        assert {i["metadata"]["name"] for i in json.loads(result.out)["items"]} == {
            VIEWER,
            EDITOR,
            OWNER,
        }


# ---------------------------------------------------------------------- least privilege


def test_the_roles_grant_exactly_the_tools_calls() -> None:
    """Nothing a tool does not call (and kubectl get): the viewer its reads, the editor
    those and patch; the owner, who writes the resource itself, the editor's rights and
    create, update, delete and the policy's verb."""
    roles = user_roles(ENABLED)
    reads = set(READ_CALLS.values()) | KUBECTL_READS
    assert granted(roles[VIEWER]) == reads
    assert granted(roles[EDITOR]) == reads | set(WRITE_CALLS.values())
    owns = {Call(v, GROUP, PLURAL) for v in ("create", "update", "delete", CONFIGURE)}
    assert granted(roles[OWNER]) == reads | set(WRITE_CALLS.values()) | owns | SCALE


def test_the_owner_may_scale_and_the_editor_may_not() -> None:
    """``kubectl scale md`` (docs/autoscaling.md) is the scale subresource, a resource of
    its own to RBAC: the owner, who may set spec.replicas, may scale; the editor, whom the
    admission policy keeps off spec.replicas, and the viewer may not (the policy does not
    judge /scale)."""
    roles = user_roles(ENABLED)
    assert granted(roles[OWNER]) >= SCALE
    assert not {c for c in granted(roles[EDITOR]) | granted(roles[VIEWER]) if c.subresource}


def test_the_viewer_has_no_write_verbs() -> None:
    viewer = user_roles(ENABLED)[VIEWER]
    verbs = {v for rule in viewer["rules"] for v in rule["verbs"]}
    assert verbs and verbs <= READ_VERBS
    assert not [r for r in viewer["rules"] if "*" in r["apiGroups"] + r["resources"]]
    assert not [r for r in viewer["rules"] if any("/" in res for res in r["resources"])]


async def test_the_viewer_role_runs_status_and_history(
    tools: ControlPlane, admin: Admin, tmp_path: Path
) -> None:
    watch = ["status", "held", "--watch", "--timeout", "1", "--interval", "0.2"]
    runs: list[tuple[list[str], set[Call], int]] = [
        (["status", "held"], {GET, PODS, EVENTS}, OK),
        (["status", "held", "-o", "json"], {GET, PODS, EVENTS}, OK),  # the pods and events too
        (watch, {GET, PODS, EVENTS}, TIMED_OUT),  # still a canary: --wait's exit code
        (["history", "held"], {GET}, OK),
        (["history", "failed", "-o", "json"], {GET}, OK),
        (["list"], {LIST}, OK),
        (["tree", "held"], {GET, PODS}, OK),
    ]
    async with cluster_as(tools, admin, tmp_path, VIEWER) as (recorder, kubeconfig):
        for args, expected, expected_code in runs:
            code, calls, output = await calls_of(
                recorder, "kubectl-model", *args, "--kubeconfig", kubeconfig
            )
            assert (code, calls) == (expected_code, expected), (args, output)
    assert recorder.denied == []
    assert set(recorder.seen) == set(READ_CALLS.values())  # every read rule is used


async def test_the_viewer_role_cannot_steer_a_rollout(
    tools: ControlPlane, admin: Admin, tmp_path: Path
) -> None:
    async with cluster_as(tools, admin, tmp_path, VIEWER) as (recorder, kubeconfig):
        for args in (["promote", "held"], ["retry", "failed"], ["rollback", "held"]):
            code, calls, output = await calls_of(
                recorder, "kubectl-model", *args, "--kubeconfig", kubeconfig
            )
            assert code == API_ERROR and "forbidden: patch" in output, (args, output)
            assert f'cannot patch resource "{PLURAL}"' in output  # the API server's words
            assert calls == {GET, PATCH}
    assert set(recorder.denied) == {PATCH}
    assert (await admin.read("held"))["metadata"].get("annotations") is None  # nothing written


async def test_the_editor_role_runs_every_command_and_release(
    tools: ControlPlane, admin: Admin, tmp_path: Path
) -> None:
    model, keys = tmp_path / "model.onnx", make_keys(tmp_path / "keys")
    write_mlp(model, seed=1)
    store = f"file://{tmp_path / 'store'}"
    async with cluster_as(tools, admin, tmp_path, EDITOR) as (recorder, kubeconfig):

        async def plugin(*args: str) -> tuple[int, set[Call], str]:
            return await calls_of(recorder, "kubectl-model", *args, "--kubeconfig", kubeconfig)

        async def release(version: str, *extra: str) -> tuple[int, set[Call], str]:
            return await calls_of(
                recorder, "model-rollout", "release", "--model", "mlp", "--version", version,
                "--file", str(model), "--key", str(keys.private), "--deployment", "held",
                "--store", store, "--kubeconfig", kubeconfig, *extra,
            )  # fmt: skip

        viewer_runs = [
            await plugin("status", "held"),
            await plugin("history", "held"),
            await plugin("list"),
        ]
        runs = [
            (await plugin("promote", "held"), OK),
            (await plugin("pause", "held"), OK),
            (await plugin("resume", "held"), OK),
            (await plugin("promote", "held", "--full"), OK),
            (await plugin("abort", "held"), OK),
            (await plugin("retry", "failed"), OK),
            (await plugin("rollback", "held"), OK),
            # --wait: follow.follow's polls too (no operator runs here: it times out)
            (
                await plugin(
                    "rollback", "held", "--to", "v3", "--force", "--wait", "--timeout", "1"
                ),
                TIMED_OUT,
            ),  # --force: v3 is no version held knows of
            (await release("v4"), OK),
            (await release("v5", "--wait", "--timeout", "1", "-o", "json"), TIMED_OUT),
        ]
        for (code, calls, output), expected_code in runs:
            assert (code, calls) == (expected_code, {GET, PATCH}), output
        for code, _, output in viewer_runs:
            assert code == OK, output
    assert recorder.denied == []
    assert set(recorder.seen) == set(READ_CALLS.values()) | set(WRITE_CALLS.values())


def test_requests_are_read_as_the_api_server_reads_them() -> None:
    """The recording proxy's reading of a request (else the tests above could pass a
    watch as a list, or a /status write as a patch of the resource)."""
    md = f"/apis/{GROUP}/v1alpha1/namespaces/ml/{PLURAL}"
    assert request_call("GET", f"{md}/x", {}) == Call("get", GROUP, PLURAL)
    assert request_call("GET", md, {}) == Call("list", GROUP, PLURAL)
    assert request_call("GET", md, {"watch": "true"}) == Call("watch", GROUP, PLURAL)
    assert request_call("PATCH", f"{md}/x/status", {}) == Call("patch", GROUP, PLURAL, "status")
    assert request_call("GET", "/api/v1/namespaces/ml/pods", {}) == Call("list", "", "pods")
    assert request_call("GET", "/api/v1/namespaces/ml", {}) == Call("get", "", "namespaces")
    assert request_call("DELETE", md, {}) == Call("deletecollection", GROUP, PLURAL)
    assert request_call("GET", f"/apis/{GROUP}/v1alpha1", {}) is None  # discovery


# Everything a user of the tools might try, for the API server's authorizer to judge:
# every verb on the ModelDeployments (and their status), pods (and their logs), events
# and what the operator owns or reads (Deployments, Secrets)
CONFIGURE = editor_policy.CONFIGURE_VERB  # change any field (the editor policy's verb)
VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection",
         CONFIGURE)  # fmt: skip
RESOURCES = (
    (GROUP, PLURAL, ""), (GROUP, PLURAL, "status"), ("", "pods", ""), ("", "pods", "log"),
    ("", "events", ""), ("apps", "deployments", ""), ("", "secrets", ""),
    (GROUP, PLURAL, "scale"),
)  # fmt: skip
EVERY_CALL = [Call(verb, *resource) for verb in VERBS for resource in RESOURCES]
OWNER_VERBS = (*READ_VERBS, "patch", "create", "update", "delete", CONFIGURE)
README = {  # the README's "RBAC for the tools"
    VIEWER: {Call(v, GROUP, PLURAL) for v in READ_VERBS} | {PODS, EVENTS},
    EDITOR: {Call(v, GROUP, PLURAL) for v in (*READ_VERBS, "patch")} | {PODS, EVENTS},
    OWNER: {Call(v, GROUP, PLURAL) for v in OWNER_VERBS} | {PODS, EVENTS} | SCALE,
}
HANG_GUARD_S = 60.0


@pytest.mark.parametrize("role", [VIEWER, EDITOR, OWNER])
async def test_the_api_server_allows_each_role_exactly_what_the_readme_says(
    tools: ControlPlane, namespace: str, role: str
) -> None:
    """Asked of the real authorizer as the bound user: the README's calls in the
    namespace of the binding, nothing else there, and nothing at all in another
    namespace."""
    user = bound_user(tools, namespace, "user", role)
    with namespace_of_its_own(tools, "elsewhere") as elsewhere:
        async with authorizer_of(user) as can:
            here = {c for c in EVERY_CALL if await can(c, namespace)}
            there = {c for c in EVERY_CALL if await can(c, elsewhere)}
    assert here == README[role]
    assert there == set()
    if role == EDITOR:  # the API server's reading of the editor's rules, spelled out
        assert Call("patch", GROUP, PLURAL) in here and Call("list", GROUP, PLURAL) in here
        assert Call("patch", GROUP, PLURAL, "status") not in here
        assert Call("update", GROUP, PLURAL) not in here
        assert Call("patch", "", "pods") not in here
        assert Call("delete", GROUP, PLURAL) not in here
        assert Call(CONFIGURE, GROUP, PLURAL) not in here  # the policy holds it to version


async def test_a_refused_call_is_the_api_servers_403(
    tools: ControlPlane, namespace: str, admin: Admin
) -> None:
    """What the editor may not do, done with kubectl: each refused by the API server
    (403, its message naming the verb); what the viewer may do with kubectl (``kubectl
    get md``) it does."""
    await model_deployment(admin, "held", CANARY_HELD)
    editor = bound_user(tools, namespace, "editor", EDITOR).kubectl
    for args, refused in (
        (["delete", "md", "held", "--wait=false"], f'cannot delete resource "{PLURAL}"'),
        # kubectl reads the status before it patches it: that read is refused already
        (["patch", "md", "held", "--subresource=status", "--type=merge", "-p",
          '{"status": {"phase": "Available"}}'], f'cannot get resource "{PLURAL}/status"'),
        (["create", "configmap", "x"], 'cannot create resource "configmaps"'),
        (["delete", "pod", "held-0", "--wait=false"], 'cannot delete resource "pods"'),
    ):  # fmt: skip
        result = editor.run(*args)
        assert result.code != 0 and "forbidden: User" in result.err, (args, str(result))
        assert refused in result.err, (args, str(result))
    viewer = bound_user(tools, namespace, "viewer", VIEWER).kubectl
    listed = viewer("get", "md", "-o", "name")
    assert listed.split() == [f"modeldeployment.{GROUP}/held"]
    header = viewer("get", "md").splitlines()[0]
    assert header.split()[:3] == ["NAME", "MODEL", "VERSION"]  # the printer columns


async def test_the_builtin_view_edit_and_admin_roles_carry_them(
    tools: ControlPlane, namespace: str, admin: Admin
) -> None:
    """Aggregated (the default): whoever is bound to the built-in ``view`` in a namespace
    may follow its rollouts, whoever has ``edit`` may steer them (and, the editor policy
    holding them to it, do nothing more), whoever has ``admin`` owns the resources (the
    controller-manager aggregates the chart's rules into all three)."""
    await model_deployment(admin, "held", CANARY_HELD)
    view = bound_user(tools, namespace, "dora", "view")
    edit = bound_user(tools, namespace, "erin", "edit")
    owner = bound_user(tools, namespace, "olga", "admin")
    configure = Call(CONFIGURE, GROUP, PLURAL)
    async with (
        authorizer_of(view) as view_can,
        authorizer_of(edit) as edit_can,
        authorizer_of(owner) as admin_can,
    ):

        async def aggregated() -> bool:  # the aggregation controller's pass is done
            while not (
                await view_can(GET, namespace)
                and await edit_can(PATCH, namespace)
                and await admin_can(configure, namespace)
            ):
                await asyncio.sleep(0.2)
            return True

        assert await asyncio.wait_for(aggregated(), HANG_GUARD_S)
        assert await view_can(PODS, namespace) and await view_can(EVENTS, namespace)
        assert not await view_can(PATCH, namespace)
        assert not await edit_can(configure, namespace)
    code, out, err = await run_tool("kubectl-model", "status", "held", "--kubeconfig",
                                    str(view.kubeconfig))  # fmt: skip
    assert code == OK and "AwaitingPromotion" in out, (out, err)
    code, out, err = await run_tool("kubectl-model", "promote", "held", "--kubeconfig",
                                    str(view.kubeconfig))  # fmt: skip
    assert code == API_ERROR and "forbidden: patch" in err, (out, err)
    code, out, err = await run_tool("kubectl-model", "promote", "held", "--kubeconfig",
                                    str(edit.kubeconfig))  # fmt: skip
    assert code == OK and "canary of v2 promoted" in out, (out, err)
    image = ["patch", "md", "held", "--type=merge", "-p", json.dumps({"spec": {"image": EVIL}})]
    refused = edit.kubectl.run(*image)
    assert refused.code != 0 and EDITOR_POLICY_DENIAL in refused.err, str(refused)
    owner.kubectl(*image)
    assert (await admin.read("held"))["spec"]["image"] == EVIL


async def test_a_ci_account_of_another_namespace_bound_as_the_readme_says_releases(
    tools: ControlPlane, namespace: str, admin: Admin, tmp_path: Path
) -> None:
    """The README's example: ``kubectl create rolebinding ci-release -n ml
    --clusterrole=model-rollout-rollout-editor --serviceaccount=ci:release``; the CI
    job's release in the model's namespace (``-n``) goes through, its own namespace
    gives it nothing."""
    await model_deployment(admin, "held", CANARY_HELD)
    model, keys = tmp_path / "model.onnx", make_keys(tmp_path / "keys")
    write_mlp(model, seed=1)
    with namespace_of_its_own(tools, "ci") as ci:
        release = bound_user(tools, ci, "release")
        tools.kubectl(
            "create", "rolebinding", "ci-release", "-n", namespace, f"--clusterrole={EDITOR}",
            f"--serviceaccount={ci}:release",
        )  # fmt: skip
        argv = ["release", "--model", "mlp", "--version", "v4", "--file", str(model),
                "--key", str(keys.private), "--deployment", "held",
                "--store", f"file://{tmp_path / 'store'}",
                "--kubeconfig", str(release.kubeconfig), "-o", "json"]  # fmt: skip
        code, out, err = await run_tool("model-rollout", *argv, "-n", namespace)
        assert code == OK and json.loads(out)["result"] == "Started", (out, err)
        code, out, err = await run_tool("model-rollout", *argv)  # its own namespace: none
        assert code == API_ERROR and "forbidden: get" in json.loads(out)["reason"], (out, err)
    assert (await admin.read("held"))["spec"]["version"] == "v4"


# ------------------------------------------------------------- the editor admission policy

EVIL = "attacker.example/shell:latest"
TENANT = track_keys("acme-mlp")
EDITOR_WRITES = {  # what the tools write (a merge patch each), and kubectl's equivalent
    "release / rollback": {"metadata": {"annotations": {CHANGE_CAUSE: "v3: rollback by ann"}},
                           "spec": {"version": "v3"}},
    "spec.version alone": {"spec": {"version": "v4"}},
    "promote": {"metadata": {"annotations": {PROMOTE: "v4@1000000000"}}},
    "abort": {"metadata": {"annotations": {ABORT: "v4"}}},
    "retry": {"metadata": {"annotations": {RETRY: "v4", CHANGE_CAUSE: "v4: retry by ann"}}},
    "a tenant track's promote, abort and retry": {"metadata": {"annotations": {
        TENANT.promote: "a3@1000000000", TENANT.abort: "a3", TENANT.retry: "a3"}}},
    "pause": {"spec": {"paused": True}},
    "promote --full of a paused resource (it resumes it)": {
        "metadata": {"annotations": {PROMOTE: "v4@1000000000+full"}}, "spec": {"paused": False}},
    "pause, resume": {"spec": {"paused": True}},
    "resume": {"spec": {"paused": False}},
    "a promote taken back": {"metadata": {"annotations": {PROMOTE: None}}},
}  # fmt: skip
# what the editor may not change: (merge patch, what the refusal names as changed)
EDITOR_REFUSED = {
    "issue 29's patch: another image, unsigned, the sidecar given a Secret": (
        {"spec": {"version": "v9", "image": EVIL, "allowUnsigned": True,
                  "signingPublicKeySecret": None,
                  "store": {"pvc": None, "url": "s3://models/x",
                            "credentialsSecret": "prod-database-password"}}},
        "spec.image, spec.store, spec.signingPublicKeySecret, spec.allowUnsigned"),
    "the image": ({"spec": {"image": EVIL}}, "spec.image"),
    "the sidecar's image": ({"spec": {"sidecarImage": EVIL}}, "spec.sidecarImage"),
    "the sidecar's settings": ({"spec": {"sidecar": {"maxConcurrentDownloads": 16}}},
                               "spec.sidecar"),
    "another volume for the store": (
        {"spec": {"store": {"pvc": "someone-elses", "url": None, "credentialsSecret": None}}},
        "spec.store"),
    "unsigned versions": ({"spec": {"allowUnsigned": True, "signingPublicKeySecret": None}},
                          "spec.signingPublicKeySecret, spec.allowUnsigned"),
    "the replicas": ({"spec": {"replicas": 50}}, "spec.replicas"),
    "the replicas with a pause": ({"spec": {"paused": True, "replicas": 50}}, "spec.replicas"),
    "the canary": ({"spec": {"canary": {"manualPromote": False}}}, "spec.canary"),
    "a label": ({"metadata": {"labels": {"team": "attackers"}}}, "metadata.labels"),
    "another annotation": ({"metadata": {"annotations": {"example.com/x": "1"}}},
                           "metadata.annotations[example.com/x]"),
    "a finalizer": ({"metadata": {"finalizers": ["example.com/keep"]}}, "metadata.finalizers"),
}  # fmt: skip


def merge(*patches: dict[str, Any]) -> dict[str, Any]:
    """The annotations the patches leave, in order (``None`` removes one)."""
    annotations: dict[str, Any] = {}
    for patch in patches:
        annotations.update((patch.get("metadata") or {}).get("annotations") or {})
    return {k: v for k, v in annotations.items() if v is not None}


def test_the_api_server_type_checks_the_editor_policy_cleanly(tools: ControlPlane) -> None:
    """Against the CRD's schema (the policy names the CRD's version, which is what lets
    the server resolve it): no validation names a field a ModelDeployment or an
    admission request does not have. The server does not report on variables: the spec
    fields that ``changed`` compares are checked against the CRD by
    ``test_editor_policy.py``, and a wrong one would fail every editor write here."""
    vap = tools.kubectl.get("validatingadmissionpolicy", editor_policy.POLICY_NAME)
    checking = vap["status"].get("typeChecking", {})
    assert checking.get("expressionWarnings", []) == [], checking
    assert not [c for c in vap["status"].get("conditions", []) if c["status"] != "True"]


async def test_the_editor_changes_the_version_and_the_rollout_annotations(
    tools: ControlPlane, namespace: str, admin: Admin
) -> None:
    """Each write of the tools, sent with kubectl as the editor: all go through."""
    await model_deployment(admin, "held", CANARY_HELD)
    editor = bound_user(tools, namespace, "editor", EDITOR).kubectl
    for what, patch in EDITOR_WRITES.items():
        result = editor.run("patch", "md", "held", "--type=merge", "-p", json.dumps(patch))
        assert result.code == 0, (what, str(result))
    md = await admin.read("held")
    assert md["spec"]["version"] == "v4"
    assert md["metadata"]["annotations"] == merge(*EDITOR_WRITES.values())


@pytest.mark.parametrize("case", EDITOR_REFUSED.values(), ids=EDITOR_REFUSED.keys())
async def test_the_editor_may_change_nothing_else(
    tools: ControlPlane, namespace: str, admin: Admin, case: tuple[dict[str, Any], str]
) -> None:
    """Refused by the API server with the policy's words, naming what the patch would
    have changed beyond the editor's fields; nothing is written."""
    patch, changed = case
    await model_deployment(admin, "held", CANARY_HELD)
    before = await admin.read("held")
    editor = bound_user(tools, namespace, "editor", EDITOR).kubectl
    result = editor.run("patch", "md", "held", "--type=merge", "-p", json.dumps(patch))
    assert result.code != 0
    assert (
        f'modeldeployments.{GROUP} "held" is forbidden: {EDITOR_POLICY_DENIAL}'
        "a rollout editor may change only spec.version"
    ) in result.err, str(result)
    assert f"this request also changes {changed}; changing anything else needs the verb" in (
        result.err
    ), str(result)
    assert (await admin.read("held"))["metadata"]["resourceVersion"] == (
        before["metadata"]["resourceVersion"]
    )


async def test_the_tools_pass_the_policys_refusal_through(
    tools: ControlPlane, namespace: str, admin: Admin
) -> None:
    """The tools' own API layer (Cluster.patch) sending what the policy refuses: the
    server's words, not advice to ask for RBAC (which allowed the patch); exit 4."""
    await model_deployment(admin, "held", CANARY_HELD)
    editor = bound_user(tools, namespace, "editor", EDITOR)
    cluster = kube.connect(KubeOptions(kubeconfig=str(editor.kubeconfig)))
    with pytest.raises(CliError) as refused:
        await asyncio.to_thread(cluster.patch, "held", {"spec": {"image": EVIL}})
    assert refused.value.code == API_ERROR
    assert refused.value.message.startswith(
        f'patch modeldeployment held refused: modeldeployments.{GROUP} "held" is forbidden: '
        f"{EDITOR_POLICY_DENIAL}a rollout editor may change only spec.version"
    ), refused.value.message
    assert "ask for RBAC" not in refused.value.message


async def test_the_editor_cannot_delete(tools: ControlPlane, namespace: str, admin: Admin) -> None:
    """Deletion is RBAC's: the role has no delete (the policy does not judge deletes)."""
    await model_deployment(admin, "held", CANARY_HELD)
    editor = bound_user(tools, namespace, "editor", EDITOR).kubectl
    result = editor.run("delete", "md", "held", "--wait=false")
    assert result.code != 0 and f'cannot delete resource "{PLURAL}"' in result.err, str(result)
    assert (await admin.read("held"))["metadata"].get("deletionTimestamp") is None


async def test_the_owner_role_changes_anything(
    tools: ControlPlane, namespace: str, admin: Admin, tmp_path: Path
) -> None:
    """Full edit, as without the policy: every patch the editor is refused, then
    ``kubectl apply`` of an edited manifest (client-side, its last-applied annotation
    included), then a delete."""
    await model_deployment(admin, "held", CANARY_HELD)
    owner = bound_user(tools, namespace, "owner", OWNER).kubectl
    for what, (patch, _) in EDITOR_REFUSED.items():
        result = owner.run("patch", "md", "held", "--type=merge", "-p", json.dumps(patch))
        assert result.code == 0, (what, str(result))
    md = await admin.read("held")
    assert md["spec"]["image"] == EVIL and md["metadata"]["labels"] == {"team": "attackers"}
    manifest = {"apiVersion": md["apiVersion"], "kind": md["kind"],
                "metadata": {"name": "held", "namespace": namespace, "labels": {"team": "ml"}},
                "spec": {**md["spec"], "image": "registry.example.com/model-server:0.2.0",
                         "replicas": 3}}  # fmt: skip
    path = tmp_path / "held.yaml"
    path.write_text(yaml.safe_dump(manifest))
    owner("apply", "-f", str(path))
    applied = await admin.read("held")
    assert (applied["spec"]["image"], applied["spec"]["replicas"]) == (
        "registry.example.com/model-server:0.2.0", 3)  # fmt: skip
    assert "kubectl.kubernetes.io/last-applied-configuration" in applied["metadata"]["annotations"]
    owner("delete", "md", "held", "--wait=false")


async def test_a_foreground_delete_completes_through_the_policy(
    tools: ControlPlane, namespace: str, admin: Admin
) -> None:
    """The garbage collector, which has no 'configure', removes the foregroundDeletion
    finalizer of an owner's foreground delete: the policy lets finalizers go once
    deletion has begun, so the resource goes (a hang guard, not a time). A dependent
    held by a finalizer of the test's keeps the owner waiting until the test lets it go:
    with no dependent the collector may finish before the owner is read (a race)."""
    await model_deployment(admin, "held", CANARY_HELD)
    uid = (await admin.read("held"))["metadata"]["uid"]
    hold = "test.model-rollout.io/hold"
    owned_by = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ModelDeployment", "name": "held",
                "uid": uid, "blockOwnerDeletion": True}  # fmt: skip
    await admin.core.create_namespaced_config_map(namespace, {
        "metadata": {"name": "held-child", "finalizers": [hold], "ownerReferences": [owned_by]}
    })  # fmt: skip
    owner = bound_user(tools, namespace, "owner", OWNER).kubectl
    owner("delete", "md", "held", "--cascade=foreground", "--wait=false")
    assert (await admin.read("held"))["metadata"]["finalizers"] == ["foregroundDeletion"]
    await admin.core.patch_namespaced_config_map(
        "held-child", namespace, [{"op": "remove", "path": "/metadata/finalizers"}]
    )

    def gone() -> bool:
        return "NotFound" in tools.kubectl.run("get", "md", "held", "-n", namespace).err

    # the garbage collector watches the CRD's resources once its discovery pass has
    # found them (every 30 s): a generous hang guard
    wait_until(gone, HANG_GUARD_S * 3, interval_s=0.5, what="the foreground delete to finish")


async def test_the_operators_writes_pass_the_policy(
    tools: ControlPlane, namespace: str, admin: Admin
) -> None:
    """The operator's own writes of the resource, sent by its code as the chart's
    ServiceAccount: clearing the rollout annotations it acted on, removing an earlier
    version's kopf finalizer, writing the status. The finalizer is what needs the
    chart's 'configure' for the operator: the same role without it is refused that."""
    await model_deployment(admin, "held", CANARY_HELD)
    await admin.patch("held", {"metadata": {
        "annotations": {PROMOTE: "v2@1000000000", ABORT: "v2", RETRY: "v2"},
        "finalizers": [KOPF_FINALIZER]}})  # fmt: skip
    operator = install_chart(tools)  # the chart's RBAC and policies; the operator's identity
    api = KubeClient(await load_configuration(None, str(operator.kubeconfig)))
    try:
        uid = (await admin.read("held"))["metadata"]["uid"]
        await operator_cluster.clear_annotations(
            api, namespace, "held", uid, (PROMOTE, ABORT, RETRY)
        )
        await operator_cluster.remove_finalizer(
            api, namespace, "held", [KOPF_FINALIZER], KOPF_FINALIZER
        )
        status = await operator_cluster.replace_status(
            api, namespace, "held", uid, {"phase": "Failed"}
        )
    finally:
        await api.close()
    md = await admin.read("held")
    assert md["metadata"].get("annotations") is None and md["metadata"].get("finalizers") is None
    assert status["phase"] == "Failed"

    # the operator's role less 'configure', as a ServiceAccount of its own
    role = role_without(CONFIGURE, PLURAL, f"no-configure-{namespace}")
    tools.kubectl.apply(role)
    try:
        bare = bound_user(tools, namespace, "bare-operator")
        tools.kubectl("create", "rolebinding", "bare-operator", "-n", namespace,
                      f"--clusterrole={role['metadata']['name']}",
                      f"--serviceaccount={namespace}:bare-operator")  # fmt: skip
        await admin.patch("held", {"metadata": {"finalizers": [KOPF_FINALIZER]}})
        api = KubeClient(await load_configuration(None, str(bare.kubeconfig)))
        try:
            with pytest.raises(ApiError) as refused:
                await operator_cluster.remove_finalizer(
                    api, namespace, "held", [KOPF_FINALIZER], KOPF_FINALIZER
                )
        finally:
            await api.close()
    finally:
        tools.kubectl.run("delete", "clusterrole", role["metadata"]["name"])
    assert refused.value.status == 403 and EDITOR_POLICY_DENIAL in str(refused.value)
    assert "metadata.finalizers" in str(refused.value)
    assert (await admin.read("held"))["metadata"]["finalizers"] == [KOPF_FINALIZER]
    await admin.patch("held", {"metadata": {"finalizers": None}})  # the namespace can go
