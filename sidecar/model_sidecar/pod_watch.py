"""Follow the sidecar's own pod through the API, so a new target version is seen at once
instead of after the kubelet's next refresh of the Downward API file (up to about a
minute on a real kubelet).

Read the pod, then watch it from that ``resourceVersion``; when the server ends a watch
(its timeout) resume from the last version seen, a bookmark's included (a bookmark says
only how far the watch got: it is never taken for the pod); after 410 Gone read it again.

When the API fails (an error answer, a cut or refused connection, a watch that ends at
once with nothing in it: :mod:`.kube`), the last good view of the pod is kept: the
pod's annotations did not change because the API cannot say so, and the Downward API
file, which the kubelet refreshes only now and then, is usually older than that view.
The file is preferred only once its content changes after the API was lost: then the
kubelet has seen something newer. Each failure in a row pauses longer
(:data:`~.kube.API_BACKOFF`, never less than the answer's ``Retry-After``), so that a
fleet of sidecars does not flatten an API server that is already overloaded; the first
good watch item ends the pauses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from pathlib import Path

from model_rollout_contract.tracks import DEFAULT_TRACK, TrackKeys

from .errors import KubeError, WatchExpired
from .kube import API_BACKOFF, Bookmark, PodApi, PodSnapshot
from .retry import Backoff

log = logging.getLogger(__name__)


def _file_text(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text()
    except OSError:
        return None


class PodWatch:
    def __init__(
        self,
        api: PodApi,
        backoff: Backoff = API_BACKOFF,
        watch_timeout_s: int = 300,
        rng: random.Random | None = None,
        keys: TrackKeys = DEFAULT_TRACK,
        fallback_file: Path | None = None,
    ) -> None:
        """``fallback_file``: the Downward API annotations file, preferred over the last
        view once it changes after the API was lost."""
        self.api = api
        self.watched = keys.followed  # this sidecar's track's: another track's edits are not
        # news to it
        self.backoff = backoff
        self.watch_timeout_s = watch_timeout_s
        self.rng = rng or random.Random()
        self.fallback_file = fallback_file
        self.annotations: dict[str, str] | None = None  # the last good view; None: none yet
        self.current = False  # whether the API answers (the view is not just the last one)
        self.changed = asyncio.Event()  # set when the target, previous or policy changes
        self.seen_at: float | None = None  # when the current view arrived
        self.failures = 0  # calls failed in a row: how long the next pause is
        self.relists = 0  # reads after a 410, for tests and metrics
        self.bookmarks = 0  # bookmarks received, for tests
        self._lost_at: float | None = None  # monotonic time the API was lost
        self._file_at_loss: str | None = None  # the fallback file's text then
        self._file_changed = False  # it changed since: the kubelet saw something newer

    def view(self) -> dict[str, str] | None:
        """The annotations to follow: the API's view, kept while the API is lost unless
        the fallback file changed since; ``None``: read the file."""
        if self.annotations is None or self.current or self.fallback_file is None:
            return self.annotations
        if not self._file_changed and _file_text(self.fallback_file) != self._file_at_loss:
            self._file_changed = True
            log.warning("pod watch: the Downward API file changed while the API is lost: using it")
        return None if self._file_changed else self.annotations

    def stale_seconds(self) -> float:
        """How long the API has been lost (0 while it answers)."""
        return 0.0 if self._lost_at is None else time.monotonic() - self._lost_at

    def _answered(self, settled: bool = True) -> None:
        """The API answered well: its view is current again; ``settled`` (a watch item or
        a watch the server ended) also ends the pauses, a read alone does not (it is
        always followed by a watch, which may fail again)."""
        self.current = True
        if settled:
            self.failures = 0
        if self._lost_at is not None:
            log.info("pod watch: the API answers again after %.1f s", self.stale_seconds())
            self._lost_at, self._file_changed = None, False
            self.changed.set()  # the file may have been followed meanwhile

    def _lost(self, exc: KubeError) -> None:
        if self._lost_at is None:
            kept = "the Downward API file" if self.annotations is None else "its last view"
            log.warning("pod watch: %s; following %s", exc, kept)
            self._lost_at = time.monotonic()
            self._file_at_loss = _file_text(self.fallback_file)
        self.current = False

    def _update(self, snapshot: PodSnapshot) -> None:
        if snapshot.deleted:
            return  # the pod is going away; keep serving what it asked for last
        before = self.annotations or {}
        self.annotations = snapshot.annotations
        if self.seen_at is None or any(
            before.get(key) != snapshot.annotations.get(key) for key in self.watched
        ):  # not the sidecar's own status annotation, which it writes itself
            self.seen_at = time.time()
            self.changed.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the pod until ``stop`` is set (a watch in progress is cancelled)."""
        following = asyncio.create_task(self._follow())
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({following, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (following, stopping):
                task.cancel()
            for task in (following, stopping):
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _follow(self) -> None:
        version: str | None = None
        while True:
            try:
                if version is None:
                    snapshot = await self.api.read()
                    self._update(snapshot)
                    self._answered(settled=False)
                    version = snapshot.resource_version
                version = await self._watch_once(version)
            except WatchExpired as exc:
                log.info("pod watch: %s; reading the pod again", exc)
                self.relists += 1
                version = None
                self.failures += 1
                if self.failures > 1:  # 410 again with nothing good between: pause
                    await asyncio.sleep(self.backoff.delay(self.failures - 2, self.rng))
            except KubeError as exc:
                self._lost(exc)
                self.failures += 1
                await asyncio.sleep(
                    self.backoff.delay(self.failures - 1, self.rng, exc.retry_after_s)
                )

    async def _watch_once(self, version: str) -> str:
        """One watch from ``version`` until the server ends it; returns the version to
        resume from: a bookmark's only moves it on."""
        async with self.api.watch(version, self.watch_timeout_s) as events:
            async for item in events:
                self._answered()
                if isinstance(item, Bookmark):
                    self.bookmarks += 1
                else:
                    self._update(item)
                version = item.resource_version or version
        self._answered()  # the server's timeout
        return version
