"""Running the day-2 tools as a user does: their console scripts as processes, with a
kubeconfig naming the API server and a namespace.

On the real control plane (``control_plane``, issue 28): the CRD and the chart's user
roles installed once (:func:`install_tools`), a namespace per test, users as
ServiceAccounts bound to a role the way the README binds them (``kubectl create
rolebinding --clusterrole=...``), the cluster's admin on the test's loop (:class:`Admin`)
to write what the operator would (a status) and read what the tools wrote, and proxies
in front of the API server for the faults a real server does not give on demand (a 500)
or to record what the tools sent."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import ssl
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config

from model_operator import admission_policy, editor_policy
from model_rollout_cli.kube import GROUP, PLURAL, VERSION
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.identities import Identity
from model_rollout_e2e.processes import free_port, wait_until
from tests.support.helm_chart import RELEASE, render_chart
from tests.support.namespaces import namespace_of_its_own

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "model-rollout"
CRD = ROOT / "deploy" / "crds" / "modeldeployment.yaml"
BIN = Path(sys.executable).parent  # the venv's scripts: kubectl-model, model-rollout
TOOL_TIMEOUT_S = 600.0  # a hang guard only
# two tenants' models of one deployment, as `spec.tenants.models` lists them
TENANT_MODELS = [
    {"name": "acme-mlp", "tenant": "acme", "model": "mlp", "version": "a2"},
    {"name": "globex-mlp", "tenant": "globex", "model": "mlp", "version": "g1"},
]
USER_ROLES = {"userRoles": {"create": True}}  # the chart's values that install them
VIEWER, EDITOR, OWNER = f"{RELEASE}-viewer", f"{RELEASE}-rollout-editor", f"{RELEASE}-owner"
# what every ModelDeployment needs besides (the CRD requires an image, a store and a key)
REQUIRED_SPEC = {
    "image": "registry.example.com/model-server:0.1.0",
    "store": {"pvc": "models"},
    "signingPublicKeySecret": "model-signing-key",
}


def interruptible() -> None:
    """A child's ``preexec_fn``: SIGINT at its default, as a terminal's foreground job has
    it, so that Python turns it into KeyboardInterrupt. A test run as a background job of
    a shell without job control (``make test &``) inherits SIGINT ignored, and so would
    the tool it starts (Python installs no handler for an ignored SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def run_tool(
    program: str, *args: str, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``program`` (a script beside the interpreter, or
    a path); it runs beside the test's event loop, which serves the proxies."""
    path = program if os.sep in program else str(BIN / program)
    proc = await asyncio.create_subprocess_exec(
        path,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "NO_COLOR": "1", **(env or {})},
    )
    out, err = await asyncio.wait_for(proc.communicate(), TOOL_TIMEOUT_S)
    return proc.returncode if proc.returncode is not None else -1, out.decode(), err.decode()


# ------------------------------------------------------------------ the real control plane


def user_roles(values: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """The chart's viewer, rollout-editor and owner ClusterRoles, by name, as Helm renders
    them."""
    docs = render_chart(CHART, USER_ROLES if values is None else values)
    names = {VIEWER, EDITOR, OWNER}
    return {d["metadata"]["name"]: d for d in docs if d["metadata"].get("name") in names}


def install_tools(cluster: ControlPlane) -> None:
    """The CRD (established), the chart's user roles (aggregated into view, edit and
    admin, the chart's default) and its editor admission policy (enforced), as ``helm
    install --set userRoles.create=true`` leaves them."""
    admin = cluster.kubectl
    admin("apply", "--server-side", "-f", str(CRD))
    admin("wait", "--for=condition=Established", "--timeout=60s", "-f", str(CRD))
    admin.apply(*user_roles().values())
    install_editor_policy(cluster)


def _install_policy(cluster: ControlPlane, objects: list[dict[str, Any]], name: str) -> None:
    """A policy and its binding, once the API server has type-checked it."""
    admin = cluster.kubectl
    admin.apply(*objects)

    def checked() -> bool:
        vap = admin.get("validatingadmissionpolicy", name)
        generation = vap["metadata"]["generation"]
        return bool(vap.get("status", {}).get("observedGeneration") == generation)

    wait_until(checked, 60, interval_s=0.5, what=f"the type check of {name}")


def install_sidecar_policy(cluster: ControlPlane) -> None:
    """The chart's sidecar admission policy: a (simulated) sidecar's writes are judged as
    in a cluster the chart installed."""
    _install_policy(cluster, admission_policy.objects(), admission_policy.POLICY_NAME)


EDITOR_POLICY_DENIAL = (
    f"ValidatingAdmissionPolicy '{editor_policy.POLICY_NAME}' with binding "
    f"'{editor_policy.POLICY_NAME}' denied request: "
)


def install_editor_policy(cluster: ControlPlane) -> None:
    """The chart's editor admission policy, installed and enforced: the API server's
    admission plugin has it once a rollout editor's server-side dry run of a label
    change is refused by it (a ModelDeployment and an editor in a namespace of their
    own, deleted afterwards), so that a test's editor is judged by it from the start."""
    _install_policy(cluster, editor_policy.objects(), editor_policy.POLICY_NAME)
    with namespace_of_its_own(cluster, "policy-probe") as namespace:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ModelDeployment",
                "metadata": {"name": "probe", "namespace": namespace},
                "spec": {**REQUIRED_SPEC, "model": "mlp", "version": "v1"}}  # fmt: skip
        cluster.kubectl.apply(body)
        editor = bound_user(cluster, namespace, "probe", EDITOR)
        probe = ["patch", "md", "probe", "--type=merge", "--dry-run=server",
                 "-p", '{"metadata": {"labels": {"probe": "1"}}}']  # fmt: skip
        wait_until(
            lambda: EDITOR_POLICY_DENIAL in editor.kubectl.run(*probe).err,
            60, interval_s=0.5, what="the editor policy to be enforced",
        )  # fmt: skip


def bound_user(
    cluster: ControlPlane,
    namespace: str,
    account: str,
    cluster_role: str | None = None,
    where: tuple[str, ...] = (),
) -> Identity:
    """The ServiceAccount ``namespace/account`` with a token in a kubeconfig whose
    context names ``namespace``, bound to ``cluster_role`` in its own namespace and in
    each of ``where`` as the README binds the tools' roles (``kubectl create rolebinding
    --clusterrole``); no binding at all without ``cluster_role``."""
    identity = cluster.service_account(namespace, account)
    if cluster_role is not None:
        for place in (namespace, *where):
            cluster.kubectl(
                "create", "rolebinding", f"{account}-{cluster_role}", "-n", place,
                f"--clusterrole={cluster_role}", f"--serviceaccount={namespace}:{account}",
            )  # fmt: skip
    return identity


def token_of(identity: Identity) -> str:
    config = yaml.safe_load(identity.kubeconfig.read_text())
    return str(config["users"][0]["user"]["token"])


def kubeconfig_through(identity: Identity, server: str, path: Path) -> Path:
    """``identity``'s kubeconfig with another server (a proxy's plain-HTTP URL)."""
    config = yaml.safe_load(identity.kubeconfig.read_text())
    config["clusters"][0]["cluster"] = {"server": server}
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


class Admin:
    """The cluster's admin on the test's loop (kubernetes_asyncio): writes what the
    operator and the cluster would (ModelDeployments, their status, pods) and reads
    what the tools wrote. ``async with Admin.connect(cluster, namespace) as admin:``."""

    def __init__(self, api: k8s.ApiClient, namespace: str) -> None:
        self.namespace = namespace
        self.custom: Any = k8s.CustomObjectsApi(api)
        self.core: Any = k8s.CoreV1Api(api)

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, cluster: ControlPlane, namespace: str) -> AsyncIterator[Admin]:
        configuration = k8s.Configuration()
        await k8s_config.load_kube_config(
            config_file=str(cluster.kubeconfig), client_configuration=configuration
        )
        async with k8s.ApiClient(configuration) as api:
            yield cls(api, namespace)

    async def create(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        """A ModelDeployment ``name`` with ``spec`` (and what the CRD requires)."""
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ModelDeployment",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": {**REQUIRED_SPEC, **spec},
        }
        created: dict[str, Any] = await self.custom.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, body
        )
        return created

    async def read(self, name: str = "mlp") -> dict[str, Any]:
        md: dict[str, Any] = await self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name
        )
        return md

    async def patch(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A merge patch of the ModelDeployment (its spec or metadata)."""
        md: dict[str, Any] = await self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name, patch,
            _content_type="application/merge-patch+json",
        )  # fmt: skip
        return md

    async def set_status(self, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """A merge patch of its status, as the operator writes it."""
        md: dict[str, Any] = await self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, PLURAL, name, {"status": status},
            _content_type="application/merge-patch+json",
        )  # fmt: skip
        return md

    async def create_pod(
        self, name: str, labels: dict[str, str], annotations: dict[str, str]
    ) -> None:
        """A pod with these labels and annotations (no node runs it: it stays Pending)."""
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": labels, "annotations": annotations},
            "spec": {"containers": [{"name": "server", "image": REQUIRED_SPEC["image"]}]},
        }
        await self.core.create_namespaced_pod(self.namespace, body)

    async def events(self) -> list[dict[str, Any]]:
        answer = await self.core.list_namespaced_event(self.namespace, _preload_content=False)
        return list(json.loads(await answer.read()).get("items") or [])

    async def when(
        self, ready: Callable[[dict[str, Any]], bool], name: str = "mlp"
    ) -> dict[str, Any]:
        """The resource once ``ready`` holds for it (what a tool wrote); a hang guard only."""

        async def poll() -> dict[str, Any]:
            while not ready(md := await self.read(name)):
                await asyncio.sleep(0.05)
            return md

        return await asyncio.wait_for(poll(), TOOL_TIMEOUT_S)


def api_ssl(cluster: ControlPlane) -> ssl.SSLContext:
    """What verifies the API server's certificate (no client certificate: a proxy
    forwards the user's token)."""
    return ssl.create_default_context(cafile=str(cluster.pki.ca.cert))


# ---------------------------------------------------------------------------- proxies


@contextlib.asynccontextmanager
async def intercepting_proxy(
    upstream: str,
    intercept: Callable[[web.Request], web.Response | None],
    tls: ssl.SSLContext | None = None,
    rewrite: Callable[[str], str] | None = None,
    before: Callable[[web.Request], Awaitable[None]] | None = None,
    answered: Callable[[web.Request, int], None] | None = None,
) -> AsyncIterator[str]:
    """An HTTP proxy in front of the API server at ``upstream`` (verified with ``tls``)
    that answers what ``intercept(request)`` gives, or forwards the request (its path
    and query through ``rewrite``) when it gives ``None``, with the user's own headers
    (a bearer token), once ``await before(request)`` has run; ``answered(request,
    status)`` is told each forwarded answer. Its URL."""
    session = aiohttp.ClientSession()

    async def forward(request: web.Request) -> web.StreamResponse:
        answer_here = intercept(request)
        if answer_here is not None:
            return answer_here
        if before is not None:
            await before(request)
        path = rewrite(request.path_qs) if rewrite is not None else request.path_qs
        async with session.request(
            request.method,
            upstream + path,
            headers={k: v for k, v in request.headers.items() if k.lower() != "host"},
            data=await request.read(),
            ssl=tls if tls is not None else True,
        ) as answer:
            if answered is not None:
                answered(request, answer.status)
            headers = {"Content-Type": answer.headers.get("Content-Type", "application/json")}
            return web.Response(status=answer.status, body=await answer.read(), headers=headers)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await session.close()


@contextlib.asynccontextmanager
async def flaky_proxy(
    upstream: str, fail: Callable[[str, str], int | None], tls: ssl.SSLContext | None = None
) -> AsyncIterator[str]:
    """An HTTP proxy in front of the API server at ``upstream`` that answers the status
    ``fail(method, path)`` picks (a Kubernetes ``Status``) instead of forwarding, and
    forwards when it picks ``None``: an API server failing over (500). Its URL."""

    def injected(request: web.Request) -> web.Response | None:
        status = fail(request.method, request.path)
        if status is None:
            return None
        body = {"kind": "Status", "code": status, "message": f"injected {status}"}
        return web.json_response(body, status=status)

    async with intercepting_proxy(upstream, injected, tls) as url:
        yield url
