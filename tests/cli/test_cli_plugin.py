"""The ``kubectl-model`` plugin and ``model-rollout release`` as processes against a real
API server (the session's control plane), with a user's kubeconfig: a ServiceAccount
bound to the chart's rollout-editor role in its namespace, as the README binds it. Found
and run by the real kubectl, the kubeconfig and its namespace honoured; what the API
server refuses (RBAC, the CRD's schema, an admission policy, a token) reaches the user
with the server's own words, and clear errors (exit 4) for a missing resource, a missing
CRD and an unreachable API. No operator runs: the test writes the status it would.

A proxy sits in front of the API server only for what a real server does not do on
demand: answer 500, lose a race at a chosen moment (the test writes in between, the
server answers the real 409), or serve without the CRD (the proxy asks the server for
a group it has not, the server answers its real 404)."""

from __future__ import annotations

import asyncio
import json
import shlex
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from model_rollout_cli.kube import GROUP
from model_rollout_contract.annotations import (
    ABORT,
    CHANGE_CAUSE,
    DEPLOYMENT_LABEL,
    PROMOTE,
    RETRY,
)
from model_rollout_contract.report import SidecarReport
from model_rollout_contract.states import SidecarState
from model_rollout_contract.tracks import track_keys
from model_rollout_e2e.binaries import BinaryNotFound, kubectl_binary
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.identities import Identity
from model_rollout_e2e.kubeconfig import write_kubeconfig
from model_rollout_e2e.onnx_models import write_mlp
from model_rollout_e2e.processes import free_port, wait_until
from tests.cli.test_cli_examples import commands_in
from tests.support.cli import (
    BIN,
    EDITOR,
    TENANT_MODELS,
    TOOL_TIMEOUT_S,
    VIEWER,
    Admin,
    api_ssl,
    bound_user,
    flaky_proxy,
    intercepting_proxy,
    interruptible,
    kubeconfig_through,
    run_tool,
    user_roles,
)
from tests.support.namespaces import namespace_of_its_own
from tests.support.sidecar import make_keys

STATUS = {
    "phase": "Canary",
    "message": "canary healthy; promote with annotation ...",
    "currentVersion": "v1",
    "targetVersion": "v2",
    "readyReplicas": 2,
    "updatedReplicas": 1,
    "versions": {"v1": 1, "v2": 1},
    "rollout": {"toVersion": "v2", "fromVersion": "v1", "stage": "canary", "startedAt": 1e9},
    "conditions": [
        {"type": "Progressing", "status": "True", "reason": "AwaitingPromotion"},
    ],
    "history": [
        {
            "version": "v2",
            "fromVersion": "v1",
            "startedAt": "2026-12-03T08:00:00Z",
            "result": "Progressing",
            "reason": "AwaitingPromotion",
            "triggeredBy": "release by ci@runner",
        },
        {
            "version": "v1",
            "startedAt": "2026-12-02T08:00:00Z",
            "finishedAt": "2026-12-02T08:01:00Z",
            "result": "Succeeded",
            "reason": "2/2 pods serve v1",
            "triggeredBy": "spec.version edit",
        },
    ],
}


@pytest.fixture
def user(tools: ControlPlane, namespace: str) -> Identity:
    """The README's user of the tools: the rollout editor in this namespace."""
    return bound_user(tools, namespace, "alice", EDITOR)


@pytest.fixture
def kubeconfig(user: Identity) -> str:
    return str(user.kubeconfig)


async def deployment(admin: Admin, name: str = "mlp", manual: bool = True) -> None:
    spec = {"model": "mlp", "version": "v2", "replicas": 2, "canary": {"manualPromote": manual}}
    await admin.create(name, spec)
    await admin.set_status(name, STATUS)


async def test_kubectl_finds_the_plugin_and_runs_it(
    tools: ControlPlane, namespace: str, admin: Admin, tmp_path: Path
) -> None:
    try:
        kubectl = kubectl_binary()
    except BinaryNotFound as exc:
        pytest.skip(str(exc))
    env = {"PATH": str(BIN), "HOME": str(tmp_path)}  # the venv's scripts only
    code, out, err = await run_tool(kubectl, "plugin", "list", env=env)
    assert code == 0, err
    assert str(BIN / "kubectl-model") in out
    await deployment(admin)
    with namespace_of_its_own(tools, "other") as other:  # the user may read there too
        kubeconfig = bound_user(tools, namespace, "bob", EDITOR, where=(other,)).kubeconfig
        code, out, err = await run_tool(
            kubectl, "model", "status", "mlp", "--kubeconfig", str(kubeconfig), env=env
        )
        assert code == 0, err
        for fragment in ("Name:        mlp", "Phase:       Canary (AwaitingPromotion)",
                         "Serving:     v1: 1 pods  v2: 1 pods", "kubectl model promote mlp",
                         "release by ci@runner"):  # fmt: skip
            assert fragment in out, out
        assert "\x1b[" not in out  # not a terminal: no colour
        # the context's namespace, overridden by -n as kubectl does
        code, out, err = await run_tool(
            kubectl, "model", "history", "mlp", "-n", other, "--kubeconfig", str(kubeconfig),
            env=env,
        )  # fmt: skip
        assert code == 4 and f"modeldeployment mlp not found in namespace {other}" in err


