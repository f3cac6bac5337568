"""The contract's one control-socket exchange (``control.exchange``) against real Unix
sockets: the reply line, and each way it fails as its own typed error — and how the
sidecar and the server's pool relay map those errors to their own."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

import model_rollout_contract
from model_rollout_contract.control import (
    MAX_LINE,
    ControlClosed,
    ControlDenied,
    ControlExchangeError,
    ControlLineTooLong,
    ControlUnreachable,
    StatusReply,
    StatusRequest,
    encode,
    exchange,
    parse_reply,
)
from model_server.errors import Unavailable
from model_server.pool.relay import WorkerLink
from model_sidecar.control_client import ServerControl
from model_sidecar.errors import ControlFailure, ServerUnavailable
from model_sidecar.retry import Backoff

REQUEST = StatusRequest("mlp")
REPLY = encode(StatusReply("mlp", "v1", None, ("v1",)))
Peer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def peer(path: Path, handle: Peer) -> AsyncIterator[list[bytes]]:
    """A control-socket server at ``path`` that reads one request line (kept in the list
    it yields), then answers as ``handle`` does, and closes the connection."""
    received: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            received.append(await reader.readline())
            await handle(reader, writer)
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_unix_server(serve, str(path))
    try:
        yield received
    finally:
        server.close()
        await server.wait_closed()


async def answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(REPLY)


async def says_nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Closes the connection without a reply (a server that died meanwhile)."""


async def answers_too_long(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"x" * (MAX_LINE + 1) + b"\n")


async def test_the_reply_line_of_the_request_sent(tmp_path: Path) -> None:
    path = tmp_path / "ctl.sock"
    async with peer(path, answers) as received:
        line = await exchange(path, REQUEST)
    assert received == [encode(REQUEST)]
    assert line == REPLY and parse_reply(line) == StatusReply("mlp", "v1", None, ("v1",))


async def test_no_socket_file_is_unreachable(tmp_path: Path) -> None:
    path = tmp_path / "absent.sock"
    with pytest.raises(ControlUnreachable) as caught:
        await exchange(path, REQUEST)
    assert caught.value.path == path
    assert str(caught.value).startswith(f"control socket {path} not answering: ")
    assert isinstance(caught.value.__cause__, FileNotFoundError)


async def test_a_socket_nobody_listens_on_is_unreachable(tmp_path: Path) -> None:
    path = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bound:  # bound, never listening
        bound.bind(str(path))
        with pytest.raises(ControlUnreachable) as caught:
            await exchange(path, REQUEST)
    assert caught.value.path == path and "not answering" in str(caught.value)
    assert isinstance(caught.value.__cause__, ConnectionRefusedError)


async def test_a_path_too_long_for_a_socket_is_denied(tmp_path: Path) -> None:
    path = tmp_path / ("d" * 120) / "ctl.sock"  # over AF_UNIX's 108 bytes
    with pytest.raises(ControlDenied) as caught:
        await exchange(path, REQUEST)
    assert caught.value.path == path
    assert str(caught.value).startswith(f"cannot connect to the control socket {path}: ")
    assert isinstance(caught.value.__cause__, OSError)
    assert not isinstance(caught.value.__cause__, PermissionError | FileNotFoundError)


def without_permission_overrides() -> list[str]:
    """As root, drop the capabilities that ignore file permissions (as the sidecar's
    behaviour tests do), so that a socket of mode 000 is refused."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all"]


_TRY_EXCHANGE = """
import asyncio, sys
from pathlib import Path
from model_rollout_contract.control import ControlExchangeError, StatusRequest, exchange
try:
    asyncio.run(exchange(Path(sys.argv[1]), StatusRequest("mlp")))
except ControlExchangeError as exc:
    print(type(exc).__name__, exc.path, type(exc.__cause__).__name__, sep="\\n")
    print(exc)
