"""docs/install.md, run as written (issue 32): every unmarked shell command of the guide,
read from the guide itself so the two cannot drift, in its order, on a control plane of
the test's own, each with ``bash -c`` as a reader's shell would run it. Only the values
the guide's ``export`` lines declare are the test's (:data:`OVERRIDES`: a SeaweedFS bucket
and its credentials), and the ``helm`` on PATH is Helm's own Go SDK behind helm's flags
(:mod:`model_rollout_e2e.helm_cli`). The chart's operator runs as the Deployment's two
pods on the kubelet stand-in, as do the model pods: no operator is started by the test,
so the rollouts the guide follows are the chart's operator's work.

A control plane of its own: the chart's cluster-scoped objects carry the release's name,
which the other tests' operators (the chart's RBAC applied without Helm) hold on the
session's control plane, and the guide deletes the CRD at the end."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib
import yaml

from model_rollout_e2e.binaries import BinaryNotFound
from model_rollout_e2e.container_runtime import ProcessContainers
from model_rollout_e2e.control_plane import COMPONENTS, ControlPlane, control_plane_binary
from model_rollout_e2e.node_agent import AgentThread, NodeAgent
from model_rollout_e2e.onnx_models import write_mlp
from model_rollout_e2e.processes import wait_until
from model_rollout_e2e.s3_scenario import BUCKET
from model_rollout_e2e.seaweed import CREDENTIALS_ENV, SeaweedFS
from tests.test_docs_commands import ROOT, Command, shell_commands

pytestmark = [pytest.mark.controlplane, pytest.mark.slow, pytest.mark.s3]

GUIDE = ROOT / "docs" / "install.md"
COMMAND_TIMEOUT_S = 900  # the guide's own waits are 10 minutes at most
RELEASE_NAMESPACE = "model-rollout-system"
LEADER_WAIT_S = 120.0


def guide_commands() -> list[Command]:
    """The guide's unmarked shell commands, in order (the marked ones need a Docker
    engine and a registry)."""
    return [c for c in shell_commands(GUIDE) if not c.marked]


def overrides(seaweed: SeaweedFS) -> dict[str, str]:
    """The test's value of each variable the guide exports."""
    seaweed.create_bucket(BUCKET)
    return {
        "REGISTRY": "registry.invalid/model-rollout",  # not pulled: no images here
        "STORE": f"s3://{BUCKET}/install-{uuid.uuid4().hex[:8]}",
        "AWS_ENDPOINT_URL": seaweed.endpoint,
        "AWS_ACCESS_KEY_ID": CREDENTIALS_ENV["AWS_ACCESS_KEY_ID"],
        "AWS_SECRET_ACCESS_KEY": CREDENTIALS_ENV["AWS_SECRET_ACCESS_KEY"],
    }


def exported(command: str) -> list[str]:
    """The names an ``export A=1 B=2`` line sets."""
    words = shlex.split(command, comments=True)
    assert words[0] == "export", command
    return [word.partition("=")[0] for word in words[1:]]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ControlPlane]:
    try:
        for name in COMPONENTS:
            control_plane_binary(name)
    except BinaryNotFound as exc:
        pytest.skip(str(exc))
    with ControlPlane(tmp_path / "control-plane") as plane:
        yield plane


