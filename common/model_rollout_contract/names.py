"""The one rule for model, version and tenant names: they become path components on
disk and in the store, label values and URL segments, so they are kept short and plain."""

from __future__ import annotations

import re

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
NAME_RULE = "1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"


class InvalidName(ValueError):
    """A name that breaks the rule; each program maps it to its own error (400, refusal,
    condition)."""


def is_valid_name(value: object) -> bool:
    """True for a string that matches the whole rule (``fullmatch``: no trailing newline)."""
    return isinstance(value, str) and NAME_PATTERN.fullmatch(value) is not None


def check_name(kind: str, value: object) -> str:
    """``value`` if it is a valid name; :class:`InvalidName` naming ``kind`` otherwise."""
    if not is_valid_name(value):
        raise InvalidName(f"invalid {kind} {value!r}: {NAME_RULE}")
    assert isinstance(value, str)
    return value


def model_key(name: str, tenant: str | None = None) -> str:
    """A served model's key: models of the default namespace are keyed by name, tenants'
    by ``tenant/name``."""
    check_name("model name", name)
    return f"{check_name('tenant', tenant)}/{name}" if tenant else name


def check_model_key(value: object) -> str:
    """A served model's key: ``name``, or ``tenant/name`` for a tenant's model."""
    parts = value.split("/") if isinstance(value, str) else [value]
    if len(parts) > 2 or not all(is_valid_name(p) for p in parts):
        raise InvalidName(f"invalid model {value!r}: 'name' or 'tenant/name', each {NAME_RULE}")
    assert isinstance(value, str)
    return value
