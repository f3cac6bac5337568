"""``model-server --log-format json`` (issue 32): a real server process writes only JSON
lines, every library's records included (aiohttp, grpc, ONNX Runtime's loader), at the
level asked; a refusal at start is one JSON line; without the flag the lines are the
text they always were."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from model_rollout_e2e.processes import ServerProcess, free_port
from tests.support.log_lines import TEXT_LINE, json_lines
from tests.support.server import add_version


def served_and_stopped(tmp_path: Path, *flags: str) -> str:
    """A server on one model, with gRPC beside HTTP, ready, then stopped: its output."""
    root = tmp_path / "models"
    add_version(root, "mlp", "v1", seed=1)
    server = ServerProcess(
        root, ["mlp=v1"], tmp_path / "server.log",
        extra=["--grpc-port", str(free_port()), "--json-workers", "1", *flags],
    ).start()  # fmt: skip
    try:
        server.wait_ready()
    finally:
        server.stop()
    return server.log_path.read_text()


def test_json_lines_only_with_the_models_swap_as_fields(tmp_path: Path) -> None:
    lines = json_lines(served_and_stopped(tmp_path, "--log-format", "json"))
    assert lines, "the server said nothing"
    for line in lines:
        assert {"time", "level", "logger", "message"} <= line.keys(), line
        assert line["level"] in ("info", "warning", "error", "critical"), line
    [served] = [line for line in lines if "now serves" in line["message"]]
    assert (served["model"], served["version"], served["logger"]) == (
        "mlp",
        "v1",
        "model_server.lifecycle",
    )
    [audit] = [line["audit"] for line in lines if "audit" in line]  # an object, not text
    assert (audit["action"], audit["model"], audit["version"]) == ("load", "mlp", "v1")


def test_the_level_asked_for_is_the_least_severe_written(tmp_path: Path) -> None:
    lines = json_lines(
        served_and_stopped(tmp_path, "--log-format", "json", "--log-level", "warning")
    )
    assert all(line["level"] in ("warning", "error", "critical") for line in lines), lines


def test_the_environment_sets_the_format_and_level(tmp_path: Path) -> None:
    root = tmp_path / "models"
    add_version(root, "mlp", "v1", seed=1)
    env = {"MODEL_SERVER_LOG_FORMAT": "json", "MODEL_SERVER_LOG_LEVEL": "debug"}
    server = ServerProcess(root, ["mlp=v1"], tmp_path / "server.log")
    server.env.update(env)
    server.start()
    try:
        server.wait_ready()
    finally:
        server.stop()
    lines = json_lines(server.log_path.read_text())
    assert any(line["level"] == "debug" for line in lines)


def test_a_refusal_at_start_is_one_json_line(tmp_path: Path) -> None:
    root = tmp_path / "models"
    add_version(root, "mlp", "v1", seed=1)
    done = subprocess.run(
        [
            sys.executable, "-m", "model_server", "--repository", str(root), "--port", "0",
            "--max-batch-size", "8", "--batch-model", "nope", "--log-format", "json",
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done
    assert done.stdout == ""
    refusals = [line for line in json_lines(done.stderr) if line["level"] == "error"]
    assert [(r["logger"], "--batch-model names 'nope'" in r["message"]) for r in refusals] == [
        ("model_server", True)
    ]


def test_text_stays_the_default_format(tmp_path: Path) -> None:
    output = served_and_stopped(tmp_path)
    lines = output.splitlines()
    assert lines and all(TEXT_LINE.fullmatch(line) for line in lines), output
    assert any(" INFO model_server.lifecycle: mlp now serves v1 " in line for line in lines)
