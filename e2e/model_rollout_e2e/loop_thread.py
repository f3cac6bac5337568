"""An asyncio event loop on a thread of its own, running one coroutine until told to stop:
what the node agent (:class:`~.node_agent.AgentThread`, for tests that drive the cluster
synchronously) and its heartbeat (:class:`~.node_heartbeat.NodeHeartbeat`, so that the
pods' work cannot hold a Lease renewal back) each run on."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable

# ``serve(ready, stopping)``: calls ``ready()`` once it is up, returns once ``stopping`` is set
Serve = Callable[[Callable[[], None], asyncio.Event], Awaitable[None]]


class LoopThread:
    """``start()`` returns once ``serve`` is ready (or ended); ``stop()`` sets its
    ``stopping`` event and waits for the thread. What ``serve`` raised is :attr:`error`."""

    def __init__(self, name: str, serve: Serve) -> None:
        self.error: BaseException | None = None
        self._serve = serve
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self, timeout_s: float, *, late: str, failed: str) -> None:
        """Raises ``TimeoutError(late)`` when ``serve`` is not ready within ``timeout_s``,
        ``RuntimeError(failed)`` (from its exception) when it failed before."""
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise TimeoutError(late)
        if self.error is not None:
            raise RuntimeError(failed) from self.error

    def stop(self, timeout_s: float) -> bool:
        """Whether the thread ended within ``timeout_s``."""
        if self._thread.is_alive() and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._run())
        except BaseException as exc:
            self.error = exc
        finally:
            self._started.set()
            self._loop.close()

    async def _run(self) -> None:
        self._stop = asyncio.Event()
        await self._serve(self._started.set, self._stop)
