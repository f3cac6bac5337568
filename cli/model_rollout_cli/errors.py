"""What can go wrong talking to the cluster, as one message and one exit code each.

Exit codes (the same for ``kubectl model`` and ``model-rollout release``):

* 0: done (with ``--wait``: the rollout reached the result asked for);
* 1: the rollout failed, was rolled back by the canary analysis, was aborted or
  superseded, or the spec was refused;
* 2: bad arguments, or ones that cannot work for this resource (a rollback ``--to`` a
  version it has no record of, a release ``--store`` its pods do not fetch from);
* 3: ``--timeout`` passed before the rollout ended;
* 4: the Kubernetes API refused or could not be reached (RBAC, not found, no kubeconfig);
* 5: publishing the version failed;
* 6: nothing to do: no canary to promote, no running rollout to abort or promote fully,
  no failed one to retry, no earlier success to roll back to, a resource paused (or not)
  already.
"""

from __future__ import annotations

import json
import re
from typing import Any

OK = 0
ROLLOUT_FAILED = 1
USAGE = 2
TIMED_OUT = 3
API_ERROR = 4
PUBLISH_FAILED = 5
NOTHING_TO_DO = 6


def exit_codes() -> list[tuple[int, str]]:
    """The exit codes as this module's docstring lists them (for each command's help)."""
    found = re.findall(r"^\* (\d+): (.+?)(?=^\* |\Z)", __doc__ or "", re.MULTILINE | re.DOTALL)
    return [(int(n), " ".join(text.split()).rstrip(";.")) for n, text in found]


class CliError(Exception):
    """A failure with the message the user sees and the exit code it ends with."""

    def __init__(
        self, message: str, code: int = API_ERROR, transient: bool = False, conflict: bool = False
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.transient = transient  # worth another try while following (a 5xx, a reset)
        self.conflict = conflict  # a write refused: the resource changed since it was read


def _api_message(body: Any) -> str | None:
    """The ``message`` of a Kubernetes ``Status`` body, if it is one."""
    try:
        raw = json.loads(body) if isinstance(body, (str, bytes)) else None
    except ValueError:
        return None
    message = raw.get("message") if isinstance(raw, dict) else None
    return str(message) if message else None


def api_error(
    status: int | None,
    body: Any,
    verb: str,
    resource: str,
    namespace: str,
    name: str | None = None,
    singular: str | None = None,
) -> CliError:
    """An API answer other than success, in words that say what to do about it.
    ``resource``: as RBAC names it (``modeldeployments.serving.model-rollout.io``);
    ``singular``: as a person does (``modeldeployment``)."""
    word = singular or resource
    what = f"{word} {name}" if name else word
    detail = _api_message(body)
    if status == 403 and detail and f"cannot {verb} resource" not in detail:
        # forbidden, but not by RBAC: an admission policy's or the namespace's refusal,
        # which more RBAC would not lift; its own words say why
        return CliError(f"{verb} {what} refused: {detail}")
    if status == 403:
        return CliError(
            f"forbidden: {verb} {resource} in namespace {namespace}: ask for RBAC that allows "
            f"'{verb}' on {resource} there" + (f" ({detail})" if detail else "")
        )
    if status == 404:
        return CliError(f"{what} not found in namespace {namespace}")
    if status == 401:
        return CliError("unauthorized: the kubeconfig's credentials were refused")
    if status == 409 and verb == "patch":
        return CliError(
            f"{what} changed while this command read it (another write came first): "
            "nothing was written; run the command again",
            conflict=True,
        )
    if status == 409 or status == 422:
        return CliError(f"{verb} {what} refused: {detail or status}")
    transient = status is None or status == 429 or status >= 500  # None: no answer at all
    return CliError(
        f"{verb} {what} in namespace {namespace}: HTTP {status}: {detail or body}",
        transient=transient,
    )
