"""The HTTP listener and connections at shutdown: stop listening and finish without
dropping a request whose connection the kernel had already accepted.

aiohttp's own way (``site.stop()``, then ``Server.pre_shutdown()``) drops requests three
ways (tests/server/frontends/http/test_drain.py shows each): closing a listening socket resets the
connections
still in its backlog, accepted by the kernel and maybe holding a request already;
``RequestHandler.close()`` ends the wait of a connection with no request parsed yet, so
a request on its way, or already in the socket's buffer, is never read, and the
connection stays open, unanswered, until the runner's cleanup at the grace's end (a
client that connected just before the listener closed waited the whole grace, then lost
its request); and it discards every byte that arrives afterwards, so a request whose body
was still uploading stalls until it is cancelled.

So the listener accepts here (not through ``loop.create_server``, whose connections have
no protocol yet for a loop turn after they are accepted, invisible to a drain), closing
it takes its backlog first, and no connection is told to close: while the server drains
every answer closes its connection, connections idle between requests are closed, and
the others (requests in flight, connections accepted whose first request is yet to be
answered) are waited for, up to the grace, as Go's ``http.Server.Shutdown`` does."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger(__name__)

BACKLOG = 128  # aiohttp's TCPSite's
ACCEPT_RETRY_S = 1.0  # out of descriptors: accept again after this (asyncio's delay)
# how often the drain looks at its connections: from this, doubling up to the last
FIRST_POLL_S = 0.001
LAST_POLL_S = 0.05
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


async def listen(host: str, port: int, reuse_port: bool) -> list[socket.socket]:
    """Listening sockets on every address ``host`` names (every interface if empty), as
    ``loop.create_server`` makes them; ``reuse_port``: a pool's workers share the port."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    sockets: list[socket.socket] = []
    try:
        for family, _, _, _, address in dict.fromkeys(infos):
            sockets.append(
                socket.create_server(
                    address[:2], family=family, backlog=BACKLOG, reuse_port=reuse_port
                )
            )
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class Listener:
    """Accepts the connections of one listening socket for an aiohttp server: each is
    the server's from the moment it is accepted, so closing misses none."""

    def __init__(self, sock: socket.socket, server: web.Server) -> None:
        self._sock = sock
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._fd = sock.fileno()
        self._retry: asyncio.TimerHandle | None = None
        self._handovers: set[asyncio.Task[object]] = set()
        sock.setblocking(False)
        self._loop.add_reader(self._fd, self._accept, BACKLOG)

    async def close(self) -> int:
        """Stop listening: take every connection the kernel has accepted, then close the
        socket (a connection that comes later is refused, never reset after its request
        was sent). Returns how many were taken, once each is the server's."""
        if self._retry is not None:
            self._retry.cancel()
        self._loop.remove_reader(self._fd)
        taken = self._accept(None)
        self._sock.close()
        if self._handovers:
            await asyncio.wait(self._handovers)
        return taken

    def _accept(self, most: int | None) -> int:
        """Accept up to ``most`` connections (``None``: all there are); how many."""
        taken = 0
        while most is None or taken < most:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionAbortedError:
                continue  # its client reset it before it was accepted
            except OSError as exc:
                log.error("cannot accept a connection: %s", exc)
                if most is not None and exc.errno in _OUT_OF_RESOURCES:  # as asyncio does:
                    self._loop.remove_reader(self._fd)  # try again later
                    self._retry = self._loop.call_later(
                        ACCEPT_RETRY_S, self._loop.add_reader, self._fd, self._accept, BACKLOG
                    )
                break
            taken += 1
            handover = self._loop.create_task(
                self._loop.connect_accepted_socket(self._server, conn)
            )
            self._handovers.add(handover)
            handover.add_done_callback(self._handed_over)
        return taken

    def _handed_over(self, handover: asyncio.Task[object]) -> None:
        self._handovers.discard(handover)
        if not handover.cancelled() and (exc := handover.exception()) is not None:
            log.info("a connection closed as it was accepted: %s", exc)


async def finish_connections(server: web.Server, grace_s: float) -> list[RequestHandler]:
    """Once the listeners are closed: close each connection idle between requests (at
    once, and whenever another becomes so) and wait, up to ``grace_s``, until the others
    are answered and closed (each answer closes its connection while the server drains):
    requests in flight, and connections accepted whose first request is yet to come.
    Returns the connections still open then, for the runner's cleanup to cancel."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    pause = FIRST_POLL_S
    while True:
        for connection in server.connections:
            if _between_requests(connection):
                connection.force_close()
        left = server.connections  # a connection stays there until its handler is done
        if not left or loop.time() >= deadline:
            return left
        await asyncio.sleep(min(pause, deadline - loop.time()))
        pause = min(2 * pause, LAST_POLL_S)


def _between_requests(connection: RequestHandler) -> bool:
    """Whether ``connection`` has answered a request and no byte of the next has come.

    aiohttp has no public word for it: this reads what its own keep-alive timeout reads
    (a pending ``_waiter``: no request parsed, none being handled) and its count of
    requests parsed (none: a new connection, whose first request may be on its way).
    Should either change, a connection reads as busy: the drain waits longer, never
    drops a request."""
    waiter = getattr(connection, "_waiter", None)
    if waiter is None or waiter.done() or not getattr(connection, "_request_count", 0):
        return False
    return not _bytes_waiting(connection)


def _bytes_waiting(connection: RequestHandler) -> bool:
    """Whether bytes have arrived on ``connection`` that the loop has not read yet."""
    transport = connection.transport
    if transport is None:
        return False
    try:
        with transport.get_extra_info("socket").dup() as sock:
            return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return False
    except OSError:  # reset: nothing to answer
        return False
