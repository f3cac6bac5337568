"""Names full-match the contract's rule everywhere the server takes one (issue 13): on
the command line, in the repository, in a CURRENT file, in URLs and on the socket; a
trailing newline or a path component is never a name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from model_server.app import ModelServer
from model_server.config import ServerConfig, parse_args
from tests.support.server import add_version, ask, infer_body


@pytest.mark.parametrize(
    "model", ["mlp\n", "../mlp", "a/b/c", "mlp=v1\n", "mlp=../v1", " mlp", "mlp="]
)
def test_the_command_line_refuses_names_that_do_not_full_match(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--repository", str(tmp_path), "--model", model])
    assert exit_info.value.code == 2
    assert "--model: invalid" in capsys.readouterr().err
    assert [s.key for s in parse_args(["--repository", ".", "--model", "acme/mlp=v1"]).models] == [
        "acme/mlp"
    ]


async def test_the_repository_and_current_files_yield_only_valid_names(tmp_path: Path) -> None:
    root = tmp_path / "models"
    add_version(root, "mlp", "v1", seed=1)
    add_version(root, "other", "v1", seed=2)
    add_version(root, "bad name", "v1", seed=3)  # not a model name: not served
    add_version(root, ".hidden", "v1", seed=4)
    (root / "other" / "CURRENT").write_text("../mlp/v1\n")  # names no valid version
    sock = tmp_path / "control.sock"
    app = ModelServer(ServerConfig(repository=root, control_socket=sock)).make_app()
    async with TestClient(TestServer(app)) as client:
        listing = await (await client.get("/v1/models")).json()
        assert [m["name"] for m in listing["models"]] == ["mlp", "other"]
        assert (await client.get("/v2/models/other/ready")).status == 503  # not loaded
        x = infer_body(np.ones((1, 8), np.float32))
        assert (await client.post("/v2/models/mlp/infer", json=x)).status == 200
        for name in ("mlp%0A", "mlp%0D", "mlp%00"):
            response = await client.post(f"/v2/models/{name}/infer", json=x)
            assert response.status == 400, (name, await response.text())
        answer = await ask(sock, {"op": "status", "model": "mlp\n"})
        assert (answer["ok"], answer["code"]) == (False, "bad_request"), answer
        answer = await ask(sock, {"op": "rollback", "model": "mlp", "version": "v1\n"})
        assert (answer["ok"], answer["code"]) == (False, "bad_request"), answer


async def test_a_current_file_planted_as_a_link_is_not_followed(tmp_path: Path) -> None:
    """CURRENT is read like a model file: a link in its place (to a file outside naming
    another version) is refused, and the model waits for an announced version."""
    root = tmp_path / "repo"
    add_version(root, "mlp", "v1", seed=1)
    add_version(root, "mlp", "v2", seed=2)
    outside = tmp_path / "outside"
    outside.write_text("v1\n")
    (root / "mlp" / "CURRENT").symlink_to(outside)
    sock = tmp_path / "control.sock"
    app = ModelServer(ServerConfig(repository=root, control_socket=sock)).make_app()
    async with TestClient(TestServer(app)) as client:
        assert (await client.get("/v2/models/mlp/ready")).status == 503
        assert (await ask(sock, {"op": "status", "model": "mlp"}))["version"] is None
    (root / "mlp" / "CURRENT").unlink()
    (root / "mlp" / "CURRENT").write_text("v1\n")  # a real file is read: v1, not the newest
    app = ModelServer(ServerConfig(repository=root, control_socket=sock)).make_app()
    async with TestClient(TestServer(app)):
        assert (await ask(sock, {"op": "status", "model": "mlp"}))["version"] == "v1"


async def test_versions_without_an_order_and_no_current_start_nothing(tmp_path: Path) -> None:
    """Git SHAs on disk and no CURRENT: no version is the newest (the contract's order,
    model_rollout_contract.versions), so the server waits for an announced one rather
    than serve whichever sorts last as text."""
    root = tmp_path / "repo"
    add_version(root, "mlp", "03b1d4a", seed=1)
    add_version(root, "mlp", "e5a0c2f", seed=2)
    sock = tmp_path / "control.sock"
    app = ModelServer(ServerConfig(repository=root, control_socket=sock)).make_app()
    async with TestClient(TestServer(app)) as client:
        assert (await client.get("/v2/models/mlp/ready")).status == 503
        assert (await ask(sock, {"op": "status", "model": "mlp"}))["version"] is None
