"""Run one of the project's Python programs as a process pod's container, with the pod's
projected ServiceAccount volume where the in-cluster Kubernetes client looks for it::

    python -m model_rollout_e2e.in_pod <host dir of the volume> <module> [args...]

A process pod has no mount namespace (:mod:`.pod_sandbox`), so the volume a pod mounts at
``/var/run/secrets/kubernetes.io/serviceaccount`` lies in the pod's directory, not at
that path. The command line's container paths are rewritten by the sandbox; the client's
fixed paths (token, CA) cannot be, so this points kubernetes_asyncio's in-cluster loader
(its two path constants, nothing else) at the volume's host directory, then runs the
module as ``python -m`` would. The program itself runs unchanged: it reads the token the
node agent rotates in that directory and the ``KUBERNETES_SERVICE_HOST``/``PORT`` the
node agent sets, as in a cluster.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from kubernetes_asyncio.config import incluster_config

USAGE = "usage: python -m model_rollout_e2e.in_pod <service-account dir> <module> [args...]"


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(USAGE)
    directory, module, *args = argv
    account = Path(directory)
    if not account.is_dir():
        raise SystemExit(f"in_pod: the service-account volume {account} is not a directory")
    incluster_config.SERVICE_TOKEN_FILENAME = str(account / "token")
    incluster_config.SERVICE_CERT_FILENAME = str(account / "ca.crt")
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
