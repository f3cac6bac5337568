"""Where every benchmark leaves its figures: one JSON file, its folder made, its path
printed last (so a run's log says which file holds what it printed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(out: str | Path, report: Any) -> Path:
    """Write ``report`` to ``out`` as indented JSON and print where."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"json: {path}")
    return path
