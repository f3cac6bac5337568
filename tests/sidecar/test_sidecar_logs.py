"""``model-sidecar --log-format json`` (issue 32): a real sidecar process writes only
JSON lines, each with the model it follows, at the level asked; a refusal at start is
one JSON line; without the flag the lines are the text they always were."""

from __future__ import annotations

import subprocess
from pathlib import Path

from model_sidecar.store import LocalStore
from tests.support.log_lines import TEXT_LINE, json_lines
from tests.support.sidecar import Keys, make_keys, publish_versions, sidecar_cli


def pre_pull(
    tmp_path: Path, *flags: str, keys: Keys | None = None
) -> subprocess.CompletedProcess[str]:
    """``model-sidecar init`` of v1 from a directory store (published once per test)."""
    store = LocalStore(tmp_path / "store")
    if keys is None:
        keys = make_keys(tmp_path / "keys")
        publish_versions(store, keys, tmp_path, {"v1": 1})
    return sidecar_cli(
        "init", "--store", f"file://{store.root}", "--volume", str(tmp_path / "volume"),
        "--model", "mlp", "--public-key", str(keys.public), "--version", "v1",
        "--start-jitter-seconds", "0", *flags,
    )  # fmt: skip


def test_init_writes_json_lines_only_each_with_its_model_and_pod(tmp_path: Path) -> None:
    done = pre_pull(tmp_path, "--log-format", "json", "--pod-name", "mlp-7f9c")
    assert done.returncode == 0, done
    assert done.stdout == ""
    lines = json_lines(done.stderr)
    assert lines, done
    assert all((line["model"], line["pod"]) == ("mlp", "mlp-7f9c") for line in lines), lines
    assert {"trusting 1 signing key(s) from " + str(tmp_path / "keys" / "signing.pub")} <= {
        line["message"] for line in lines
    }


def test_the_level_asked_for_is_the_least_severe_written(tmp_path: Path) -> None:
    done = pre_pull(tmp_path, "--log-format", "json", "--log-level", "warning")
    assert done.returncode == 0, done
    assert all(line["level"] in ("warning", "error") for line in json_lines(done.stderr))
    assert "trusting" not in done.stderr  # an info line


def test_a_refusal_at_start_is_one_json_line(tmp_path: Path) -> None:
    keys = Keys(tmp_path / "none.key", tmp_path / "none.pub")  # no such key
    done = pre_pull(tmp_path, "--log-format", "json", keys=keys)
    assert done.returncode == 1, done
    [line] = json_lines(done.stderr)
    assert (line["level"], line["logger"], line["model"]) == ("error", "model_sidecar", "mlp")
    assert line["message"].startswith("cannot load --public-key: ")


def test_text_stays_the_default_format(tmp_path: Path) -> None:
    done = pre_pull(tmp_path)
    assert done.returncode == 0, done
    lines = done.stderr.splitlines()
    assert lines and all(TEXT_LINE.fullmatch(line) for line in lines), done.stderr
    refused = pre_pull(tmp_path / "refused", keys=Keys(tmp_path / "k", tmp_path / "none.pub"))
    assert refused.stderr.startswith("model-sidecar: cannot load --public-key: "), refused
