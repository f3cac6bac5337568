"""Watch mode: keep the server on the pod's target version.

Each poll (period + random jitter, so pods do not pull at once): read the target; if the
server serves something else, fetch and verify it, ask the server to swap over the
control socket, and report the outcome. Refused versions are not retried until the
target changes or ``refused_retry_s`` passes; store or server outages are retried with
backoff while the old version keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass

from model_rollout_contract.control import ErrorReply
from model_rollout_contract.report import SidecarReport
from model_rollout_contract.states import SidecarState

from .control_client import ServerControl
from .errors import ServerUnavailable, StoreError, VerificationError
from .fetcher import Fetcher
from .metrics import SidecarMetrics
from .status import StatusReporter
from .target import TargetSource

log = logging.getLogger(__name__)


@dataclass
class WatchSettings:
    model: str
    poll_s: float = 2.0
    jitter_s: float = 1.0
    keep_versions: int = 3
    refused_retry_s: float = 300.0


class Watcher:
    def __init__(
        self,
        settings: WatchSettings,
        source: TargetSource,
        fetcher: Fetcher,
        control: ServerControl,
        reporter: StatusReporter,
        metrics: SidecarMetrics,
        rng: random.Random | None = None,
        wake: asyncio.Event | None = None,
    ) -> None:
        """``wake`` is set when the target may have changed (the pod watch): the next
        cycle starts at once instead of after the poll period."""
        self.settings = settings
        self.source = source
        self.fetcher = fetcher
        self.control = control
        self.reporter = reporter
        self.metrics = metrics
        self.rng = rng or random.Random()
        self.wake = wake or asyncio.Event()
        self._refused: dict[str, float] = {}  # version -> when it was refused
        self._last_target: str | None = None
        self._target_seen_at: float | None = None
        self._retained: tuple[str, ...] = ()  # what the server holds beside the serving one

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.wake.clear()
            try:
                await self.step()
            except Exception:  # never let one bad cycle end the sidecar
                log.exception("watch cycle failed")
            delay = self.settings.poll_s + self.rng.uniform(0, self.settings.jitter_s)
            waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.wake.wait())]
            try:
                await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()

    async def _report(
        self,
        target: str | None,
        serving: str | None,
        state: SidecarState,
        reason: str | None = None,
        sha256: str | None = None,
    ) -> None:
        await self.reporter.report(
            SidecarReport(
                self.settings.model,
                target,
                serving,
                state,
                reason,
                sha256,
                retained=self._retained,
                target_seen_at=self._target_seen_at,
            )
        )

    def _held(self, loaded: tuple[str, ...], serving: str | None) -> None:
        self._retained = tuple(v for v in loaded if v != serving)

    async def step(self) -> str:
        """One cycle; returns the resulting state (for tests and logs)."""
        model = self.settings.model
        target = self.source.target()
        if target != self._last_target or self._target_seen_at is None:
            self._refused.pop(target or "", None)  # a new target deserves a fresh attempt
            jitter_first = self._last_target is not None
            self._last_target = target
            self._target_seen_at = time.time()
        else:
            jitter_first = False
        try:
            status = await self.control.status(model)
        except ServerUnavailable as exc:
            await self._report(target, None, SidecarState.ERROR, f"server unavailable: {exc}")
            return "error"
        serving = status.version
        self._held(status.loaded, serving)
        if serving:
            self.metrics.serving.labels(model, serving).set(1)
        if target is None:
            await self._report(
                None,
                serving,
                SidecarState.OK if serving else SidecarState.ERROR,
                None if serving else "no target version set",
            )
            return "no-target"
        if serving == target:
            await self._report(target, serving, SidecarState.OK, sha256=status.sha256)
            return "ok"  # versions only arrive through _switch, which prunes after a swap
        refused_at = self._refused.get(target)
        if refused_at is not None and time.monotonic() - refused_at < self.settings.refused_retry_s:
            return "refused"
        if target in status.loaded:  # still loaded beside the serving one: a pointer swap
            return await self._swap_retained(target, serving)
        if jitter_first and self.settings.jitter_s > 0:
            await asyncio.sleep(self.rng.uniform(0, self.settings.jitter_s))  # spread the pulls
        return await self._switch(target, serving)

    async def _swap_retained(self, target: str, serving: str | None) -> str:
        """Nothing to fetch or verify: the server verified this version when it loaded it.
        The critical path of a rollback is this one local call."""
        model = self.settings.model
        try:
            answer = await self.control.swap_to_retained(model, target)
        except ServerUnavailable as exc:
            await self._report(target, serving, SidecarState.ERROR, f"server unavailable: {exc}")
            return "error"
        if isinstance(answer, ErrorReply):  # evicted meanwhile: fetch and load it instead
            log.info("%s:%s is no longer retained (%s); loading it", model, target, answer.error)
            return await self._switch(target, serving)
        await self._swapped(target, serving)
        return "ok"

    async def _swapped(self, target: str, serving: str | None, sha256: str | None = None) -> None:
        """After a swap: metrics, what the server holds now, and the report."""
        model = self.settings.model
        self.metrics.swaps.labels(model, "ok").inc()
        if serving:
            self.metrics.serving.labels(model, serving).set(0)
        self.metrics.serving.labels(model, target).set(1)
        with contextlib.suppress(ServerUnavailable):
            after = await self.control.status(model)
            self._held(after.loaded, after.version)
        await self._report(target, target, SidecarState.OK, sha256=sha256)

    async def _switch(self, target: str, serving: str | None) -> str:
        model = self.settings.model
        await self._report(target, serving, SidecarState.FETCHING)
        try:
            fetched = await self.fetcher.fetch(model, target)
        except VerificationError as exc:
            self._refused[target] = time.monotonic()
            self.metrics.refusals.labels(model, exc.reason).inc()
            self.metrics.fetches.labels(model, "refused").inc()
            await self._report(
                target, serving, SidecarState.REFUSED, f"{exc.reason}: {exc.message}"
            )
            return "refused"
        except StoreError as exc:
            self.metrics.fetches.labels(model, "error").inc()
            await self._report(target, serving, SidecarState.ERROR, f"model store: {exc}")
            return "error"
        self.metrics.fetches.labels(model, "ok").inc()
        self.metrics.fetch_seconds.labels(model).observe(fetched.seconds)
        self.metrics.bytes.labels(model).inc(fetched.downloaded_bytes)
        sha256 = fetched.local.manifest.sha256
        await self._report(target, serving, SidecarState.LOADING, sha256=sha256)
        try:
            answer = await self.control.load(model, target, fetched.local.file, sha256)
        except ServerUnavailable as exc:
            self.metrics.swaps.labels(model, "error").inc()
            await self._report(target, serving, SidecarState.ERROR, f"server unavailable: {exc}")
            return "error"
        if isinstance(answer, ErrorReply):
            self._refused[target] = time.monotonic()
            self.metrics.swaps.labels(model, "refused").inc()
            self.metrics.refusals.labels(model, "server_refused").inc()
            await self._report(
                target, serving, SidecarState.REFUSED, f"server refused: {answer.error}"
            )
            return "refused"
        await self._swapped(target, serving, sha256)
        await asyncio.to_thread(self.fetcher.prune, model, self.settings.keep_versions, {target})
        return "ok"
