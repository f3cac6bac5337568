"""Plain-text tables, ages and timestamps as kubectl prints them."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone

MAX_CELL = 80  # characters of one cell (a reason, a message) before it is cut


def timestamp(value: object) -> datetime | None:
    """An RFC 3339 time from the API (``2026-12-03T08:19:47Z``), or ``None``."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def age(seconds: float) -> str:
    """``45s``, ``3m10s``, ``2h5m``, ``4d``: kubectl's AGE column, roughly."""
    s = max(0, int(seconds))
    if s < 120:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60}s" if s < 600 else f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60}m"
    return f"{s // 86400}d"


def since(value: object, now: datetime) -> str:
    moment = timestamp(value)
    return "-" if moment is None else age((now - moment).total_seconds())


def cut(text: str, width: int = MAX_CELL) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def table(header: Sequence[str], rows: Sequence[Sequence[str]], last_free: bool = True) -> str:
    """Columns padded to their widest cell, three spaces apart; the last column is cut
    to :data:`MAX_CELL` instead of padded when ``last_free``."""
    cells = [list(header), *[[cut(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        padded = [c.ljust(w) for c, w in zip(row, widths, strict=True)]
        if last_free:
            padded[-1] = row[-1]
        lines.append("   ".join(padded).rstrip())
    return "\n".join(lines)
