"""Which version answers one request: the one its ``PIN_HEADER`` names, else under the
model's traffic policy the candidate for ``trafficPercent`` % of requests (drawn per
request) and the stable one for the rest, of which ``shadowPercent`` % are mirrored to
the candidate; without a policy, the serving version. The draws come from one
``random.Random`` (seeded with ``--traffic-seed`` for a reproducible split)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from model_rollout_contract.canary import TrafficPolicy
from model_server.lifecycle.model_slot import ModelSlot


@dataclass(frozen=True)
class Route:
    version: str | None  # None: the serving version
    pinned: bool = False  # named by the request: when it is not loaded, the answer is 404
    shadow: str | None = None  # the candidate to mirror this request to, once answered


SERVING = Route(None)


class TrafficRouter:
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def route(self, policy: TrafficPolicy | None, pinned: str | None = None) -> Route:
        if pinned is not None:
            return Route(pinned, pinned=True)
        if policy is None:
            return SERVING
        if self._rng.randrange(100) < policy.traffic_percent:
            return Route(policy.candidate)
        mirrored = self._rng.randrange(100) < policy.shadow_percent
        return Route(policy.stable, shadow=policy.candidate if mirrored else None)

    def route_in(self, slot: ModelSlot, pinned: str | None = None) -> Route:
        """Where one request to ``slot`` goes, decided on one view of its policy and its
        serving version (under the lock that swaps them): a request not split by a policy
        goes to the version serving *now*, by name, so one that arrived just before a
        swap that installed a candidate under a policy is not answered by that candidate."""

        def choose(policy: TrafficPolicy | None, serving: str | None) -> Route:
            route = self.route(policy, pinned)
            return Route(serving) if route.version is None and serving is not None else route

        return slot.decide(choose)
