"""The control socket of a pool of server processes (:mod:`.pool`): the sidecar's
requests (:mod:`model_rollout_contract.control`, unchanged) relayed to every worker's own
control socket at once, and one reply made of theirs, so that the pod acts as one server
and never stays split between versions.

* ``load``, ``rollback``, ``traffic``: ok only if every worker said ok and swapped to
  the version asked (worker 0's reply, the longest duration). A rollback naming no
  version is sent naming one: the worker healthy longest's most recently served
  retained version (a restarted worker's history is shorter). If only some did, those
  are put back where they were before (a rollback to the version they served — a
  pointer swap; a load of it, from the file it was loaded from, if it is no longer
  held — and the traffic policy they held) and the first error is the reply.
* ``status``: the workers' common answer when they serve the same version with the same
  digest and policy (``loaded``: the versions every worker holds, each one can swap to
  at once); while they disagree (one restarting, being replayed) ``busy``, which the
  sidecar retries.
* A worker not (yet, or again) healthy is waited for up to ``wait_s``, then ``busy``.

Swaps are relayed one at a time, and never while a restarted worker is being replayed
the others' state (:meth:`ControlRelay.exclusive`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

from model_rollout_contract.control import (
    BUSY,
    ControlExchangeError,
    ErrorReply,
    LoadRequest,
    ProtocolError,
    Reply,
    Request,
    RollbackRequest,
    StatusReply,
    StatusRequest,
    SwapReply,
    TrafficRequest,
    exchange,
    parse_reply,
    parse_request,
)
from model_rollout_contract.manifest import MANIFEST_NAME, Manifest
from model_server.errors import BadRequest, Conflict, Unavailable
from model_server.frontends.control_socket import LineServer

log = logging.getLogger(__name__)

WORKER_WAIT_S = 10.0  # how long a request waits for a (re)starting worker before busy


class WorkerLink:
    """One worker's control socket, and whether the worker counts as healthy (started,
    and given the pool's state if it was restarted)."""

    def __init__(self, index: int, path: Path) -> None:
        self.index = index
        self.path = path
        self.healthy = asyncio.Event()
        self.healthy_since = 0.0  # monotonic: the worker healthy longest knows the most history

    async def ask(self, request: Request) -> Reply:
        """The worker's reply; a worker that cannot be reached or dies meanwhile is an
        ``unavailable`` error (transient: the sidecar tries again)."""
        try:
            line = await exchange(self.path, request)
        except ControlExchangeError as exc:
            return ErrorReply(f"worker {self.index}: {exc}", Unavailable.code)
        try:
            return parse_reply(line)
        except ProtocolError as exc:
            return ErrorReply(f"worker {self.index} failed to reply: {exc}", Unavailable.code)


def _same_serving(a: StatusReply, b: StatusReply) -> bool:
    return (a.version, a.sha256, a.policy) == (b.version, b.sha256, b.policy)


def merged_status(replies: Sequence[Reply]) -> Reply:
    """The pool's status reply from every worker's (see the module's docstring)."""
    first = replies[0]
    if all(isinstance(r, ErrorReply) for r in replies):
        codes = {r.code for r in replies if isinstance(r, ErrorReply)}
        return first if len(codes) == 1 else ErrorReply("the workers answer differently", BUSY)
    statuses = [r for r in replies if isinstance(r, StatusReply)]
    if len(statuses) < len(replies) or not all(_same_serving(statuses[0], s) for s in statuses):
        return ErrorReply("the server's processes disagree (one is catching up)", BUSY)
    assert isinstance(first, StatusReply)
    everywhere = set.intersection(*(set(s.loaded) for s in statuses))
    loaded = tuple(v for v in first.loaded if v in everywhere)
    return StatusReply(
        first.model, first.version, first.sha256, loaded, first.policy, first.policy_reported
    )


def merged_swap(replies: Sequence[Reply]) -> Reply:
    """Worker 0's reply, with the longest duration (and that load's stages) when it was
    a swap."""
    first = replies[0]
    if isinstance(first, SwapReply):
        slowest = max((r for r in replies if isinstance(r, SwapReply)), key=_duration)
        return SwapReply(
            first.model,
            first.from_version,
            first.to_version,
            slowest.duration_ms,
            first.instant,
            slowest.stages_ms,
        )
    return first


def _duration(reply: SwapReply) -> float:
    return reply.duration_ms


