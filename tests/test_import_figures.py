"""The README's command for the server's import figures runs and counts what it says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_figures_command_counts_the_servers_layers() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "import_figures.py"), "model_server"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    figures = re.match(
        r"model_server: (\d+) modules, (\d+) import edges, longest chain (\d+) modules, "
        r"(\d+) upward edges",
        run.stdout,
    )
    assert figures is not None, run.stdout
    modules, edges, chain, upward = map(int, figures.groups())
    assert modules > 50 and edges > modules and 1 < chain < modules
    assert upward == 0, run.stdout  # what lint-imports' layers contract says too