async def test_promote_writes_the_annotation_of_this_rollout(
    admin: Admin, kubeconfig: str, tmp_path: Path
) -> None:
    await deployment(admin)
    await deployment(admin, "auto", manual=False)
    code, out, err = await run_tool("kubectl-model", "promote", "mlp", "--kubeconfig", kubeconfig)
    assert code == 0 and "canary of v2 promoted" in out, err
    annotations = (await admin.read())["metadata"]["annotations"]
    assert annotations["serving.model-rollout.io/promote"] == "v2@1000000000"
    code, out, err = await run_tool("kubectl-model", "promote", "auto", "--kubeconfig", kubeconfig)
    assert code == 6 and "manualPromote" in err
    code, out, err = await run_tool("kubectl-model", "retry", "mlp", "--kubeconfig", kubeconfig)
    assert code == 6 and "has not failed" in err
    # $KUBECONFIG as kubectl reads it (an unreadable path beside it is skipped)
    env = {"KUBECONFIG": f"{tmp_path / 'absent'}:{kubeconfig}"}
    code, out, err = await run_tool("kubectl-model", "history", "mlp", env=env)
    assert code == 0 and "release by ci@runner" in out, err
    code, out, err = await run_tool("kubectl-model", "rollback", "mlp", "--kubeconfig", kubeconfig)
    assert code == 0 and "from v2 to v1" in out, err  # the last success but spec.version
    md = await admin.read()
    assert md["spec"]["version"] == "v1"
    assert md["metadata"]["annotations"][CHANGE_CAUSE].startswith("v1: rollback by ")


async def test_an_rbac_denial_says_what_to_ask_for(
    tools: ControlPlane, namespace: str, admin: Admin
) -> None:
    """A user the API server's RBAC gives nothing in the namespace: its 403, with the
    server's own message."""
    await deployment(admin)
    nobody = bound_user(tools, namespace, "nobody")
    code, out, err = await run_tool(
        "kubectl-model", "status", "mlp", "--kubeconfig", str(nobody.kubeconfig)
    )
    assert code == 4, (out, err)
    resource = f"modeldeployments.{GROUP}"
    assert err.strip() == (
        f"error: forbidden: get {resource} in namespace {namespace}: ask for RBAC that allows "
        f"'get' on {resource} there ({resource} \"mlp\" is forbidden: User "
        f'"system:serviceaccount:{namespace}:nobody" cannot get resource "modeldeployments" '
        f'in API group "{GROUP}" in the namespace "{namespace}")'
    )
    assert "Traceback" not in err


async def test_a_viewer_is_refused_a_write_with_the_servers_words(
    tools: ControlPlane, namespace: str, admin: Admin
) -> None:
    """The viewer may read but not patch: the API server's 403 for the patch, passed
    through; nothing written."""
    await deployment(admin)
    viewer = bound_user(tools, namespace, "carol", VIEWER)
    before = (await admin.read())["metadata"]["resourceVersion"]
    code, out, err = await run_tool(
        "kubectl-model", "promote", "mlp", "--kubeconfig", str(viewer.kubeconfig)
    )
    assert code == 4, (out, err)
    resource = f"modeldeployments.{GROUP}"
    assert err.strip() == (
        f"error: forbidden: patch {resource} in namespace {namespace}: ask for RBAC that allows "
        f"'patch' on {resource} there ({resource} \"mlp\" is forbidden: User "
        f'"system:serviceaccount:{namespace}:carol" cannot patch resource "modeldeployments" '
        f'in API group "{GROUP}" in the namespace "{namespace}")'
    )
    assert (await admin.read())["metadata"]["resourceVersion"] == before


async def test_a_version_the_crds_schema_refuses_is_the_servers_refusal(
    admin: Admin, kubeconfig: str
) -> None:
    """``rollback --to`` a name that is no version: the API server validates the patch
    against the CRD's schema and refuses it (422) with its own message; nothing is
    written. (``--force``: without it the tool refuses first, a version it has no record
    of: test_rollback_to_a_version_the_resource_never_saw_is_refused_unless_forced.)"""
    await deployment(admin)
    code, out, err = await run_tool(
        "kubectl-model", "rollback", "mlp", "--to", "v 3", "--force", "--kubeconfig", kubeconfig
    )
    assert code == 4, (out, err)
    assert err.strip().startswith(
        f'error: patch modeldeployment mlp refused: ModelDeployment.{GROUP} "mlp" is invalid: '
        'spec.version: Invalid value: "v 3": spec.version in body should match '
        "'^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$'"
    ), err
    assert "Traceback" not in err
    assert (await admin.read())["spec"]["version"] == "v2"


def change_freeze(namespace: str) -> list[dict[str, Any]]:
    """A cluster's own ValidatingAdmissionPolicy, bound to one namespace: no change of
    any ModelDeployment's spec.version there (a change freeze)."""
    name = f"change-freeze-{namespace}"
    rule = {"apiGroups": [GROUP], "apiVersions": ["*"], "operations": ["UPDATE"],
            "resources": ["modeldeployments"]}  # fmt: skip
    return [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {"resourceRules": [rule]},
                "validations": [
                    {
                        "expression": "object.spec.version == oldObject.spec.version",
                        "message": "change freeze: no new versions until Monday",
                    }
                ],
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {
                "policyName": name,
                "validationActions": ["Deny"],
                "matchResources": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
                },
            },
        },
    ]


async def test_a_release_an_admission_policy_refuses_says_the_policys_words(
    tools: ControlPlane, namespace: str, admin: Admin, user: Identity, tmp_path: Path
) -> None:
    """The cluster's admission policy refuses the release's write: the JSON report has
    the server's message (not advice about RBAC, which allowed it) and what was
    published before; exit 4."""
    await deployment(admin)
    policy = change_freeze(namespace)
    tools.kubectl.apply(*policy)
    try:
        probe = ["patch", "md", "mlp", "-n", namespace, "--type=merge", "--dry-run=server",
                 "-p", '{"spec": {"version": "v9"}}']  # fmt: skip
        wait_until(
            lambda: "change freeze" in user.kubectl.run(*probe).err,
            60, interval_s=0.5, what="the policy to be enforced",
        )  # fmt: skip
        model, keys = tmp_path / "model.onnx", make_keys(tmp_path / "keys")
        write_mlp(model, seed=1)
        code, out, err = await run_tool(
            "model-rollout", "release", "--model", "mlp", "--version", "v3", "--file",
            str(model), "--key", str(keys.private), "--deployment", "mlp", "--store",
            f"file://{tmp_path / 'store'}", "--kubeconfig", str(user.kubeconfig), "-o", "json",
        )  # fmt: skip
    finally:
        for doc in policy:
            tools.kubectl.run("delete", doc["kind"], doc["metadata"]["name"], "--wait=false")
    report = json.loads(out)
    assert code == 4 and report["result"] == "Error", (out, err)
    assert report["reason"] == (
        f'patch modeldeployment mlp refused: modeldeployments.{GROUP} "mlp" is forbidden: '
        f"ValidatingAdmissionPolicy 'change-freeze-{namespace}' with binding "
        f"'change-freeze-{namespace}' denied request: change freeze: no new versions until "
        "Monday"
    ), report
    assert report["published"].startswith("published mlp:v3")
    assert (await admin.read())["spec"]["version"] == "v2"


