"""Structured JSON audit log: one line per load, swap, rollback or refusal.

The file lives on a volume only the server mounts, and is opened without following a
link in its place (``O_NOFOLLOW``), so nothing else can point the server's writes at
another file. A line that cannot be written is logged, and the action goes on."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("model_server.observability.audit")
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class AuditEvent:
    action: str  # load | rollback | traffic
    model: str
    version: str
    who: str
    source: str  # http | socket | startup
    result: str  # success | failure | noop
    from_version: str | None = None
    digest: str | None = None
    duration_s: float | None = None
    error: str | None = None
    detail: str | None = None  # traffic: the policy set (its annotation form), or "cleared"


class AuditLog:
    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self.events: list[dict[str, Any]] = []  # recent events, for /v1/audit and tests
        self.max_kept = 1000

    def record(self, event: AuditEvent) -> dict[str, Any]:
        entry = {"ts": time.time(), **asdict(event)}
        line = json.dumps(entry, sort_keys=True)
        with self._lock:
            self.events.append(entry)
            del self.events[: -self.max_kept]
            if self.path is not None:
                self._append(self.path, line)
        log.info(line, extra={"audit": entry})  # a JSON line's field (--log-format json)
        return entry

    @staticmethod
    def _append(path: Path, line: str) -> None:
        try:
            fd = os.open(path, _APPEND, 0o600)
        except OSError as exc:  # ELOOP: a link in the file's place
            log.error("audit log %s not written (%s): %s", path, exc.strerror, line)
            return
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(line + "\n")
