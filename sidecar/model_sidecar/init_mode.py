"""Init-container mode: pre-pull the target (and previous) version before the server starts."""

from __future__ import annotations

import logging
import os

from model_rollout_contract.layout import CURRENT_FILE
from model_rollout_contract.versions import predecessor as previous_in_order

from .errors import StoreError, VerificationError
from .fetcher import Fetcher
from .store import ModelStore

log = logging.getLogger(__name__)


def predecessor(store: ModelStore, model: str, version: str) -> str | None:
    """The version published just before ``version`` (the contract's order), for rollback."""
    return previous_in_order(store.list_children(model), version)


async def pre_pull(fetcher: Fetcher, model: str, target: str, previous: str | None) -> int:
    """Fetch ``target`` (required) and ``previous`` (best effort); returns an exit code."""
    try:
        result = await fetcher.fetch(model, target)
    except (VerificationError, StoreError) as exc:
        log.error("cannot pre-pull %s:%s: %s", model, target, exc)
        return 1
    log.info(
        "%s:%s ready at %s (%s)",
        model,
        target,
        result.local.file,
        "downloaded" if result.downloaded_bytes else "already present",
    )
    if previous is None:
        try:
            previous = predecessor(fetcher.store, model, target)
        except StoreError as exc:
            log.warning("cannot list %s versions: %s", model, exc)
    if previous and previous != target:
        try:
            await fetcher.fetch(model, previous)
        except (VerificationError, StoreError) as exc:
            log.warning("previous version %s:%s not pre-pulled: %s", model, previous, exc)
    current = fetcher.volume / model / CURRENT_FILE
    tmp = current.with_name(f".{CURRENT_FILE}.tmp")
    tmp.write_text(target + "\n")
    os.replace(tmp, current)
    return 0
