"""What every command's ``--help`` ends with: an example or two and the exit codes, and
a formatter that shows each option's default."""

from __future__ import annotations

import argparse

from .errors import exit_codes

# one or more examples per command, as a person types them (tests/cli/test_cli_examples.py
# parses every one with the command's parser, and runs those of the README)
EXAMPLES: dict[str, list[str]] = {
    "status": [
        "kubectl model status mlp",
        "kubectl model status mlp --watch --timeout 600   # exit code as promote --wait's",
        "kubectl model status mlp -o json",
    ],
    "tree": ["kubectl model tree mlp"],
    "list": ["kubectl model list", "kubectl model list -A"],
    "promote": [
        "kubectl model promote mlp --wait --timeout 900",
        "kubectl model promote mlp --track acme-mlp",
        "kubectl model promote mlp --full   # skip the canary hold, analysis and batches",
    ],
    "pause": ["kubectl model pause mlp"],
    "resume": ["kubectl model resume mlp"],
    "abort": ["kubectl model abort mlp --wait"],
    "retry": ["kubectl model retry mlp --wait"],
    "rollback": [
        "kubectl model rollback mlp --wait",
        "kubectl model rollback mlp --to v1 --dry-run",
    ],
    "history": ["kubectl model history mlp --limit 20", "kubectl model history mlp -o json"],
    "completion": [
        "source <(kubectl-model completion bash)",
        "kubectl-model completion fish > ~/.config/fish/completions/kubectl-model.fish",
    ],
    "version": ["kubectl model version"],
    "release": [
        "model-rollout release --model mlp --version v2 --file model.onnx --key signing.pem "
        "--deployment mlp --store s3://models/prod --wait -o json",
        "model-rollout release --model mlp --version v2 --file model.onnx --key signing.pem "
        "--deployment mlp --store s3://models/prod --dry-run",
    ],
}


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown; the epilog's lines kept as written."""


def epilog(command: str) -> str:
    codes = "\n".join(f"  {n}  {text.replace('``', '')}" for n, text in exit_codes())
    examples = "\n".join(f"  {line}" for line in EXAMPLES[command])
    return f"examples:\n{examples}\n\nexit codes:\n{codes}"
