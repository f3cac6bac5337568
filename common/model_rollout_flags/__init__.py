"""The programs' flags, each also read from the environment (ConfigArgParse's
``auto_env_var_prefix``): ``--some-flag`` of ``model-server`` is
``MODEL_SERVER_SOME_FLAG``, the command line winning. The prefixes are the contract's
(:mod:`model_rollout_contract.cli`): the operator sets them in the pods it generates.

Three rules on top of ConfigArgParse's, kept from the scheme the programs have always
had: an empty variable counts as unset; a repeatable flag's variable holds its values
comma-separated; and a bad value is refused naming its variable. Variables are read only
for the command being run (a bad one for ``watch`` does not break ``keygen`` or
``--help``), and help shows each flag's variable and default.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any

import configargparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default beside its variable; none for switches and hidden flags."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, []) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


class FlagParser(configargparse.ArgumentParser):
    """An ``ArgumentParser`` whose flags (and its sub-commands') are also read from
    ``env_prefix`` + the flag's name, upper-cased."""

    def __init__(self, *args: Any, env_prefix: str, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(
            *args,
            auto_env_var_prefix=env_prefix,
            exit_on_error=False,  # errors come back to say which variable holds the value
            **kwargs,
        )
        self.env_prefix = env_prefix

    def add_subparsers(self, **kwargs: Any) -> Any:
        """Sub-commands read the same prefix (each parses its own flags' variables)."""
        kwargs.setdefault("parser_class", _SubParser(type(self), self.env_prefix))
        return super().add_subparsers(**kwargs)

    def parse_known_args(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        namespace: argparse.Namespace | None = None,
        env_vars: Mapping[str, str] = os.environ,
        **kwargs: Any,
    ) -> tuple[argparse.Namespace, list[str]]:
        set_variables = {name: value for name, value in env_vars.items() if value != ""}
        try:
            return super().parse_known_args(args, namespace, env_vars=set_variables, **kwargs)
        except argparse.ArgumentError as exc:
            self.error(self._explained(exc))
            raise  # error() exits

    def convert_item_to_command_line_arg(self, action: Any, key: str, value: Any) -> list[str]:
        if isinstance(value, str) and isinstance(action, argparse._AppendAction):
            value = [item.strip() for item in value.split(",") if item.strip()]
        result: list[str] = super().convert_item_to_command_line_arg(action, key, value)
        return result

    def _explained(self, exc: argparse.ArgumentError) -> str:
        """argparse's message, naming the variable when the value came from one."""
        from_env = self.get_source_to_settings_dict().get("environment_variables", {})
        for name, (action, raw) in from_env.items():
            if exc.argument_name in action.option_strings:
                return f"{name}={raw!r}: not a valid value for {exc.argument_name} ({exc})"
        return str(exc)


class _SubParser:
    """Makes a sub-command's parser with its parent's class and prefix."""

    def __init__(self, cls: type[FlagParser], env_prefix: str) -> None:
        self.cls, self.env_prefix = cls, env_prefix

    def __call__(self, **kwargs: Any) -> FlagParser:
        kwargs.setdefault("env_prefix", self.env_prefix)
        return self.cls(**kwargs)