@pytest.fixture
def pods() -> Iterator[Path]:
    """The pods' directories, under a short path: a pod's control socket must fit a
    Unix socket's 108 bytes (as the scenarios' ``/tmp/mr-*``)."""
    directory = Path(tempfile.mkdtemp(prefix="mr-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def node(cluster: ControlPlane, pods: Path) -> Iterator[AgentThread]:
    """One node for the operator's pods and the model pods: processes, nothing given but
    what the pod specs name (Secrets and tokens come from the API). ``KUBECONFIG`` is
    emptied so that no pod finds this test's credentials in its environment."""
    runtime = ProcessContainers(pods, env={"KUBECONFIG": ""}, api_server=cluster.server)
    agent = NodeAgent(cluster.node_kubeconfig("install-node"), runtime, "install-node")
    thread = AgentThread(agent).start()
    yield thread
    thread.stop()


def checkout(tmp_path: Path) -> Path:
    """Where the reader runs the guide: the repository's chart and examples, and the two
    model builds the guide asks for (small ONNX MLPs)."""
    work = tmp_path / "checkout"
    work.mkdir()
    for folder in ("deploy", "examples"):
        (work / folder).symlink_to(ROOT / folder)
    write_mlp(work / "model-v1.onnx", seed=1)
    write_mlp(work / "model-v2.onnx", seed=2)
    return work


def tools(tmp_path: Path) -> Path:
    """A ``helm`` on PATH: Helm's actions behind its flags."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    helm = bin_dir / "helm"
    helm.write_text(f'#!/bin/sh\nexec {sys.executable} -m model_rollout_e2e.helm_cli "$@"\n')
    helm.chmod(0o755)
    return bin_dir


def pod_logs(pods: Path) -> str:
    """The last lines of every container's log, for a failure's report."""
    logs = sorted(pods.glob("*/*.log"))
    tails = [f"== {p.parent.name}/{p.name}\n" + "\n".join(p.read_text().splitlines()[-15:])
             for p in logs]  # fmt: skip
    return "\n".join(tails)[-12000:]


def test_the_guide_lists_the_steps_the_issue_asks_for() -> None:
    """Build, Secrets, install, publish, apply, watch, canary, promote, roll back (both
    ways), upgrade, uninstall: a command for each, the build and push alone marked."""
    texts = [c.text for c in guide_commands()]
    for needed in (
        "model-sidecar keygen", "create secret generic model-signing-key",
        "create secret generic model-store-credentials", "helm install model-rollout",
        "model-sidecar publish", "kubectl apply -f", "--watch", "model-rollout release",
        "kubectl model promote", "kubectl model rollback", '{"spec":{"version":"v1"}}',
        "helm upgrade", "helm uninstall", "kubectl delete crd",
    ):  # fmt: skip
        assert any(needed in text for text in texts), needed
    marked = [c.text for c in shell_commands(GUIDE) if c.marked]
    assert "make images" in marked
    assert all(c.startswith(("make images", "for ", "docker ", "done")) for c in marked), marked


def test_the_guides_image_tags_are_the_projects_version() -> None:
    """``make images`` tags the project's version, which the chart's appVersion (the
    operator's default tag) follows; the guide pushes and the example runs that tag."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    pushed = [c.text for c in shell_commands(GUIDE) if c.text.startswith("docker ")]
    assert pushed and all(text.count(f":{version}") == text.count(":") for text in pushed)
    [example] = yaml.safe_load_all((ROOT / "examples" / "quickstart.yaml").read_text())
    assert example["spec"]["image"].endswith(f"/model-rollout-server-cpu:{version}")


@pytest.mark.timeout(1800)  # the guide's steps, each bounded by its own --timeout
def test_the_install_guide_runs_on_a_real_control_plane(
    cluster: ControlPlane, node: AgentThread, pods: Path, seaweed: SeaweedFS, tmp_path: Path
) -> None:
    values = overrides(seaweed)
    work = checkout(tmp_path)
    env = {
        **os.environ,
        "PATH": os.pathsep.join(
            [str(tools(tmp_path)), str(Path(sys.executable).parent), os.environ["PATH"]]
        ),
        "KUBECONFIG": str(cluster.kubeconfig),
    }
    declared: list[str] = []
    outputs: dict[str, str] = {}
    for command in guide_commands():
        if command.text.startswith("export "):
            names = exported(command.text)
            declared += names
            env.update({name: values[name] for name in names})
            continue
        done = subprocess.run(
            ["bash", "-c", command.text], cwd=work, env=env, capture_output=True, text=True,
            timeout=COMMAND_TIMEOUT_S, check=False,
        )  # fmt: skip
        outputs[command.text] = done.stdout
        with (tmp_path / "guide.log").open("a") as log:  # what ran, for a failure's reader
            log.write(f"$ {command.text}\nexit {done.returncode}\n{done.stdout}{done.stderr}\n")
        assert done.returncode == 0, (
            f"{command.doc}:{command.line}: {command.text}\nexit {done.returncode}\n"
            f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}\npods:\n{pod_logs(pods)}"
        )
        if command.text.startswith(f"kubectl -n {RELEASE_NAMESPACE} rollout status"):
            check_the_charts_operator_leads(cluster)
    assert sorted(declared) == sorted(values), "the guide's exports and the test's values"
    history = next(out for text, out in outputs.items() if "kubectl model history" in text)
    # v1, v2 released and promoted, v1 by kubectl model rollback, v2 again left for v1
    assert history.count("Succeeded") == 4 and "Superseded" in history, history
    assert "release by" in history and "rollback by" in history, history
    left = next(out for text, out in outputs.items() if text.startswith("kubectl get crd"))
    assert "modeldeployments.serving.model-rollout.io" in left  # helm uninstall left it


def check_the_charts_operator_leads(cluster: ControlPlane) -> None:
    """A Lease is held by one of the chart's operator pods: the rollouts that follow are
    that Deployment's work (the test starts no operator)."""

    def leader() -> str | None:
        leases = cluster.kubectl.get("leases", "-n", RELEASE_NAMESPACE)["items"]
        holders = {(lease.get("spec") or {}).get("holderIdentity") for lease in leases}
        pods = cluster.kubectl.get("pods", "-n", RELEASE_NAMESPACE)["items"]
        names = {p["metadata"]["name"] for p in pods}
        return next(iter(holders & names), None)

    wait_until(leader, LEADER_WAIT_S, 0.5, "a Lease held by one of the chart's operator pods")