async def test_missing_resources_and_an_unreachable_api_are_clear_errors(
    tools: ControlPlane, user: Identity, kubeconfig: str, tmp_path: Path
) -> None:
    code, _, err = await run_tool("kubectl-model", "abort", "nope", "--kubeconfig", kubeconfig)
    assert code == 4 and err.strip() == (
        f"error: modeldeployment nope not found in namespace {user.namespace}"
    )
    ca = tools.pki.ca.cert
    dead = str(
        write_kubeconfig(tmp_path / "dead", f"https://127.0.0.1:{free_port()}", ca, token="t")
    )
    code, _, err = await run_tool("kubectl-model", "status", "mlp", "--kubeconfig", dead)
    assert code == 4 and "cannot reach the Kubernetes API" in err and "connection refused" in err
    assert "Traceback" not in err
    # a token the API server does not know (revoked, another cluster's)
    stale = str(write_kubeconfig(tmp_path / "stale", tools.server, ca, token="not-a-token"))
    code, _, err = await run_tool("kubectl-model", "status", "mlp", "--kubeconfig", stale)
    assert code == 4 and err.strip() == (
        "error: unauthorized: the kubeconfig's credentials were refused"
    ), err
    code, _, err = await run_tool(
        "kubectl-model", "status", "mlp", "--kubeconfig", str(tmp_path / "missing")
    )
    assert code == 4 and "cannot load the Kubernetes configuration" in err
    nowhere = {"HOME": str(tmp_path), "KUBECONFIG": "", "KUBERNETES_SERVICE_HOST": ""}
    code, _, err = await run_tool("kubectl-model", "status", "mlp", env=nowhere)
    assert code == 4 and "no Kubernetes configuration" in err
    code, _, err = await run_tool("kubectl-model", "frobnicate")
    assert code == 2 and "invalid choice" in err


async def test_watch_in_a_log_prints_a_view_only_when_something_changed(
    admin: Admin, kubeconfig: str
) -> None:
    await deployment(admin)
    code, out, err = await run_tool(
        "kubectl-model", "status", "mlp", "--watch", "--interval", "0.1", "--timeout", "1",
        "--kubeconfig", kubeconfig,
    )  # fmt: skip
    assert code == 3, err  # still a canary when its --timeout passed: --wait's exit code
    assert out.count("Name:        mlp") == 1 and out.rstrip().endswith("---")  # read ~10 times


V2_SUCCEEDED = {
    "version": "v2",
    "fromVersion": "v1",
    "startedAt": "2026-12-03T08:00:00Z",
    "finishedAt": "2026-12-03T08:01:00Z",
    "result": "Succeeded",
    "reason": "2/2 pods serve v2",
    "triggeredBy": "release by ci@runner",
}
SERVING_V2 = {
    "phase": "Available",
    "currentVersion": "v2",
    "previousVersion": "v1",
    "versions": {"v2": 2},
    "rollout": {"toVersion": "v2", "fromVersion": "v1", "stage": "complete", "startedAt": 1e9},
    "history": [V2_SUCCEEDED, STATUS["history"][1]],
}


async def test_a_release_run_again_for_the_version_served_publishes_nothing(
    admin: Admin, kubeconfig: str, tmp_path: Path
) -> None:
    """A CI job run again: exit 0, nothing published or written; ``--force`` refused,
    since new bytes under a version the pods hold would never reach them."""
    model, keys = tmp_path / "model.onnx", make_keys(tmp_path / "keys")
    write_mlp(model, seed=1)
    store = tmp_path / "store"
    await deployment(admin)
    await admin.set_status("mlp", SERVING_V2)
    before = await admin.read()
    argv = ["release", "--model", "mlp", "--version", "v2", "--file", str(model),
            "--key", str(keys.private), "--deployment", "mlp", "--store", f"file://{store}",
            "--kubeconfig", kubeconfig, "--wait", "-o", "json"]  # fmt: skip
    code, out, err = await run_tool("model-rollout", *argv)
    assert code == 0, (out, err)
    report = json.loads(out)
    assert (report["result"], report["reason"]) == ("Succeeded", "already serving v2")
    assert report["published"] is None and "not published again" in err
    code, out, err = await run_tool("model-rollout", *argv, "--force")
    assert code == 2 and "--force refused: pods of mlp hold v2" in json.loads(out)["reason"]
    after = await admin.read()
    assert not store.exists()  # nothing published
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]


async def test_abort_wait_explains_a_rollout_that_completed_first(
    admin: Admin, kubeconfig: str
) -> None:
    await deployment(admin)
    tool = asyncio.create_task(
        run_tool("kubectl-model", "abort", "mlp", "--wait", "--kubeconfig", kubeconfig)
    )
    await admin.when(lambda md: ABORT in (md["metadata"].get("annotations") or {}))
    await admin.set_status("mlp", SERVING_V2)  # the operator finished v2 before it read it
    code, out, err = await tool
    assert code == 1 and "result: Succeeded" in out, (out, err)
    assert "had completed before the abort" in out and "kubectl model rollback mlp" in out


async def test_abort_of_a_first_deployment_has_nothing_to_go_back_to(
    admin: Admin, kubeconfig: str
) -> None:
    await deployment(admin)
    first = {**STATUS, "currentVersion": None, "versions": {"v2": 1}}
    await admin.set_status("mlp", first)
    code, out, err = await run_tool("kubectl-model", "abort", "mlp", "--kubeconfig", kubeconfig)
    md = await admin.read()
    assert code == 6 and "no stable version to go back to from v2" in err, (out, err)
    assert ABORT not in (md["metadata"].get("annotations") or {})


