"""The chart's opt-in ClusterRoles for the day-2 tools (templates/user-roles.yaml):
``<release>-viewer`` for ``kubectl model status`` / ``history`` and
``<release>-rollout-editor`` for promote, abort, retry, rollback and ``model-rollout
release``. They render, validate (kubernetes-validate, real kubectl, ``helm lint``) and
aggregate into the built-in view / edit roles when asked; and they are least privilege:
the real tools, run as processes against the emulated API server behind a proxy that
authorizes each request with the rendered role's rules (as the API server's RBAC
authorizer does), succeed, and every rule is one the tools use."""

from __future__ import annotations

import ast
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

import model_rollout_cli
from cli_helpers import intercepting_proxy, run_tool, write_kubeconfig
from helm_chart import RELEASE, lint_chart, render_chart
from model_rollout_cli import kube
from model_rollout_cli.errors import API_ERROR, OK, TIMED_OUT
from model_rollout_cli.kube import GROUP, PLURAL, Cluster
from model_rollout_e2e.binaries import BinaryNotFound, kubectl_binary
from model_rollout_e2e.kube_emulator import MD_PATH, create_model_deployment, kube_emulator
from model_rollout_e2e.onnx_models import write_mlp
from sidecar_helpers import make_keys

ROOT = Path(__file__).parent.parent
CHART = ROOT / "deploy" / "helm" / "model-rollout"
K8S_VERSION = "1.37.0"  # as tests/test_manifests.py
NAMESPACE = "ml"
ENABLED = {"userRoles": {"create": True}}
VIEWER, EDITOR = f"{RELEASE}-viewer", f"{RELEASE}-rollout-editor"
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
}
WRITE_CALLS = {
    # custom.patch_namespaced_custom_object, a merge patch: the annotations of promote,
    # abort, retry; annotations and spec.version of rollback and release (patch_read)
    "Cluster.patch": Call("patch", GROUP, PLURAL),
}
# Not the tools' but kubectl's: `kubectl get modeldeployments [-w]`, which anyone who may
# view a rollout expects to run too
KUBECTL_READS = {Call("list", GROUP, PLURAL), Call("watch", GROUP, PLURAL)}
# Not a rule: Cluster._crd_served's discovery (GET /apis/<group>/<version>, after a 404)
# is a non-resource URL that every authenticated user may read (system:discovery).
GET, PODS, EVENTS = (
    READ_CALLS["Cluster.get"],
    READ_CALLS["Cluster.pods"],
    READ_CALLS["Cluster.events"],
)
PATCH = WRITE_CALLS["Cluster.patch"]


