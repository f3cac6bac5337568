"""``pause`` and ``resume``, as ``kubectl argo rollouts pause|resume``: each sets
``spec.paused`` of the ModelDeployment (one merge patch; the rollout-editor role may),
and the operator holds or continues every rollout of the resource (its tenant models'
too). While paused no rollout step starts: loads in flight finish, ``abort`` and a fast
rollback still act (docs/day2.md)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TextIO

from .errors import NOTHING_TO_DO, OK, CliError
from .kube import Cluster

COMMANDS = ("pause", "resume")


def add_parsers(command: Callable[..., argparse.ArgumentParser]) -> None:
    command("pause", "hold every rollout of the ModelDeployment where it is (spec.paused)")
    command("resume", "let a paused ModelDeployment's rollouts go on (spec.paused: false)")


def is_paused(md: dict[str, Any]) -> bool:
    return (md.get("spec") or {}).get("paused") is True


def unpause_patch(md: dict[str, Any]) -> dict[str, Any]:
    """What a patch adds to resume ``md`` (nothing when it is not paused): a promotion
    resumes a paused resource, as Argo Rollouts' does."""
    return {"spec": {"paused": False}} if is_paused(md) else {}


def set_paused(cluster: Cluster, name: str, paused: bool, out: TextIO) -> int:
    md = cluster.get(name)
    if is_paused(md) == paused:
        state = "paused already" if paused else "not paused"
        raise CliError(f"nothing to do: {name} is {state} (spec.paused)", NOTHING_TO_DO)
    cluster.patch(name, {"spec": {"paused": paused}})
    phase = (md.get("status") or {}).get("phase") or "Pending"
    if paused:
        print(
            f"modeldeployment {name} paused: no rollout step starts until "
            f"kubectl model resume {name} (was {phase})",
            file=out,
        )
    else:
        print(f"modeldeployment {name} resumed", file=out)
    return OK


def run(cluster: Cluster, args: argparse.Namespace, out: TextIO) -> int:
    return set_paused(cluster, args.name, args.command == "pause", out)