"""


async def test_a_socket_without_permission_is_denied(tmp_path: Path) -> None:
    path = tmp_path / "ctl.sock"
    async with peer(path, answers) as received:
        os.chmod(path, 0)
        common = Path(model_rollout_contract.__file__).parent.parent
        done = await asyncio.to_thread(
            subprocess.run,
            [*without_permission_overrides(), sys.executable, "-c", _TRY_EXCHANGE, str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(common)},
        )
    assert done.returncode == 0, done.stderr
    kind, where, cause, message = done.stdout.splitlines()
    assert (kind, where, cause) == ("ControlDenied", str(path), "PermissionError"), done.stdout
    assert message.startswith(f"no permission to use the control socket {path}: ")
    assert "Permission denied" in message and received == []


async def test_a_connection_closed_without_a_reply_is_closed(tmp_path: Path) -> None:
    path = tmp_path / "ctl.sock"
    async with peer(path, says_nothing) as received:
        with pytest.raises(ControlClosed) as caught:
            await exchange(path, REQUEST)
    assert received == [encode(REQUEST)]  # the request reached the peer
    assert caught.value.path == path
    assert str(caught.value) == f"control socket {path} closed the connection without answering"


async def test_a_connection_reset_midway_is_closed(tmp_path: Path) -> None:
    """The peer closes with the request unread: the kernel resets the connection."""
    path = tmp_path / "ctl.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.setblocking(False)
    listener.bind(str(path))
    listener.listen()
    loop = asyncio.get_running_loop()
    try:
        asking = asyncio.create_task(exchange(path, REQUEST))
        conn, _ = await asyncio.wait_for(loop.sock_accept(listener), 60)
        with conn:
            assert await asyncio.wait_for(loop.sock_recv(conn, 1), 60) == b"{"  # rest unread
        with pytest.raises(ControlClosed) as caught:
            await asyncio.wait_for(asking, 60)
    finally:
        listener.close()
    assert caught.value.path == path
    assert str(caught.value).startswith(f"control socket {path} closed the connection: ")
    assert isinstance(caught.value.__cause__, ConnectionResetError)


async def test_a_reply_line_over_max_line_is_too_long(tmp_path: Path) -> None:
    path = tmp_path / "ctl.sock"
    async with peer(path, answers_too_long):
        with pytest.raises(ControlLineTooLong) as caught:
            await exchange(path, REQUEST)
    assert caught.value.path == path
    assert str(caught.value) == (
        f"control socket {path} answered status with a line over {MAX_LINE} bytes"
    )


def test_every_typed_error_is_a_control_exchange_error() -> None:
    for kind in (ControlUnreachable, ControlDenied, ControlClosed, ControlLineTooLong):
        assert issubclass(kind, ControlExchangeError)


# how the two callers map them: exactly as before the exchange was shared


async def test_the_sidecar_retries_unreachable_and_closed_and_fails_the_rest(
    tmp_path: Path,
) -> None:
    once = Backoff(attempts=1, base_s=0.01, max_s=0.01)
    with pytest.raises(ServerUnavailable, match="not answering"):
        await ServerControl(tmp_path / "absent.sock", once).status("mlp")
    async with peer(tmp_path / "quiet.sock", says_nothing):
        with pytest.raises(ServerUnavailable, match="closed the connection without answering"):
            await ServerControl(tmp_path / "quiet.sock", once).status("mlp")
    with pytest.raises(ControlFailure) as denied:
        await ServerControl(tmp_path / ("d" * 120) / "ctl.sock", once).status("mlp")
    assert denied.value.code == "control_denied"
    async with peer(tmp_path / "long.sock", answers_too_long):
        with pytest.raises(ControlFailure) as too_long:
            await ServerControl(tmp_path / "long.sock", once).status("mlp")
    assert too_long.value.code == "protocol_error" and f"over {MAX_LINE} bytes" in str(
        too_long.value
    )
    async with peer(tmp_path / "ok.sock", answers):
        assert (await ServerControl(tmp_path / "ok.sock", once).status("mlp")).version == "v1"


async def test_the_pool_relay_makes_every_failure_unavailable(tmp_path: Path) -> None:
    cases: list[tuple[Path, Peer | None, str]] = [
        (tmp_path / "absent.sock", None, "not answering"),
        (tmp_path / ("d" * 120) / "ctl.sock", None, "cannot connect"),
        (tmp_path / "quiet.sock", says_nothing, "without answering"),
        (tmp_path / "long.sock", answers_too_long, f"over {MAX_LINE} bytes"),
    ]
    for path, handle, why in cases:
        link = WorkerLink(3, path)
        if handle is None:
            reply = await link.ask(REQUEST)
        else:
            async with peer(path, handle):
                reply = await link.ask(REQUEST)
        assert reply.to_json()["code"] == Unavailable.code, reply
        error = reply.to_json()["error"]
        assert error.startswith("worker 3: ") and str(path) in error and why in error, reply

    async def not_json(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"not json\n")

    async with peer(tmp_path / "bad.sock", not_json):
        reply = await WorkerLink(3, tmp_path / "bad.sock").ask(REQUEST)
    assert reply.to_json()["code"] == Unavailable.code
    assert reply.to_json()["error"].startswith("worker 3 failed to reply: not a JSON line")
    async with peer(tmp_path / "ok.sock", answers):
        assert await WorkerLink(3, tmp_path / "ok.sock").ask(REQUEST) == parse_reply(REPLY)
