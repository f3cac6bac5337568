"""Check every Dockerfile before ``make images`` builds it (standard library only, so it
runs before any virtual environment exists)::

    python3 tools/check_images.py

Each base image is pinned by digest (``name:tag@sha256:...``; the tag says what it is,
the digest what is pulled): a FROM by tag alone pulls whatever the tag points at that
day. Each ``pip install`` installs a lock file with ``--require-hashes`` or the project's
own wheels (``--no-index``), nothing from an index unhashed.

Refreshing a digest (on a machine that reaches the registry), then `make images`::

    docker buildx imagetools inspect python:3.12-slim --format '{{json .Manifest.Digest}}'
    docker buildx imagetools inspect nvcr.io/nvidia/tensorrt:26.06-py3 \\
      --format '{{json .Manifest.Digest}}'

(the digest of the multi-platform index; ``docker pull <image>`` prints it too, as
``Digest: sha256:...``), and replace the ``@sha256:...`` in the Dockerfile's ``ARG BASE=``.
A new TensorRT image: its CUDA major must be cuda-python's in requirements/server-gpu.in.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = sorted(ROOT.glob("Dockerfile.*"))
DIGEST = re.compile(r"^[^\s@]+:[^\s@/]+@sha256:[0-9a-f]{64}$")
ARG = re.compile(r"^ARG\s+(\w+)=(\S+)\s*$")
FROM = re.compile(r"^FROM\s+(\S+)")
VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
LOCK = re.compile(r"--require-hashes\b.*-r\s+\S*requirements\S*\.txt")


def logical_lines(text: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    return [
        line.strip()
        for line in joined.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def problems(path: Path) -> list[str]:
    """What makes the Dockerfile's build depend on the day it runs: empty when nothing."""
    found = []
    args: dict[str, str] = {}
    stages: set[str] = set()
    for line in logical_lines(path.read_text()):
        if match := ARG.match(line):
            args[match[1]] = match[2]
        elif match := FROM.match(line):
            image = VARIABLE.sub(lambda m: args.get(m[1] or m[2], m[0]), match[1])
            alias = re.search(r"\s+AS\s+(\S+)$", line, re.I)
            if image not in stages and not DIGEST.match(image):
                found.append(
                    f"{path.name}: FROM {image}: not pinned by digest (name:tag@sha256:...)"
                )
            if alias:
                stages.add(alias[1])
        elif re.search(r"\bpip3?\s+install\b", line):
            for command in re.split(r"&&|;", line):
                if not re.search(r"\bpip3?\s+install\b", command):
                    continue
                if "--no-index" in command or LOCK.search(command):
                    continue
                found.append(
                    f"{path.name}: {command.strip()}: not from a lock with --require-hashes"
                )
    return found


def main() -> int:
    found = [p for path in DOCKERFILES for p in problems(path)]
    for problem in found:
        print(problem, file=sys.stderr)
    if found:
        print(
            f"see {Path(__file__).relative_to(ROOT)} for how to pin a base by digest",
            file=sys.stderr,
        )
        return 1
    print(f"checked {', '.join(p.name for p in DOCKERFILES)}: bases pinned by digest, locks hashed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
