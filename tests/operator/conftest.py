"""The operator tests' fixtures on the session's real control plane: the chart's
operator identity (installed once per module), a namespace of the test's own, and a
namespace no operator runs for."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.identities import Identity
from model_rollout_e2e.node_agent import NodeAgent
from tests.support.control_plane_operator import Operator, install_chart
from tests.support.namespaces import namespace_of_its_own
from tests.support.rollout_cluster import RolloutCluster, rollout_cluster


@pytest.fixture(scope="module")
def operator_identity(control_plane: ControlPlane) -> Identity:
    return install_chart(control_plane)


@pytest.fixture
def namespace(
    request: pytest.FixtureRequest,
    control_plane: ControlPlane,
    operator_identity: Identity,
    node_agents: Callable[..., NodeAgent],
) -> Iterator[str]:
    """A namespace of the test's own, named after its module, deleted with what the test
    left in it before the test's nodes are (it asks for ``node_agents`` so that pytest
    tears it down first): pods of a Deployment left behind never reach a later test's
    node, where they would take its GPUs."""
    prefix = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    with namespace_of_its_own(control_plane, prefix.replace("_", "-")[:40]) as name:
        yield name


@pytest.fixture
def operator(operator_identity: Identity, namespace: str, tmp_path: Path) -> Iterator[Operator]:
    """The operator as the chart's ServiceAccount, for this test's namespace, the store not
    checked (none here); stopped whatever the test did. A module that needs another kind
    defines its own ``operator``."""
    started = Operator(
        operator_identity.kubeconfig, namespace, tmp_path / "op.log", extra=["--no-store-check"]
    ).start()
    yield started
    started.stop()


@pytest.fixture
async def bare_cluster(
    control_plane: ControlPlane,
    operator_identity: Identity,
    node_agents: Callable[..., NodeAgent],
    tmp_path: Path,
) -> AsyncIterator[RolloutCluster]:
    """A namespace no operator runs for: the test starts its own (stops, kills it)."""
    async with rollout_cluster(
        control_plane, operator_identity, node_agents, tmp_path, "rollout"
    ) as created:
        yield created
