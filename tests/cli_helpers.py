"""Running the day-2 tools as a user does: their console scripts as processes, with a
kubeconfig file naming the (emulated) API server and a namespace."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import yaml

BIN = Path(sys.executable).parent  # the venv's scripts: kubectl-model, model-rollout
TOOL_TIMEOUT_S = 600.0  # a hang guard only


def write_kubeconfig(path: Path, server: str, namespace: str | None) -> Path:
    context: dict[str, str] = {"cluster": "emulated", "user": "tester"}
    if namespace is not None:
        context["namespace"] = namespace
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulated", "cluster": {"server": server}}],
        "users": [{"name": "tester", "user": {"token": "test-token"}}],
        "contexts": [{"name": "test", "context": context}],
        "current-context": "test",
    }
    path.write_text(yaml.safe_dump(config))
    return path


async def run_tool(
    program: str, *args: str, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``program`` (a script beside the interpreter, or
    a path); it runs beside the test's event loop, which serves the emulated API."""
    path = program if os.sep in program else str(BIN / program)
    proc = await asyncio.create_subprocess_exec(
        path,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "NO_COLOR": "1", **(env or {})},
    )
    out, err = await asyncio.wait_for(proc.communicate(), TOOL_TIMEOUT_S)
    return proc.returncode if proc.returncode is not None else -1, out.decode(), err.decode()
