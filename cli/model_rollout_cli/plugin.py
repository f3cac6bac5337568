"""``kubectl-model``: the kubectl plugin (``kubectl model ...``; kubectl finds any
``kubectl-<name>`` executable on PATH). ``status``, ``tree``, ``list``, ``promote``,
``abort``, ``retry``, ``rollback``, ``history`` (``promote``, ``abort`` and ``retry`` on a
tenant model's track with ``--track``), ``pause``, ``resume``, ``completion``,
``version``; exit codes in :mod:`.errors`, shown with an example by every command's ``--help``."""

from __future__ import annotations

import argparse
import sys

from . import commands, overview_commands, pausing
from .errors import USAGE, CliError
from .helptext import Formatter, epilog
from .kube import connect
from .options import at_least_one, kube_flags, kube_options, positive


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubectl model",
        description="Follow and steer ModelDeployment rollouts",
        parents=[kube_flags(suppress=False)],
        formatter_class=Formatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    flags = kube_flags(suppress=True)

    def command(name: str, text: str, named: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name, help=text, description=text, parents=[flags], formatter_class=Formatter,
            epilog=epilog(name),
        )  # fmt: skip
        if named:
            p.add_argument("name", help="the ModelDeployment")
        return p

    def waits(p: argparse.ArgumentParser) -> None:
        p.add_argument("--wait", action="store_true", help="follow the rollout to its result")
        p.add_argument(
            "--timeout", type=positive, default=commands.DEFAULT_TIMEOUT_S,
            help="seconds --wait waits (exit 3 after)",
        )  # fmt: skip

    p = command("status", "phase, pods per version, canary analysis, history and events")
    p.add_argument("-w", "--watch", action="store_true", help="a live view, until Ctrl-C")
    p.add_argument("--interval", type=positive, default=1.0, help="seconds between redraws")
    p.add_argument(
        "--timeout", type=positive, default=None, help="with --watch: stop after this long"
    )
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")

    def on_track(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--track", default=None,
            help="a tenant model's track (a spec.tenants.models name; default: the "
            "deployment's own model)",
        )  # fmt: skip
        waits(p)

    p = command(
        "promote", "promote the canary held for promotion (canary.manualPromote); --full: "
        "the whole rollout",
    )  # fmt: skip
    p.add_argument(
        "--full", action="store_true",
        help="skip what remains: the canary hold and its analysis, the remaining batches and "
        "their jitter (every pod moves now, under maxConcurrentLoads)",
    )  # fmt: skip
    on_track(p)
    on_track(command("abort", "stop the running rollout (a version's or the pod template's): "
                     "every pod back to the stable one now"))  # fmt: skip
    on_track(command("retry", "run the failed rollout (of spec.version or the pod template) again"))
    p = command("rollback", "set spec.version to the previous Succeeded version (or --to)")
    p.add_argument("--to", help="the version to roll back to")
    p.add_argument(
        "--force", action="store_true",
        help="roll back to a --to version the resource has no record of (its history, "
        "verified versions); it must be in the store",
    )  # fmt: skip
    p.add_argument(
        "--dry-run", action="store_true",
        help="say what would be set, checked by the API server's dry run; write nothing",
    )  # fmt: skip
    waits(p)
    p = command("history", "the last rollouts: version, start, end, result, trigger")
    p.add_argument("--limit", type=at_least_one, default=10, help="rollouts shown (>= 1)")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")
    overview_commands.add_parsers(command)
    pausing.add_parsers(command)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.command in overview_commands.LOCAL:  # no cluster needed
        return overview_commands.run_local(args)
    cluster = connect(kube_options(args))
    if getattr(args, "wait", False) or (args.command == "status" and args.timeout):
        cluster.until(args.timeout)  # every API call too, not only the rollout's following
    try:
        if args.command == "status":
            return commands.status(
                cluster, args.name, args.watch, args.output, args.timeout or 0, args.interval
            )
        if args.command == "history":
            return commands.history(cluster, args.name, args.limit, args.output)
        if args.command in overview_commands.REMOTE:
            return overview_commands.run(cluster, args)
        if args.command in pausing.COMMANDS:
            return pausing.run(cluster, args, sys.stdout)
        how = commands.Follow(args.wait, args.timeout)
        if args.command == "promote":
            return commands.promote(cluster, args.name, how, args.track, args.full)
        if args.command == "abort":
            return commands.abort(cluster, args.name, how, args.track)
        if args.command == "retry":
            return commands.retry(cluster, args.name, how, args.track)
        return commands.rollback(cluster, args.name, args.to, how, args.force, args.dry_run)
    finally:
        cluster.close()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    overview_commands.autocomplete(parser)  # answers a shell's completion request, exits
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or bad arguments (2)
        return int(exc.code) if isinstance(exc.code, int) else USAGE
    if args.command == "status" and args.watch and args.output == "json":
        print("error: status --watch is a view for people; -o json reads once", file=sys.stderr)
        return USAGE
    try:
        return run(args)
    except CliError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
