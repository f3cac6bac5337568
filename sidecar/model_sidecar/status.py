"""What the sidecar reports: a JSON status file the operator (or a person) can read, and,
in a cluster, the same JSON as an annotation on its own pod."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from pathlib import Path

from model_rollout_contract.annotations import SIDECAR_STATUS
from model_rollout_contract.report import SidecarReport

from .kube import PodApi

log = logging.getLogger(__name__)


class StatusReporter:
    def __init__(
        self,
        path: Path | None,
        pod: PodApi | None = None,
    ) -> None:
        self.path = path
        self.pod = pod
        self.last: SidecarReport | None = None

    async def report(self, status: SidecarReport) -> None:
        status = replace(status, updated_at=time.time())
        same = status.same_as(self.last)
        self.last = status
        if same:
            return
        log.info("status: %s", status.to_json())
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.write_text(status.to_json())
            os.replace(tmp, self.path)
        if self.pod is not None:
            try:
                await self.pod.annotate({SIDECAR_STATUS: status.to_json()})
            except Exception as exc:  # the file and log still carry it; retried next change
                log.warning("could not annotate pod with status: %s", exc)
                self.last = None
