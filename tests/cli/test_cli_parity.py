"""The plugin's parity with ``kubectl argo rollouts``: ``pause``, ``resume``, ``promote
--full`` and ``kubectl model <TAB>`` (``kubectl_complete-model``, which the real kubectl
runs). Views and completion as functions; the commands as the rollout editor runs them on
the session's real API server, judged by the chart's editor admission policy; the
completion through the real kubectl binary."""

from __future__ import annotations

import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import tomllib

from model_rollout_cli import kubectl_complete, plugin
from model_rollout_cli.overview import list_row
from model_rollout_cli.view import render
from model_rollout_contract.annotations import PROMOTE
from model_rollout_e2e.binaries import BinaryNotFound, kubectl_binary
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.kubeconfig import write_kubeconfig
from model_rollout_e2e.processes import free_port
from tests.cli.test_cli_plugin import STATUS, deployment
from tests.support.cli import EDITOR, Admin, bound_user, run_tool

ROOT = Path(__file__).resolve().parents[2]
NOW = datetime(2026, 12, 6, tzinfo=timezone.utc)
PAUSED_CONDITION = {
    "type": "Paused",
    "status": "True",
    "reason": "RolloutPaused",
    "message": "paused (spec.paused) at the canary stage: 1/2 pods serve v2",
}


def resource(paused: bool, reason: str = "Paused") -> dict[str, Any]:
    conditions = [{"type": "Progressing", "status": "True", "reason": reason}]
    if paused:
        conditions.append(PAUSED_CONDITION)
    return {
        "metadata": {"name": "mlp", "namespace": "ml"},
        "spec": {"model": "mlp", "version": "v2", "replicas": 2, "paused": paused},
        "status": {**STATUS, "conditions": conditions},
    }


def test_status_and_list_say_a_resource_is_paused() -> None:
    text = render(resource(True), [], [], NOW)
    assert "Phase:       Canary (Paused)" in text
    assert (
        "Paused:      yes (kubectl model resume mlp): paused (spec.paused) at the canary stage"
    ) in text
    assert "Paused:" not in render(resource(False, "CanaryPause"), [], [], NOW)
    assert list_row(resource(True), NOW, False)[5] == "Canary (Paused)"
    idle = resource(True, "CanaryPause")  # paused, the operator not there yet
    assert list_row(idle, NOW, False)[5] == "Canary (CanaryPause) paused"
    assert list_row(resource(False, "CanaryPause"), NOW, False)[5] == "Canary (CanaryPause)"


def complete(*words: str) -> list[str]:
    def names(prefix: str, **_: object) -> list[str]:
        return [n for n in ("mlp", "other") if n.startswith(prefix)]

    parser = kubectl_complete.with_name_completer(plugin.build_parser(), names)
    return [c for c, _ in kubectl_complete.candidates(parser, list(words))]


def test_completion_walks_the_plugins_own_parser() -> None:
    assert complete("pa") == ["pause"]
    assert {"pause", "resume", "promote", "status", "completion"} <= set(complete(""))
    assert "--full" in complete("promote", "mlp", "--f")
    assert complete("status", "-o", "") == ["text", "json"]
    assert complete("completion", "") == ["bash", "zsh", "fish"]
    assert complete("resume", "") == ["mlp", "other"]  # the name's completer
    assert complete("-n", "ml", "promote", "o") == ["other"]  # kubectl's flags first
    assert complete("status", "") == ["mlp", "other"]  # no flags until "-" is typed
    lines = kubectl_complete.cobra_lines([("pause", "hold it"), ("mlp", "")])
    assert lines == ["pause\thold it", "mlp", ":4"]


def test_the_console_script_is_the_completion_module() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kubectl_complete-model"] == "model_rollout_cli.kubectl_complete:main"


def shims(where: Path) -> dict[str, str]:
    """``kubectl-model`` and ``kubectl_complete-model`` on a PATH of their own, each
    running this checkout's module with this interpreter (the console scripts of an
    installed venv may predate the checkout)."""
    where.mkdir()
    modules = {
        "kubectl-model": "model_rollout_cli",
        "kubectl_complete-model": "model_rollout_cli.kubectl_complete",
    }
    for name, module in modules.items():
        shim = where / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m {module} "$@"\n')
        shim.chmod(0o755)
    return {"PATH": f"{where}:/usr/bin:/bin", "HOME": str(where)}


