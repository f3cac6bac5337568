"""``helm install``, ``upgrade``, ``uninstall`` and ``status`` as a command line, for the
tests that run the docs' commands: no helm binary is installed here, so this runs Helm
v4's own actions (its Go SDK, through ``helm-python-sdk``: the same install, upgrade and
uninstall code as the ``helm`` command, release records in Secrets, ``crds/`` installed
first) behind the subset of ``helm``'s flags the docs use::

    python -m model_rollout_e2e.helm_cli install NAME CHART [-n NS] [--create-namespace]
        [-f FILE]... [--set K=V]... [--set-string K=V]... [--wait] [--timeout 5m]
    python -m model_rollout_e2e.helm_cli upgrade NAME CHART [...] [--reuse-values]
    python -m model_rollout_e2e.helm_cli uninstall NAME [-n NS]
    python -m model_rollout_e2e.helm_cli status NAME [-n NS]

Values merge as helm merges them: files in order, then ``--set`` and ``--set-string`` in
order. An unknown flag is refused (exit 2), so a docs command this does not understand
fails its test rather than being half run. Failures print ``Error: ...`` and exit 1, as
helm does.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import helm_python as helm

_DURATION = re.compile(r"(\d+)([hms])")
_SECONDS = {"h": 3600, "m": 60, "s": 1}


def seconds(duration: str) -> int:
    """A Go duration as helm's ``--timeout`` takes it (``5m``, ``1h30m``, ``90s``)."""
    parts = _DURATION.findall(duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise argparse.ArgumentTypeError(f"invalid duration {duration!r}")
    return sum(int(n) * _SECONDS[u] for n, u in parts)


class Merge(argparse.Action):
    """``-f``, ``--set``, ``--set-string``: kept in their order on the command line."""

    def __call__(self, parser: Any, namespace: Any, value: Any, option: Any = None) -> None:
        namespace.values.append((self.dest, value))


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def user_values(items: list[tuple[str, str]]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for kind, text in items:
        if kind == "file":
            layer = helm.values_from_yaml(Path(text).read_text())
        elif kind == "set":
            layer = helm.parse_set_string(text)
        else:
            layer = helm.parse_set_string_values(text)
        values = merged(values, layer)
    return values


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="helm")
    sub = top.add_subparsers(dest="command", required=True)
    for name in ("install", "upgrade", "uninstall", "status"):
        command = sub.add_parser(name)
        command.add_argument("release")
        command.add_argument("-n", "--namespace", default="default")
        if name in ("install", "upgrade"):
            command.add_argument("chart")
            command.set_defaults(values=[])
            command.add_argument("-f", "--values", dest="file", action=Merge)
            command.add_argument("--set", dest="set", action=Merge)
            command.add_argument("--set-string", dest="set_string", action=Merge)
            command.add_argument("--wait", action="store_true")
            command.add_argument("--timeout", type=seconds, default=300)
        if name == "install":
            command.add_argument("--create-namespace", action="store_true")
        if name == "upgrade":
            command.add_argument("--reuse-values", action="store_true")
    return top


def run(args: argparse.Namespace) -> dict[str, Any]:
    with helm.Config(namespace=args.namespace) as config:  # KUBECONFIG, as helm reads it
        if args.command == "status":
            return dict(config.status(args.release))
        if args.command == "uninstall":
            return dict(config.uninstall(args.release))
        common: dict[str, Any] = {
            "namespace": args.namespace,
            "timeout": args.timeout,
            "wait": "watcher" if args.wait else None,
        }
        values = user_values(args.values)
        if args.command == "install":
            return dict(
                config.install(
                    args.chart, args.release, values,
                    create_namespace=args.create_namespace, **common,
                )
            )  # fmt: skip
        return dict(
            config.upgrade(
                args.chart, args.release, values, reuse_values=args.reuse_values, **common
            )
        )


def report(command: str, release: str, answer: dict[str, Any]) -> str:
    """What helm prints: the release, its status and, after an install or upgrade, the
    chart's NOTES."""
    if command == "uninstall":
        return str(answer.get("info") or f'release "{release}" uninstalled')
    lines = [
        f"NAME: {answer.get('name', release)}",
        f"NAMESPACE: {answer.get('namespace', '')}",
        f"STATUS: {answer.get('status', '')}",
        f"REVISION: {answer.get('revision', '')}",
    ]
    notes = answer.get("notes")
    return "\n".join(lines + (["NOTES:", str(notes)] if notes else []))


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        answer = run(args)
    except helm.HelmError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    print(report(args.command, args.release, answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
