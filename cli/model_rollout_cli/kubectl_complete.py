"""``kubectl_complete-model``: what kubectl (1.26+) runs to complete ``kubectl model <TAB>``.

kubectl completes a plugin's arguments by running ``kubectl_complete-<plugin>`` from PATH
with the words after ``kubectl model``, the last one the word being completed, and
passes on what it prints: one candidate a line (``candidate<TAB>description``), then a
cobra directive line (``:4``: complete no file names). The candidates come from the
plugin's own parser, walked by argcomplete (as ``kubectl-model completion bash`` does):
sub-commands, flags, a flag's choices, and the names of the ModelDeployments of the
namespace, asked of the API within :data:`NAMES_TIMEOUT_S` (none when it cannot answer:
completion never hangs and never fails)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from .errors import CliError
from .kube import connect
from .options import kube_options

# cobra's ShellCompDirectiveNoFileComp: the shell offers no file names instead
NO_FILES = 4
NAMES_TIMEOUT_S = 2.0  # every API request of a name completion, retries included


def deployment_names(prefix: str, parsed_args: argparse.Namespace, **_: Any) -> list[str]:
    """The ModelDeployments of the namespace the words name (``-n``, ``--context``,
    ``--kubeconfig``, else kubectl's), or none when the API does not answer in time."""
    options = argparse.Namespace(
        **{k: getattr(parsed_args, k, None) for k in ("kubeconfig", "context", "namespace")}
    )
    try:
        cluster = connect(kube_options(options))
    except CliError:
        return []
    try:
        cluster.until(NAMES_TIMEOUT_S)
        items = cluster.deployments()
    except CliError:
        return []
    finally:
        cluster.close()
    names = (str((md.get("metadata") or {}).get("name") or "") for md in items)
    return sorted(n for n in names if n.startswith(prefix))


def with_name_completer(
    parser: argparse.ArgumentParser, completer: Callable[..., list[str]] = deployment_names
) -> argparse.ArgumentParser:
    """``parser`` with ``completer`` on every sub-command's ``name`` argument (argcomplete
    calls an action's ``completer``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                for argument in sub._actions:
                    if argument.dest == "name" and not argument.option_strings:
                        argument.completer = completer  # type: ignore[attr-defined]
    return parser


def candidates(parser: argparse.ArgumentParser, words: list[str]) -> list[tuple[str, str]]:
    """(candidate, description) for the last of ``words`` (the words after the program's
    name; none: complete an empty word), from argcomplete's walk of ``parser``."""
    import argcomplete  # only here: the plugin's commands start without it

    typed, prefix = words[:-1], (words[-1] if words else "")
    finder = argcomplete.CompletionFinder(
        parser,
        always_complete_options=False,  # flags once a "-" is typed, as kubectl's own
        default_completer=argcomplete.completers.SuppressCompleter(),
        append_space=False,
    )
    found = finder._get_completions([parser.prog, *typed], prefix, "", None)
    shown = finder.get_display_completions()
    return [(c, " ".join((shown.get(c) or "").split())) for c in found]


def cobra_lines(found: list[tuple[str, str]]) -> list[str]:
    """What cobra reads: ``candidate<TAB>description`` lines, then the directive."""
    lines = [f"{c}\t{d}" if d else c for c, d in found]
    return [*lines, f":{NO_FILES}"]


def main(argv: list[str] | None = None) -> int:
    from .plugin import build_parser  # the plugin's parser, as it is

    words = list(sys.argv[1:] if argv is None else argv)
    try:
        found = candidates(with_name_completer(build_parser()), words)
    except Exception:  # a completion never fails the shell: it offers nothing
        found = []
    print("\n".join(cobra_lines(found)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
