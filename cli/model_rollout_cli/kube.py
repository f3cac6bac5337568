"""Access to the cluster as kubectl has it: the kubeconfig (``--kubeconfig``, else
``$KUBECONFIG``, else ``~/.kube/config``), its current context or ``--context``, the
context's namespace unless ``-n``; in a pod without a kubeconfig, the service account.
Every API failure becomes a :class:`~.errors.CliError` that says what to do."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from model_rollout_contract.annotations import DEPLOYMENT_LABEL, DOMAIN

from .errors import API_ERROR, TIMED_OUT, CliError, api_error

GROUP, VERSION, PLURAL = DOMAIN, "v1alpha1", "modeldeployments"
RESOURCE = f"{PLURAL}.{GROUP}"  # as RBAC rules and kubectl name it
SINGULAR = "modeldeployment"
IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
MERGE_PATCH = "application/merge-patch+json"
REQUEST_TIMEOUT_S = 30.0  # one API call; a watch view polls with calls this short
RETRIES = 1  # a refused connection is reported, not retried for minutes

T = TypeVar("T")


@dataclass(frozen=True)
class KubeOptions:
    """kubectl's own flags, with kubectl's names."""

    kubeconfig: str | None = None
    context: str | None = None
    namespace: str | None = None


def _config_file(options: KubeOptions) -> str:
    """kubectl's choice: the flag, else $KUBECONFIG (paths joined by ``:``, merged), else
    ``~/.kube/config`` (an empty $KUBECONFIG counts as unset, as for kubectl)."""
    return options.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"


def _context_namespace(options: KubeOptions) -> str | None:
    contexts, active = config.list_kube_config_contexts(_config_file(options))
    chosen = active
    if options.context is not None:
        chosen = next((c for c in contexts if c.get("name") == options.context), None)
    return ((chosen or {}).get("context") or {}).get("namespace")


def _kubeconfig_present(options: KubeOptions) -> bool:
    if options.kubeconfig:
        return True  # named: a missing file is an error, not a fallback
    paths = _config_file(options).split(os.pathsep)
    return any(p and Path(p).expanduser().exists() for p in paths)


def connect(options: KubeOptions) -> Cluster:
    """An API client and the namespace to work in, as kubectl would choose them."""
    configuration = client.Configuration()
    try:
        if _kubeconfig_present(options):
            config.load_kube_config(
                config_file=_config_file(options),
                context=options.context,
                client_configuration=configuration,
            )
            namespace = options.namespace or _context_namespace(options) or "default"
        elif not os.environ.get("KUBERNETES_SERVICE_HOST"):
            raise CliError(
                "no Kubernetes configuration: no --kubeconfig, no $KUBECONFIG, no "
                "~/.kube/config, and not in a pod"
            )
        else:
            config.load_incluster_config(client_configuration=configuration)
            namespace = options.namespace or (
                IN_CLUSTER_NAMESPACE.read_text().strip()
                if IN_CLUSTER_NAMESPACE.exists()
                else "default"
            )
    except (ConfigException, OSError, ValueError) as exc:
        raise CliError(f"cannot load the Kubernetes configuration: {exc}", API_ERROR) from exc
    configuration.retries = RETRIES
    return Cluster(client.ApiClient(configuration), namespace, configuration.host)


class Cluster:
    """The few calls the tools make, each failure turned into a clear message.

    ``deadline`` (``time.monotonic()``; set by a command's ``--timeout``): no call, its
    retry included, outlasts it; a call that would start after it, or fails for want of
    time, ends the command as timed out (exit 3), not as an API error."""

    def __init__(self, api: client.ApiClient, namespace: str, host: str) -> None:
        self.api, self.namespace, self.host = api, namespace, host
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.deadline: float | None = None
        self.timeout_s: float | None = None  # what set the deadline, for the message
        self._cut = False  # the last call's timeout was cut short by the deadline

    def until(self, timeout_s: float) -> None:
        """Bound every call from now on by ``timeout_s`` in all."""
        self.deadline, self.timeout_s = time.monotonic() + timeout_s, timeout_s

    def _timed_out(self) -> CliError:
        return CliError(
            f"--timeout {self.timeout_s:g}s passed waiting for the Kubernetes API at {self.host}",
            TIMED_OUT,
        )

    def _request_timeout(self) -> float:
        """Seconds one attempt of a call may take: the remaining time shared by the
        attempts urllib3 may make (a GET is retried once after a read timeout)."""
        if self.deadline is None:
            return REQUEST_TIMEOUT_S
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self._timed_out()
        share = left / (RETRIES + 1)
        self._cut = share < REQUEST_TIMEOUT_S  # a timeout of this call is the deadline's
        return min(REQUEST_TIMEOUT_S, share)

    def _call(
        self,
        verb: str,
        resource: str,
        name: str | None,
        call: Callable[[], T],
        singular: str | None = None,
    ) -> T:
        try:
            return call()
        except ApiException as exc:
            if self.deadline is not None and time.monotonic() >= self.deadline:
                raise self._timed_out() from exc
            if exc.status == 404 and resource == RESOURCE and not self._crd_served():
                raise CliError(
                    f"the ModelDeployment CRD is not installed: the API at {self.host} serves "
                    f"no {RESOURCE}/{VERSION} (install deploy/crds/modeldeployment.yaml or the "
                    "Helm chart)"
                ) from exc
            raise api_error(
                exc.status, exc.body, verb, resource, self.namespace, name, singular
            ) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            if self.deadline is not None and (
                time.monotonic() >= self.deadline or (self._cut and _is_timeout(exc))
            ):  # out of time, or of the part of it this call was given
                raise self._timed_out() from exc
            raise CliError(
                f"cannot reach the Kubernetes API at {self.host}: {_root_cause(exc)} "
                "(is the cluster up, and is this the right kubeconfig context?)",
                transient=True,
            ) from exc

    def _crd_served(self) -> bool:
        """Discovery lists ModelDeployments (a 404 of one is then of the object, not of
        its kind); when discovery cannot tell, assume so (the plain "not found")."""
        try:
            found = self.custom.get_api_resources(
                GROUP, VERSION, _request_timeout=self._request_timeout()
            )
        except ApiException as exc:
            return exc.status != 404
        except (urllib3.exceptions.HTTPError, OSError):
            return True
        return any(r.name == PLURAL for r in getattr(found, "resources", None) or [])

    def get(self, name: str) -> dict[str, Any]:
        """A ModelDeployment as the API holds it."""
        return _object(
            self._call(
                "get",
                RESOURCE,
                name,
                lambda: self.custom.get_namespaced_custom_object(
                    GROUP,
                    VERSION,
                    self.namespace,
                    PLURAL,
                    name,
                    _request_timeout=self._request_timeout(),
                ),
                SINGULAR,
            )
        )

    def patch(
        self,
        name: str,
        patch: dict[str, Any],
        read: dict[str, Any] | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """A JSON merge patch (RFC 7386) of a ModelDeployment; its new state. ``read``:
        the state the patch was decided on; the API refuses the patch (409) if the
        resource changed since (its ``resourceVersion``). ``dry_run``: the API server
        checks it all (schema, admission, RBAC) and stores nothing."""
        version = ((read or {}).get("metadata") or {}).get("resourceVersion")
        if version is not None:
            meta = {**(patch.get("metadata") or {}), "resourceVersion": version}
            patch = {**patch, "metadata": meta}
        return _object(
            self._call(
                "patch",
                RESOURCE,
                name,
                lambda: self.custom.patch_namespaced_custom_object(
                    GROUP,
                    VERSION,
                    self.namespace,
                    PLURAL,
                    name,
                    patch,
                    _content_type=MERGE_PATCH,
                    _request_timeout=self._request_timeout(),
                    dry_run="All" if dry_run else None,
                ),
                SINGULAR,
            )
        )

    def patch_read(
        self,
        name: str,
        decide: Callable[[dict[str, Any]], dict[str, Any]],
        dry_run: bool = False,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Read, decide the patch on what was read (``decide`` may refuse), write it only
        if nothing changed since; on a conflict (the operator's status writes change the
        resource too) once more from a new read. (The state decided on, the new state.)"""
        for attempt in (1, 2):
            md = self.get(name)
            try:
                return md, self.patch(name, decide(md), read=md, dry_run=dry_run)
            except CliError as exc:
                if not exc.conflict or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def deployments(self, all_namespaces: bool = False) -> list[dict[str, Any]]:
        """The ModelDeployments of the namespace, or of every namespace the user may list."""
        if all_namespaces:
            answer = self._call(
                "list",
                RESOURCE,
                None,
                lambda: self.custom.list_cluster_custom_object(
                    GROUP,
                    VERSION,
                    PLURAL,
                    _request_timeout=self._request_timeout(),
                    _preload_content=False,
                ),
            )
        else:
            answer = self._call(
                "list",
                RESOURCE,
                None,
                lambda: self.custom.list_namespaced_custom_object(
                    GROUP,
                    VERSION,
                    self.namespace,
                    PLURAL,
                    _request_timeout=self._request_timeout(),
                    _preload_content=False,
                ),
            )
        return _items(answer)

    def pods(self, name: str) -> list[dict[str, Any]]:
        """The pods the operator runs for ModelDeployment ``name``."""
        answer = self._call(
            "list",
            "pods",
            None,
            lambda: self.core.list_namespaced_pod(
                self.namespace,
                label_selector=f"{DEPLOYMENT_LABEL}={name}",
                _request_timeout=self._request_timeout(),
                _preload_content=False,
            ),
        )
        return _items(answer)

    def events(self, name: str) -> list[dict[str, Any]]:
        """The Events about ModelDeployment ``name``, oldest first."""
        answer = self._call(
            "list",
            "events",
            None,
            lambda: self.core.list_namespaced_event(
                self.namespace,
                field_selector=f"involvedObject.name={name}",
                _request_timeout=self._request_timeout(),
                _preload_content=False,
            ),
        )
        kinds = (None, "ModelDeployment")  # a pod may share the name; its events are not ours
        ours = [e for e in _items(answer) if (e.get("involvedObject") or {}).get("kind") in kinds]
        return sorted(ours, key=event_time)

    def close(self) -> None:
        self.api.close()


def _object(answer: object) -> dict[str, Any]:
    if not isinstance(answer, dict):
        raise CliError(f"the Kubernetes API sent {type(answer).__name__}, not an object")
    return answer


def _items(answer: Any) -> list[dict[str, Any]]:
    """The items of a list answer read as plain JSON (no model classes: what the API
    sends is shown as it is, fields newer than this client included)."""
    try:
        raw = json.loads(answer.data)
    except (ValueError, AttributeError) as exc:
        raise CliError(f"the Kubernetes API sent a list that is not JSON: {exc}") from exc
    items = raw.get("items") if isinstance(raw, dict) else None
    return [i for i in items or [] if isinstance(i, dict)]


def event_time(event: dict[str, Any]) -> str:
    meta = event.get("metadata") or {}
    return str(
        event.get("lastTimestamp")
        or event.get("eventTime")
        or event.get("firstTimestamp")
        or meta.get("creationTimestamp")
        or ""
    )


def _is_timeout(exc: BaseException) -> bool:
    """The failure is a timeout (urllib3 wraps it in its retry error)."""
    reason: object = exc
    while isinstance(reason, BaseException):
        if isinstance(reason, (urllib3.exceptions.TimeoutError, TimeoutError)):
            return True
        reason = getattr(reason, "reason", None)
    return False


def _root_cause(exc: BaseException) -> str:
    """``Connection refused`` rather than urllib3's retry wrapper around it."""
    reason = getattr(exc, "reason", None)
    while isinstance(reason, BaseException) and getattr(reason, "reason", None) is not None:
        reason = getattr(reason, "reason", None)
    text = str(reason or exc)
    return "connection refused" if "refused" in text.lower() else text
