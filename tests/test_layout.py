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
    root = Path(__file__).resolve().parents[1]
    code = "import operator, collections; print(operator.itemgetter(0)([7]))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "7", out.stderr


ROOT = Path(__file__).resolve().parents[1]
IMAGES = {  # Dockerfile -> (source folders it copies, the extras it installs)
    "Dockerfile.server": ({"common", "server", "sidecar"}, "server,sidecar"),
    "Dockerfile.operator": ({"common", "operator"}, "operator"),
    "Dockerfile.server-cpu": ({"common", "server", "sidecar"}, "server,sidecar"),
    "Dockerfile.sidecar": ({"common", "sidecar"}, "sidecar"),
}


def test_each_image_carries_only_its_programs() -> None:
    import re

    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # the base is the contract alone, with the one library its version order needs
    assert project["project"]["dependencies"] == ["packaging>=22"]
    extras = project["project"]["optional-dependencies"]
    assert not any("onnxruntime" in d or "numpy" in d for d in extras["operator"])
    assert "model_rollout_e2e" not in str(project["tool"]["setuptools"])  # tooling stays out
    for name, (folders, extra) in IMAGES.items():
        text = (ROOT / name).read_text()
        copied = set(re.findall(r"^COPY (\w+) \1$", text, re.M))
        assert copied == folders, (name, copied)
        assert f'".[{extra}]"' in text, name
