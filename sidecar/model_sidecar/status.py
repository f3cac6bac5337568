"""What the sidecar reports: a JSON status file the operator (or a person) can read, and,
in a cluster, the same JSON as an annotation on its own pod.

A report is written when it changes, and an unchanged one again to the file once
``heartbeat_s`` (:data:`~model_rollout_contract.report.HEARTBEAT_SECONDS`) has passed
since the last write, so the file's ``updated_at`` shows that the sidecar is alive; the
watch loop calls :meth:`StatusReporter.heartbeat` between its cycles. The pod's
annotation is patched only when the report says something new (or the last patch
failed): an idle pod costs the API server no writes, and every pod event the operator
sees is news. The file is replaced atomically and
never through a link (it lies in the shared volume). A failed write (a full volume) is
logged and tried again on the next report; the pod annotation still carries it. A patch
of the annotation that the API refuses (403 from admission, 429, 5xx, no answer) is
logged, counted (``model_sidecar_kube_api_errors_total{call="annotate"}``) and tried
again with the newest report after a pause that grows with each refusal in a row
(:data:`~.kube.API_BACKOFF`, never shorter than the answer's ``Retry-After``).
Credentials in URLs are redacted from the reason.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import replace
from pathlib import Path

from model_rollout_contract.redact import redact
from model_rollout_contract.report import HEARTBEAT_SECONDS, SidecarReport
from model_rollout_contract.tracks import DEFAULT_TRACK, TrackKeys

from .errors import KubeError, SidecarError
from .kube import API_BACKOFF, PodApi
from .retry import Backoff
from .volume import SafeDir

log = logging.getLogger(__name__)


class StatusReporter:
    def __init__(
        self,
        path: Path | None,
        pod: PodApi | None = None,
        heartbeat_s: float = HEARTBEAT_SECONDS,
        keys: TrackKeys = DEFAULT_TRACK,
        backoff: Backoff = API_BACKOFF,
        rng: random.Random | None = None,
    ) -> None:
        self.path = path
        self.annotation = keys.sidecar_status  # this sidecar's track's report
        self.pod = pod
        self.heartbeat_s = heartbeat_s
        self.backoff = backoff  # between refused patches of the annotation
        self.rng = rng or random.Random()
        self.last: SidecarReport | None = None
        self._annotated: SidecarReport | None = None  # what the pod's annotation says
        self._written_at = 0.0  # monotonic time of the last complete write
        self._dirty = False  # the last report did not reach every destination
        self.patch_failures = 0  # patches refused in a row
        self._patch_after = 0.0  # monotonic time before which no patch is sent

    async def report(self, status: SidecarReport) -> None:
        if status.reason is not None:
            status = replace(status, reason=redact(status.reason))
        due = time.monotonic() - self._written_at >= self.heartbeat_s
        if status.same_as(self.last) and not self._dirty and not due:
            return
        status = replace(status, updated_at=time.time())
        changed = not status.same_as(self.last)
        self.last = status
        if changed:  # the JSON line (--log-format json) carries the state as fields too
            fields = {"version": status.target, "serving": status.serving, "state": status.state}
            log.info("status: %s", status.to_json(), extra=fields)
        written = self._write_file(status)
        annotated = await self._annotate(status)
        self._dirty = not (written and annotated)  # tried again on the next heartbeat
        self._written_at = time.monotonic()

    async def heartbeat(self) -> None:
        """Rewrite the last report if the heartbeat period has passed (or it failed)."""
        if self.last is not None:
            await self.report(self.last)

    def _write_file(self, status: SidecarReport) -> bool:
        if self.path is None:
            return True
        try:
            with SafeDir.open(self.path.parent, create=True) as directory:
                directory.write_atomic(self.path.name, status.to_json().encode())
        except (SidecarError, OSError) as exc:
            log.warning("could not write the status file %s: %s", self.path, exc)
            return False
        return True

    async def _annotate(self, status: SidecarReport) -> bool:
        """Whether the pod's annotation carries ``status`` now; while a refused patch's
        pause lasts, nothing is sent (the report stays due)."""
        if self.pod is None or status.same_as(self._annotated):
            return True
        if time.monotonic() < self._patch_after:
            return False
        try:
            await self.pod.annotate({self.annotation: status.to_json()})
        except KubeError as exc:  # the file and log still carry it; retried after a pause
            self.patch_failures += 1
            pause = self.backoff.delay(self.patch_failures - 1, self.rng, exc.retry_after_s)
            self._patch_after = time.monotonic() + pause
            log.warning(
                "could not annotate the pod with the status (%d in a row): %s; again in %.1f s",
                self.patch_failures,
                exc,
                pause,
            )
            return False
        self.patch_failures = 0
        self._annotated = status
        return True