def user_roles(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    docs = render_chart(CHART, values)
    names = {VIEWER, EDITOR}
    return {d["metadata"]["name"]: d for d in docs if d["metadata"].get("name") in names}


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


def allows(rules: list[dict[str, Any]], call: Call) -> bool:
    """RBAC's rule match: verb, API group and resource (``resource/subresource`` for a
    subresource) each listed or ``*``; a rule with resourceNames needs a name, and the
    tools' lists have none, so such a rule is not counted."""
    resource = f"{call.resource}/{call.subresource}" if call.subresource else call.resource
    return any(
        {call.verb, "*"} & set(rule.get("verbs", []))
        and {call.group, "*"} & set(rule.get("apiGroups", []))
        and {resource, "*"} & set(rule.get("resources", []))
        and not rule.get("resourceNames")
        for rule in rules
    )


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
class Authorizer:
    """What a proxy in front of the API lets through: the role's rules, and the
    non-resource discovery URLs every authenticated user may GET."""

    rules: list[dict[str, Any]]
    seen: list[Call] = field(default_factory=list)
    denied: list[Call] = field(default_factory=list)

    def refuse(self, method: str, path: str, query: Mapping[str, str]) -> str | None:
        """Why the request is forbidden, or ``None``; every resource request is kept."""
        call = request_call(method, path, query)
        if call is None:
            return None if method == "GET" else f"{method} {path}"
        self.seen.append(call)
        if allows(self.rules, call):
            return None
        self.denied.append(call)
        where = f'resource "{call.resource}" in API group "{call.group}"'
        return f'User "tester" cannot {call.verb} {where}'


@contextlib.asynccontextmanager
async def authorizing_proxy(upstream: str, authorizer: Authorizer) -> AsyncIterator[str]:
    """An HTTP proxy to the API server at ``upstream`` that answers 403 Forbidden (a
    Kubernetes ``Status``, as the API server does) to what ``authorizer`` refuses."""

    def forbidden(request: web.Request) -> web.Response | None:
        why = authorizer.refuse(request.method, request.path, request.query)
        if why is None:
            return None
        body = {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": f"forbidden: {why}", "reason": "Forbidden", "code": 403,
        }  # fmt: skip
        return web.json_response(body, status=403)

    async with intercepting_proxy(upstream, forbidden) as url:
        yield url


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


async def model_deployment(api: Any, name: str, status: dict[str, Any]) -> None:
    spec = {"model": "mlp", "version": "v2", "replicas": 2, "canary": {"manualPromote": True}}
    await create_model_deployment(api, NAMESPACE, {"metadata": {"name": name}, "spec": spec})
    await api.merge_patch(f"{MD_PATH.format(ns=NAMESPACE)}/{name}/status", {"status": status})


@contextlib.asynccontextmanager
async def cluster_as(
    tmp_path: Path, role: str, authorizer: Authorizer | None = None
) -> AsyncIterator[tuple[Authorizer, str]]:
    """The emulated cluster with ModelDeployments ``held`` (a canary to promote) and
    ``failed``, reached through the proxy that grants ``role`` only; the kubeconfig."""
    authorizer = authorizer or Authorizer(user_roles(ENABLED)[role]["rules"])
    async with kube_emulator() as api, authorizing_proxy(api.url, authorizer) as proxy:
        await model_deployment(api, "held", CANARY_HELD)
        await model_deployment(api, "failed", FAILED)
        yield authorizer, str(write_kubeconfig(tmp_path / f"config-{role}", proxy, NAMESPACE))


async def calls_of(authorizer: Authorizer, program: str, *args: str) -> tuple[int, set[Call], str]:
    """Run a tool; its exit code, the calls it made, its output (for failures)."""
    before = len(authorizer.seen)
    code, out, err = await run_tool(program, *args)
    return code, set(authorizer.seen[before:]), out + err


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
    # and nothing but those sends: patch_read is get then patch; close sends nothing
    assert public == {m.removeprefix("Cluster.") for m in table} | {"patch_read", "close"}


# ---------------------------------------------------------------------------- rendering


def test_the_roles_are_opt_in() -> None:
    assert user_roles({}) == {}
    assert user_roles({"userRoles": {"create": False, "aggregateToBuiltin": True}}) == {}
    assert user_roles({"userRoles": None}) == {}  # no such values (an older release's)
    assert set(user_roles(ENABLED)) == {VIEWER, EDITOR}


def test_the_roles_aggregate_into_view_and_edit_when_asked() -> None:
    roles = user_roles(ENABLED)  # aggregateToBuiltin: true by default
    labels = {n: r["metadata"]["labels"] for n, r in roles.items()}
    assert labels[VIEWER][AGGREGATE.format("view")] == "true"
    assert labels[EDITOR][AGGREGATE.format("edit")] == "true"  # edit aggregates into admin
    aggregations = {n: {k for k in ls if k.startswith("rbac.authorization.k8s.io/")}
                    for n, ls in labels.items()}  # fmt: skip
    assert aggregations == {VIEWER: {AGGREGATE.format("view")}, EDITOR: {AGGREGATE.format("edit")}}
    alone = user_roles({"userRoles": {"create": True, "aggregateToBuiltin": False}})
    assert set(alone) == {VIEWER, EDITOR}
    for role in alone.values():
        assert not [k for k in role["metadata"]["labels"] if k.startswith("rbac.authorization")]
        assert "aggregationRule" not in role


@pytest.mark.parametrize("aggregate", [True, False])
def test_the_roles_validate_and_lint(aggregate: bool) -> None:
    values = {"userRoles": {"create": True, "aggregateToBuiltin": aggregate}}
    for role in user_roles(values).values():
        kubernetes_validate.validate(role, K8S_VERSION, strict=True)
    assert lint_chart(CHART, values) == []


async def test_kubectl_parses_the_roles(tmp_path: Path) -> None:
    try:
        kubectl = kubectl_binary()
    except BinaryNotFound as exc:
        pytest.skip(str(exc))
    path = tmp_path / "user-roles.yaml"
    path.write_text(yaml.safe_dump_all(list(user_roles(ENABLED).values())))
    async with kube_emulator() as api:
        code, out, err = await run_tool(
            kubectl, f"--server={api.url}", "--request-timeout=20s", "apply",
            "--dry-run=client", "--validate=false", "-o", "json", "-f", str(path),
        )  # fmt: skip
    assert code == 0, out + err
    assert {i["metadata"]["name"] for i in json.loads(out)["items"]} == {VIEWER, EDITOR}


# ---------------------------------------------------------------------- least privilege


def test_the_roles_grant_exactly_the_tools_calls() -> None:
    """Nothing a tool does not call (and kubectl get): the viewer its reads, the editor
    those and patch."""
    roles = user_roles(ENABLED)
    reads = set(READ_CALLS.values()) | KUBECTL_READS
    assert granted(roles[VIEWER]) == reads
    assert granted(roles[EDITOR]) == reads | set(WRITE_CALLS.values())


def test_the_viewer_has_no_write_verbs() -> None:
    viewer = user_roles(ENABLED)[VIEWER]
    verbs = {v for rule in viewer["rules"] for v in rule["verbs"]}
    assert verbs and verbs <= READ_VERBS
    assert not [r for r in viewer["rules"] if "*" in r["apiGroups"] + r["resources"]]
    assert not [r for r in viewer["rules"] if any("/" in res for res in r["resources"])]


async def test_the_viewer_role_runs_status_and_history(tmp_path: Path) -> None:
    runs: list[tuple[list[str], set[Call]]] = [
        (["status", "held"], {GET, PODS, EVENTS}),
        (["status", "held", "-o", "json"], {GET}),
        (["status", "held", "--watch", "--timeout", "1", "--interval", "0.2"], {GET, PODS, EVENTS}),
        (["history", "held"], {GET}),
        (["history", "failed", "-o", "json"], {GET}),
    ]
    async with cluster_as(tmp_path, VIEWER) as (authorizer, kubeconfig):
        for args, expected in runs:
            code, calls, output = await calls_of(
                authorizer, "kubectl-model", *args, "--kubeconfig", kubeconfig
            )
            assert (code, calls) == (OK, expected), (args, output)
    assert authorizer.denied == []
    assert set(authorizer.seen) == set(READ_CALLS.values())  # every read rule is used


async def test_the_viewer_role_cannot_steer_a_rollout(tmp_path: Path) -> None:
    async with cluster_as(tmp_path, VIEWER) as (authorizer, kubeconfig):
        for args in (["promote", "held"], ["retry", "failed"], ["rollback", "held"]):
            code, calls, output = await calls_of(
                authorizer, "kubectl-model", *args, "--kubeconfig", kubeconfig
            )
            assert code == API_ERROR and "forbidden: patch" in output, (args, output)
            assert calls == {GET, PATCH}
    assert set(authorizer.denied) == {PATCH}


async def test_the_editor_role_runs_every_command_and_release(tmp_path: Path) -> None:
    model, keys = tmp_path / "model.onnx", make_keys(tmp_path / "keys")
    write_mlp(model, seed=1)
    store = f"file://{tmp_path / 'store'}"
    async with cluster_as(tmp_path, EDITOR) as (authorizer, kubeconfig):

        async def plugin(*args: str) -> tuple[int, set[Call], str]:
            return await calls_of(authorizer, "kubectl-model", *args, "--kubeconfig", kubeconfig)

        async def release(version: str, *extra: str) -> tuple[int, set[Call], str]:
            return await calls_of(
                authorizer, "model-rollout", "release", "--model", "mlp", "--version", version,
                "--file", str(model), "--key", str(keys.private), "--deployment", "held",
                "--store", store, "--kubeconfig", kubeconfig, *extra,
            )  # fmt: skip

        viewer_runs = [await plugin("status", "held"), await plugin("history", "held")]
        runs = [
            (await plugin("promote", "held"), OK),
            (await plugin("abort", "held"), OK),
            (await plugin("retry", "failed"), OK),
            (await plugin("rollback", "held"), OK),
            # --wait: follow.follow's polls too (no operator runs here: it times out)
            (await plugin("rollback", "held", "--to", "v3", "--wait", "--timeout", "1"), TIMED_OUT),
            (await release("v4"), OK),
            (await release("v5", "--wait", "--timeout", "1", "-o", "json"), TIMED_OUT),
        ]
        for (code, calls, output), expected_code in runs:
            assert (code, calls) == (expected_code, {GET, PATCH}), output
        for code, _, output in viewer_runs:
            assert code == OK, output
    assert authorizer.denied == []
    assert set(authorizer.seen) == set(READ_CALLS.values()) | set(WRITE_CALLS.values())


def test_the_authorizer_reads_requests_as_the_api_server_does() -> None:
    """The proxy's reading of a request (else the tests above could pass a watch as a
    list, or a /status write as a patch of the resource)."""
    md = f"/apis/{GROUP}/v1alpha1/namespaces/ml/{PLURAL}"
    assert request_call("GET", f"{md}/x", {}) == Call("get", GROUP, PLURAL)
    assert request_call("GET", md, {}) == Call("list", GROUP, PLURAL)
    assert request_call("GET", md, {"watch": "true"}) == Call("watch", GROUP, PLURAL)
    assert request_call("PATCH", f"{md}/x/status", {}) == Call("patch", GROUP, PLURAL, "status")
    assert request_call("GET", "/api/v1/namespaces/ml/pods", {}) == Call("list", "", "pods")
    assert request_call("GET", "/api/v1/namespaces/ml", {}) == Call("get", "", "namespaces")
    assert request_call("DELETE", md, {}) == Call("deletecollection", GROUP, PLURAL)
    assert request_call("GET", f"/apis/{GROUP}/v1alpha1", {}) is None  # discovery
    editor = user_roles(ENABLED)[EDITOR]["rules"]
    assert allows(editor, Call("patch", GROUP, PLURAL))
    assert not allows(editor, Call("patch", GROUP, PLURAL, "status"))
    assert allows(editor, Call("list", GROUP, PLURAL))
    assert not allows(editor, Call("update", GROUP, PLURAL))
    assert not allows(editor, Call("patch", "", "pods"))
    assert not allows(editor, Call("delete", GROUP, PLURAL))
