"""``model-operator --log-format json`` (issue 32) against a real API server: every line
the process writes is JSON — kopf's, aiohttp's and the operator's own — and kopf's
per-object lines carry the ModelDeployment as ``object``; the level asked for is the
least severe written; a refusal at start is one JSON line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.identities import Identity
from tests.support.control_plane_operator import (
    Operator,
    get,
    model_deployment,
    wait_for,
)
from tests.support.log_lines import json_lines


def settled_with(
    control_plane: ControlPlane, identity: Identity, namespace: str, tmp_path: Path, *flags: str
) -> str:
    """Everything an operator wrote, run in ``namespace`` until it has written a new
    ModelDeployment's status, then stopped."""
    admin = control_plane.kubectl
    operator = Operator(identity.kubeconfig, namespace, tmp_path / "op.log", extra=flags)
    operator.start()
    try:
        admin.apply(model_deployment(namespace))

        def settled() -> Any:
            md = get(admin, "md", "mlp", "-n", namespace) or {}
            status = md.get("status") or {}
            return status.get("observedGeneration") == md["metadata"]["generation"]

        wait_for("the status", settled, operator)
    finally:
        operator.stop()
    return operator.log_path.read_text()


def test_json_lines_only_and_kopfs_object_lines_name_the_resource(
    control_plane: ControlPlane, operator_identity: Identity, namespace: str, tmp_path: Path
) -> None:
    output = settled_with(
        control_plane, operator_identity, namespace, tmp_path, "--log-format", "json"
    )
    lines = json_lines(output)
    assert {line["level"] for line in lines} <= {"info", "warning", "error", "critical"}
    objects = [line for line in lines if "object" in line]
    assert objects, output
    for line in objects:
        assert line["logger"].startswith("kopf."), line
        assert line["object"]["kind"] == "ModelDeployment", line
        assert (line["object"]["namespace"], line["object"]["name"]) == (namespace, "mlp")
        assert not {"settings", "k8s_skip", "k8s_ref"} & line.keys(), line


def test_the_level_asked_for_is_the_least_severe_written(
    control_plane: ControlPlane, operator_identity: Identity, namespace: str, tmp_path: Path
) -> None:
    output = settled_with(
        control_plane, operator_identity, namespace, tmp_path,
        "--log-format", "json", "--log-level", "warning",
    )  # fmt: skip
    assert all(line["level"] != "info" for line in json_lines(output)), output


def _operator_without_cluster(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``model-operator --log-format json`` where nothing says where an API server is,
    but ``env``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "MODEL_"))}
    return subprocess.run(
        [sys.executable, "-m", "model_operator", "--log-format", "json"],
        capture_output=True, text=True, timeout=120, env={**clean, "HOME": str(tmp_path), **env},
    )  # fmt: skip


def test_no_api_server_is_one_json_line(tmp_path: Path) -> None:
    done = _operator_without_cluster(tmp_path)
    assert (done.returncode, done.stdout) == (2, ""), done
    [line] = json_lines(done.stderr)
    assert (line["level"], line["logger"]) == ("error", "model_operator"), line
    assert line["message"].startswith("no Kubernetes API server"), line


def test_an_uncaught_exception_is_one_json_line(tmp_path: Path) -> None:
    """A kubeconfig that is not there: kubernetes_asyncio's warning, then its exception,
    uncaught, with its traceback as a field of the one line."""
    done = _operator_without_cluster(tmp_path, KUBECONFIG=str(tmp_path / "none"))
    assert done.returncode == 1, done
    *_, crash = json_lines(done.stderr)
    assert (crash["level"], crash["message"]) == ("critical", "uncaught exception"), crash
    assert crash["exception"].startswith("Traceback (most recent call last):")
    assert "ConfigException" in crash["exception"].splitlines()[-1]