def kubectl() -> str:
    try:
        return kubectl_binary()
    except BinaryNotFound as exc:
        pytest.skip(str(exc))


async def test_kubectl_completes_the_plugins_words(tmp_path: Path) -> None:
    env = shims(tmp_path / "bin")
    code, out, err = await run_tool(kubectl(), "__complete", "model", "pa", env=env)
    assert code == 0, err
    assert out.splitlines() == [
        "pause\thold every rollout of the ModelDeployment where it is (spec.paused)",
        ":4",
    ]
    code, out, err = await run_tool(
        kubectl(), "__complete", "model", "promote", "mlp", "--fu", env=env
    )
    assert code == 0 and out.splitlines()[0].startswith("--full\tskip what remains"), (out, err)
    # an API that does not answer: no names, no hang, no error
    (tmp_path / "ca.pem").touch()
    dead = write_kubeconfig(
        tmp_path / "dead", f"http://127.0.0.1:{free_port()}", tmp_path / "ca.pem", token="t"
    )
    code, out, err = await run_tool(
        kubectl(), "__complete", "model", "status", "--kubeconfig", str(dead), "", env=env
    )
    assert (code, out.splitlines()) == (0, [":4"]), err


# ------------------------------------------------------------ on a real API server


@pytest.fixture
def kubeconfig(tools: ControlPlane, namespace: str) -> str:
    """The README's user of the tools: the rollout editor in this namespace."""
    return str(bound_user(tools, namespace, "alice", EDITOR).kubeconfig)


async def test_kubectl_completes_the_names_of_the_namespaces_model_deployments(
    admin: Admin, kubeconfig: str, tmp_path: Path
) -> None:
    await deployment(admin)
    await deployment(admin, "other")
    env = shims(tmp_path / "bin")
    code, out, err = await run_tool(
        kubectl(), "__complete", "model", "pause", "--kubeconfig", kubeconfig, "", env=env
    )
    assert (code, out.splitlines()) == (0, ["mlp", "other", ":4"]), err
    code, out, err = await run_tool(
        kubectl(), "__complete", "model", "--kubeconfig", kubeconfig, "status", "o", env=env
    )
    assert (code, out.splitlines()) == (0, ["other", ":4"]), err


async def test_the_rollout_editor_pauses_resumes_and_promotes_fully(
    admin: Admin, kubeconfig: str
) -> None:
    """Each a merge patch the editor admission policy lets through; a promotion of a
    paused resource resumes it, as Argo's does; nothing to do is exit 6."""
    await deployment(admin)
    code, out, err = await run_tool("kubectl-model", "pause", "mlp", "--kubeconfig", kubeconfig)
    assert code == 0 and "modeldeployment mlp paused" in out, err
    assert (await admin.read())["spec"]["paused"] is True
    code, out, err = await run_tool("kubectl-model", "pause", "mlp", "--kubeconfig", kubeconfig)
    assert code == 6 and "paused already" in err
    code, out, err = await run_tool("kubectl-model", "status", "mlp", "--kubeconfig", kubeconfig)
    assert code == 0 and "Paused:      yes (kubectl model resume mlp)" in out, err
    code, out, err = await run_tool(
        "kubectl-model", "promote", "mlp", "--full", "--kubeconfig", kubeconfig
    )
    assert code == 0 and "rollout of v2 fully promoted" in out and "mlp resumed" in out, err
    md = await admin.read()
    assert md["metadata"]["annotations"][PROMOTE] == "v2@1000000000+full"
    assert md["spec"]["paused"] is False
    code, out, err = await run_tool("kubectl-model", "resume", "mlp", "--kubeconfig", kubeconfig)
    assert code == 6 and "not paused" in err
    for command in ("pause", "resume"):
        code, out, err = await run_tool("kubectl-model", command, "mlp", "--kubeconfig", kubeconfig)
        assert code == 0, err
    assert (await admin.read())["spec"]["paused"] is False
    # no rollout runs: nothing to promote fully
    done = {**STATUS["rollout"], "stage": "complete"}  # type: ignore[dict-item]
    await admin.set_status("mlp", {**STATUS, "phase": "Available", "rollout": done})
    code, out, err = await run_tool(
        "kubectl-model", "promote", "mlp", "--full", "--kubeconfig", kubeconfig
    )
    assert code == 6 and "no rollout runs" in err
