"""How the three programs are configured: command-line flags, each also read from the
environment under one prefix scheme — ``--some-flag`` of ``model-server`` is
``MODEL_SERVER_SOME_FLAG`` — with the command line winning. The operator relies on the
scheme when it sets variables in the pods it generates, so it belongs to the contract.

Each program builds its own ``argparse`` parser and parses it with
:func:`parse_with_environment`, then turns the namespace into a frozen configuration
dataclass. Environment values are converted and checked like command-line values, only
for the command being run (a bad variable for ``watch`` does not break ``keygen`` or
``--help``); an empty variable counts as unset. Flags may be plain options,
``store_true`` switches or ``append`` lists (comma-separated in the environment).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

SERVER_ENV_PREFIX = "MODEL_SERVER_"
SIDECAR_ENV_PREFIX = "MODEL_SIDECAR_"
OPERATOR_ENV_PREFIX = "MODEL_OPERATOR_"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}
_UNSET = object()  # a default meaning "not on the command line"
_SUPPORTED = (argparse._StoreAction, argparse._StoreTrueAction, argparse._AppendAction)


def env_name(prefix: str, flag: str) -> str:
    """``env_name("MODEL_SIDECAR_", "--kube-api") == "MODEL_SIDECAR_KUBE_API"``."""
    return prefix + flag.lstrip("-").replace("-", "_").upper()


def optional_path(value: str | None) -> Path | None:
    return Path(value) if value else None


def _long_flag(action: argparse.Action) -> str | None:
    return next((o for o in action.option_strings if o.startswith("--")), None)


def _options(
    parser: argparse.ArgumentParser,
) -> Iterator[tuple[argparse.ArgumentParser, argparse.Action]]:
    """Every long option of ``parser`` and of its sub-commands, with its own parser."""
    for action in parser._actions:  # argparse has no public iterator over actions
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _options(sub)
        elif _long_flag(action) and not isinstance(action, argparse._HelpAction):
            yield parser, action


def _convert(
    parser: argparse.ArgumentParser, action: argparse.Action, name: str, raw: str
) -> object:
    if isinstance(action, argparse._StoreTrueAction):
        if raw.lower() not in _TRUE | _FALSE:
            parser.error(f"{name}={raw!r}: expected true or false")
        return raw.lower() in _TRUE
    if isinstance(action, argparse._AppendAction):
        items = [item.strip() for item in raw.split(",") if item.strip()]
        return [_one(parser, action, name, item) for item in items]
    return _one(parser, action, name, raw)


def _one(parser: argparse.ArgumentParser, action: argparse.Action, name: str, raw: str) -> object:
    try:
        value = action.type(raw) if callable(action.type) else raw
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(f"{name}={raw!r}: not a valid value for {_long_flag(action)} ({exc})")
    if action.choices is not None and value not in action.choices:
        parser.error(f"{name}={raw!r}: choose from {', '.join(map(str, action.choices))}")
    return value


def parse_with_environment(
    parser: argparse.ArgumentParser,
    prefix: str,
    argv: list[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> argparse.Namespace:
    """``parser.parse_args(argv)``, each option not given falling back to its variable."""
    env = os.environ if environ is None else environ
    from_env: list[tuple[argparse.ArgumentParser, argparse.Action, str, str]] = []
    defaults: dict[int, tuple[argparse.Action, object, bool]] = {}
    for owner, action in _options(parser):
        if not isinstance(action, _SUPPORTED) or action.nargs not in (None, 0, "?"):
            raise TypeError(
                f"{_long_flag(action)}: no environment form for {type(action).__name__}"
            )
        name = env_name(prefix, str(_long_flag(action)))
        if action.help != argparse.SUPPRESS and f"[env {name}]" not in (action.help or ""):
            action.help = f"{action.help or ''} [env {name}]".strip()
        raw = env.get(name, "")
        if raw == "":
            continue
        from_env.append((owner, action, name, raw))
        defaults[id(action)] = (action, action.default, action.required)
        action.required = False  # satisfied by the environment
        if not isinstance(action, argparse._AppendAction):  # an append default would merge
            action.default = _UNSET
    try:
        namespace = parser.parse_args(argv)
    finally:  # the parser stays as it was built, to be parsed again
        for action, default, required in defaults.values():
            action.default, action.required = default, required
    for owner, action, name, raw in from_env:
        current = getattr(namespace, action.dest, None)
        unset = current is _UNSET or (isinstance(action, argparse._AppendAction) and not current)
        if hasattr(namespace, action.dest) and unset:
            setattr(namespace, action.dest, _convert(owner, action, name, raw))
    return namespace
