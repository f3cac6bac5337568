"""The canary's traffic policy, relayed from the pod's annotation to its server.

The operator puts :data:`~model_rollout_contract.canary.TRAFFIC_POLICY` on a canary pod
whose target is the policy's candidate. Once the server serves that candidate, the
sidecar sends it the policy (the ``traffic`` op); when the annotation goes away
(promotion) or the target is no longer the candidate (rollback, a new rollout), it sends
``TrafficRequest(model, None)`` to clear it. A malformed annotation is reported
(``bad_policy``) and treated as no policy.

The server can only split between versions it holds, so the stable one is kept loaded
beside the candidate (:func:`hold_stable`): a server that restarted holds only the
version ``CURRENT`` names (the candidate), and is given the stable one back — loaded
from the volume, where retention keeps it — then swapped back to the candidate.

When to send: the server's status does not say which policy it holds, so the relay
sends when what it wants differs from what the server last accepted; when the server's
status (serving version, versions held) differs from what it showed after that — a
restarted server holds less, and the stable version given back to it is a change too;
at the first cycle of a sidecar (the server may hold a policy from before it started:
that one is cleared or replaced); and, for a policy in force, again every ``resend_s``
(the report heartbeat), which bounds how long any restart the status cannot show goes
without it. A clear is not repeated: a restarted server holds no policy.
"""

from __future__ import annotations

import logging
import time

from model_rollout_contract import defaults
from model_rollout_contract.canary import TrafficPolicy
from model_rollout_contract.control import ErrorReply, StatusReply
from model_rollout_contract.report import HEARTBEAT_SECONDS
from model_rollout_contract.server_codes import is_permanent

from .control_client import ServerControl
from .errors import PolicyNotApplied, SidecarError
from .fetcher import Fetcher

log = logging.getLogger(__name__)
View = tuple[str | None, frozenset[str]]  # what a status shows: serving, versions held


def wanted_policy(
    policy: TrafficPolicy | None, target: str | None, serving: str | None
) -> TrafficPolicy | None:
    """The policy the server should hold now: the pod's, once its candidate is both the
    target and served; else none."""
    if policy is not None and policy.candidate == target == serving:
        return policy
    return None


def _view(status: StatusReply) -> View:
    return status.version, frozenset(status.loaded)


class PolicyRelay:
    """What the server was last told, and whether it must be told again."""

    def __init__(
        self,
        model: str,
        resend_s: float = HEARTBEAT_SECONDS,
        unholdable_retry_s: float = defaults.BACKOFF_MAX_SECONDS,
    ) -> None:
        self.model = model
        self.resend_s = resend_s
        self.unholdable_retry_s = unholdable_retry_s
        self._known = False  # False: the server's policy is not known (start, failure)
        self._sent: TrafficPolicy | None = None
        self._seen: View | None = None  # the server's status after it accepted _sent
        self._sent_at = 0.0  # monotonic
        # (stable, candidate) the server could not hold both of, and when that was found
        self._unholdable: tuple[str, str, float] | None = None

    def due(self, wanted: TrafficPolicy | None, status: StatusReply) -> bool:
        if not self._known or wanted != self._sent:
            return True
        if wanted is None:
            return False
        return _view(status) != self._seen or time.monotonic() - self._sent_at >= self.resend_s

    def forget(self) -> None:
        """The server must be told again (it was given its stable version back)."""
        self._known = False

    async def sync(
        self, control: ServerControl, wanted: TrafficPolicy | None, status: StatusReply
    ) -> StatusReply | None:
        """Send ``wanted`` if :meth:`due`; the server's status after it (``None``: not
        sent). Raises ``PolicyNotApplied`` when the server refuses a policy."""
        if not self.due(wanted, status):
            return None
        self._known = False  # until the server answers
        reply = await control.traffic(self.model, wanted)
        if isinstance(reply, ErrorReply):
            if wanted is None and is_permanent(reply.code):
                # refused outright (a server older than traffic policies, one that does
                # not serve the model): it holds no policy to clear
                log.info("%s: clearing the traffic policy: %s", self.model, reply.error)
                self._accepted(None, status)
                return None
            raise PolicyNotApplied(
                reply.code,
                f"server did not take the traffic policy "
                f"{wanted.to_annotation() if wanted else 'clear'}: {reply.error}",
            )
        log.info(
            "%s: traffic policy %s", self.model, wanted.to_annotation() if wanted else "cleared"
        )
        self._accepted(wanted, reply)
        return reply

    def _accepted(self, policy: TrafficPolicy | None, status: StatusReply) -> None:
        self._known, self._sent, self._seen = True, policy, _view(status)
        self._sent_at = time.monotonic()

    async def hold_stable(
        self, control: ServerControl, fetcher: Fetcher, policy: TrafficPolicy
    ) -> StatusReply:
        """Load the policy's stable version (from the volume; fetched if it is not
        there) and swap back to the candidate: the server then holds both. Raises
        ``PolicyNotApplied``; a server that cannot hold both is not asked again for
        pair before ``unholdable_retry_s`` (it would evict the candidate every cycle)."""
        model, stable, candidate = self.model, policy.stable, policy.candidate
        if self._unholdable is not None:
            *pair, found_at = self._unholdable
            if pair == [stable, candidate] and (
                time.monotonic() - found_at < self.unholdable_retry_s
            ):
                raise PolicyNotApplied(
                    "cannot_hold_both", f"the server cannot hold {stable} beside {candidate}"
                )
        log.info("%s: loading the stable %s beside the candidate %s", model, stable, candidate)
        try:
            fetched = await fetcher.fetch(model, stable)
        except SidecarError as exc:
            raise PolicyNotApplied(
                exc.code, f"the policy's stable {model}:{stable} is not usable: {exc.message}"
            ) from exc
        local = fetched.local
        loaded = await control.load(model, stable, local.file, local.manifest.sha256)
        if isinstance(loaded, ErrorReply):
            raise PolicyNotApplied(
                loaded.code, f"server did not load the stable {stable}: {loaded.error}"
            )
        back = await control.swap_to_retained(model, candidate)
        if isinstance(back, ErrorReply):
            self._unholdable = (stable, candidate, time.monotonic())
            raise PolicyNotApplied(
                "cannot_hold_both",
                f"loading the stable {stable} made the server drop {candidate} "
                f"({back.error}); it keeps fewer versions than a traffic policy needs",
            )
        self.forget()
        return await control.status(model)
