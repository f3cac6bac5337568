"""Flags every command takes: kubectl's connection flags, accepted before or after the
command (``kubectl model -n ml status mlp`` and ``kubectl model status mlp -n ml``), as
kubectl passes a plugin every argument it was given."""

from __future__ import annotations

import argparse

from .kube import KubeOptions


def kube_flags(suppress: bool) -> argparse.ArgumentParser:
    """A parent parser; ``suppress``: no defaults (a command's copy must not overwrite
    what was given before the command)."""
    default = argparse.SUPPRESS if suppress else None
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--kubeconfig", default=default, help="kubeconfig file (default: kubectl's)")
    p.add_argument("--context", default=default, help="kubeconfig context (default: current)")
    p.add_argument("-n", "--namespace", default=default, help="namespace (default: the context's)")
    return p


def kube_options(args: argparse.Namespace) -> KubeOptions:
    return KubeOptions(args.kubeconfig, args.context, args.namespace)


def positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
    return value


def at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text}") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {text}")
    return value
