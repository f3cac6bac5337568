"""What the programs' log tests read of their output: JSON lines, or the text format."""

from __future__ import annotations

import json
import re
from typing import Any

# the text format's line: time, level, logger, message (model_rollout_flags.logs)
TEXT_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ [\w.]+: .*")


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of the output parsed as JSON: a line that is not JSON fails the test."""
    parsed = []
    for line in text.splitlines():
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            raise AssertionError(f"not a JSON line: {line!r}\nin:\n{text}") from None
    return parsed
