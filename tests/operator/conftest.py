"""The operator tests' fixtures on the session's real control plane: the chart's
operator identity (installed once per module) and a namespace no operator runs for."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.identities import Identity
from model_rollout_e2e.node_agent import NodeAgent
from tests.support.control_plane_operator import install_chart
from tests.support.rollout_cluster import RolloutCluster, rollout_cluster


@pytest.fixture(scope="module")
def operator_identity(control_plane: ControlPlane) -> Identity:
    return install_chart(control_plane)


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
