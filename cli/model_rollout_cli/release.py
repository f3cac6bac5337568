"""``model-rollout release``: one CI step from a model file to a finished rollout.

Publish the version signed (``model-sidecar publish``, run as a process: this program
never imports the sidecar), set ``spec.version`` with a change-cause, follow the rollout
with a line per change, and end 0 when every pod serves the version (Available), non-zero
with a short report when it failed, was rolled back by the canary analysis, was aborted
or did not end in ``--timeout`` (exit codes in :mod:`.errors`). No prompts; colour only
on a terminal; ``--output json`` prints one JSON object on stdout (progress on stderr)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, TextIO

from model_rollout_contract.annotations import CHANGE_CAUSE
from model_rollout_contract.argv import PublishArgs, publish_argv
from model_rollout_contract.layout import StoreUrl
from model_rollout_contract.names import InvalidName, check_name
from model_rollout_contract.states import Phase, RolloutResult

from .cause import change_cause
from .errors import OK, PUBLISH_FAILED, ROLLOUT_FAILED, USAGE, CliError
from .follow import Outcome, follow, rollout_on
from .helptext import Formatter, epilog
from .history import entries, key, keys
from .kube import Cluster, connect
from .options import kube_flags, kube_options, positive
from .overview_commands import autocomplete
from .view import Progress

DEFAULT_TIMEOUT_S = 900.0
PUBLISH_TIMEOUT_S = 1800.0  # a large engine over a slow link


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="model-rollout", description="model-rollout tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "release",
        parents=[kube_flags(suppress=False)],
        help="publish a version signed, roll it out, follow it to its result",
        description="publish a version signed, roll it out, follow it to its result",
        formatter_class=Formatter,
        epilog=epilog("release"),
    )
    p.add_argument("--model", required=True)
    p.add_argument("--version", required=True)
    p.add_argument("--file", required=True, help="the model file (model.onnx, model.engine)")
    p.add_argument("--key", required=True, help="Ed25519 private key (PEM) to sign with")
    p.add_argument("--deployment", required=True, help="the ModelDeployment to roll out to")
    p.add_argument("--store", required=True, help="s3://bucket/prefix or file:///dir")
    p.add_argument(
        "--store-id",
        help="a directory store's identity (the ModelDeployment's spec.store.id), bound by "
        "the signed manifest",
    )
    p.add_argument("--s3-endpoint", help="S3 endpoint URL (default: AWS, or $AWS_ENDPOINT_URL)")
    p.add_argument("--precision", help="the publisher's --precision")
    p.add_argument("--golden", help="golden set signed with the manifest (publisher's --golden)")
    p.add_argument("--force", action="store_true", help="replace a published version")
    p.add_argument(
        "--dry-run", action="store_true",
        help="check everything (the resource, its store, the files, the patch by the API "
        "server's dry run); publish and write nothing",
    )  # fmt: skip
    p.add_argument("--wait", action="store_true", help="follow the rollout to its result")
    p.add_argument("--timeout", type=positive, default=DEFAULT_TIMEOUT_S, help="seconds")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")
    return parser


def publish(args: argparse.Namespace) -> str:
    """Run the publisher; its one-line report, or :class:`CliError` with its stderr."""
    line = publish_argv(
        PublishArgs(
            args.store, args.model, args.version, args.file, args.key,
            args.s3_endpoint, args.precision, args.golden, args.force, args.store_id,
        )
    )  # fmt: skip
    command = [sys.executable, "-m", "model_sidecar", *line[1:]]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=PUBLISH_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise CliError(
            f"publish did not finish in {PUBLISH_TIMEOUT_S:.0f}s", PUBLISH_FAILED
        ) from exc
    if done.returncode != 0:
        why = done.stderr.strip().splitlines()
        tail = why[-1] if why else f"exit {done.returncode}"
        if "No module named" in done.stderr:
            tail += " (publishing needs the sidecar: pip install 'model-rollout[sidecar]')"
        raise CliError(f"publish failed: {tail}", PUBLISH_FAILED)
    return done.stdout.strip()


def _check(args: argparse.Namespace, md: dict[str, Any]) -> None:
    try:
        check_name("model", args.model)
        check_name("version", args.version)
    except InvalidName as exc:
        raise CliError(str(exc), USAGE) from exc
    model = (md.get("spec") or {}).get("model")
    if model != args.model:
        raise CliError(
            f"modeldeployment {args.deployment} serves model {model}, not {args.model}", USAGE
        )
    _check_store(args, md)
    store_id = ((md.get("spec") or {}).get("store") or {}).get("id")
    if store_id != args.store_id:  # its pods would refuse the version: wrong_store
        wanted = f"--store-id {store_id}" if store_id else "no --store-id"
        raise CliError(
            f"modeldeployment {args.deployment}'s store has "
            f"{f'the id {store_id}' if store_id else 'no id'} (spec.store.id): publish with "
            f"{wanted}, or its pods refuse the version",
            USAGE,
        )


def _check_store(args: argparse.Namespace, md: dict[str, Any]) -> None:
    """``--store`` is the store the ModelDeployment's pods fetch from, or its pods would
    never find the version: an S3 store by its bucket and prefix (any endpoint: the same
    bucket), a volume store (spec.store.pvc) as a directory (its path differs between the
    publisher and the pods; spec.store.id names it, checked beside)."""
    store = (md.get("spec") or {}).get("store") or {}
    try:
        given = StoreUrl.parse(args.store)
    except ValueError as exc:
        raise CliError(str(exc), USAGE) from exc
    url = store.get("url")
    if url:
        try:
            wanted = StoreUrl.parse(str(url))
        except ValueError:
            return  # the operator refuses that spec itself (Invalid)
        if given.scheme != wanted.scheme or given.scope != wanted.scope:
            raise CliError(
                f"modeldeployment {args.deployment} fetches from {wanted} (spec.store.url), "
                f"not {given}: its pods would never find the version; publish to {wanted}",
                USAGE,
            )
    elif store.get("pvc") and given.scheme != "file":
        raise CliError(
            f"modeldeployment {args.deployment} fetches from the volume "
            f"{store.get('pvc')} (spec.store.pvc), not {given}: publish to that volume's "
            "directory (file:///path/where/it/is/mounted)",
            USAGE,
        )


def _held(md: dict[str, Any], version: str) -> bool:
    """A pod serves ``version``, or it is the stable or previous (pre-pulled) one: new
    bytes published under it would never reach the pods that hold it."""
    status = md.get("status") or {}
    held = {status.get("currentVersion"), status.get("previousVersion")}
    return version in held or version in (status.get("versions") or {})


def _already(md: dict[str, Any], version: str) -> Outcome | None:
    """spec.version is the version already: the outcome of its last rollout, or ``None``
    when it is not decided yet (its rollout runs, or it succeeded and a pod restarts):
    then it is followed."""
    status = md.get("status") or {}
    last = next((e for e in entries(md) if e.get("version") == version), {})
    result = last.get("result")
    if status.get("phase") == Phase.AVAILABLE and status.get("currentVersion") == version:
        return Outcome(str(RolloutResult.SUCCEEDED), f"already serving {version}", OK, last, status)
    if result in (None, RolloutResult.PROGRESSING, RolloutResult.SUCCEEDED):
        return None
    why = f"{result}: {last.get('reason')}; retry it with: kubectl model retry"
    return Outcome(str(result), why, ROLLOUT_FAILED, last, status)


def _set_already(
    args: argparse.Namespace, cluster: Cluster, md: dict[str, Any], log: TextIO
) -> Outcome | None:
    """A release of spec.version (a CI job run again): nothing is written (nor published,
    but with ``--force`` for a version no pod holds); its rollout's outcome, followed with
    ``--wait`` until it is decided."""
    done = (
        "published again; its rollout is not restarted (kubectl model retry runs it again)"
        if args.force
        else "not published again"
    )
    print(
        f"modeldeployment {args.deployment}: spec.version is {args.version} already; {done}",
        file=log,
        flush=True,
    )
    outcome = _already(md, args.version)
    if outcome is not None or not args.wait:
        return outcome
    name, version = args.deployment, args.version
    show = Progress(log)
    cluster.until(args.timeout)
    if rollout_on(md, version):  # succeeded: no new entry comes, Available ends it
        generation = (md.get("metadata") or {}).get("generation")
        return follow(
            cluster, name, version, keys(md), args.timeout,
            generation=generation, on_update=show, new_entry=False,
        )  # fmt: skip
    known = keys(md) - {key(e) for e in entries(md)[:1]}  # follow the running one
    return follow(cluster, name, version, known, args.timeout, on_update=show)


def _dry_run(args: argparse.Namespace, cluster: Cluster, log: TextIO, is_set: bool) -> Outcome:
    """What a release would do, checked as far as it can be without doing it: the
    resource's checks (above), the files there, and the patch by the API server's own
    dry run (schema, admission policies, RBAC). Nothing is published or written."""
    for flag, path in (("--file", args.file), ("--key", args.key), ("--golden", args.golden)):
        if path is not None and not Path(path).is_file():
            raise CliError(f"{flag} {path}: no such file", USAGE)
    if is_set:
        what = f"spec.version is {args.version} already: nothing would be published or set"
    else:
        patch = {"spec": {"version": args.version}}
        cluster.patch_read(args.deployment, lambda _: patch, dry_run=True)
        what = (
            f"would publish {args.model}:{args.version} to {args.store} and set spec.version "
            f"to {args.version}"
        )
    print(f"modeldeployment {args.deployment}: {what} (dry run)", file=log, flush=True)
    return Outcome("DryRun", "nothing published or written", OK)


def release(
    args: argparse.Namespace, cluster: Cluster, log: TextIO, report: dict[str, Any]
) -> Outcome | None:
    """Publish, set the version, follow; the outcome (``None`` without ``--wait``).
    ``report["published"]``: what the publisher said, as soon as it said it."""
    md = cluster.get(args.deployment)
    _check(args, md)
    status = md.get("status") or {}
    is_set = (md.get("spec") or {}).get("version") == args.version
    if args.force and _held(md, args.version):
        raise CliError(
            f"--force refused: pods of {args.deployment} hold {args.version} already, and new "
            f"bytes under that name would never reach them; release them as a new version",
            USAGE,
        )
    if args.dry_run:
        return _dry_run(args, cluster, log, is_set and status.get("phase") != Phase.INVALID)
    if is_set and status.get("phase") != Phase.INVALID:
        if args.force:  # no pod holds it (a version the sidecars refused): new bytes
            report["published"] = publish(args)
            print(report["published"], file=log, flush=True)
        return _set_already(args, cluster, md, log)
    report["published"] = publish(args)
    print(report["published"], file=log, flush=True)
    if args.wait:  # from here on, every API call is bounded by what is left of it
        cluster.until(args.timeout)
    cause = change_cause("release", args.version)
    patch = {"metadata": {"annotations": {CHANGE_CAUSE: cause}}, "spec": {"version": args.version}}
    md, answer = cluster.patch_read(args.deployment, lambda _: patch)  # read after publishing
    known = keys(md)
    new_entry = not rollout_on(md, args.version)
    print(
        f"modeldeployment {args.deployment}: spec.version set to {args.version} ({cause})", file=log
    )
    if not args.wait:
        return None
    generation = (answer.get("metadata") or {}).get("generation")
    if is_set and isinstance(generation, int):
        # refused before it was published: the spec is unchanged (no new generation), so
        # the refusal in the status is not this release's answer; a new entry is
        generation += 1
    return follow(
        cluster, args.deployment, args.version, known, args.timeout,
        generation=generation, on_update=Progress(log), new_entry=new_entry,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    autocomplete(parser)  # answers a shell's completion request, exits
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else USAGE
    as_json = args.output == "json"
    log = sys.stderr if as_json else sys.stdout  # stdout holds only the JSON then
    report: dict[str, Any] = {
        "deployment": args.deployment,
        "model": args.model,
        "version": args.version,
        "published": None,  # the publisher's report, once it ran
    }
    try:
        cluster = connect(kube_options(args))
        report["namespace"] = cluster.namespace
        try:
            outcome = release(args, cluster, log, report)
        finally:
            cluster.close()
    except CliError as exc:  # the report keeps what was done before (published)
        report |= {"result": "Error", "reason": exc.message, "exitCode": exc.code}
        print(
            json.dumps(report) if as_json else f"error: {exc.message}",
            file=sys.stdout if as_json else sys.stderr,
        )
        return exc.code
    except KeyboardInterrupt:
        if as_json:  # a CI step cancelled: still one JSON object on stdout
            reason = "interrupted (the rollout goes on in the cluster)"
            print(json.dumps(report | {"result": "interrupted", "reason": reason, "exitCode": 130}))
        return 130
    if outcome is None:
        report |= {"result": "Started", "reason": "not followed (no --wait)", "exitCode": OK}
    else:
        report |= outcome.to_json()
    if as_json:
        print(json.dumps(report))
    else:
        print(
            f"result: {report['result']}"
            + (f": {report['reason']}" if report.get("reason") else "")
        )
    return int(report["exitCode"])


if __name__ == "__main__":
    raise SystemExit(main())
