"""The audit log (issue 13 follow-up): written without following a link in its place,
and a line that cannot be written never stops the action it records."""

from __future__ import annotations

import json
import os
from pathlib import Path

from model_server.observability.audit import AuditEvent, AuditLog

EVENT = AuditEvent("load", "mlp", "v2", "socket:uid=1", "socket", "success")


def test_lines_are_appended(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path / "audit.jsonl")
    audit.record(EVENT)
    audit.record(EVENT)
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    assert [json.loads(line)["version"] for line in lines] == ["v2", "v2"]
    assert (tmp_path / "audit.jsonl").stat().st_mode & 0o777 == 0o600


def test_a_link_in_place_of_the_log_is_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.symlink(victim, tmp_path / "audit.jsonl")
    audit = AuditLog(tmp_path / "audit.jsonl")
    entry = audit.record(EVENT)  # the action goes on
    assert entry["version"] == "v2" and audit.events == [entry]
    assert victim.read_text() == "precious\n"
