"""Init-container mode: pre-pull the target (and previous) version before the server starts.

Leftovers of a killed download are swept first. Unless the target is already verified on
the volume (a restarted pod), a random pause of up to ``start_jitter_s`` comes before the
first store request, so a fleet created at once does not hit the store at once. The
target and the previous version are fetched side by side, as many at once as the
fetcher's download limit allows.

On a canary pod (a traffic policy whose candidate is the target) the policy's stable
version is pre-pulled too and the policy written to ``TRAFFIC`` before ``CURRENT``, so the
server starts with both versions and the split (:mod:`.current`); a stale ``TRAFFIC`` is
removed otherwise. A stable version that cannot be fetched leaves no ``TRAFFIC`` (the
watch loop gives it to the server later) and does not fail the init."""

from __future__ import annotations

import asyncio
import logging
import random

from model_rollout_contract.canary import TrafficPolicy
from model_rollout_contract.versions import is_ordered
from model_rollout_contract.versions import predecessor as previous_in_order

from .current import write_current, write_traffic
from .errors import SidecarError, StoreError
from .fetcher import Fetcher, FetchResult
from .publish import published_sequence
from .retry import start_jitter
from .store import ModelStore

log = logging.getLogger(__name__)


def predecessor(store: ModelStore, model: str, version: str) -> str | None:
    """The version before ``version``, for rollback: by the contract's order where the
    versions follow a rule (PEP 440, SemVer), else by publish order (each manifest's
    publish sequence, read only then)."""
    versions = store.list_children(model)
    if is_ordered([*versions, version]):
        return previous_in_order(versions, version)
    return previous_in_order(versions, version, publish_order(store, model, versions))


def publish_order(store: ModelStore, model: str, versions: list[str]) -> list[str]:
    """``versions`` oldest published first; those without a manifest are left out."""
    sequences = {v: published_sequence(store, model, v) for v in versions}
    return sorted(
        (v for v, s in sequences.items() if s is not None), key=lambda v: sequences[v] or 0
    )


async def pre_pull(
    fetcher: Fetcher,
    model: str,
    target: str,
    previous: str | None,
    start_jitter_s: float = 0.0,
    rng: random.Random | None = None,
    policy: TrafficPolicy | None = None,
) -> int:
    """Fetch ``target`` (required), ``previous`` and the stable version of ``policy``
    (best effort); returns an exit code."""
    if policy is not None and (policy.candidate != target or policy.stable == target):
        log.warning("traffic policy %s is not one for %s; ignored", policy.to_annotation(), target)
        policy = None
    try:
        await asyncio.to_thread(fetcher.sweep_incoming, model)
        present = await asyncio.to_thread(fetcher.verified_local, model, target)
    except (SidecarError, OSError) as exc:
        log.error("cannot use the volume %s: %s", fetcher.volume, exc)
        return 1
    if present is None:
        await start_jitter(start_jitter_s, rng or random.Random(), "the first store request")
    if previous is None:
        try:
            previous = await asyncio.to_thread(predecessor, fetcher.store, model, target)
        except StoreError as exc:
            log.warning("cannot list %s versions: %s", model, exc)
    stable = policy.stable if policy else None
    versions = list(dict.fromkeys(v for v in (target, previous, stable) if v))
    results = await asyncio.gather(
        *(fetcher.fetch(model, v) for v in versions), return_exceptions=True
    )
    fetched = dict(zip(versions, results, strict=True))
    for version, result in fetched.items():
        if isinstance(result, BaseException) and not isinstance(result, SidecarError | OSError):
            raise result
        if isinstance(result, BaseException) and version != target:
            log.warning("version %s:%s not pre-pulled: %s", model, version, result)
    if policy is not None and isinstance(fetched[policy.stable], BaseException):
        policy = None  # the server cannot split without it: the watch loop sees to it
    outcome = results[0]
    if isinstance(outcome, BaseException):
        code = getattr(outcome, "code", "volume_error")
        log.error("cannot pre-pull %s:%s: %s: %s", model, target, code, outcome)
        return 1
    assert isinstance(outcome, FetchResult)
    log.info(
        "%s:%s ready at %s (%s)",
        model,
        target,
        outcome.local.file,
        "downloaded" if outcome.downloaded_bytes else "already present",
    )
    try:
        await asyncio.to_thread(write_traffic, fetcher.volume, model, policy)  # CURRENT after
        await asyncio.to_thread(write_current, fetcher.volume, model, target)
    except (SidecarError, OSError) as exc:
        log.error("cannot write CURRENT or TRAFFIC for %s: %s", model, exc)
        return 1
    return 0
