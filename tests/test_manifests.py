"""Every YAML we ship is checked: kubernetes-validate against the Kubernetes schemas, real
kubectl (client dry-run, with an emulated API server for discovery), the Helm chart
rendered and linted by real Helm (with its default values and each example's values),
and ModelDeployments against the CRD's own openAPIV3Schema."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from helm_chart import lint_chart, render_chart
from model_operator.manifests import children
from model_operator.spec import SpecError, parse_spec
from model_rollout_e2e.binaries import BinaryNotFound, kubectl_binary
from model_rollout_e2e.kube_emulator import kube_emulator

ROOT = Path(__file__).parent.parent
CRD = ROOT / "deploy" / "crds" / "modeldeployment.yaml"
CHART = ROOT / "deploy" / "helm" / "model-rollout"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
CHART_VALUES = {"defaults": {}} | {  # the chart's defaults, then each example's values
    p.name: yaml.safe_load(p.read_text()) for p in sorted(ROOT.glob("examples/helm/*.yaml"))
}
K8S_VERSION = "1.37.0"


def load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def openapi_to_jsonschema(node: Any) -> Any:
    """OpenAPI v3 (Kubernetes flavour) -> JSON Schema: ``nullable`` becomes a null type."""
    if isinstance(node, list):
        return [openapi_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: openapi_to_jsonschema(v) for k, v in node.items() if not k.startswith("x-")}
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def cr_schema() -> dict[str, Any]:
    [crd] = load_all(CRD)
    [version] = crd["spec"]["versions"]
    return openapi_to_jsonschema(version["schema"]["openAPIV3Schema"])


def rendered_chart(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return render_chart(CHART, values)


def operator_children() -> list[dict[str, Any]]:
    [example] = [d for d in load_all(EXAMPLES[0])]
    spec = parse_spec(example["spec"])
    return children("resnet", "ml-serving", spec, spec.version)


def k8s_objects() -> list[tuple[str, dict[str, Any]]]:
    objects = [("crd", d) for d in load_all(CRD)]
    for values_name, values in CHART_VALUES.items():
        objects += [(f"chart[{values_name}]:{d['kind']}", d) for d in rendered_chart(values)]
    objects += [(f"operator:{d['kind']}", d) for d in operator_children()]
    return objects


@pytest.mark.parametrize(
    ("where", "obj"), k8s_objects(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_kubernetes_schema(where: str, obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_chart_ships_the_same_crd() -> None:
    assert (CHART / "crds" / CRD.name).read_text() == CRD.read_text()
    crds = [d for d in rendered_chart() if d["kind"] == "CustomResourceDefinition"]
    assert crds == load_all(CRD)  # and Helm installs it from there


def test_example_values_exist() -> None:
    assert len(CHART_VALUES) >= 3, "examples/helm/*.yaml: chart values to render and lint"


@pytest.mark.parametrize("values_name", CHART_VALUES)
def test_helm_lint_is_clean(values_name: str) -> None:
    assert lint_chart(CHART, CHART_VALUES[values_name]) == []


@pytest.mark.parametrize("values_name", CHART_VALUES)
def test_chart_renders_what_the_values_ask(values_name: str) -> None:
    values = CHART_VALUES[values_name]
    docs = rendered_chart(values)
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    namespaces = [args[i + 1] for i, arg in enumerate(args) if arg == "--namespace"]
    assert namespaces == list(values.get("watchNamespaces") or [])
    assert ("--no-store-check" in args) == (values.get("storeCheck") is False)
    assert args[args.index("--interval") + 1] == str(values.get("interval", 30))
    secret = values.get("storeCredentialsSecret")
    assert container.get("envFrom", []) == ([{"secretRef": {"name": secret}}] if secret else [])
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    watched = set(values.get("watchNamespaces") or [])
    operator_bindings = [b for b in bindings if b["roleRef"]["kind"] == "ClusterRole"]
    assert {b["metadata"]["namespace"] for b in operator_bindings} == watched
    # leader election: a Lease, in the release's namespace, and nothing else
    [election] = [d for d in docs if d["kind"] == "Role"]
    assert election["metadata"]["namespace"] == "model-rollout-system"
    assert election["rules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["get", "create", "patch", "update"],
        }
    ]
    assert "--leader-election" in args and deployment["spec"]["replicas"] >= 2


def test_helm_refuses_values_of_the_wrong_shape() -> None:
    import helm_python as helm

    with pytest.raises(helm.HelmRenderError, match="image"):
        rendered_chart({"image": "not-a-map"})


def test_chart_rbac_is_least_privilege() -> None:
    docs = rendered_chart()
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
    verbs = {verb for role in roles.values() for rule in role["rules"] for verb in rule["verbs"]}
    assert "delete" not in verbs and "*" not in verbs and "deletecollection" not in verbs
    # secrets: only get, for the store credentials a ModelDeployment names; never listed,
    # watched or written
    secret_verbs = {
        verb
        for role in roles.values()
        for rule in role["rules"]
        if "secrets" in rule["resources"]
        for verb in rule["verbs"]
    }
    assert secret_verbs == {"get"}
    namespaced = rendered_chart({"watchNamespaces": ["a"]})
    assert {d["kind"] for d in namespaced} >= {"RoleBinding", "ClusterRoleBinding"}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_match_crd_schema_and_operator(example: Path) -> None:
    for doc in load_all(example):
        jsonschema.validate(doc, cr_schema())
        parse_spec(doc["spec"])  # the operator accepts it too


BAD_SPECS = {
    "negative replicas": {"replicas": -1},
    "canary over 100%": {"canary": {"percent": 150}},
    "both batch settings": {"rollout": {"batchSize": 1, "batchPercent": 10}},
    "version with a slash": {"version": "../v2"},
    "two stores": {"store": {"url": "s3://bucket/p", "pvc": "claim"}},
    "no store": {"store": {}},
    "unknown backend": {"backend": "tensorflow"},
    "zero retained": {"retainVersions": 0},
}


@pytest.mark.parametrize("change", BAD_SPECS.values(), ids=BAD_SPECS.keys())
def test_bad_specs_are_rejected_by_schema_and_operator(change: dict[str, Any]) -> None:
    [doc] = load_all(EXAMPLES[0])
    bad = copy.deepcopy(doc)
    bad["spec"].update(change)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, cr_schema())
    with pytest.raises(SpecError):
        parse_spec(bad["spec"])


async def _kubectl(server: str, path: Path) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        kubectl_binary(),
        f"--server={server}",
        "--request-timeout=20s",
        "apply",
        "--dry-run=client",
        "--validate=false",
        "-o",
        "json",
        "-f",
        str(path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode()


async def test_kubectl_parses_everything(tmp_path: Path) -> None:
    try:
        kubectl_binary()
    except BinaryNotFound as exc:
        pytest.skip(str(exc))
    files = [CRD, *EXAMPLES]
    charts = []
    for values_name, values in CHART_VALUES.items():
        charts.append(tmp_path / f"chart-{values_name}")
        charts[-1].write_text(yaml.safe_dump_all(rendered_chart(values)))
    children_out = tmp_path / "children.yaml"
    children_out.write_text(yaml.safe_dump_all(operator_children()))
    async with kube_emulator() as api:
        for path in [*files, *charts, children_out]:
            code, out = await _kubectl(api.url, path)
            assert code == 0, f"{path.name}: {out}"
            parsed = json.loads(out)
            items = parsed.get("items", [parsed])
            assert len(items) == len(load_all(path)), path.name


def _maybe(strategy):  # type: ignore[no-untyped-def]
    from hypothesis import strategies as st

    return st.one_of(st.none(), strategy)


def _spec_strategy():  # type: ignore[no-untyped-def]
    from hypothesis import strategies as st

    ints = st.integers(-3, 1200)
    numbers = st.one_of(st.integers(-5, 4000), st.floats(-5, 4000, allow_nan=False))
    names = st.sampled_from(["m", "resnet50", "v2", "2026-11-30", "a_b.c", "../x", "", "-x"])
    return st.fixed_dictionaries(
        {
            "model": names,
            "version": names,
            "image": st.sampled_from(["img:1", ""]),
        },
        optional={
            "replicas": ints,
            "backend": st.sampled_from(["tensorrt", "onnxruntime", "torch", "tf"]),
            "precision": st.sampled_from(["fp32", "fp16", "int8", "bf16"]),
            "retainVersions": ints,
            "store": st.sampled_from(
                [
                    {"url": "s3://bucket/p"},
                    {"pvc": "c"},
                    {},
                    {"url": "s3://bucket", "pvc": "c"},
                    {"url": "http://x"},
                ]
            ),
            "resources": st.fixed_dictionaries({}, optional={"gpu": ints}),
            "canary": st.fixed_dictionaries(
                {},
                optional={"percent": ints, "pauseSeconds": numbers, "manualPromote": st.booleans()},
            ),
            "rollout": st.fixed_dictionaries(
                {},
                optional={
                    "batchSize": ints,
                    "batchPercent": ints,
                    "jitterSeconds": numbers,
                    "maxUnavailable": ints,
                    "maxConcurrentLoads": ints,
                    "progressDeadlineSeconds": numbers,
                },
            ),
        },
    )


def test_crd_schema_and_operator_agree() -> None:
    """Whatever the API server's schema accepts the operator accepts, and vice versa."""
    from hypothesis import given, settings

    schema = cr_schema()

    @settings(max_examples=400, deadline=None)
    @given(_spec_strategy())
    def check(spec: dict[str, Any]) -> None:
        spec.setdefault("store", {"url": "s3://bucket/p"})
        doc = {
            "apiVersion": "serving.model-rollout.io/v1alpha1",
            "kind": "ModelDeployment",
            "metadata": {"name": "x"},
            "spec": spec,
        }
        try:
            jsonschema.validate(doc, schema)
            schema_ok = True
        except jsonschema.ValidationError:
            schema_ok = False
        try:
            parse_spec(spec)
            operator_ok = True
        except SpecError:
            operator_ok = False
        assert schema_ok == operator_ok, spec

    check()


def test_store_credentials_are_passed_key_by_key_never_a_whole_secret() -> None:
    [example] = load_all(ROOT / "examples" / "modeldeployment.yaml")
    spec = parse_spec(example["spec"])
    assert spec.store.credentials_secret
    objects = children("resnet", "ml-serving", spec, spec.version)
    [deployment] = [d for d in objects if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    for container in [*pod["initContainers"], *pod["containers"]]:
        assert "envFrom" not in container, container["name"]
    sidecar = next(c for c in pod["containers"] if c["name"] == "sidecar")
    refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in sidecar["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert set(refs) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}
    assert {r["name"] for r in refs.values()} == {spec.store.credentials_secret}
