"""The one order of versions, used wherever "newer" or "older" is decided: the server's
default version, the init container's predecessor for rollback, and retention on disk.

Natural order: digit runs compare as numbers, so ``v2 < v10`` and dates such as
``2026-11-30`` sort as dates."""

from __future__ import annotations

import re
from collections.abc import Iterable


def version_order(version: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key: digit runs as numbers, the rest as text (numbers before text)."""
    parts = (p for p in re.split(r"(\d+)", version) if p)
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in parts)


def sorted_versions(versions: Iterable[str]) -> list[str]:
    """Oldest first."""
    return sorted(versions, key=version_order)


def newest(versions: Iterable[str]) -> str | None:
    ordered = sorted_versions(versions)
    return ordered[-1] if ordered else None


def predecessor(versions: Iterable[str], version: str) -> str | None:
    """The newest version older than ``version`` (the rollback target by default)."""
    older = [v for v in sorted_versions(versions) if version_order(v) < version_order(version)]
    return older[-1] if older else None
