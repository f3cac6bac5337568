"""Watch mode: keep the server on the pod's target version.

At start: sweep ``.incoming``, then a random pause of up to ``start_jitter_s`` before the
first poll. Each cycle: read the target; if the server serves something else, fetch and
verify it, ask the server to swap over the control socket, write ``CURRENT`` (so a
restarted server serves what this one served last), and report the outcome.

Every failure is reported with its code and reason — none leaves the report at
``fetching`` or ``loading``. Refusals (verification, permanent store errors such as bad
credentials or a missing object, the server's permanent answers:
``model_rollout_contract.server_codes``) are ``refused`` and not retried until the
target changes or ``refused_retry_s`` (the longest backoff) passes. Other failures — the
server's transient answers included (a load overtaken by a rollback, room held by
versions finishing requests) — are ``error`` and the next cycle waits longer each time
(exponential backoff with full jitter between ``backoff.base_s`` and ``backoff.max_s``)
while the old version keeps serving. Between cycles the report is refreshed as a
heartbeat.

Traffic policy (a canary pod's, :mod:`.traffic`): the candidate is loaded with the policy,
after the stable version when the server lacks it, so it never answers outside the
policy's share; each cycle then brings the server's policy, and the volume's ``TRAFFIC``
file (what a restarted server resumes), in line with the pod's annotation, and clears
both when the annotation goes or the target moves on; a malformed annotation is reported
(``bad_policy``) and ignored, a policy the server does not take is an ``error``.

Trust: the keys are read again before every verification (:class:`~.signing.TrustedKeys`).
When they change, the versions the server holds are checked again (their manifests on the
volume: ``model_sidecar_untrusted_versions``), versions refused for their signature are
tried again at once, and a swap back to a held version that no longer verifies is refused
(``untrusted``) while the serving version keeps serving.

Retention: after a swap the volume keeps the serving version, the previous good one,
those the server still holds and the stable version a traffic policy names, then the
newest others up to ``keep_versions``; a version whose bytes the server refused
(``load_refused``) is deleted at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass, field

from model_rollout_contract import defaults
from model_rollout_contract.canary import InvalidPolicy, TrafficPolicy
from model_rollout_contract.control import ErrorReply, StatusReply
from model_rollout_contract.report import SidecarReport
from model_rollout_contract.server_codes import REFUSED_BYTES, is_permanent
from model_rollout_contract.states import SidecarState

from .control_client import ServerControl
from .current import read_current, read_traffic, traffic_text, write_current, write_traffic
from .errors import LoadNotDone, SidecarError, StoreError, VerificationError, VolumeError
from .fetcher import Fetcher
from .metrics import SidecarMetrics
from .retry import Backoff, start_jitter
from .status import StatusReporter
from .target import TargetSource
from .traffic import PolicyRelay, wanted_policy

log = logging.getLogger(__name__)


def _cycle_backoff() -> Backoff:
    return Backoff(base_s=defaults.BACKOFF_BASE_SECONDS, max_s=defaults.BACKOFF_MAX_SECONDS)


@dataclass
class WatchSettings:
    model: str
    poll_s: float = 2.0
    jitter_s: float = 1.0
    keep_versions: int = 3
    start_jitter_s: float = 0.0  # before the first poll
    backoff: Backoff = field(default_factory=_cycle_backoff)  # between failed cycles
    refused_retry_s: float = defaults.BACKOFF_MAX_SECONDS  # a refused target, tried again


# refusals that a change of the trusted keys may undo: tried again at once when they change
_KEY_REFUSALS = frozenset({"bad_signature", "untrusted"})


def _refusal(exc: SidecarError) -> bool:
    """Permanent for this version: retrying at once would only hammer the store."""
    return isinstance(exc, VerificationError) or (isinstance(exc, StoreError) and not exc.transient)


class Watcher:
    def __init__(
        self,
        settings: WatchSettings,
        source: TargetSource,
        fetcher: Fetcher,
        control: ServerControl,
        reporter: StatusReporter,
        metrics: SidecarMetrics,
        rng: random.Random | None = None,
        wake: asyncio.Event | None = None,
    ) -> None:
        """``wake`` is set when the target may have changed (the pod watch): the next
        cycle starts at once instead of after the poll period."""
        self.settings = settings
        self.source = source
        self.fetcher = fetcher
        self.control = control
        self.reporter = reporter
        self.metrics = metrics
        self.rng = rng or random.Random()
        self.wake = wake or asyncio.Event()
        self.failures = 0  # failed cycles in a row ("error"): how long the next wait is
        self._refused: dict[str, float] = {}  # version -> when it was refused
        self._key_refused: set[str] = set()  # refused for its signature: see _recheck_held
        self._trust_seen: tuple[int, tuple[str, ...]] | None = None  # keys, held: checked
        self._untrusted: set[str] = set()  # held versions that no longer verify
        self._server_refused: set[str] = set()  # loaded and refused: deleted from disk
        self._last_target: str | None = None
        self._target_seen_at: float | None = None
        self._serving: str | None = None  # as the server said last
        self._previous_good: str | None = None  # served before the serving one
        self._retained: tuple[str, ...] = ()  # what the server holds beside the serving one
        self.relay = PolicyRelay(settings.model)
        self._policy: TrafficPolicy | None = None  # the pod's, as read this cycle
        self._policy_problem: str | None = None  # why the pod's annotation was ignored

    async def run(self, stop: asyncio.Event) -> None:
        await self.start(stop)
        while not stop.is_set():
            self.wake.clear()
            await self.step()
            deadline = time.monotonic() + self.next_delay()
            while not (stop.is_set() or self.wake.is_set()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                await self._wait(stop, min(remaining, self.reporter.heartbeat_s))
                await self.reporter.heartbeat()

    async def start(self, stop: asyncio.Event) -> None:
        """Before the first poll: leftovers of killed downloads go, then the start jitter."""
        try:
            await asyncio.to_thread(self.fetcher.sweep_incoming, self.settings.model)
        except (SidecarError, OSError) as exc:
            log.error("cannot sweep the volume's downloads: %s", exc)
        await start_jitter(self.settings.start_jitter_s, self.rng, "the first poll", stop)

    async def _wait(self, stop: asyncio.Event, seconds: float) -> None:
        waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.wake.wait())]
        try:
            await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    def next_delay(self) -> float:
        """The poll period (plus jitter) after a good cycle; after ``n`` failed ones in a
        row, at least that and up to ``backoff.cap(n - 1)``."""
        delay = self.settings.poll_s + self.rng.uniform(0, self.settings.jitter_s)
        if self.failures:
            delay = max(delay, self.settings.backoff.delay(self.failures - 1, self.rng))
        return delay

    async def _report(
        self,
        target: str | None,
        serving: str | None,
        state: SidecarState,
        reason: str | None = None,
        sha256: str | None = None,
        code: str | None = None,
    ) -> None:
        if code is None and self._policy_problem is not None:  # reported, not a failure
            code, reason = "bad_policy", self._policy_problem
        await self.reporter.report(
            SidecarReport(
                self.settings.model,
                target,
                serving,
                state,
                f"{code}: {reason}" if code and reason else reason,
                sha256,
                retained=self._retained,
                target_seen_at=self._target_seen_at,
                code=code,
            )
        )

    def _held(self, loaded: tuple[str, ...], serving: str | None) -> None:
        self._retained = tuple(v for v in loaded if v != serving)

    async def step(self) -> str:
        """One cycle; returns the resulting state (for tests and logs). Never raises:
        whatever goes wrong is reported."""
        try:
            outcome = await self._step()
        except SidecarError as exc:
            outcome = await self._failed(exc)
        except Exception as exc:
            log.exception("watch cycle failed")
            await self._report(
                self._last_target,
                self._serving,
                SidecarState.ERROR,
                f"{type(exc).__name__}: {exc}",
                code="internal",
            )
            outcome = "error"
        self.failures = self.failures + 1 if outcome == "error" else 0
        return outcome

    async def _failed(self, exc: SidecarError) -> str:
        target, model = self._last_target, self.settings.model
        if target is not None and _refusal(exc):
            self._refused[target] = time.monotonic()
            if exc.code in _KEY_REFUSALS:
                self._key_refused.add(target)
            self.metrics.refusals.labels(model, exc.code).inc()
            await self._report(
                target, self._serving, SidecarState.REFUSED, exc.message, code=exc.code
            )
            return "refused"
        log.warning("%s: %s: %s", model, exc.code, exc.message)
        await self._report(target, self._serving, SidecarState.ERROR, exc.message, code=exc.code)
        return "error"

    def _read_policy(self) -> None:
        """The pod's policy; one that cannot be applied is ignored and its problem kept
        for the report (``bad_policy``)."""
        problem = None
        try:
            self._policy = self.source.policy()
            if self._policy is not None and self._policy.stable == self._policy.candidate:
                problem = f"stable and candidate are both {self._policy.stable!r}"
        except InvalidPolicy as exc:
            problem = str(exc)
        if problem is not None:
            annotation = self.source.keys.traffic
            self._policy, problem = None, f"pod annotation {annotation} ignored: {problem}"
            if problem != self._policy_problem:
                log.warning("%s: %s", self.settings.model, problem)
        self._policy_problem = problem

    async def _relay(self, status: StatusReply | None = None) -> None:
        """The server's traffic policy brought in line with the pod's (:mod:`.traffic`):
        the stable version given back to a server that lacks it, then the policy sent,
        or cleared, if the server may not hold it yet."""
        model = self.settings.model
        if status is None:
            status = await self.control.status(model)
        wanted = wanted_policy(self._policy, self._last_target, status.version)
        await self._keep_traffic(wanted)
        try:
            if wanted is not None and wanted.stable not in status.loaded:
                status = await self.relay.hold_stable(self.control, self.fetcher, wanted)
                self._held(status.loaded, status.version)
                self.metrics.policies.labels(model, "set").inc()
            after = await self.relay.sync(self.control, wanted, status)
        except SidecarError:
            self.metrics.policies.labels(model, "error").inc()
            with contextlib.suppress(SidecarError):  # giving the stable back may have swapped
                now = await self.control.status(model)
                self._serving = now.version
                self._held(now.loaded, now.version)
            raise
        if after is not None:
            self.metrics.policies.labels(model, "set" if wanted else "cleared").inc()
            self._held(after.loaded, after.version)

    async def _step(self) -> str:
        model = self.settings.model
        self._read_policy()
        target = self.source.target()
        if target != self._last_target or self._target_seen_at is None:
            self._refused.pop(target or "", None)  # a new target deserves a fresh attempt
            jitter_first = self._last_target is not None
            self._last_target = target
            self._target_seen_at = time.time()
        else:
            jitter_first = False
        status = await self.control.status(model)
        serving = self._serving = status.version
        self._held(status.loaded, serving)
        if serving:
            self.metrics.serving.labels(model, serving).set(1)
        await self._recheck_held(status.loaded)
        if target is None:
            await self._relay(status)
            await self._report(
                None,
                serving,
                SidecarState.OK if serving else SidecarState.ERROR,
                None if serving else "no target version set",
                code=None if serving else "no_target",
            )
            return "no-target"
        if serving == target:
            await self._keep_current(serving)
            await self._relay(status)
            await self._report(target, serving, SidecarState.OK, sha256=status.sha256)
            return "ok"  # versions only arrive through _switch, which prunes after a swap
        refused_at = self._refused.get(target)
        if refused_at is not None and time.monotonic() - refused_at < self.settings.refused_retry_s:
            await self._relay(status)
            return "refused"
        if target in status.loaded:  # still loaded beside the serving one: a pointer swap
            return await self._swap_retained(target, serving)
        await self._relay(status)  # the target is not served yet: a policy is cleared
        if jitter_first and self.settings.jitter_s > 0:
            await asyncio.sleep(self.rng.uniform(0, self.settings.jitter_s))  # spread the pulls
        return await self._switch(target, serving)

    async def _keep_traffic(self, policy: TrafficPolicy | None) -> None:
        """``TRAFFIC`` holds ``policy`` (removed for ``None``), rewritten if anything else
        changed it (a link in its place is replaced, never followed)."""
        volume, model = self.fetcher.volume, self.settings.model
        try:
            written = await asyncio.to_thread(read_traffic, volume, model)
        except VolumeError:  # a link, not a file, too large: not the sidecar's, replaced
            written = "unreadable"
        if written != traffic_text(policy):
            await asyncio.to_thread(write_traffic, volume, model, policy)

    def _load_policy(self, target: str) -> TrafficPolicy | None:
        """The policy a load of ``target`` carries: the pod's, when ``target`` is its
        candidate."""
        policy = self._policy
        return policy if policy is not None and policy.candidate == target else None

    async def _keep_current(self, serving: str) -> None:
        """``CURRENT`` names the serving version (rewritten if anything else changed it)."""
        volume, model = self.fetcher.volume, self.settings.model
        if await asyncio.to_thread(read_current, volume, model) != serving:
            await asyncio.to_thread(write_current, volume, model, serving)

    async def _recheck_held(self, loaded: tuple[str, ...]) -> None:
        """When the trusted keys changed (or what the server holds), check the held
        versions again: ``model_sidecar_untrusted_versions`` says which no longer verify
        before a rollback to one is asked for, and refusals for a signature are forgotten
        (a key added may sign them now). Keys that cannot be read are left to the next
        verification to report: the serving version is not disturbed for it."""
        verifier, model = self.fetcher.verifier, self.settings.model
        if not verifier.signed:
            return
        try:
            await asyncio.to_thread(verifier.trusted_keys)
        except SidecarError as exc:
            log.warning("%s: %s", model, exc.message)
            return
        seen = (verifier.key_generation, tuple(sorted(loaded)))
        if seen == self._trust_seen:
            return
        if self._trust_seen is not None and seen[0] != self._trust_seen[0]:
            for version in self._key_refused:
                self._refused.pop(version, None)
            self._key_refused.clear()
        self._trust_seen = seen
        untrusted: set[str] = set()
        for version in loaded:
            try:
                why = await asyncio.to_thread(self.fetcher.untrusted, model, version)
            except SidecarError as exc:
                log.warning("%s: cannot check %s again: %s", model, version, exc.message)
                continue
            if why is not None:
                untrusted.add(version)
                if version not in self._untrusted:
                    log.warning("%s:%s, held by the server, is no longer trusted: %s",
                                model, version, why)  # fmt: skip
            self.metrics.untrusted.labels(model, version).set(1 if why else 0)
        for gone in self._untrusted - set(loaded):
            with contextlib.suppress(KeyError):
                self.metrics.untrusted.remove(model, gone)
        self._untrusted = untrusted

    async def _swap_retained(self, target: str, serving: str | None) -> str:
        """Nothing to fetch: the server hashed this version when it loaded it. Its
        manifest is checked again (the keys may have changed since: a version that no
        longer verifies is refused, ``untrusted``, and the serving one keeps serving).
        The critical path of a rollback is this check and one local call."""
        model = self.settings.model
        if self._load_policy(target) is not None:  # the policy goes with the swap: a load
            return await self._switch(target, serving)  # (the server swaps to what it holds)
        why = await asyncio.to_thread(self.fetcher.untrusted, model, target)
        self.metrics.untrusted.labels(model, target).set(1 if why else 0)
        if why is not None:
            self._untrusted.add(target)
            kept = f"; {serving} keeps serving" if serving else ""
            raise VerificationError(
                "untrusted",
                f"{model}:{target} is held by the server but its manifest no longer "
                f"verifies ({why}): not swapped back to{kept}",
            )
        self._untrusted.discard(target)
        answer = await self.control.swap_to_retained(model, target)
        if isinstance(answer, ErrorReply):  # evicted meanwhile: fetch and load it instead
            log.info("%s:%s is no longer retained (%s); loading it", model, target, answer.error)
            return await self._switch(target, serving)
        await self._keep_traffic(None)
        after = await self._swapped(target, serving)
        await self._relay(after)
        # with its digest, as every later cycle reports it: the next report is no news
        await self._report(
            target, target, SidecarState.OK, sha256=after.sha256 if after is not None else None
        )
        return "ok"

    async def _swapped(self, target: str, serving: str | None) -> StatusReply | None:
        """After a swap: metrics, what the server holds now (returned; ``None`` if the
        server did not say), ``CURRENT``."""
        model = self.settings.model
        self.metrics.swaps.labels(model, "ok").inc()
        if serving:
            self.metrics.serving.labels(model, serving).set(0)
            self._previous_good = serving
        self.metrics.serving.labels(model, target).set(1)
        self._serving = target
        after = None
        with contextlib.suppress(SidecarError):  # the swap is done; the next cycle asks again
            after = await self.control.status(model)
            self._held(after.loaded, after.version)
        await asyncio.to_thread(write_current, self.fetcher.volume, model, target)
        return after

    async def _switch(self, target: str, serving: str | None) -> str:
        model = self.settings.model
        await self._report(target, serving, SidecarState.FETCHING)
        try:
            fetched = await self.fetcher.fetch(model, target)
        except SidecarError as exc:
            self.metrics.fetches.labels(model, "refused" if _refusal(exc) else "error").inc()
            raise
        self.metrics.fetches.labels(model, "ok").inc()
        self.metrics.fetch_seconds.labels(model).observe(fetched.seconds)
        self.metrics.bytes.labels(model).inc(fetched.downloaded_bytes)
        sha256 = fetched.local.manifest.sha256
        await self._report(target, serving, SidecarState.LOADING, sha256=sha256)
        policy = self._load_policy(target)
        if policy is not None and policy.stable not in (serving, *self._retained):
            serving = await self._give_stable(policy, serving)
        try:
            answer = await self.control.load(model, target, fetched.local.file, sha256, policy)
        except SidecarError:
            self.metrics.swaps.labels(model, "error").inc()
            self.relay.forget()
            raise
        if isinstance(answer, ErrorReply):
            return await self._load_failed(target, serving, answer)
        self._server_refused.discard(target)
        await self._keep_traffic(policy)  # before CURRENT names the candidate
        after = await self._swapped(target, serving)
        self.relay.loaded_with(policy, after)
        if policy is not None:
            self.metrics.policies.labels(model, "set").inc()
        await asyncio.to_thread(
            self.fetcher.prune,
            model,
            self.settings.keep_versions,
            self._protected(target),
            self._server_refused,
        )
        await self._relay(after)
        await self._report(target, target, SidecarState.OK, sha256=sha256)
        return "ok"

    async def _give_stable(self, policy: TrafficPolicy, serving: str | None) -> str:
        """Load the policy's stable version before its candidate (the server serves it
        meanwhile: within any policy); returns it, the version now serving."""
        try:
            await self.relay.load_stable(self.control, self.fetcher, policy)
        except SidecarError:
            self.metrics.policies.labels(self.settings.model, "error").inc()
            raise
        await self._swapped(policy.stable, serving)
        return policy.stable

    def _protected(self, target: str) -> set[str]:
        """What retention keeps whatever its age: the target, what the server holds, the
        previous good version, and the stable one the pod's traffic policy names."""
        kept = {target, *self._retained}
        if self._previous_good:
            kept.add(self._previous_good)
        if self._policy is not None:
            kept.add(self._policy.stable)
        return kept

    async def _load_failed(self, target: str, serving: str | None, answer: ErrorReply) -> str:
        """The server answered the load with an error: retried later if it passes, else
        the version is refused (and deleted if its bytes were what the server refused)."""
        model = self.settings.model
        if not is_permanent(answer.code):
            self.metrics.swaps.labels(model, "error").inc()
            raise LoadNotDone(answer.code, f"server did not load {target}: {answer.error}")
        self._refused[target] = time.monotonic()
        self.metrics.swaps.labels(model, "refused").inc()
        self.metrics.refusals.labels(model, "server_refused").inc()
        if answer.code == REFUSED_BYTES:
            self._server_refused.add(target)
            await asyncio.to_thread(self.fetcher.remove_version, model, target)
        await self._report(
            target, serving, SidecarState.REFUSED, answer.error, code="server_refused"
        )
        return "refused"
