"""The ``operator/`` folder must never shadow the standard library's ``operator``."""

from __future__ import annotations

import importlib
import operator
import subprocess
import sys
import sysconfig
from pathlib import Path


def test_stdlib_operator_is_not_shadowed() -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert not hasattr(operator, "__file__") or Path(operator.__file__).parent == stdlib
    assert operator.add(2, 3) == 5
    assert importlib.import_module("model_operator.planner").plan_rollout


def test_fresh_interpreter_in_repo_root_sees_stdlib_operator() -> None:
    """Even with the repository root first on sys.path (as with ``python -m`` there)."""
    root = Path(__file__).parent.parent
    code = "import operator, collections; print(operator.itemgetter(0)([7]))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "7", out.stderr
