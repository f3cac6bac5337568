"""The ``kubectl-model`` plugin as a process against the emulated API server: found and
run by the real kubectl, the user's kubeconfig and its namespace honoured, and clear
errors (exit 4) for an RBAC denial, a missing resource and an unreachable API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kmock
import pytest

from cli_helpers import BIN, run_tool, write_kubeconfig
from model_rollout_e2e.binaries import BinaryNotFound, kubectl_binary
from model_rollout_e2e.kube_emulator import MD_PATH, create_model_deployment, kube_emulator
from model_rollout_e2e.processes import free_port

NAMESPACE = "ml"
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
            "triggeredBy": "release of v2 by ci@runner",
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


async def deployment(api: Any, name: str = "mlp", manual: bool = True) -> None:
    spec = {"model": "mlp", "version": "v2", "replicas": 2, "canary": {"manualPromote": manual}}
    await create_model_deployment(api, NAMESPACE, {"metadata": {"name": name}, "spec": spec})
    path = f"{MD_PATH.format(ns=NAMESPACE)}/{name}/status"
    await api.merge_patch(path, {"status": STATUS})


async def test_kubectl_finds_the_plugin_and_runs_it(tmp_path: Path) -> None:
    try:
        kubectl = kubectl_binary()
    except BinaryNotFound as exc:
        pytest.skip(str(exc))
    env = {"PATH": str(BIN), "HOME": str(tmp_path)}  # the venv's scripts only
    code, out, err = await run_tool(kubectl, "plugin", "list", env=env)
    assert code == 0, err
    assert str(BIN / "kubectl-model") in out
    async with kube_emulator() as api:
        await deployment(api)
        kubeconfig = write_kubeconfig(tmp_path / "config", api.url, NAMESPACE)
        code, out, err = await run_tool(
            kubectl, "model", "status", "mlp", "--kubeconfig", str(kubeconfig), env=env
        )
        assert code == 0, err
        for fragment in ("Name:        mlp", "Phase:       Canary (AwaitingPromotion)",
                         "Serving:     v1: 1 pods  v2: 1 pods", "kubectl model promote mlp",
                         "release of v2 by ci@runner"):  # fmt: skip
            assert fragment in out, out
        assert "\x1b[" not in out  # not a terminal: no colour
        # the context's namespace, overridden by -n as kubectl does
        code, out, err = await run_tool(
            kubectl, "model", "history", "mlp", "-n", "other", "--kubeconfig", str(kubeconfig),
            env=env,
        )  # fmt: skip
        assert code == 4 and "modeldeployment mlp not found in namespace other" in err


async def test_promote_writes_the_annotation_of_this_rollout(tmp_path: Path) -> None:
    async with kube_emulator() as api:
        await deployment(api)
        await deployment(api, "auto", manual=False)
        kubeconfig = str(write_kubeconfig(tmp_path / "config", api.url, NAMESPACE))
        code, out, err = await run_tool(
            "kubectl-model", "promote", "mlp", "--kubeconfig", kubeconfig
        )
        assert code == 0 and "canary of v2 promoted" in out, err
        md = await api.request("GET", f"{MD_PATH.format(ns=NAMESPACE)}/mlp")
        annotations = md["metadata"]["annotations"]
        assert annotations["serving.model-rollout.io/promote"] == "v2@1000000000"
        code, out, err = await run_tool(
            "kubectl-model", "promote", "auto", "--kubeconfig", kubeconfig
        )
        assert code == 6 and "manualPromote" in err
        code, out, err = await run_tool("kubectl-model", "retry", "mlp", "--kubeconfig", kubeconfig)
        assert code == 6 and "has not failed" in err
        # $KUBECONFIG as kubectl reads it (an unreadable path beside it is skipped)
        env = {"KUBECONFIG": f"{tmp_path / 'absent'}:{kubeconfig}"}
        code, out, err = await run_tool("kubectl-model", "history", "mlp", env=env)
        assert code == 0 and "release of v2 by ci@runner" in out, err
        code, out, err = await run_tool(
            "kubectl-model", "rollback", "mlp", "--kubeconfig", kubeconfig
        )
        assert code == 0 and "from v2 to v1" in out, err  # the last success but spec.version
        md = await api.request("GET", f"{MD_PATH.format(ns=NAMESPACE)}/mlp")
        assert md["spec"]["version"] == "v1"
        assert md["metadata"]["annotations"]["serving.model-rollout.io/change-cause"].startswith(
            "rollback by "
        )


async def test_an_rbac_denial_says_what_to_ask_for(tmp_path: Path) -> None:
    async with kube_emulator() as api:
        await deployment(api)
        assert api.emulator is not None

        def forbidden(request: Any) -> None:
            raise kmock.KubernetesError(403, "Forbidden", 'user "tester" cannot get it')

        api.emulator[f"get {MD_PATH.format(ns=NAMESPACE)}/mlp"] << forbidden
        kubeconfig = str(write_kubeconfig(tmp_path / "config", api.url, NAMESPACE))
        code, out, err = await run_tool(
            "kubectl-model", "status", "mlp", "--kubeconfig", kubeconfig
        )
    assert code == 4, (out, err)
    assert err.strip() == (
        "error: forbidden: get modeldeployments.serving.model-rollout.io in namespace ml: ask "
        "for RBAC that allows 'get' on modeldeployments.serving.model-rollout.io there "
        '(user "tester" cannot get it)'
    )
    assert "Traceback" not in err


async def test_missing_resources_and_an_unreachable_api_are_clear_errors(tmp_path: Path) -> None:
    async with kube_emulator() as api:
        kubeconfig = str(write_kubeconfig(tmp_path / "config", api.url, NAMESPACE))
        code, _, err = await run_tool("kubectl-model", "abort", "nope", "--kubeconfig", kubeconfig)
        assert code == 4 and err.strip() == "error: modeldeployment nope not found in namespace ml"
    dead = str(write_kubeconfig(tmp_path / "dead", f"http://127.0.0.1:{free_port()}", None))
    code, _, err = await run_tool("kubectl-model", "status", "mlp", "--kubeconfig", dead)
    assert code == 4 and "cannot reach the Kubernetes API" in err and "connection refused" in err
    assert "Traceback" not in err
    code, _, err = await run_tool(
        "kubectl-model", "status", "mlp", "--kubeconfig", str(tmp_path / "missing")
    )
    assert code == 4 and "cannot load the Kubernetes configuration" in err
    nowhere = {"HOME": str(tmp_path), "KUBECONFIG": "", "KUBERNETES_SERVICE_HOST": ""}
    code, _, err = await run_tool("kubectl-model", "status", "mlp", env=nowhere)
    assert code == 4 and "no Kubernetes configuration" in err
    code, _, err = await run_tool("kubectl-model", "frobnicate")
    assert code == 2 and "invalid choice" in err


async def test_watch_in_a_log_prints_a_view_only_when_something_changed(tmp_path: Path) -> None:
    async with kube_emulator() as api:
        await deployment(api)
        kubeconfig = str(write_kubeconfig(tmp_path / "config", api.url, NAMESPACE))
        code, out, err = await run_tool(
            "kubectl-model", "status", "mlp", "--watch", "--interval", "0.1", "--timeout", "1",
            "--kubeconfig", kubeconfig,
        )  # fmt: skip
    assert code == 0, err
    assert out.count("Name:        mlp") == 1 and out.rstrip().endswith("---")  # read ~10 times
