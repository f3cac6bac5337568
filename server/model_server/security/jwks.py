"""The public keys that tenants' JWTs are verified against: a JWKS (RFC 7517) read from a
file (re-read when it changes) or fetched from a URL (cached; refetched on an unknown
``kid`` or once the keys are older than a maximum age, but never more often than a
minimum interval, so that a storm of forged ``kid`` values cannot turn the server into
a load generator against the identity provider; a failing endpoint keeps the cached
keys).

Only asymmetric keys whose algorithm is allowed are kept: a symmetric (``oct``) key in a
JWKS is dropped, so that no HMAC algorithm can ever be verified with a published key."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from jwt import PyJWK
from jwt.exceptions import PyJWKError

log = logging.getLogger(__name__)

JWKS_FETCH_TIMEOUT_S = 10.0
JWKS_MAX_BYTES = 1 << 20  # a key set is a few KiB: more is no key set


@dataclass(frozen=True)
class KeySet:
    """Usable keys by ``kid``; a key without ``kid`` is found only in a set of one."""

    by_kid: Mapping[str, PyJWK]
    unnamed: tuple[PyJWK, ...] = ()

    def find(self, kid: str | None) -> PyJWK | None:
        if kid is not None:
            return self.by_kid.get(kid)
        keys = [*self.by_kid.values(), *self.unnamed]
        return keys[0] if len(keys) == 1 else None


EMPTY = KeySet({})


def parse_jwks(raw: Any, algorithms: Collection[str]) -> KeySet:
    """A JWKS document as the keys usable with ``algorithms``; keys of another type, of a
    disallowed algorithm or that do not parse are skipped (logged), a document that is no
    ``{"keys": [...]}`` is a ``ValueError``."""
    entries = raw.get("keys") if isinstance(raw, dict) else None
    if not isinstance(entries, list):
        raise ValueError("a JWKS is a JSON object with a 'keys' list")
    by_kid: dict[str, PyJWK] = {}
    unnamed: list[PyJWK] = []
    for entry in entries:
        if not isinstance(entry, dict) or entry.get("kty") == "oct":
            continue  # symmetric keys are never published keys
        if entry.get("use", "sig") != "sig":
            continue
        try:
            key = PyJWK(entry)
        except PyJWKError as exc:
            log.warning("JWKS: key %r skipped: %s", entry.get("kid"), exc)
            continue
        if key.algorithm_name not in algorithms:
            log.info("JWKS: key %r (%s) not allowed", entry.get("kid"), key.algorithm_name)
            continue
        kid = entry.get("kid")
        if isinstance(kid, str):
            by_kid[kid] = key
        else:
            unnamed.append(key)
    return KeySet(by_kid, tuple(unnamed))


class KeySource(Protocol):
    async def key(self, kid: str | None) -> PyJWK | None:
        """The key a token's ``kid`` names, ``None`` when there is none."""
        ...


class JwksFile:
    """A JWKS file (a mounted Secret, say), re-read whenever it changes (its inode, size or
    modification time): rotation is a new file. A file that does not parse keeps the keys
    read last, so that a half-written file never locks every tenant out."""

    def __init__(self, path: Path, algorithms: Collection[str]) -> None:
        self.path = path
        self.algorithms = algorithms
        self._stamp: tuple[int, int, int] | None = None
        self._keys = EMPTY
        self._reload()
        if self._stamp is None:
            raise ValueError(f"JWKS file {path}: no key set could be read (logged above)")

    def _reload(self) -> None:
        try:
            stat = self.path.stat()
            stamp = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
            if stamp == self._stamp:
                return
            keys = parse_jwks(json.loads(self.path.read_bytes()), self.algorithms)
        except (OSError, ValueError) as exc:
            log.error("JWKS file %s: %s; keeping the keys read before", self.path, exc)
            return
        self._stamp, self._keys = stamp, keys

    async def key(self, kid: str | None) -> PyJWK | None:
        self._reload()  # a stat per token: the file is local and tiny
        return self._keys.find(kid)


class JwksUrl:
    """A JWKS endpoint, fetched with aiohttp (never blocking the event loop), its keys
    cached. A token whose ``kid`` is unknown, or any token once the keys are older than
    ``max_age_s``, refreshes them, but at most once per ``min_refresh_s``; concurrent
    callers share one fetch, which a caller that leaves does not cancel."""

    def __init__(
        self,
        url: str,
        algorithms: Collection[str],
        min_refresh_s: float,
        max_age_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.algorithms = algorithms
        self.min_refresh_s = min_refresh_s
        self.max_age_s = max_age_s
        self.clock = clock
        self.fetches = 0  # attempts, for logs and tests
        self._keys = EMPTY
        self._fetched_at: float | None = None  # last success
        self._tried_at: float | None = None  # last attempt
        self._fetch: asyncio.Task[None] | None = None

    async def key(self, kid: str | None) -> PyJWK | None:
        """A known key at once (refreshing stale keys behind it); an unknown one after
        a fetch, when one is allowed now."""
        found = self._keys.find(kid)
        now = self.clock()
        if not self._may_refresh(now):
            return found
        if found is not None:
            if self._fetched_at is None or now - self._fetched_at >= self.max_age_s:
                self._start_fetch()
            return found
        await self.refreshed(self._start_fetch())
        return self._keys.find(kid)

    def _may_refresh(self, now: float) -> bool:
        if self._fetch is not None:  # one in flight: share it
            return True
        return self._tried_at is None or now - self._tried_at >= self.min_refresh_s

    def _start_fetch(self) -> asyncio.Task[None]:
        if self._fetch is None:
            self._tried_at = self.clock()
            self.fetches += 1
            self._fetch = asyncio.ensure_future(self._download())
            self._fetch.add_done_callback(self._fetched)
        return self._fetch

    async def refreshed(self, fetch: asyncio.Task[None] | None = None) -> None:
        """Wait for ``fetch`` (default: the fetch in flight, if any) to end, successful
        or not: a caller that leaves meanwhile does not cancel it."""
        fetch = fetch or self._fetch
        if fetch is None:
            return
        try:
            await asyncio.shield(fetch)
        except Exception:  # logged once, by _fetched: the cached keys still serve
            pass

    def _fetched(self, task: asyncio.Task[None]) -> None:
        self._fetch = None
        if not task.cancelled() and task.exception() is not None:
            log.error("JWKS %s: %s; keeping the cached keys", self.url, task.exception())

    async def _download(self) -> None:
        timeout = aiohttp.ClientTimeout(total=JWKS_FETCH_TIMEOUT_S)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(self.url, headers={"Accept": "application/json"}) as response,
        ):
            response.raise_for_status()
            body = await response.content.read(JWKS_MAX_BYTES + 1)
        if len(body) > JWKS_MAX_BYTES:
            raise ValueError(f"more than {JWKS_MAX_BYTES} bytes: no key set")
        self._keys = parse_jwks(json.loads(body), self.algorithms)
        self._fetched_at = self.clock()
