"""A :class:`~.scenario.Scenario` whose model store is a SeaweedFS bucket: what every
end-to-end test on S3 sets up the same way (a prefix of its own in a shared bucket, and
the pods' processes given the server's credentials as the AWS SDK reads them)."""

from __future__ import annotations

import uuid
from typing import Any

from model_sidecar.store import S3Store

from .scenario import Scenario, StoreSetup
from .seaweed import CREDENTIALS_ENV, SeaweedFS

BUCKET = "models"


def s3_scenario(
    seaweed: SeaweedFS, name: str, env: dict[str, str] | None = None, **options: Any
) -> Scenario:
    """A scenario publishing to ``<name>-<random>/`` in :data:`BUCKET`, so that tests
    sharing one SeaweedFS never see each other's versions. ``env``: more environment for
    the operator and the pods, beside the credentials; ``options``: the
    :class:`~.scenario.Scenario`'s own."""
    seaweed.create_bucket(BUCKET)
    store = S3Store(BUCKET, f"{name}-{uuid.uuid4().hex[:8]}", endpoint_url=seaweed.endpoint)
    return Scenario(StoreSetup.s3(store), env={**CREDENTIALS_ENV, **(env or {})}, **options)
