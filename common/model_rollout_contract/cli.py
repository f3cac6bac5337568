"""How the three programs are configured: command-line flags, each also read from the
environment under one prefix scheme — ``--some-flag`` of ``model-server`` is
``MODEL_SERVER_SOME_FLAG`` — with the command line winning. The operator relies on the
scheme when it sets variables in the pods it generates, so it belongs to the contract.

Each program builds its own ``argparse`` parser, calls :func:`read_environment` on it,
and turns the parsed namespace into a frozen configuration dataclass.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

SERVER_ENV_PREFIX = "MODEL_SERVER_"
SIDECAR_ENV_PREFIX = "MODEL_SIDECAR_"
OPERATOR_ENV_PREFIX = "MODEL_OPERATOR_"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def env_name(prefix: str, flag: str) -> str:
    """``env_name("MODEL_SIDECAR_", "--kube-api") == "MODEL_SIDECAR_KUBE_API"``."""
    return prefix + flag.lstrip("-").replace("-", "_").upper()


def _long_flag(action: argparse.Action) -> str | None:
    return next((o for o in action.option_strings if o.startswith("--")), None)


def read_environment(
    parser: argparse.ArgumentParser, prefix: str, environ: Mapping[str, str] | None = None
) -> None:
    """Make every long option of ``parser`` (and of its sub-commands) default to its
    environment variable, when that is set. Flags given on the command line win."""
    env = os.environ if environ is None else environ
    for action in parser._actions:  # argparse has no public iterator over actions
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                read_environment(sub, prefix, env)
            continue
        flag = _long_flag(action)
        if flag is None or isinstance(action, argparse._HelpAction):
            continue
        name = env_name(prefix, flag)
        action.help = f"{action.help or ''} [env {name}]".strip()
        if name not in env:
            continue
        raw = env[name]
        if isinstance(action, argparse._StoreTrueAction):
            if raw.lower() not in _TRUE | _FALSE:
                parser.error(f"{name}={raw!r}: expected true or false")
            action.default = raw.lower() in _TRUE
        elif isinstance(action, argparse._AppendAction):
            items = [item.strip() for item in raw.split(",") if item.strip()]
            action.default = [_convert(parser, action, name, item) for item in items]
        else:
            action.default = _convert(parser, action, name, raw)
        action.required = False


def _convert(
    parser: argparse.ArgumentParser, action: argparse.Action, name: str, raw: str
) -> object:
    try:
        value = action.type(raw) if callable(action.type) else raw
    except (TypeError, ValueError):
        parser.error(f"{name}={raw!r}: not a valid value for {_long_flag(action)}")
    if action.choices is not None and value not in action.choices:
        parser.error(f"{name}={raw!r}: choose from {', '.join(map(str, action.choices))}")
    return value