async def test_rollback_wait_after_a_refused_version_ends_on_available(
    admin: Admin, kubeconfig: str
) -> None:
    """spec.version v9 refused (not in the store): rolling back to v2, which the
    operator's rollout state is complete on, starts no rollout and adds no history entry;
    Available on v2 for the generation written is the success."""
    await deployment(admin)
    await admin.patch("mlp", {"spec": {"version": "v9"}})
    refused = {**SERVING_V2, "phase": "Invalid", "message": "v9 is not in the store"}
    await admin.set_status("mlp", {**refused, "observedGeneration": 2})
    tool = asyncio.create_task(
        run_tool("kubectl-model", "rollback", "mlp", "--wait", "--kubeconfig", kubeconfig)
    )
    md = await admin.when(lambda md: md["spec"]["version"] == "v2")
    generation = md["metadata"]["generation"]
    assert md["metadata"]["annotations"][CHANGE_CAUSE].startswith("v2: rollback by ")
    await admin.set_status("mlp", {**SERVING_V2, "observedGeneration": generation})
    code, out, err = await tool
    assert code == 0 and "from v9 to v2" in out and "result: Succeeded" in out, (out, err)


async def test_wait_rides_out_api_errors_while_it_follows(
    tools: ControlPlane, admin: Admin, user: Identity, tmp_path: Path
) -> None:
    """Two reads of the followed resource answered 500 (an API server failing over):
    the rollback is still followed to its result, not ended with exit 4."""
    reads: list[str] = []

    def fail(method: str, path: str) -> int | None:
        if method == "GET" and path.endswith("/modeldeployments/mlp"):
            reads.append(path)
            return 500 if len(reads) in (2, 3) else None  # the first two polls after the patch
        return None

    await deployment(admin)
    async with flaky_proxy(tools.server, fail, api_ssl(tools)) as proxy:
        kubeconfig = str(kubeconfig_through(user, proxy, tmp_path / "config"))
        tool = asyncio.create_task(
            run_tool("kubectl-model", "rollback", "mlp", "--wait", "--kubeconfig", kubeconfig)
        )
        await admin.when(lambda md: md["spec"]["version"] == "v1" and len(reads) > 3)
        v1_again = {
            **V2_SUCCEEDED, "version": "v1", "fromVersion": "v2",
            "startedAt": "2026-12-03T09:00:00.000Z", "reason": "2/2 pods serve v1",
        }  # fmt: skip
        history = [v1_again, *STATUS["history"]]
        await admin.set_status(
            "mlp",
            {"phase": "Available", "currentVersion": "v1", "versions": {"v1": 2},
             "history": history},
        )  # fmt: skip
        code, out, err = await tool
    assert code == 0 and "result: Succeeded" in out, (out, err)


async def test_a_write_that_lost_a_race_is_decided_again_once(
    tools: ControlPlane, admin: Admin, user: Identity, tmp_path: Path
) -> None:
    """The rollback's patch carries the resourceVersion it was decided on; a 409 (the
    operator wrote the status in between: here the test, just before the patch reaches
    the API server, which then refuses it) is read again and decided again, once."""
    patches: list[str] = []
    writes = iter(range(1, 1000))

    async def status_write_first(request: web.Request) -> None:
        if request.method == "PATCH" and request.path.endswith("/modeldeployments/mlp"):
            patches.append(request.path)
            if len(patches) <= limit:
                await admin.set_status("mlp", {"message": f"status write {next(writes)}"})

    await deployment(admin)
    async with intercepting_proxy(
        tools.server, lambda _: None, api_ssl(tools), before=status_write_first
    ) as proxy:
        kubeconfig = str(kubeconfig_through(user, proxy, tmp_path / "config"))
        limit = 1
        code, out, err = await run_tool(
            "kubectl-model", "rollback", "mlp", "--kubeconfig", kubeconfig
        )
        assert code == 0 and "from v2 to v1" in out and len(patches) == 2, (out, err)
        await admin.patch("mlp", {"spec": {"version": "v2"}})
        patches.clear()
        limit = 2
        code, out, err = await run_tool(
            "kubectl-model", "rollback", "mlp", "--kubeconfig", kubeconfig
        )
        assert code == 4 and "mlp changed while this command read it" in err, (out, err)
        assert (await admin.read())["spec"]["version"] == "v2" and len(patches) == 2


async def test_a_missing_crd_is_named(
    tools: ControlPlane, namespace: str, user: Identity, tmp_path: Path
) -> None:
    """The API server's own answers for a group it does not serve, to a user whose
    rights name it (RBAC rules name groups, installed or not): the proxy asks the server
    for another group's paths, which the user has the editor's rights on (this
    session's server has the CRD, which other tests use)."""
    absent = f"absent.{GROUP}"
    rules = [
        {**rule, "apiGroups": [absent]}
        for rule in user_roles()[EDITOR]["rules"]
        if rule["apiGroups"] == [GROUP]
    ]
    meta = {"name": "absent-group", "namespace": namespace}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta}
    tools.kubectl.apply({**role, "rules": rules})
    tools.kubectl(
        "create", "rolebinding", "absent-group", "-n", namespace, "--role=absent-group",
        f"--serviceaccount={namespace}:{user.name}",
    )  # fmt: skip

    def absent_group(path: str) -> str:
        return path.replace(f"/apis/{GROUP}/", f"/apis/{absent}/")

    async with intercepting_proxy(
        tools.server, lambda _: None, api_ssl(tools), rewrite=absent_group
    ) as proxy:
        kubeconfig = str(kubeconfig_through(user, proxy, tmp_path / "config"))
        code, out, err = await run_tool(
            "kubectl-model", "status", "mlp", "--kubeconfig", kubeconfig
        )
    assert code == 4 and "the ModelDeployment CRD is not installed" in err, (out, err)


