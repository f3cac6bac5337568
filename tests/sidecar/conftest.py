"""The sidecar tests' store: a prefix of its own per test in the session's SeaweedFS."""

from __future__ import annotations

import uuid

import pytest

from model_rollout_e2e.seaweed import SeaweedFS
from model_sidecar.store import S3Store


@pytest.fixture
def bucket(s3_env: SeaweedFS) -> S3Store:
    s3_env.create_bucket("models")  # one bucket (one SeaweedFS collection); a prefix per test
    return S3Store("models", f"team-{uuid.uuid4().hex[:10]}", endpoint_url=s3_env.endpoint)