class ControlRelay:
    def __init__(
        self,
        links: Sequence[WorkerLink],
        digest_of: Callable[[str, str], str | None],
        wait_s: float = WORKER_WAIT_S,
    ) -> None:
        self.links = list(links)
        self.digest_of = digest_of  # of a version to load again: ``manifest_digests``
        self.wait_s = wait_s
        self._swapping = asyncio.Lock()
        # the file each version was loaded from through the relay (None: its directory),
        # for loading it again when a swap is undone
        self._paths: dict[tuple[str, str], str | None] = {}

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """No swap is relayed meanwhile (a restarted worker being given the state)."""
        async with self._swapping:
            yield

    async def _all_healthy(self) -> bool:
        try:
            async with asyncio.timeout(self.wait_s):
                for link in self.links:
                    await link.healthy.wait()
        except TimeoutError:
            return False
        return True

    async def _ask_all(self, request: Request) -> list[Reply]:
        return list(await asyncio.gather(*(link.ask(request) for link in self.links)))

    async def handle(self, request: Request) -> Reply:
        if isinstance(request, StatusRequest):
            if not await self._all_healthy():
                return ErrorReply("a server process is starting", BUSY)
            return merged_status(await self._ask_all(request))
        starting = ErrorReply("a server process is starting: nothing was done", BUSY)
        if not await self._all_healthy():  # waited for outside the lock: a catch-up takes it
            return starting
        async with self._swapping:
            if not all(link.healthy.is_set() for link in self.links):
                return starting
            before = await self._ask_all(StatusRequest(request.model))
            if isinstance(request, RollbackRequest) and request.version is None:
                request = RollbackRequest(request.model, self._rollback_target(before))
            answered = await self._ask_all(request)
            replies = [self._checked_swap(request, i, r) for i, r in enumerate(answered)]
            errors = [r for r in replies if isinstance(r, ErrorReply)]
            if not errors:
                if isinstance(request, LoadRequest):
                    self._paths[(request.model, request.version)] = request.path
                return merged_swap(replies)
            # put back every worker that moved: one whose swap went elsewhere than asked
            # (an error once checked) moved too
            done = [i for i, r in enumerate(answered) if not isinstance(r, ErrorReply)]
            if done:
                log.warning(
                    "pool: %s %s: refused by worker(s) %s (%s), done by %s: putting those back",
                    request.op, request.model,
                    [i for i, r in enumerate(replies) if isinstance(r, ErrorReply)],
                    errors[0].error, done,
                )  # fmt: skip
                await asyncio.gather(*(self._put_back(self.links[i], before[i]) for i in done))
            return errors[0]

    def _rollback_target(self, before: Sequence[Reply]) -> str | None:
        """The one version a rollback naming none goes to on every worker: the most
        recently served retained one of the worker healthy longest (a restarted worker
        holds a shorter history); None when it holds none (each worker refuses)."""
        oldest = min(range(len(self.links)), key=lambda i: self.links[i].healthy_since)
        held = before[oldest]
        if not isinstance(held, StatusReply):
            return None
        retained = [v for v in held.loaded if v != held.version]
        return retained[-1] if retained else None

    @staticmethod
    def _checked_swap(request: Request, index: int, reply: Reply) -> Reply:
        """A swap reply that went elsewhere than ``request`` named is an error."""
        wanted = getattr(request, "version", None)
        if isinstance(reply, SwapReply) and wanted is not None and reply.to_version != wanted:
            return ErrorReply(
                f"worker {index} swapped to {reply.to_version}, not {wanted}", Conflict.code
            )
        return reply

    async def _put_back(self, link: WorkerLink, before: Reply) -> None:
        """Return ``link``'s worker to the version and policy ``before`` says it had."""
        if not isinstance(before, StatusReply):
            log.error("pool: worker %d: no earlier state to put back (%s)", link.index, before)
            return
        now = await link.ask(StatusRequest(before.model))
        if not isinstance(now, StatusReply):
            log.error("pool: worker %d: cannot put back: %s", link.index, now)
            return
        if before.version is not None and now.version != before.version:
            back = await link.ask(RollbackRequest(before.model, before.version))
            if isinstance(back, ErrorReply) and before.sha256 is not None:  # no longer held
                path = self._paths.get((before.model, before.version))
                back = await link.ask(
                    LoadRequest(before.model, before.version, path, before.sha256)
                )
            if isinstance(back, ErrorReply):
                log.error("pool: worker %d: could not go back to %s: %s",
                          link.index, before.version, back.error)  # fmt: skip
                return
            now = await link.ask(StatusRequest(before.model))  # a rollback may clear it
        policy = before.policy
        if isinstance(now, StatusReply) and policy is not None and policy.stable not in now.loaded:
            await self._load_stable_again(link, now, policy.stable)  # the swap evicted it
        if not isinstance(now, StatusReply) or now.policy != before.policy:
            back = await link.ask(TrafficRequest(before.model, before.policy))
            if isinstance(back, ErrorReply):
                log.error("pool: worker %d: could not restore the traffic policy: %s",
                          link.index, back.error)  # fmt: skip

    async def _load_stable_again(self, link: WorkerLink, now: StatusReply, stable: str) -> None:
        """Load a policy's stable version evicted by the swap being undone (its digest from
        its manifest), then swap back to the version ``now`` serves, which it retains."""
        digest = self.digest_of(now.model, stable)
        if digest is None or now.version is None:
            log.error("pool: worker %d: %s %s is gone and has no manifest to load it again",
                      link.index, now.model, stable)  # fmt: skip
            return
        for request in (
            LoadRequest(now.model, stable, self._paths.get((now.model, stable)), digest),
            RollbackRequest(now.model, now.version),
        ):
            reply = await link.ask(request)
            if isinstance(reply, ErrorReply):
                log.error("pool: worker %d: %s %s: %s", link.index, request.op, now.model,
                          reply.error)  # fmt: skip
                return


def manifest_digests(repository: Path) -> Callable[[str, str], str | None]:
    """The digest a version's manifest names (what the sidecar verified and published)."""

    def digest_of(key: str, version: str) -> str | None:
        try:
            raw = (repository / key / version / MANIFEST_NAME).read_bytes()
            return Manifest.from_bytes(raw).sha256
        except (OSError, ValueError):
            return None

    return digest_of


class RelaySocketServer(LineServer):
    """The pool's control socket, where the sidecar connects (the configured path)."""

    def __init__(self, relay: ControlRelay, path: Path) -> None:
        super().__init__(path)
        self.relay = relay

    async def handle_line(self, line: bytes, who: str) -> Reply:
        try:
            request = parse_request(line)
        except ProtocolError as exc:
            return ErrorReply(str(exc), BadRequest.code)
        log.info("pool: %s %s from %s", request.op, request.model, who)
        return await self.relay.handle(request)
