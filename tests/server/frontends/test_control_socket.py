"""The sidecar's control socket: load with digest check, rollback, status, bad input."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
from pathlib import Path

from aiohttp.test_utils import TestClient

from model_server.app import ModelServer
from model_server.frontends.control_socket import ControlSocketServer
from tests.support.server import add_version, ask


async def test_load_rollback_status(
    client: TestClient, model_server: ModelServer, repo, server_config
) -> None:
    sock = server_config.control_socket
    assert oct(sock.stat().st_mode & 0o777) == "0o600"
    v2 = repo[1]["v2"]
    answer = await ask(
        sock,
        {"op": "load", "model": "mlp", "version": "v2", "path": str(v2.path), "sha256": v2.sha256},
    )
    assert answer["ok"] and answer["from"] == "v1" and answer["to"] == "v2", answer
    status = await ask(sock, {"op": "status", "model": "mlp"})
    assert status["version"] == "v2" and status["loaded"] == ["v1", "v2"]
    answer = await ask(sock, {"op": "rollback", "model": "mlp"})
    assert answer["ok"] and answer["to"] == "v1" and answer["instant"]
    who = model_server.audit.events[-1]["who"]
    assert who.startswith("socket:uid=")


async def test_refusals(
    client: TestClient, model_server: ModelServer, repo, server_config, tmp_path: Path
) -> None:
    sock = server_config.control_socket
    v2, v3 = repo[1]["v2"], repo[1]["v3"]
    wrong_digest = await ask(
        sock,
        {"op": "load", "model": "mlp", "version": "v2", "path": str(v2.path), "sha256": v3.sha256},
    )
    assert not wrong_digest["ok"] and "sha256" in wrong_digest["error"]
    outside = add_version(tmp_path / "elsewhere", "mlp", "v5", seed=5)
    answer = await ask(
        sock,
        {
            "op": "load",
            "model": "mlp",
            "version": "v5",
            "path": str(outside.path),
            "sha256": outside.sha256,
        },
    )
    assert not answer["ok"] and answer["code"] == "forbidden"
    assert not (await ask(sock, b"not json"))["ok"]
    assert (await ask(sock, {"op": "explode", "model": "mlp"}))["code"] == "bad_request"
    assert (await ask(sock, {"op": "status", "model": "nope"}))["code"] == "model_not_found"
    assert model_server.manager.slot("mlp").current.version == "v1"  # type: ignore[union-attr]


async def test_http_and_socket_answer_swaps_with_the_same_fields(
    client: TestClient, server_config
) -> None:
    from tests.support.server import ADMIN

    over_http = await (await client.post("/v1/reload?target_version=v2", headers=ADMIN)).json()
    over_socket = await ask(server_config.control_socket, {"op": "rollback", "model": "mlp"})
    assert over_http.pop("status") == "ok" and over_socket.pop("ok") is True
    # a load says where its time went (the same in a socket's reply); a pointer swap has
    # no stages
    assert set(over_http.pop("stages_ms")) >= {"read_hash", "hash_wait", "warm_up", "swap", "other"}
    assert set(over_http) == set(over_socket) == {"model", "from", "to", "duration_ms", "instant"}
    assert (over_http["to"], over_socket["to"]) == ("v2", "v1")
    health = await (await client.get("/v1/models/mlp/health")).json()
    assert health["versions"]["v1"] == {"state": "READY", "reason": "serving"}
    assert health["versions"]["v2"] == {"state": "READY", "reason": "retained for rollback"}


# -- robustness (issue 13) --------------------------------------------------------------
_watched: list[tuple[Path, list[int]]] = []  # (path, modes seen) while a test watches


def _watch_modes(event: str, args: tuple) -> None:  # type: ignore[type-arg]
    """An audit hook: at every audited operation of this process (mkdir, bind, chmod,
    rename, …) note the mode the watched path has, if it exists."""
    for path, seen in _watched:
        try:
            seen.append(stat.S_IMODE(os.lstat(path).st_mode))
        except FileNotFoundError:
            pass


sys.addaudithook(_watch_modes)


async def test_the_socket_never_exists_with_another_mode(
    model_server: ModelServer, tmp_path: Path
) -> None:
    path = tmp_path / "run" / "control.sock"
    path.parent.mkdir()
    path.write_text("a stale file of an earlier run")
    os.chmod(path, 0o600)
    seen: list[int] = []
    old_umask = os.umask(0)  # the widest: a socket bound in place would be 0777
    _watched.append((path, seen))
    server = ControlSocketServer(model_server.plane, path)
    try:
        await server.start()
    finally:
        _watched.clear()
        os.umask(old_umask)
    try:
        assert seen and set(seen) == {0o600}, [oct(m) for m in seen]
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert (await ask(path, {"op": "status", "model": "mlp"}))["ok"]
        assert sorted(p.name for p in path.parent.iterdir()) == ["control.sock"]
    finally:
        await server.stop()
    assert not path.exists()


async def test_idle_connections_are_closed(model_server: ModelServer, tmp_path: Path) -> None:
    server = ControlSocketServer(model_server.plane, tmp_path / "c.sock", idle_timeout_s=0.2)
    await server.start()
    try:
        reader, writer = await asyncio.open_unix_connection(str(server.path))
        writer.write(b'{"op": "status", "model": "mlp"}\n')  # a request, then silence
        assert json.loads(await reader.readline())["ok"]
        assert await asyncio.wait_for(reader.read(), 30) == b""  # closed by the server
        writer.close()
    finally:
        await server.stop()


async def test_connections_beyond_the_bound_are_refused(
    model_server: ModelServer, tmp_path: Path
) -> None:
    server = ControlSocketServer(model_server.plane, tmp_path / "c.sock", max_connections=4)
    await server.start()
    held = [await asyncio.open_unix_connection(str(server.path)) for _ in range(4)]
    try:
        while server.connections < 4:
            await asyncio.sleep(0.01)
        silent = [await asyncio.open_unix_connection(str(server.path)) for _ in range(1000)]
        for reader, writer in silent:  # each told why, and closed at once
            answer = json.loads(await asyncio.wait_for(reader.readline(), 30))
            assert (answer["ok"], answer["code"]) == (False, "busy"), answer
            assert await asyncio.wait_for(reader.read(), 30) == b""
            writer.close()
        assert server.connections == 4
        for _, writer in held:
            writer.close()
        while server.connections:
            await asyncio.sleep(0.01)
        assert (await ask(server.path, {"op": "status", "model": "mlp"}))["ok"]
    finally:
        await server.stop()


async def test_hostile_requests_get_short_error_replies(client: TestClient, server_config) -> None:
    sock = server_config.control_socket
    deep = await ask(sock, b'{"op": ' + b"[" * 30000 + b"]" * 30000 + b"}")
    assert (deep["ok"], deep["code"]) == (False, "bad_request"), deep
    nested = await ask(sock, {"op": "status", "model": [[["mlp"]]]})
    assert (nested["ok"], nested["code"]) == (False, "bad_request"), nested
    long_op = await ask(sock, {"op": "\u0001" * 10000, "model": "mlp"})  # a 60 KB line
    assert (long_op["ok"], long_op["code"]) == (False, "bad_request")
    assert len(json.dumps(long_op)) < 1000, len(json.dumps(long_op))
    long_name = await ask(sock, {"op": "status", "model": "m" * 60000})
    assert long_name["code"] == "bad_request" and len(json.dumps(long_name)) < 1000
    unknown = await ask(sock, {"op": "rollback", "model": "mlp", "version": "v9"})
    assert (unknown["ok"], unknown["code"]) == (False, "conflict"), unknown
    assert "v9" in unknown["error"]


async def test_the_sidecar_retries_a_busy_server(model_server: ModelServer, tmp_path: Path) -> None:
    """A connection over the bound is answered busy and nothing is done: the sidecar's
    client tries again (it used to take the refusal as "the server holds nothing")."""
    from model_sidecar.control_client import ServerControl
    from model_sidecar.retry import Backoff

    server = ControlSocketServer(
        model_server.plane, tmp_path / "c.sock", idle_timeout_s=0.5, max_connections=1
    )
    await server.start()
    try:
        _, silent = await asyncio.open_unix_connection(str(server.path))  # holds the one slot
        while server.connections < 1:
            await asyncio.sleep(0.01)
        control = ServerControl(server.path, Backoff(attempts=50, base_s=0.05, max_s=0.2))
        status = await control.status("mlp")  # busy until the idle one is closed
        assert status.version == "v1"
        silent.close()
    finally:
        await server.stop()
