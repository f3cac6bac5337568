"""Follow the sidecar's own pod through the API, so a new target version is seen at once
instead of after the kubelet's next refresh of the Downward API file (up to about a
minute on a real kubelet).

Read the pod, then watch it from that ``resourceVersion``; when the server ends a watch
(its timeout) resume from the last version seen, a bookmark's included (a bookmark says
only how far the watch got: it is never taken for the pod); after 410 Gone read it again.

When the API fails (an error answer, a cut or refused connection, a watch that ends at
once with nothing in it, an answer that is not one: :mod:`.kube`; or anything else that
goes wrong here, logged), the last good view of the pod is kept: the pod's annotations
did not change because the API cannot say so, and the Downward API file, which the
kubelet refreshes only now and then, is usually older than that view. The file is
preferred only once what this track reads of it (target, previous, traffic policy, pins)
changes after the API was lost: then the kubelet has seen something newer; a file that
cannot be read is no news. Each failure in a row pauses longer
(:data:`~.kube.API_BACKOFF`, never less than the answer's ``Retry-After``), so that a
fleet of sidecars does not flatten an API server that is already overloaded. Only a
watch that stayed open a while (:attr:`PodWatch.settle_s`) ends the run of failures, as
client-go's backoff resets only after a quiet while: a watch that brings a bookmark and
then fails is still a failure in a row, and a 410 that comes again is read again only
after the pause.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from pathlib import Path

from model_rollout_contract.annotations import parse_downward_annotations
from model_rollout_contract.tracks import DEFAULT_TRACK, TrackKeys

from .errors import KubeError, PodWatchEnded, WatchExpired
from .kube import API_BACKOFF, Bookmark, PodApi, PodSnapshot
from .retry import Backoff

log = logging.getLogger(__name__)


def _file_keys(path: Path | None, keys: tuple[str, ...]) -> tuple[str | None, ...] | None:
    """What the Downward API file at ``path`` says of ``keys``; ``None`` when it cannot be
    read (the kubelet swapping it, say): that is no news of the pod."""
    if path is None:
        return None
    try:
        annotations = parse_downward_annotations(path.read_text())
    except (OSError, UnicodeDecodeError):
        return None
    return tuple(annotations.get(key) for key in keys)


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
        view once what the track reads of it changes after the API was lost."""
        self.api = api
        self.watched = keys.followed  # this sidecar's track's: another track's edits are not
        # news to it
        self.read_keys = (*keys.followed, keys.pins)  # all that the sidecar reads of them
        self.backoff = backoff
        self.watch_timeout_s = watch_timeout_s
        # a watch open this long ends a run of failures: as long as the longest pause, so
        # a watch failing after a while is never more often than the longest pause allows
        self.settle_s = backoff.max_s
        self.rng = rng or random.Random()
        self.fallback_file = fallback_file
        self.annotations: dict[str, str] | None = None  # the last good view; None: none yet
        self.current = False  # whether the API answers (the view is not just the last one)
        self.changed = asyncio.Event()  # set when the target, previous or policy changes
        self.seen_at: float | None = None  # when the current view arrived
        self.relists = 0  # reads after a 410, for tests and metrics
        self.bookmarks = 0  # bookmarks received, for tests
        self._failed = 0  # failures in a row, as of the last call that ended
        self._open_since: float | None = None  # monotonic time the open watch was answered
        self._lost_at: float | None = None  # monotonic time the API was lost
        self._file_at_loss: tuple[str | None, ...] | None = None  # the file's read keys then
        self._file_changed = False  # they changed since: the kubelet saw something newer

    @property
    def failures(self) -> int:
        """Calls failed in a row: how long the next pause is. A watch open for
        :attr:`settle_s` ends the run; its items do not (one bookmark, then an error, is
        still a failure in a row)."""
        if self._open_since is not None and time.monotonic() - self._open_since >= self.settle_s:
            return 0
        return self._failed

    def view(self) -> dict[str, str] | None:
        """The annotations to follow: the API's view, kept while the API is lost unless
        what the track reads of the fallback file changed since; ``None``: read the
        file."""
        if self.annotations is None or self.current or self.fallback_file is None:
            return self.annotations
        if not self._file_changed:
            now = _file_keys(self.fallback_file, self.read_keys)
            if self._file_at_loss is None:  # unreadable when the API was lost: from now
                self._file_at_loss = now
            elif now is not None and now != self._file_at_loss:
                self._file_changed = True
                log.warning(
                    "pod watch: the Downward API file changed while the API is lost: using it"
                )
        return None if self._file_changed else self.annotations

    def stale_seconds(self) -> float:
        """How long the API has been lost (0 while it answers)."""
        return 0.0 if self._lost_at is None else time.monotonic() - self._lost_at

    def _answered(self) -> None:
        """The API answered well: its view is current again (the pauses end only once a
        watch has stayed open a while: :attr:`failures`)."""
        self.current = True
        if self._lost_at is not None:
            log.info("pod watch: the API answers again after %.1f s", self.stale_seconds())
            self._lost_at, self._file_changed = None, False
            self.changed.set()  # the file may have been followed meanwhile

    def _ended(self, failed: bool) -> int:
        """A call ended (``failed``: with a failure); returns the failures in a row."""
        self._failed = self.failures + (1 if failed else 0)
        self._open_since = None
        return self._failed

    def _lost(self, why: str) -> None:
        if self._lost_at is None:
            kept = "the Downward API file" if self.annotations is None else "its last view"
            log.warning("pod watch: %s; following %s", why, kept)
            self._lost_at = time.monotonic()
            self._file_at_loss = _file_keys(self.fallback_file, self.read_keys)
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
        """Follow the pod until ``stop`` is set (a watch in progress is cancelled). Every
        failure is retried, so following never ends by itself; should it all the same (a
        defect), the view is marked stale and :class:`PodWatchEnded` raised: the caller
        must not go on with a view frozen for good."""
        following = asyncio.create_task(self._follow())
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({following, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (following, stopping):
                task.cancel()
            await asyncio.gather(following, stopping, return_exceptions=True)
        if following.cancelled():
            return
        self.current = False  # the view is frozen from now: stale, and it says so
        if self._lost_at is None:
            self._lost_at = time.monotonic()
        raise PodWatchEnded("following the pod ended by itself") from following.exception()

    async def _follow(self) -> None:
        version: str | None = None
        while True:
            try:
                if version is None:
                    snapshot = await self.api.read()
                    self._update(snapshot)
                    self._answered()
                    version = snapshot.resource_version
                version = await self._watch_once(version)
            except WatchExpired as exc:
                log.info("pod watch: %s; reading the pod again", exc)
                self.relists += 1
                version = None
                failures = self._ended(failed=True)
                if failures > 1:  # 410 again with no watch that lived between: pause
                    await asyncio.sleep(self.backoff.delay(failures - 2, self.rng))
            except KubeError as exc:
                self._lost(str(exc))
                failures = self._ended(failed=True)
                await asyncio.sleep(self.backoff.delay(failures - 1, self.rng, exc.retry_after_s))
            except Exception as exc:  # a defect, or an answer nobody foresaw: never the end
                log.exception("pod watch: unexpected failure; reading the pod again after a pause")
                self._lost(f"{type(exc).__name__}: {exc}")
                version = None  # whatever state the failure left, start again from a read
                failures = self._ended(failed=True)
                await asyncio.sleep(self.backoff.delay(failures - 1, self.rng))

    async def _watch_once(self, version: str) -> str:
        """One watch from ``version`` until the server ends it; returns the version to
        resume from: a bookmark's only moves it on."""
        async with self.api.watch(version, self.watch_timeout_s) as events:
            self._open_since = time.monotonic()
            async for item in events:
                self._answered()
                if isinstance(item, Bookmark):
                    self.bookmarks += 1
                else:
                    self._update(item)
                version = item.resource_version or version
        self._answered()  # the server's timeout
        self._ended(failed=False)
        return version
