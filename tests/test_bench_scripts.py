"""The benchmark scripts are leaves: what they share is in bench/bench_support.py, and no
script imports another by its name (a script is run, never a library)."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
SUPPORT = "bench_support"


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_benchmark_script_imports_another() -> None:
    scripts = {path.stem: path for path in BENCH.glob("*.py") if path.stem != SUPPORT}
    assert len(scripts) > 5  # the check below cannot pass on an empty folder
    imports = {name: _imported(path) & set(scripts) for name, path in scripts.items()}
    assert imports == {name: set() for name in scripts}
    assert all(SUPPORT in _imported(path) for path in scripts.values())  # one place for JSON
    assert SUPPORT not in _imported(BENCH / f"{SUPPORT}.py") and not (
        _imported(BENCH / f"{SUPPORT}.py") & set(scripts)
    )
