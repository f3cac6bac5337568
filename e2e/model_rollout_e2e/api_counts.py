"""What the API server itself counted: the writes of its audit log in a window of time,
by who wrote and what, and the CPU time a process has used. A benchmark's or test's
figures come from here rather than from the clients' own accounts of what they sent."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

WRITE_VERBS = ("create", "update", "patch", "delete", "deletecollection")


def now_utc() -> datetime:
    """A mark for :func:`writes_between` (the API server runs on this machine's clock)."""
    return datetime.now(timezone.utc)


def received_at(entry: Mapping[str, Any]) -> datetime:
    """When the API server received the request of an audit log entry."""
    return datetime.fromisoformat(str(entry["requestReceivedTimestamp"]))


def writes_between(
    entries: Iterable[Mapping[str, Any]], since: datetime | None, until: datetime | None = None
) -> list[Mapping[str, Any]]:
    """The writes received in ``[since, until)`` (either end open when ``None``)."""
    return [
        e for e in entries
        if e.get("verb") in WRITE_VERBS
        and (since is None or received_at(e) >= since)
        and (until is None or received_at(e) < until)
    ]  # fmt: skip


def resource_of(entry: Mapping[str, Any]) -> str:
    """``pods``, ``pods/status``, ``modeldeployments/status``, ``leases``, ..."""
    ref = entry.get("objectRef") or {}
    resource = str(ref.get("resource") or "?")
    sub = ref.get("subresource")
    return f"{resource}/{sub}" if sub else resource


@dataclass(frozen=True)
class WriteCounts:
    """Writes counted by (user, resource[/subresource]) and by verb."""

    by_writer: Counter[tuple[str, str]]
    by_verb: Counter[str]

    @classmethod
    def of(cls, entries: Iterable[Mapping[str, Any]]) -> WriteCounts:
        by_writer: Counter[tuple[str, str]] = Counter()
        by_verb: Counter[str] = Counter()
        for entry in entries:
            by_writer[(str((entry.get("user") or {}).get("username")), resource_of(entry))] += 1
            by_verb[str(entry.get("verb"))] += 1
        return cls(by_writer, by_verb)

    def total(self, exclude: Iterable[str] = ()) -> int:
        """All writes but those to the resources in ``exclude`` (``leases``, say)."""
        skipped = set(exclude)
        return sum(n for (_, res), n in self.by_writer.items() if res not in skipped)

    def status_writes(self, resource: str) -> int:
        """PUTs and PATCHes of ``resource``'s status subresource."""
        return sum(n for (_, res), n in self.by_writer.items() if res == f"{resource}/status")

    def table(self) -> list[dict[str, Any]]:
        """Rows for a JSON report, most first."""
        return [
            {"user": user, "resource": resource, "writes": n}
            for (user, resource), n in self.by_writer.most_common()
        ]


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far (``/proc/<pid>/stat``),
    its waited-for children included."""
    with open(f"/proc/{pid}/stat") as stat:
        text = stat.read()
    # the command name (field 2) may hold spaces: the fields after it follow its ")"
    fields = text[text.rindex(")") + 2 :].split()
    utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
    return (utime + stime + cutime + cstime) / os.sysconf("SC_CLK_TCK")
