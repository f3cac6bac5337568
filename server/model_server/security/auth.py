"""Who may do what: an admin bearer token for control endpoints, and tenants, each
authenticated by its API key or by a JWT (:mod:`.jwt_auth`) whose tenant claim names it,
whose calls are routed to the tenant's own models and held to its rate limit
(:mod:`.rate_limits`)."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from model_rollout_contract.names import check_name
from model_server.errors import Forbidden, Unauthorized
from model_server.security.jwt_auth import INVALID, JwtConfig, JwtVerifier, looks_like_jwt
from model_server.security.rate_limits import RateLimit, TenantRateLimits

log = logging.getLogger(__name__)


def _raw(text: str) -> bytes:
    """Header values may hold any byte (decoded with surrogateescape): compare bytes."""
    return text.encode("utf-8", "surrogateescape")


def bearer(headers: Mapping[str, str]) -> str | None:
    header = headers.get("Authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip() or None
    return headers.get("X-API-Key") or None


@dataclass(frozen=True)
class Tenant:
    name: str
    api_key: str | None  # None: reached by JWT only
    models: tuple[str, ...]
    rate_limit: RateLimit | None = None  # None: unlimited
    memory_mb: float | None = None  # what its models may hold and reserve; None: no cap


@dataclass
class AccessPolicy:
    admin_token: str | None = None
    tenants: dict[str, Tenant] = field(default_factory=dict)
    jwt: JwtVerifier | None = None
    rate_limits: TenantRateLimits = field(default_factory=lambda: TenantRateLimits({}))

    def __post_init__(self) -> None:
        if self.jwt is not None and not self.tenants:
            raise ValueError("JWT authentication needs tenants (--tenants-file)")

    @classmethod
    def from_files(
        cls,
        admin_token_file: Path | None,
        tenants_file: Path | None,
        jwt: JwtConfig | None = None,
        on_rate_limited: Callable[[str], None] | None = None,
    ) -> AccessPolicy:
        token = admin_token_file.read_text().strip() if admin_token_file else None
        tenants: dict[str, Tenant] = {}
        if tenants_file:
            tenants = parse_tenants(yaml.safe_load(tenants_file.read_text()) or {})
        limits = {t.name: t.rate_limit for t in tenants.values() if t.rate_limit is not None}
        return cls(
            token or None,
            tenants,
            JwtVerifier(jwt) if jwt is not None else None,
            TenantRateLimits(limits, on_limited=on_rate_limited),
        )

    def check_admin(self, headers: Mapping[str, str]) -> str:
        """Return the caller's identity for the audit log, or raise."""
        if self.admin_token is None:
            raise Forbidden("the admin API is disabled: start the server with --admin-token-file")
        given = bearer(headers)
        if given is None:
            raise Unauthorized("admin endpoints need 'Authorization: Bearer <admin token>'")
        if not hmac.compare_digest(_raw(given), _raw(self.admin_token)):
            raise Unauthorized("invalid admin token")
        return "admin"

    async def tenant_for(self, headers: Mapping[str, str]) -> str | None:
        """The caller's tenant (namespace), ``None`` for the open default namespace. With
        JWT authentication on, a bearer token shaped as a JWT is verified as one (a token
        naming no configured tenant is refused as any invalid token is); any other is an
        API key."""
        if not self.tenants:
            return None
        given = bearer(headers)
        if given is None:
            raise Unauthorized("inference needs an API key or a token ('Authorization: Bearer')")
        if self.jwt is not None and looks_like_jwt(given):
            name = await self.jwt.tenant_claim(given)
            if name not in self.tenants:
                log.info("JWT refused: its tenant claim names no configured tenant")
                raise Unauthorized(INVALID)
            return name
        for tenant in self.tenants.values():
            if tenant.api_key is not None and hmac.compare_digest(
                _raw(given), _raw(tenant.api_key)
            ):
                return tenant.name
        raise Unauthorized("unknown API key")

    def admit(self, tenant: str | None) -> None:
        """Hold one inference of ``tenant`` to its rate limit (``RateLimited`` if over)."""
        self.rate_limits.admit(tenant)


def parse_tenants(raw: Any) -> dict[str, Tenant]:
    """``{tenants: {acme: {api_key: ..., models: [m1], rate_limit: {requests_per_second:
    R, burst: B}, memory_mb: M}}}`` -> tenants by name (``api_key``, ``rate_limit`` and
    ``memory_mb`` optional: a tenant without a key is reached by JWT only; ``memory_mb``
    caps what its models hold in the server's memory budget)."""
    entries = raw.get("tenants", {}) if isinstance(raw, dict) else None
    if not isinstance(entries, dict):
        raise ValueError("tenants file must map 'tenants' to {name: {api_key, models}}")
    tenants = {}
    for name, entry in entries.items():
        check_name("tenant", str(name))
        if not isinstance(entry, dict):
            raise ValueError(f"tenant {name!r}: want {{api_key, models, rate_limit, memory_mb}}")
        api_key = entry.get("api_key")
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError(f"tenant {name!r}: 'api_key' must be a non-empty string")
        models = tuple(check_name("model name", str(m)) for m in entry.get("models", []))
        limit = entry.get("rate_limit")
        rate_limit = RateLimit.parse(limit, str(name)) if limit is not None else None
        memory_mb = entry.get("memory_mb")
        if memory_mb is not None and (
            isinstance(memory_mb, bool)
            or not isinstance(memory_mb, int | float)
            or not 0 < memory_mb < float("inf")
        ):
            raise ValueError(f"tenant {name!r}: 'memory_mb' must be a positive number of MiB")
        tenants[str(name)] = Tenant(str(name), api_key, models, rate_limit, memory_mb)
    return tenants
