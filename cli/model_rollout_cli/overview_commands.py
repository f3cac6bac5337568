"""The commands that are not about one rollout: ``list``, ``tree``, ``completion`` and
``version`` (their parsers are added beside the others', so that the plugin's parser
grows without changing what was there)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata

from .errors import OK
from .kube import Cluster
from .overview import list_table, tree
from .view import pod_objects

LOCAL = ("completion", "version")  # need no cluster
REMOTE = ("list", "tree")
SHELLS = ("bash", "zsh", "fish")
PROGRAMS = ("kubectl-model", "model-rollout")
DISTRIBUTION = "model-rollout"


def add_parsers(command: Callable[..., argparse.ArgumentParser]) -> None:
    p = command("list", "every ModelDeployment of the namespace (-A: of all namespaces)", False)
    p.add_argument(
        "-A", "--all-namespaces", action="store_true", help="list them in every namespace"
    )
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")
    p = command("tree", "the ModelDeployment, its pods and each pod's versions")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")
    p = command("completion", "the shell code that completes kubectl-model's arguments", False)
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    command("version", "this plugin's version", False)


def run_local(args: argparse.Namespace) -> int:
    if args.command == "completion":
        import argcomplete  # only here: every other command starts without it

        print(argcomplete.shellcode(list(PROGRAMS), shell=args.shell))
        return OK
    print(f"kubectl-model {version()}")
    return OK


def version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown (not installed)"


def run(cluster: Cluster, args: argparse.Namespace) -> int:
    if args.command == "list":
        items = cluster.deployments(args.all_namespaces)
        if args.output == "json":
            print(json.dumps(items, indent=2, sort_keys=True))
        else:
            print(list_table(items, datetime.now(timezone.utc), args.all_namespaces))
        return OK
    md, pods = cluster.get(args.name), cluster.pods(args.name)
    if args.output == "json":
        print(json.dumps({"modelDeployment": md, "pods": pod_objects(pods)}, indent=2))
    else:
        print(tree(md, pods))
    return OK


def autocomplete(parser: argparse.ArgumentParser) -> None:
    """Answer a shell's completion request (argcomplete's environment, set by the code
    ``completion`` prints) and exit; return at once otherwise."""
    if "_ARGCOMPLETE" in os.environ:
        import argcomplete

        from .kubectl_complete import with_name_completer

        argcomplete.autocomplete(with_name_completer(parser))
        sys.exit(0)
