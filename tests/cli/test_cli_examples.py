"""Every example of the day-2 tools parses with the tool's own parser: each command's
``--help`` examples, the commands the README (and docs/) show, and those in examples/'
comments (tests/cli/test_cli_plugin.py also runs examples/' against the API server). An
example the parser refuses, or one of a command that does not exist, fails here."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from model_rollout_cli import plugin, release
from model_rollout_cli.helptext import EXAMPLES

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("kubectl model ", "kubectl-model ", "model-rollout ")


def documents() -> list[Path]:
    docs = sorted((ROOT / "docs").rglob("*.md")) if (ROOT / "docs").is_dir() else []
    return [ROOT / "README.md", *docs, *sorted((ROOT / "examples").rglob("*.yaml"))]


def commands_in(text: str, yaml_comments: bool = True) -> list[str]:
    """The tools' command lines in ``text``: lines of fenced code blocks (a YAML folded
    ``run: >`` joined), inline code spans with an argument after the command (not a
    mention such as `kubectl model status`), and (``yaml_comments``) comment lines, that
    start with a tool's name; ``[--flag value]`` (optional parts) given, ``${{ ... }}``
    a word."""
    candidates = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.DOTALL):
        candidates += re.sub(r"\n\s+(?=--)", " ", block).splitlines()
    candidates += [c for c in re.findall(r"`([^`\n]+)`", text) if len(c.split()) > 3]
    if yaml_comments:
        candidates += [line.lstrip("# ") for line in text.splitlines() if line.startswith("#")]
    found = []
    for candidate in candidates:
        line = candidate.strip().replace("[", "").replace("]", "")
        line = re.sub(r"\$\{\{[^}]*\}\}", "x", line)
        if not line.startswith(TOOLS) or "<" in line or "…" in line or "NAME" in line:
            continue  # not a command, or one with placeholders
        found.append(line)
    return list(dict.fromkeys(found))


def parse(line: str) -> None:
    words = shlex.split(line, comments=True)
    if words[:2] == ["kubectl", "model"]:
        words = ["kubectl-model", *words[2:]]
    program, argv = words[0], words[1:]
    parser = plugin.build_parser() if program == "kubectl-model" else release.build_parser()
    parser.parse_args(argv)  # SystemExit (2) on a bad example


EXAMPLE_LINES = [
    (doc.name, line)
    for doc in documents()
    for line in commands_in(doc.read_text(), yaml_comments=doc.suffix == ".yaml")
]


def test_the_documents_show_commands() -> None:  # the scan below cannot pass vacuously
    assert len(EXAMPLE_LINES) >= 8
    assert ("modeldeployment-cpu-manual.yaml",
            "kubectl model promote recommender -n ml-serving") in EXAMPLE_LINES  # fmt: skip


@pytest.mark.parametrize(("where", "line"), EXAMPLE_LINES)
def test_every_documented_command_parses(where: str, line: str) -> None:
    parse(line)


@pytest.mark.parametrize(
    ("command", "line"), [(c, line) for c, lines in EXAMPLES.items() for line in lines]
)
def test_every_help_example_parses(command: str, line: str) -> None:
    if line.startswith("source ") or ">" in line:
        line = line.removeprefix("source <(").split(")")[0].split(">")[0]
    assert command in shlex.split(line, comments=True)
    parse(line)


def test_every_command_has_help_with_defaults_an_example_and_the_exit_codes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    commands = [c for c in EXAMPLES if c != "release"]
    for command in commands:
        assert plugin.main([command, "--help"]) == 0
        text = capsys.readouterr().out
        assert "examples:\n  " in text and EXAMPLES[command][0] in text, command
        assert "exit codes:\n  0  done" in text and "  6  nothing to do" in text, command
    assert plugin.main(["rollback", "--help"]) == 0
    assert "(default: 600.0)" in capsys.readouterr().out  # --timeout's
    assert release.main(["release", "--help"]) == 0
    text = capsys.readouterr().out
    assert "(default: 900.0)" in text and "model-rollout release --model mlp" in text
    # every command of the plugin has its examples
    sub = next(a for a in plugin.build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == set(commands)  # type: ignore[arg-type]
