"""Tenants' JWT bearer tokens, verified with PyJWT against a JWKS (:mod:`.jwks`): the
signature with an allowed asymmetric algorithm that matches the key (never ``none``,
never HS*: the algorithm confusion attack), issuer, audience, expiry and not-before
within a small clock skew; the tenant is one claim.

Every refusal is :class:`~.errors.Unauthorized` with one of a few fixed messages, so a
client learns nothing of the keys or of what the token claimed; the precise reason is
logged at INFO (never the token)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import jwt

from model_rollout_contract import defaults
from model_server.errors import Unauthorized
from model_server.security.jwks import JwksFile, JwksUrl, KeySource

log = logging.getLogger(__name__)

# asymmetric algorithms only: a verifying key is public, an HMAC "key" would be a secret
ASYMMETRIC_ALGORITHMS = defaults.JWT_ASYMMETRIC_ALGORITHMS
DEFAULT_ALGORITHMS = defaults.JWT_ALGORITHMS
DEFAULT_LEEWAY_S = defaults.JWT_LEEWAY_SECONDS
DEFAULT_TENANT_CLAIM = defaults.JWT_TENANT_CLAIM
DEFAULT_MIN_REFRESH_S = 60.0
DEFAULT_MAX_AGE_S = 3600.0
# header.payload.signature, each base64url (an unsigned token's signature is empty)
JWT_SHAPE = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")

INVALID = "invalid bearer token"
EXPIRED = "bearer token expired"
NOT_YET_VALID = "bearer token not yet valid"


def looks_like_jwt(token: str) -> bool:
    return JWT_SHAPE.fullmatch(token) is not None


@dataclass(frozen=True)
class JwtConfig:
    """How tenants' JWTs are verified; checked when built (a bad setting is a start-up
    error, never a token accepted that should not be)."""

    issuer: str
    audience: str
    jwks_file: Path | None = None
    jwks_url: str | None = None
    algorithms: tuple[str, ...] = DEFAULT_ALGORITHMS
    leeway_s: float = DEFAULT_LEEWAY_S
    tenant_claim: str = DEFAULT_TENANT_CLAIM
    min_refresh_s: float = DEFAULT_MIN_REFRESH_S  # of a JWKS URL
    max_age_s: float = DEFAULT_MAX_AGE_S  # of a JWKS URL's cached keys

    def __post_init__(self) -> None:
        if (self.jwks_file is None) == (self.jwks_url is None):
            raise ValueError("JWT authentication needs one JWKS: a file or a URL")
        if self.jwks_url is not None and not self.jwks_url.startswith(("https://", "http://")):
            raise ValueError(f"JWKS URL {self.jwks_url!r}: want http(s)://")
        if not self.issuer or not self.audience:
            raise ValueError("JWT authentication needs an issuer and an audience")
        refused = [a for a in self.algorithms if a not in ASYMMETRIC_ALGORITHMS]
        if refused or not self.algorithms:
            raise ValueError(
                f"JWT algorithms {refused or '(none)'} refused: allowed are the asymmetric "
                f"{', '.join(ASYMMETRIC_ALGORITHMS)} (never 'none' or HS*)"
            )
        if not 0 <= self.leeway_s <= 300:
            raise ValueError("JWT leeway must be 0 to 300 seconds")
        if not self.tenant_claim:
            raise ValueError("JWT tenant claim must be named")
        if self.min_refresh_s <= 0 or self.max_age_s < self.min_refresh_s:
            raise ValueError("JWKS refresh: want 0 < min refresh <= max age")

    def key_source(self) -> KeySource:
        if self.jwks_file is not None:
            return JwksFile(self.jwks_file, self.algorithms)
        assert self.jwks_url is not None
        return JwksUrl(self.jwks_url, self.algorithms, self.min_refresh_s, self.max_age_s)


class JwtVerifier:
    def __init__(self, config: JwtConfig, keys: KeySource | None = None) -> None:
        self.config = config
        self.keys = keys or config.key_source()

    async def tenant_claim(self, token: str) -> str:
        """The tenant claim of a valid token, or ``Unauthorized``."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as exc:
            raise _refused("malformed token", exc) from None
        alg, kid = header.get("alg"), header.get("kid")
        if alg not in self.config.algorithms:
            raise _refused(f"algorithm {alg!r} not allowed")
        if kid is not None and not isinstance(kid, str):
            raise _refused("kid is no string")
        key = await self.keys.key(kid)
        if key is None:
            raise _refused(f"no key {kid!r}")
        if key.algorithm_name != alg:  # an RSA key verifies RS256 only, whatever is claimed
            raise _refused(f"algorithm {alg!r} is not key {kid!r}'s")
        try:
            claims = jwt.decode(
                token,
                key.key,
                algorithms=[alg],
                audience=self.config.audience,
                issuer=self.config.issuer,
                leeway=self.config.leeway_s,
                options={"require": ["exp", "iss", "aud", self.config.tenant_claim]},
            )
        except jwt.ExpiredSignatureError as exc:
            raise _refused("expired", exc, EXPIRED) from None
        except jwt.ImmatureSignatureError as exc:
            raise _refused("not yet valid", exc, NOT_YET_VALID) from None
        except (jwt.PyJWTError, ValueError, TypeError) as exc:  # never a 500 with its text
            raise _refused("rejected", exc) from None
        tenant = claims[self.config.tenant_claim]
        if not isinstance(tenant, str):
            raise _refused("tenant claim is no string")
        return tenant


def _refused(why: str, exc: Exception | None = None, message: str = INVALID) -> Unauthorized:
    log.info("JWT refused: %s%s", why, f" ({type(exc).__name__}: {exc})" if exc else "")
    return Unauthorized(message)