async def test_release_json_reports_what_was_done_whatever_ends_it(
    tools: ControlPlane, namespace: str, admin: Admin, kubeconfig: str, tmp_path: Path
) -> None:
    """A refused write after the publish (a user the API server lets read, not patch):
    the report keeps what was published. Ctrl-C while following: still one JSON object,
    result "interrupted", exit 130."""
    model, keys = tmp_path / "model.onnx", make_keys(tmp_path / "keys")
    write_mlp(model, seed=1)

    def argv(version: str, kubeconfig: str) -> list[str]:
        return ["release", "--model", "mlp", "--version", version, "--file", str(model),
                "--key", str(keys.private), "--deployment", "mlp",
                "--store", f"file://{tmp_path / 'store'}", "--kubeconfig", kubeconfig,
                "--wait", "-o", "json"]  # fmt: skip

    await deployment(admin)
    denied = str(bound_user(tools, namespace, "viewer", VIEWER).kubeconfig)
    code, out, err = await run_tool("model-rollout", *argv("v3", denied))
    report = json.loads(out)
    assert code == 4 and report["result"] == "Error" and "forbidden" in report["reason"]
    assert report["published"].startswith("published mlp:v3"), (out, err)
    proc = await asyncio.create_subprocess_exec(
        str(BIN / "model-rollout"), *argv("v4", kubeconfig),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        preexec_fn=interruptible,
    )  # fmt: skip
    await admin.when(lambda md: md["spec"]["version"] == "v4")  # following now
    proc.send_signal(signal.SIGINT)
    stdout, _ = await asyncio.wait_for(proc.communicate(), TOOL_TIMEOUT_S)
    report = json.loads(stdout)
    assert proc.returncode == 130 and report["result"] == "interrupted", report
    assert report["published"].startswith("published mlp:v4")


ACME_CANARY = {
    "phase": "Canary",
    "message": "canary: 1/2 pods serve a2",
    "currentVersion": "a1",
    "model": "acme/mlp",
    "versions": {"a1": 1, "a2": 1},
    "rollout": {"toVersion": "a2", "fromVersion": "a1", "stage": "canary", "startedAt": 1e9},
    "conditions": [{"type": "Progressing", "status": "True", "reason": "CanaryPause"}],
}
GLOBEX_AVAILABLE = {
    "phase": "Available",
    "message": "2/2 pods serve g1",
    "currentVersion": "g1",
    "model": "globex/mlp",
    "versions": {"g1": 2},
    "rollout": {"toVersion": "g1", "stage": "complete", "startedAt": 1e9},
    "conditions": [{"type": "Progressing", "status": "False", "reason": "Idle"}],
}


async def tenant_pod(admin: Admin, name: str, acme: str) -> None:
    """A pod of mlp serving v1 on its own track, ``acme`` on acme's and g1 on globex's,
    each as that track's sidecar reports it in the track's annotation."""
    annotations = {}
    for track, model, version in (
        (None, "mlp", "v1"), ("acme-mlp", "acme/mlp", acme), ("globex-mlp", "globex/mlp", "g1")
    ):  # fmt: skip
        keys = track_keys(track)
        annotations[keys.target] = version
        report = SidecarReport(model, version, version, SidecarState.OK)
        annotations[keys.sidecar_status] = report.to_json()
    await admin.create_pod(name, {DEPLOYMENT_LABEL: "mlp"}, annotations)


async def next_view(stream: asyncio.StreamReader) -> list[str]:
    """The lines of the next view a non-terminal ``--watch`` prints (each ends in ---)."""
    lines: list[str] = []
    while (line := (await asyncio.wait_for(stream.readline(), TOOL_TIMEOUT_S)).decode()) != "":
        if line.rstrip("\n") == "---":
            return lines
        lines.append(line.rstrip("\n"))
    raise AssertionError(f"the watch ended mid-view: {lines}")


def tenant_row(view: list[str], track: str) -> list[str]:
    return next(line.split() for line in view if line.strip().startswith(track + " "))


