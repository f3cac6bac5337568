"""Follow the sidecar's own pod through the API, so a new target version is seen at once
instead of after the kubelet's next refresh of the Downward API file (up to about a
minute on a real kubelet).

Read the pod, then watch it from that ``resourceVersion``; when the server ends a watch
(its timeout) resume from the last version seen; after 410 Gone read it again. While the
API cannot be reached, :attr:`PodWatch.annotations` is ``None`` and the target comes
from the Downward API file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time

from model_rollout_contract.tracks import DEFAULT_TRACK, TrackKeys

from .errors import KubeError, WatchExpired
from .kube import PodApi, PodSnapshot
from .retry import Backoff

log = logging.getLogger(__name__)


class PodWatch:
    def __init__(
        self,
        api: PodApi,
        backoff: Backoff | None = None,
        watch_timeout_s: int = 300,
        rng: random.Random | None = None,
        keys: TrackKeys = DEFAULT_TRACK,
    ) -> None:
        self.api = api
        self.watched = keys.followed  # this sidecar's track's: another track's edits are not
        # news to it
        self.backoff = backoff or Backoff(base_s=0.5, max_s=15.0)
        self.watch_timeout_s = watch_timeout_s
        self.rng = rng or random.Random()
        self.annotations: dict[str, str] | None = None  # None: the API view is not current
        self.changed = asyncio.Event()  # set when the target, previous or policy changes
        self.seen_at: float | None = None  # when the current view arrived
        self.relists = 0  # reads after a 410, for tests and metrics

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
        failures = 0
        while True:
            try:
                if version is None:
                    snapshot = await self.api.read()
                    self._update(snapshot)
                    version = snapshot.resource_version
                async for snapshot in self.api.events(version, self.watch_timeout_s):
                    self._update(snapshot)
                    version = snapshot.resource_version or version
                    failures = 0
                failures = 0  # the server ended the watch (its timeout): resume
            except WatchExpired as exc:
                log.info("pod watch: %s; reading the pod again", exc)
                self.relists += 1
                version = None
            except KubeError as exc:
                if self.annotations is not None:
                    log.warning("pod watch: %s; falling back to the Downward API file", exc)
                self.annotations = None  # not current any more
                self.changed.set()
                failures += 1
                await asyncio.sleep(self.backoff.delay(failures, self.rng))
