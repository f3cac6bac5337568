"""What a (re)started server loads for a model before it reports ready: the version
``CURRENT`` names and, on a canary pod, the traffic policy the sidecar wrote beside it
(``TRAFFIC``, :data:`~model_rollout_contract.layout.TRAFFIC_FILE`).

Without the policy, a restarted canary pod would answer every request from the
candidate (``CURRENT``) until its sidecar gave the stable version back. So when the
file's policy has ``CURRENT`` as its candidate and names a stable version on disk, the
stable version is loaded first and the candidate then with the policy, in one swap
(``EngineManager.load``): the first request is already split. A file that cannot be
read or is not a policy, or whose stable version does not load, is logged and left
aside: the server serves ``CURRENT`` as it would without one, and never fails to start
for it. The repository extension's load (``DataPlane.repository_load``, after an admin's
unload) comes back the same way as a restart.
"""

from __future__ import annotations

import logging

from model_rollout_contract.canary import InvalidPolicy, TrafficPolicy
from model_rollout_contract.layout import TRAFFIC_FILE
from model_server.errors import ServingError
from model_server.files.trusted_files import UntrustedPath
from model_server.lifecycle.engine_manager import EngineManager, SwapResult
from model_server.lifecycle.repository import ModelRepository

log = logging.getLogger(__name__)


def resumed_policy(repository: ModelRepository, key: str, current: str) -> TrafficPolicy | None:
    """The policy to serve ``current`` under at start: the model's ``TRAFFIC`` file's,
    when its candidate is ``current`` and its stable version is in the repository."""
    try:
        policy = repository.traffic_policy(key)
    except (InvalidPolicy, UntrustedPath, OSError) as exc:
        log.error("model %s: %s ignored: %s; serving %s alone", key, TRAFFIC_FILE, exc, current)
        return None
    if policy is None:
        return None
    if policy.candidate != current:  # written for another swap (or one not done yet)
        log.info(
            "model %s: %s %s ignored: its candidate is not %s, the version to serve",
            key, TRAFFIC_FILE, policy.to_annotation(), current,
        )  # fmt: skip
        return None
    problem = (
        "it splits between one version and itself"
        if policy.stable == current
        else None
        if policy.stable in repository.versions(key)
        else "its stable version is not on disk"
    )
    if problem:
        log.warning(
            "model %s: %s %s ignored: %s; serving %s alone",
            key, TRAFFIC_FILE, policy.to_annotation(), problem, current,
        )  # fmt: skip
        return None
    return policy


async def load_resumed(
    manager: EngineManager,
    key: str,
    version: str,
    policy: TrafficPolicy | None,
    who: str = "startup",
    source: str = "startup",
) -> SwapResult:
    """Load ``version`` under ``policy`` (:func:`resumed_policy`'s): its stable version
    first when it is not loaded already (one that does not load is logged, and
    ``version`` then served alone), then ``version`` with the policy, in one swap. A
    restart and the repository extension's load (after an unload) both come back so.
    Raises ``version``'s own ``ServingError``."""
    if policy is not None and manager.slot(key).get(policy.stable) is None:
        try:
            await manager.load(key, policy.stable, who=who, source=source)
        except ServingError as exc:
            log.error(
                "could not load %s:%s, the stable version of %s: %s; serving %s alone",
                key, policy.stable, TRAFFIC_FILE, exc.message, version,
            )  # fmt: skip
            policy = None
    return await manager.load(key, version, who=who, source=source, policy=policy)


async def load_at_start(
    manager: EngineManager, key: str, version: str, policy: TrafficPolicy | None
) -> None:
    """Load ``version`` (under ``policy``, after its stable version); failures are logged:
    the model is then not ready until the sidecar loads a version."""
    try:
        await load_resumed(manager, key, version, policy)
    except ServingError as exc:
        log.error("could not load %s:%s at start: %s", key, version, exc.message)
