"""A pod lookup for a rollout task run outside an operator: no pods, all of them seen."""

from __future__ import annotations

from collections.abc import Iterable

from model_operator.pods import PodView


class NoPods:
    """:class:`model_operator.pod_index.PodLookup` of a namespace with no pods."""

    def get(self, key: tuple[str, str], default: list[PodView], /) -> Iterable[PodView]:
        return default

    def unseen(self, namespace: str, /) -> str | None:
        return None
