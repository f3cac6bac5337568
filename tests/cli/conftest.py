"""The day-2 tools' tests on the session's real control plane: the CRD and the chart's
user roles installed once per module, and a namespace of each test's own with its admin."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from model_rollout_e2e.control_plane import ControlPlane
from tests.support.cli import Admin, install_tools
from tests.support.namespaces import namespace_of_its_own


@pytest.fixture(scope="module")
def tools(control_plane: ControlPlane) -> ControlPlane:
    install_tools(control_plane)
    return control_plane


@pytest.fixture
def namespace(tools: ControlPlane) -> Iterator[str]:
    with namespace_of_its_own(tools, "cli") as name:
        yield name


@pytest.fixture
async def admin(tools: ControlPlane, namespace: str) -> AsyncIterator[Admin]:
    async with Admin.connect(tools, namespace) as cluster_admin:
        yield cluster_admin
