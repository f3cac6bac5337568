"""The canary's traffic policy, relayed from the pod's annotation to its server.

The operator puts :data:`~model_rollout_contract.canary.TRAFFIC_POLICY` on a canary pod
whose target is the policy's candidate. The sidecar loads the candidate *with* the policy
(the ``load`` op carries it; the server sets it in the same step as the swap), so the
candidate never answers a request outside the policy's share, and writes it to the
volume beside ``CURRENT`` (``TRAFFIC``) so that a restarted server resumes it before its
first answer. When the annotation goes away (promotion) or the target is no longer the
candidate (rollback, a new rollout), it sends ``TrafficRequest(model, None)`` to clear
it; a change of the shares is sent with the ``traffic`` op. A malformed annotation is
reported (``bad_policy``) and treated as no policy.

The server can only split between versions it holds, so the stable one is loaded first
(:meth:`PolicyRelay.load_stable`, from the volume, where retention keeps it): the server
then serves the stable version, which is within any policy, until the candidate is
swapped in with the policy. A server that lost the stable version (one restarted without
``TRAFFIC``, say) is given it back the same way (:meth:`PolicyRelay.hold_stable`):
stable first, then the candidate and the policy in one step, never the candidate alone.

A load's policy counts as taken only when the server's status after it shows that very
policy (``StatusReply.policy``): a server older than that field ignores the policy a load
carries and shows none, so the relay sends it with the ``traffic`` op at once, which such
a server supports; the candidate then answers outside the policy's share only between
the two replies.

When to send: when the server's status shows a policy other than the one wanted; when
what the relay wants differs from what the server last accepted; when the server's
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

from model_rollout_contract.canary import TrafficPolicy
from model_rollout_contract.control import ErrorReply, StatusReply
from model_rollout_contract.report import HEARTBEAT_SECONDS
from model_rollout_contract.server_codes import is_permanent

from .control_client import ServerControl
from .errors import PolicyNotApplied, SidecarError
from .fetcher import Fetcher, LocalVersion

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

    def __init__(self, model: str, resend_s: float = HEARTBEAT_SECONDS) -> None:
        self.model = model
        self.resend_s = resend_s
        self._known = False  # False: the server's policy is not known (start, failure)
        self._sent: TrafficPolicy | None = None
        self._seen: View | None = None  # the server's status after it accepted _sent
        self._sent_at = 0.0  # monotonic

    def due(self, wanted: TrafficPolicy | None, status: StatusReply) -> bool:
        if not self._known or wanted != self._sent:
            return True
        if status.policy_reported and status.policy != wanted:
            return True
        if wanted is None:
            return False
        return _view(status) != self._seen or time.monotonic() - self._sent_at >= self.resend_s

    def forget(self) -> None:
        """The server must be told again (what it holds is not known)."""
        self._known = False

    def loaded_with(self, policy: TrafficPolicy | None, status: StatusReply | None) -> None:
        """A load carrying ``policy`` was answered; ``status``: the server's after it.
        The policy is taken only if that status shows it (``None``, a status that shows
        another policy or none, one of a server that does not say: it is sent again)."""
        if policy is None:
            return
        if status is not None and status.policy_reported and status.policy == policy:
            self._accepted(policy, status)
        else:
            self.forget()

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

    async def load_stable(
        self, control: ServerControl, fetcher: Fetcher, policy: TrafficPolicy
    ) -> None:
        """Load the policy's stable version (from the volume; fetched if it is not
        there): the server serves it until the candidate is swapped in with the policy.
        Raises ``PolicyNotApplied``."""
        model, stable = self.model, policy.stable
        log.info("%s: loading the stable %s before the candidate %s", model, stable,
                 policy.candidate)  # fmt: skip
        local = await self._usable(fetcher, stable, "stable")
        self.forget()  # whatever the answer, the server's versions change
        loaded = await control.load(model, stable, local.file, local.manifest.sha256)
        if isinstance(loaded, ErrorReply):
            raise PolicyNotApplied(
                loaded.code, f"server did not load the stable {stable}: {loaded.error}"
            )

    async def _usable(self, fetcher: Fetcher, version: str, role: str) -> LocalVersion:
        """The policy's ``role`` version, verified on the volume (fetched if need be);
        one that cannot be had raises ``PolicyNotApplied`` with the fetch's code."""
        try:
            return (await fetcher.fetch(self.model, version)).local
        except SidecarError as exc:
            raise PolicyNotApplied(
                exc.code,
                f"the policy's {role} {self.model}:{version} is not usable: {exc.message}",
            ) from exc

    async def hold_stable(
        self, control: ServerControl, fetcher: Fetcher, policy: TrafficPolicy
    ) -> StatusReply:
        """Give a server that serves the candidate without the stable version both back:
        the stable version loaded (:meth:`load_stable`), then the candidate swapped in
        again *with* the policy (a pointer swap: the server still holds it, unless it
        keeps too few versions, which it then says). Raises ``PolicyNotApplied``."""
        model, candidate = self.model, policy.candidate
        await self.load_stable(control, fetcher, policy)
        local = await self._usable(fetcher, candidate, "candidate")
        back = await control.load(model, candidate, local.file, local.manifest.sha256, policy)
        if isinstance(back, ErrorReply):
            raise PolicyNotApplied(
                back.code,
                f"server did not take {candidate} back with the traffic policy "
                f"{policy.to_annotation()} (it serves the stable {policy.stable}): {back.error}",
            )
        status = await control.status(model)
        self.loaded_with(policy, status)  # not shown there: the caller's sync sends it
        return status
