"""Who may do what: an admin bearer token for control endpoints, and per-tenant API keys
that route inference to the tenant's own models."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from model_rollout_contract.names import check_name

from .errors import Forbidden, Unauthorized


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
    api_key: str
    models: tuple[str, ...]


@dataclass
class AccessPolicy:
    admin_token: str | None = None
    tenants: dict[str, Tenant] = field(default_factory=dict)

    @classmethod
    def from_files(cls, admin_token_file: Path | None, tenants_file: Path | None) -> AccessPolicy:
        token = admin_token_file.read_text().strip() if admin_token_file else None
        tenants: dict[str, Tenant] = {}
        if tenants_file:
            tenants = parse_tenants(yaml.safe_load(tenants_file.read_text()) or {})
        return cls(token or None, tenants)

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

    def tenant_for(self, headers: Mapping[str, str]) -> str | None:
        """The caller's tenant (namespace), ``None`` for the open default namespace."""
        if not self.tenants:
            return None
        given = bearer(headers)
        if given is None:
            raise Unauthorized("inference needs an API key ('Authorization: Bearer <key>')")
        for tenant in self.tenants.values():
            if hmac.compare_digest(_raw(given), _raw(tenant.api_key)):
                return tenant.name
        raise Unauthorized("unknown API key")


def parse_tenants(raw: Any) -> dict[str, Tenant]:
    """``{tenants: {acme: {api_key: ..., models: [m1]}}}`` -> tenants by name."""
    entries = raw.get("tenants", {}) if isinstance(raw, dict) else None
    if not isinstance(entries, dict):
        raise ValueError("tenants file must map 'tenants' to {name: {api_key, models}}")
    tenants = {}
    for name, entry in entries.items():
        check_name("tenant", str(name))
        if not isinstance(entry, dict) or not isinstance(entry.get("api_key"), str):
            raise ValueError(f"tenant {name!r} needs an 'api_key' string")
        models = tuple(check_name("model name", str(m)) for m in entry.get("models", []))
        tenants[str(name)] = Tenant(str(name), entry["api_key"], models)
    return tenants
