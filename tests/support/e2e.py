"""The end-to-end tests' common opening on a :class:`Scenario`: a version deployed and
available, then its pods (their URLs, and their lives to compare at the end)."""

from __future__ import annotations

from typing import Any

from model_rollout_e2e.scenario import Scenario, available

Lives = dict[str, dict[str, tuple[str, str, int]]]  # pod uid -> container -> (id, start, restarts)


async def deployed(
    scenario: Scenario, version: str, replicas: int, timeout_s: float, **spec: Any
) -> None:
    """The ModelDeployment at ``version`` with ``replicas`` (and ``spec``), available."""
    await scenario.apply(version, replicas, **spec)
    await scenario.wait(available(version, replicas), timeout_s)


async def pods_of(scenario: Scenario, replicas: int) -> tuple[list[str], Lives]:
    """Each pod's URL and life (uid, containers and their starts): one of each per replica."""
    urls = scenario.pod_urls()
    assert len(urls) == replicas, urls
    lives = await scenario.pod_lives()
    assert len(lives) == replicas, lives
    return urls, lives