async def test_status_shows_each_tenant_track_and_watch_prints_a_change_in_one(
    admin: Admin, kubeconfig: str
) -> None:
    spec = {
        "model": "mlp", "version": "v2", "replicas": 2,
        "tenants": {"secretName": "keys", "models": TENANT_MODELS},
    }  # fmt: skip
    await admin.create("mlp", spec)
    tenants = {"acme-mlp": ACME_CANARY, "globex-mlp": GLOBEX_AVAILABLE}
    await admin.set_status("mlp", {**STATUS, "tenants": tenants})
    await tenant_pod(admin, "mlp-a", "a2")
    await tenant_pod(admin, "mlp-b", "a1")
    code, out, err = await run_tool("kubectl-model", "status", "mlp", "--kubeconfig", kubeconfig)
    assert code == 0, err
    view = out.splitlines()
    assert view[view.index("Tenants:") + 1].split()[:3] == ["TRACK", "TENANT/MODEL", "DESIRED"]
    assert tenant_row(view, "acme-mlp")[:7] == [
        "acme-mlp", "acme/mlp", "a2", "a1", "Canary", "(CanaryPause)", "a1=1"
    ]  # fmt: skip
    assert tenant_row(view, "globex-mlp")[:6] == [
        "globex-mlp", "globex/mlp", "g1", "g1", "Available", "g1=2"
    ]  # fmt: skip
    assert "Phase:       Canary (AwaitingPromotion)" in out  # the deployment's own
    # -o json: the resource as the API has it, its tenants' spec and status included
    code, out, err = await run_tool(
        "kubectl-model", "status", "mlp", "-o", "json", "--kubeconfig", kubeconfig
    )
    assert code == 0, err
    raw = json.loads(out)
    assert raw["status"]["tenants"] == tenants
    assert raw["spec"]["tenants"]["models"] == TENANT_MODELS

    proc = await asyncio.create_subprocess_exec(
        str(BIN / "kubectl-model"), "status", "mlp", "--watch", "--interval", "0.1",
        "--kubeconfig", kubeconfig,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        preexec_fn=interruptible,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        first = await next_view(proc.stdout)
        # only acme's track moves on: a change the log must show
        done = {
            "phase": "Available", "message": "2/2 pods serve a2", "currentVersion": "a2",
            "versions": {"a2": 2}, "rollout": {"stage": "complete"},
            "conditions": [{"type": "Progressing", "status": "False", "reason": "Idle"}],
        }  # fmt: skip
        await admin.set_status("mlp", {"tenants": {"acme-mlp": done}})
        second = await next_view(proc.stdout)
    finally:
        proc.send_signal(signal.SIGINT)
        rest, err_bytes = await asyncio.wait_for(proc.communicate(), TOOL_TIMEOUT_S)
    assert proc.returncode == 130, err_bytes.decode()
    assert tenant_row(first, "acme-mlp")[2:5] == ["a2", "a1", "Canary"]
    assert tenant_row(second, "acme-mlp")[2:5] == ["a2", "a2", "Available"]
    assert tenant_row(second, "globex-mlp") == tenant_row(first, "globex-mlp")
    changed = [b for a, b in zip(first, second, strict=True) if a.split() != b.split()]
    assert len(changed) == 1 and changed[0].strip().startswith("acme-mlp "), changed
    assert "Name:" not in rest.decode()  # nothing changed after: no view more


async def tenant_deployment(admin: Admin, acme: dict[str, Any]) -> None:
    """mlp held at its own canary (manualPromote), with acme's track in state ``acme`` and
    globex's Available."""
    spec = {
        "model": "mlp", "version": "v2", "replicas": 2, "canary": {"manualPromote": True},
        "tenants": {"secretName": "keys", "models": TENANT_MODELS},
    }  # fmt: skip
    await admin.create("mlp", spec)
    tenants = {"acme-mlp": acme, "globex-mlp": GLOBEX_AVAILABLE}
    await admin.set_status("mlp", {**STATUS, "tenants": tenants})


ACME_HELD = {
    **ACME_CANARY,
    "message": "canary healthy; promote with annotation",
    "conditions": [{"type": "Progressing", "status": "True", "reason": "AwaitingPromotion"}],
}
ACME_FAILED = {
    **ACME_CANARY,
    "phase": "Degraded",
    "message": "a2 failed to load",
    "rollout": {"toVersion": "a2", "fromVersion": "a1", "stage": "failed", "startedAt": 1e9},
}


async def test_promote_abort_and_retry_with_track_write_that_tracks_annotations_only(
    admin: Admin, kubeconfig: str
) -> None:
    """``--track``: each command reads the tenant track's state in status.tenants and
    writes the annotation key, and value, the operator reads for that track; the
    deployment's own rollout (held at its canary too) is left alone."""
    acme = track_keys("acme-mlp")
    await tenant_deployment(admin, ACME_HELD)

    async def tool(*argv: str) -> tuple[int, str, str]:
        return await run_tool("kubectl-model", *argv, "--kubeconfig", kubeconfig)

    code, out, err = await tool("promote", "mlp", "--track", "acme-mlp")
    assert code == 0 and "track acme-mlp: canary of a2 promoted" in out, (out, err)
    annotations = (await admin.read())["metadata"]["annotations"]
    assert annotations[acme.promote] == "a2@1000000000"
    assert PROMOTE not in annotations  # the deployment's own canary stays held

    code, out, err = await tool("abort", "mlp", "--track", "acme-mlp")
    assert code == 0 and "rollout of a2 aborted; pods go back to a1" in out, (out, err)
    annotations = (await admin.read())["metadata"]["annotations"]
    assert annotations[acme.abort] == "a2" and ABORT not in annotations

    await admin.set_status("mlp", {"tenants": {"acme-mlp": ACME_FAILED}})
    code, out, err = await tool("retry", "mlp", "--track", "acme-mlp")
    assert code == 0 and "track acme-mlp: version rollout of a2 retried" in out, (out, err)
    annotations = (await admin.read())["metadata"]["annotations"]
    assert annotations[acme.retry] == "a2" and RETRY not in annotations
    # the one change-cause of every track is left alone: a release may have just
    # written it (the operator has not read it yet)
    assert CHANGE_CAUSE not in annotations
    # the default track has not failed: its retry is still refused
    code, out, err = await tool("retry", "mlp")
    assert code == 6 and "the rollout of v2 has not failed" in err, (out, err)

    before = (await admin.read())["metadata"]["resourceVersion"]
    code, out, err = await tool("promote", "mlp", "--track", "globex-mlp")
    assert code == 6 and "mlp's track globex-mlp is Available" in err, (out, err)
    code, out, err = await tool("abort", "mlp", "--track", "acme-mlp")  # failed: not running
    assert code == 6 and "nothing to abort: mlp's track acme-mlp is Degraded" in err
    for command in ("promote", "abort", "retry"):
        code, out, err = await tool(command, "mlp", "--track", "initech-mlp")
        assert code == 2, (command, out, err)
        assert err.strip() == (
            "error: unknown track 'initech-mlp' for mlp: its tracks are acme-mlp, globex-mlp"
        )
    assert (await admin.read())["metadata"]["resourceVersion"] == before  # nothing written


async def test_promote_track_wait_follows_that_tracks_rollout(
    admin: Admin, kubeconfig: str
) -> None:
    """``--wait`` with ``--track`` ends on the track's result in status.tenants, while
    the deployment's own rollout stays held at its canary (following it would time out)."""
    progressing = {"version": "a2", "fromVersion": "a1", "startedAt": "2026-12-03T08:00:00Z",
                   "result": "Progressing", "reason": "AwaitingPromotion"}  # fmt: skip
    await tenant_deployment(admin, {**ACME_HELD, "history": [progressing]})
    argv = ("promote", "mlp", "--track", "acme-mlp", "--wait")
    tool = asyncio.create_task(run_tool("kubectl-model", *argv, "--kubeconfig", kubeconfig))
    key = track_keys("acme-mlp").promote
    await admin.when(lambda md: key in (md["metadata"].get("annotations") or {}))
    done = {
        "phase": "Available", "message": "2/2 pods serve a2", "currentVersion": "a2",
        "versions": {"a1": None, "a2": 2},  # a merge patch: a1 removed
        "rollout": {"toVersion": "a2", "stage": "complete"},
        "conditions": [{"type": "Progressing", "status": "False", "reason": "Idle"}],
        "history": [{**progressing, "result": "Succeeded", "reason": "2/2 pods serve a2",
                     "finishedAt": "2026-12-03T08:05:00Z"}],
    }  # fmt: skip
    await admin.set_status("mlp", {"tenants": {"acme-mlp": done}})
    code, out, err = await tool
    md = await admin.read()
    assert code == 0 and "result: Succeeded: 2/2 pods serve a2" in out, (out, err)
    assert "Available: 2/2 pods serve a2 | pods serving a2=2" in out  # the track's progress
    assert md["status"]["phase"] == "Canary"  # the deployment's own, never followed


# --- issue 31, item 6: tools that refuse what cannot work, and say why ---


async def test_rollback_to_a_version_the_resource_never_saw_is_refused_unless_forced(
    admin: Admin, kubeconfig: str
) -> None:
    """``--to v9``, never served, never found in the store: refused (exit 2) with the
    versions it knows; ``--dry-run`` writes nothing (the API server's dry run); ``--force``
    sets it. A version the operator verified in the store is not refused."""
    await deployment(admin)
    before = await admin.read()
    code, out, err = await run_tool(
        "kubectl-model", "rollback", "mlp", "--to", "v9", "--kubeconfig", kubeconfig
    )
    assert code == 2 and "mlp has no record of v9" in err and "Known: v1" in err, (out, err)
    assert "--force" in err
    code, out, err = await run_tool(
        "kubectl-model", "rollback", "mlp", "--to", "v9", "--force", "--dry-run",
        "--kubeconfig", kubeconfig,
    )  # fmt: skip
    assert code == 0 and "would roll back from v2 to v9 (dry run" in out, (out, err)
    after = await admin.read()
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    await admin.set_status("mlp", {"verifiedVersions": ["v2", "v7"]})
    code, out, err = await run_tool(
        "kubectl-model", "rollback", "mlp", "--to", "v7", "--kubeconfig", kubeconfig
    )
    assert code == 0 and "from v2 to v7" in out, (out, err)
    code, out, err = await run_tool(
        "kubectl-model", "rollback", "mlp", "--to", "v9", "--force", "--kubeconfig", kubeconfig
    )
    assert code == 0 and "from v7 to v9" in out, (out, err)
    assert (await admin.read())["spec"]["version"] == "v9"


async def test_a_release_to_a_store_the_deployment_does_not_fetch_from_is_refused(
    admin: Admin, kubeconfig: str, tmp_path: Path
) -> None:
    """Published where the pods never look, the version would never reach them: refused
    before publishing (exit 2), naming the store they fetch from. ``--dry-run`` checks
    the rest and publishes and writes nothing."""
    model, keys = tmp_path / "model.onnx", make_keys(tmp_path / "keys")
    write_mlp(model, seed=1)
    await admin.create(
        "s3", {"model": "mlp", "version": "v1", "store": {"url": "s3://models/prod"}}
    )
    await admin.create("pvc", {"model": "mlp", "version": "v1"})  # store: the pvc models

    def argv(deployment: str, store: str) -> list[str]:
        return ["release", "--model", "mlp", "--version", "v2", "--file", str(model),
                "--key", str(keys.private), "--deployment", deployment, "--store", store,
                "--kubeconfig", kubeconfig]  # fmt: skip

    directory = tmp_path / "store"
    code, out, err = await run_tool("model-rollout", *argv("s3", f"file://{directory}"))
    assert code == 2 and "fetches from s3://models/prod (spec.store.url)" in err, (out, err)
    code, out, err = await run_tool("model-rollout", *argv("s3", "s3://models/staging"))
    assert code == 2 and "not s3://models/staging" in err, (out, err)
    code, out, err = await run_tool("model-rollout", *argv("pvc", "s3://models/prod"))
    assert code == 2 and "fetches from the volume models (spec.store.pvc)" in err, (out, err)
    assert not directory.exists()  # nothing published
    for name in ("s3", "pvc"):
        assert (await admin.read(name))["spec"]["version"] == "v1"  # nothing written
    code, out, err = await run_tool(
        "model-rollout", *argv("pvc", f"file://{directory}"), "--dry-run"
    )
    assert code == 0 and "would publish mlp:v2" in out and "DryRun" in out, (out, err)
    assert not directory.exists() and (await admin.read("pvc"))["spec"]["version"] == "v1"


async def test_wait_against_a_hanging_api_ends_when_its_timeout_does(
    tools: ControlPlane, admin: Admin, user: Identity, tmp_path: Path
) -> None:
    """An API server that takes a request and never answers: ``promote --wait --timeout
    2`` ends as timed out (exit 3, its --timeout named), not as an API error after the
    client's own 30 s per request and its retry."""
    hang = asyncio.Event()

    async def stall(request: web.Request) -> None:
        if request.method == "GET" and request.path.endswith("/modeldeployments/mlp"):
            await hang.wait()

    await deployment(admin)
    async with intercepting_proxy(
        tools.server, lambda _: None, api_ssl(tools), before=stall
    ) as proxy:
        kubeconfig = str(kubeconfig_through(user, proxy, tmp_path / "config"))
        try:
            code, out, err = await run_tool(
                "kubectl-model", "promote", "mlp", "--wait", "--timeout", "2",
                "--kubeconfig", kubeconfig,
            )  # fmt: skip
            watched = await run_tool(
                "kubectl-model", "status", "mlp", "--watch", "--timeout", "2",
                "--kubeconfig", kubeconfig,
            )  # fmt: skip
        finally:
            hang.set()
    assert code == 3 and "--timeout 2s passed waiting for the Kubernetes API" in err, (out, err)
    assert watched[0] == 3 and "--timeout 2s passed" in watched[2], watched


@pytest.mark.parametrize(
    ("status", "code"),
    [
        ({**SERVING_V2, "phase": "Degraded", "message": "v2 failed"}, 1),
        ({"phase": "Invalid", "message": "spec refused"}, 1),
        (SERVING_V2, 0),
        (STATUS, 3),  # still a canary: as --wait's timeout
    ],
)
async def test_status_watch_with_a_timeout_exits_as_wait_does(
    admin: Admin, kubeconfig: str, status: dict[str, Any], code: int
) -> None:
    await deployment(admin)
    md = await admin.read()
    await admin.set_status("mlp", {**status, "observedGeneration": md["metadata"]["generation"]})
    result = await run_tool(
        "kubectl-model", "status", "mlp", "--watch", "--interval", "0.2", "--timeout", "1",
        "--kubeconfig", kubeconfig,
    )  # fmt: skip
    assert result[0] == code, result


async def test_status_json_has_the_pods_and_events_the_text_view_shows(
    admin: Admin, kubeconfig: str
) -> None:
    await deployment(admin)
    report = SidecarReport("mlp", "v2", "v1", SidecarState.LOADING, retained=("v0",))
    annotations = {"serving.model-rollout.io/target-version": "v2",
                   "serving.model-rollout.io/sidecar-status": report.to_json()}  # fmt: skip
    await admin.create_pod("mlp-a", {DEPLOYMENT_LABEL: "mlp"}, annotations)
    md = await admin.read()
    event = {
        "metadata": {"name": "mlp.canary"},
        "involvedObject": {"kind": "ModelDeployment", "name": "mlp", "namespace": admin.namespace,
                           "uid": md["metadata"]["uid"], "apiVersion": f"{GROUP}/v1alpha1"},
        "reason": "CanaryStarted", "message": "canary of v2 started", "type": "Normal",
        "firstTimestamp": "2026-12-03T08:00:00Z", "lastTimestamp": "2026-12-03T08:00:00Z",
    }  # fmt: skip
    await admin.core.create_namespaced_event(admin.namespace, event)
    code, text, err = await run_tool("kubectl-model", "status", "mlp", "--kubeconfig", kubeconfig)
    assert code == 0 and "mlp-a" in text and "canary of v2 started" in text, err
    code, out, err = await run_tool(
        "kubectl-model", "status", "mlp", "-o", "json", "--kubeconfig", kubeconfig
    )
    assert code == 0, err
    shown = json.loads(out)
    assert shown["spec"]["version"] == "v2" and shown["status"]["phase"] == "Canary"
    assert shown["pods"] == [
        {"name": "mlp-a", "ready": False, "serving": "v1", "retained": ["v0"], "target": "v2",
         "state": "loading", "reason": None}
    ]  # fmt: skip
    assert [(e["reason"], e["message"]) for e in shown["events"]] == [
        ("CanaryStarted", "canary of v2 started")
    ]


EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"


async def test_the_examples_promote_command_promotes_the_examples_canary(
    admin: Admin, kubeconfig: str
) -> None:
    """examples/modeldeployment-cpu-manual.yaml, created as it is (in this test's
    namespace), held at its canary of v8: the command its comment shows, run as it is
    written (its -n the test's namespace), writes the promotion of this rollout (the
    annotation ``promote=v8`` it used to show promoted nothing: the id was missing)."""
    path = EXAMPLES_DIR / "modeldeployment-cpu-manual.yaml"
    text = path.read_text()
    example = yaml.safe_load(text)
    name = example["metadata"]["name"]
    await admin.create(name, example["spec"])
    held = {
        **STATUS, "currentVersion": "v7", "targetVersion": "v8", "versions": {"v7": 2, "v8": 1},
        "rollout": {"toVersion": "v8", "fromVersion": "v7", "stage": "canary", "startedAt": 1e9},
    }  # fmt: skip
    await admin.set_status(name, held)
    line = next(c for c in commands_in(text) if c.startswith("kubectl model"))
    words = shlex.split(line)[2:]
    words[words.index("-n") + 1] = admin.namespace
    code, out, err = await run_tool("kubectl-model", *words, "--kubeconfig", kubeconfig)
    assert code == 0, (out, err)
    annotations = (await admin.read(name))["metadata"]["annotations"]
    assert annotations[PROMOTE] == "v8@1000000000"


async def test_list_and_tree_read_what_the_api_server_holds(
    tools: ControlPlane, admin: Admin, kubeconfig: str, namespace: str
) -> None:
    """``list`` shows the namespace's ModelDeployments (``-A``: every namespace's, for a
    user who may list them there); ``tree`` each pod's versions."""
    await deployment(admin)
    report = SidecarReport("mlp", "v2", "v1", SidecarState.FETCHING, retained=("v0",))
    annotations = {"serving.model-rollout.io/target-version": "v2",
                   "serving.model-rollout.io/sidecar-status": report.to_json()}  # fmt: skip
    await admin.create_pod("mlp-a", {DEPLOYMENT_LABEL: "mlp"}, annotations)
    code, out, err = await run_tool("kubectl-model", "list", "--kubeconfig", kubeconfig)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["NAME", "MODEL"] and lines[1].split()[:5] == [
        "mlp", "mlp", "v1", "v2", "2/2"
    ]  # fmt: skip
    code, out, err = await run_tool(
        "kubectl-model", "list", "-A", "--kubeconfig", str(tools.kubeconfig)
    )
    assert code == 0, err
    assert any(line.split()[:2] == [namespace, "mlp"] for line in out.splitlines()), out
    code, out, err = await run_tool("kubectl-model", "tree", "mlp", "--kubeconfig", kubeconfig)
    assert code == 0, err
    assert out.splitlines()[1:] == [
        "└── pod/mlp-a  not ready",
        "    ├── v2  loading (fetching)",
        "    ├── v1  serving",
        "    └── v0  retained",
    ]
