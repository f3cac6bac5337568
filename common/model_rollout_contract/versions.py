"""The one order of versions, used wherever "newer" or "older" is decided: the server's
default version, the init container's predecessor for rollback, retention on disk and
what the tools show.

Versions are ordered as people write them, by a published rule, and only where every
version compared follows it:

* PEP 440 (:mod:`packaging.version`, which accepts a leading ``v``): ``v2 < v10`` and
  ``1.10.0rc1 < 1.10.0`` (``1.10.0-rc1`` is the same version);
* else SemVer 2.0.0 precedence (https://semver.org/#spec-item-11, a leading ``v``
  accepted) where every version is one: ``1.0.0-alpha.beta < 1.0.0-beta``;
* else there is no implied order (git SHAs, dates with dashes, free text): the
  ``history`` (publish order, or the ModelDeployment's rollouts, oldest first) decides.

``packaging`` is the contract's one dependency: the canonical, pure-Python reading of
PEP 440, where an own parser would be a second, subtly different rule."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from packaging.version import InvalidVersion, Version

# semver.org's suggested expression, with an optional leading v
_SEMVER = re.compile(
    r"^[vV]?(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)

Key = Callable[[str], Any]


def pep440(version: str) -> Version | None:
    try:
        return Version(version)
    except InvalidVersion:
        return None


def semver(version: str) -> tuple[Any, ...] | None:
    """SemVer precedence as a sort key (build metadata ignored), ``None`` for text that
    is not SemVer. A release ranks above its pre-releases; pre-release identifiers
    compare numbers numerically, below words, which compare as ASCII."""
    match = _SEMVER.match(version)
    if match is None:
        return None
    major, minor, patch, pre, _build = match.groups()
    if pre is None:
        rank: tuple[Any, ...] = (1,)
    else:
        ids = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in pre.split("."))
        rank = (0, ids)
    return (int(major), int(minor), int(patch), rank)


def rule(versions: Iterable[str]) -> Key | None:
    """The published rule every one of ``versions`` follows (PEP 440 first, then SemVer),
    ``None`` when none does: then only a history orders them."""
    unique = set(versions)
    if all(pep440(v) is not None for v in unique):
        return pep440
    if all(semver(v) is not None for v in unique):
        return semver
    return None


def is_ordered(versions: Iterable[str], history: Sequence[str] = ()) -> bool:
    """Whether ``versions`` have an order: a rule they all follow, or a history that
    names them all."""
    unique = set(versions)
    return rule(unique) is not None or unique <= set(history)


def sorted_versions(versions: Iterable[str], history: Sequence[str] = ()) -> list[str]:
    """Oldest first. By the rule all follow (equal versions such as ``v1`` and ``1.0``
    by the history, then as text); without one, the versions the history names in its
    order, after those it does not name (as text: shown in a stable order, none of them
    counted newer than a version the history has)."""
    unique = set(versions)
    by_rule = rule(unique)
    if by_rule is not None:
        return _sorted_by(by_rule, unique, history)
    position = _positions(history)
    return sorted(unique, key=lambda v: (v in position, position.get(v, -1), v))


def _sorted_by(by_rule: Key, versions: Iterable[str], history: Sequence[str]) -> list[str]:
    """Oldest first by ``by_rule`` (equal ones by the history, then as text)."""
    position = _positions(history)
    return sorted(versions, key=lambda v: (by_rule(v), position.get(v, -1), v))


def _positions(history: Sequence[str]) -> dict[str, int]:
    """Each version's first place in the history (a version rolled out again keeps it)."""
    position: dict[str, int] = {}
    for i, v in enumerate(history):
        position.setdefault(v, i)
    return position


def newest(versions: Iterable[str], history: Sequence[str] = ()) -> str | None:
    """The newest version, ``None`` for none, or for versions that have no order (see
    :func:`is_ordered`): a git SHA is not newer than another."""
    unique = set(versions)
    if len(unique) > 1 and not is_ordered(unique, history):
        return None
    ordered = sorted_versions(unique, history)
    return ordered[-1] if ordered else None


def predecessor(versions: Iterable[str], version: str, history: Sequence[str] = ()) -> str | None:
    """The newest of ``versions`` older than ``version`` (the rollback target by
    default): by the rule all follow, else the one the history has just before it;
    ``None`` when there is none or no order says which."""
    unique = set(versions) - {version}
    by_rule = rule(unique | {version})
    if by_rule is not None:
        key = by_rule(version)  # the rule of all of them: that of the older ones alone
        # can differ (1.0.0 and 1.0.0-1 are PEP 440, 1.0.1-0.0 is SemVer only)
        older = _sorted_by(by_rule, (v for v in unique if by_rule(v) < key), history)
        return older[-1] if older else None
    if version not in history:
        return None
    before = history[: list(history).index(version)]
    return next((v for v in reversed(before) if v in unique), None)
