"""The one rule for model, version and tenant names: they become path components on
disk and in the store, label values and URL segments, so they are kept short and plain."""

from __future__ import annotations

import re
from dataclasses import dataclass

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


@dataclass(frozen=True)
class ModelKey:
    """A served model's key, the one place its text is made and read: ``name`` for a
    model of the server's own namespace, ``tenant/name`` for a tenant's. Keys travel as
    that text (dictionary keys, metric labels, the control protocol, store prefixes)."""

    tenant: str | None
    name: str

    def __post_init__(self) -> None:
        check_name("model name", self.name)
        if self.tenant is not None:
            check_name("tenant", self.tenant)

    @classmethod
    def of(cls, name: str, tenant: str | None = None) -> ModelKey:
        """The model a namespace calls ``name``: a tenant's, or (``None``) the server's own."""
        return cls(tenant or None, name)

    @classmethod
    def parse(cls, text: object) -> ModelKey:
        """A key's text, checked: ``name`` or ``tenant/name``, each part a valid name."""
        parts = text.split("/") if isinstance(text, str) else [text]
        if len(parts) > 2 or not all(is_valid_name(p) for p in parts):
            raise InvalidName(f"invalid model {text!r}: 'name' or 'tenant/name', each {NAME_RULE}")
        assert isinstance(text, str)
        tenant, _, name = text.rpartition("/")
        return cls(tenant or None, name)

    @property
    def parts(self) -> tuple[str, ...]:
        """Its path components: a tenant's models lie in the tenant's directory."""
        return (self.name,) if self.tenant is None else (self.tenant, self.name)

    def __str__(self) -> str:
        return f"{self.tenant}/{self.name}" if self.tenant is not None else self.name

    @staticmethod
    def tenant_in(text: str) -> str | None:
        """The tenant part of a key's text, unchecked (a metric label carries whatever
        name a caller sent); ``None`` for a model of the server's own."""
        tenant, slash, _ = text.partition("/")
        return tenant if slash else None

    @staticmethod
    def name_in(text: str) -> str:
        """The name part of a key's text, unchecked: the name its namespace knows it by."""
        return text.rpartition("/")[2]


def check_model_key(value: object) -> str:
    """``value`` if it is a valid model key's text (:meth:`ModelKey.parse`)."""
    return str(ModelKey.parse(value))
