"""The operator's store check against a real S3 (SeaweedFS): credentials are resolved on
every check, so a key rotated in the operator's environment (or a wrong key first) is
not cached for the life of the process."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from model_operator.spec import parse_spec
from model_operator.store_check import VersionCheck, check_version
from model_sidecar.store import S3Store
from sidecar_helpers import make_keys, publish_versions


def spec_for(store: S3Store, endpoint: str) -> Any:
    return parse_spec(
        {
            "model": "mlp",
            "version": "v1",
            "image": "img",
            "store": {"url": f"s3://models/{store.prefix}", "endpoint": endpoint},
            "signingPublicKeySecret": "k",
        }
    )


async def test_credentials_are_resolved_on_every_check(
    s3_env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_env.create_bucket("models")
    store = S3Store("models", f"sc-{uuid.uuid4().hex[:8]}", endpoint_url=s3_env.endpoint)
    publish_versions(store, make_keys(tmp_path / "keys"), tmp_path, {"v1": 1})
    spec = spec_for(store, s3_env.endpoint)
    right_key = os.environ["AWS_ACCESS_KEY_ID"]  # s3_env's
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "not-the-key")
    answer = await check_version(spec)
    assert answer.result is VersionCheck.UNREACHABLE, answer.message  # 403 with the wrong key
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", right_key)  # the key is rotated to the right one
    answer = await check_version(spec)
    assert answer.result is VersionCheck.PRESENT, answer.message
