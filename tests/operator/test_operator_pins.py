"""Issue 29, replays: when a rollout of a version starts, the operator pins the publish
sequence of the version's manifest in the store (``status.pinnedSequences``) and gives
it to the pods (their annotation, and the ConfigMap for pods not annotated yet), so that
a sidecar on an empty volume refuses an older build written back into the store later.

The operator process on the session's real control plane with a simulated node, as in
``test_operator_rollouts`` (:mod:`rollout_cluster`); the store is a real S3
(SeaweedFS)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from model_operator.manifests import children
from model_operator.spec import SpecError, parse_spec
from model_rollout_contract.annotations import TARGET_VERSION
from model_rollout_contract.manifest import Manifest
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.onnx_models import write_mlp
from model_sidecar.config import InitConfig, WatchConfig, parse_args
from model_sidecar.publish import publish
from model_sidecar.store import S3Store, read_object
from tests.support.crd_validation import ResourceSchema
from tests.support.rollout_cluster import RolloutCluster
from tests.support.sidecar import make_keys, publish_versions

FILES = ("model.onnx", "manifest.sig", "manifest.json")
ROOT = Path(__file__).resolve().parents[2]
PINNED_SEQUENCES = "serving.model-rollout.io/pinned-sequences"  # the pods' annotation


def sequence(store: S3Store, version: str) -> int:
    found = Manifest.from_bytes(read_object(store, f"mlp/{version}/manifest.json", 1 << 20))
    assert found.sequence is not None
    return found.sequence


async def pod_pins(cluster: RolloutCluster) -> list[tuple[str | None, dict[str, int]]]:
    """Each pod's target and pins, as its annotations say."""
    found = []
    for pod in await cluster.items("pods"):
        annotations = pod["metadata"].get("annotations") or {}
        pins = json.loads(annotations[PINNED_SEQUENCES]) if PINNED_SEQUENCES in annotations else {}
        found.append((annotations.get(TARGET_VERSION), pins))
    return found


@pytest.mark.slow  # a whole operator loop with a node
async def test_the_sequence_of_a_rollout_is_pinned_in_status_pods_and_configmap(
    bare_cluster: RolloutCluster, s3_env: Any, tmp_path: Path
) -> None:
    cluster = bare_cluster  # a namespace no operator runs for: the test starts its own
    s3_env.create_bucket("models")
    store = S3Store("models", f"pin-{uuid.uuid4().hex[:8]}", endpoint_url=s3_env.endpoint)
    keys = make_keys(tmp_path / "keys")
    publish_versions(store, keys, tmp_path, {"v1": 1, "v2": 2})
    first_v2 = {name: read_object(store, f"mlp/v2/{name}", 1 << 26) for name in FILES}
    rebuilt = tmp_path / "rebuilt" / "model.onnx"
    write_mlp(rebuilt, 22, in_dim=8)
    publish(store, "mlp", "v2", rebuilt, keys.private, force=True)  # v2's newer build
    # the pods' key: the operator pins only what it verifies with it
    secret = {"metadata": {"name": "model-signing-key"},
              "stringData": {"public.pem": keys.public.read_text()}}  # fmt: skip
    await cluster.core.create_namespaced_secret(cluster.namespace, secret)
    body = {
        "metadata": {"name": "mlp"},
        "spec": {
            "model": "mlp", "version": "v1", "image": "registry.example/model-server:0.1",
            "replicas": 2, "backend": "onnxruntime",
            "store": {"url": f"s3://models/{store.prefix}", "endpoint": s3_env.endpoint},
            "rollout": {"batchSize": 1, "jitterSeconds": 0},
            "signingPublicKeySecret": "model-signing-key",
        },
    }  # fmt: skip
    cluster.run_pods()
    cluster.start_operator()
    await cluster.create(body)

    def available(version: str) -> Any:
        return lambda s: s.get("phase") == "Available" and s.get("currentVersion") == version

    status = await cluster.wait(available("v1"))
    v1 = {"v1": sequence(store, "v1")}
    assert status["pinnedSequences"] == v1
    assert await pod_pins(cluster) == [("v1", v1), ("v1", v1)]

    await cluster.patch({"spec": {"version": "v2"}})
    status = await cluster.wait(available("v2"))
    pinned = {**v1, "v2": sequence(store, "v2")}  # the newer build's
    assert pinned["v2"] > Manifest.from_bytes(first_v2["manifest.json"]).sequence  # type: ignore[operator]
    assert status["pinnedSequences"] == pinned
    assert await pod_pins(cluster) == [("v2", pinned), ("v2", pinned)]
    configmap = await cluster.get("config_map", "mlp-rollout")
    assert configmap is not None and configmap["data"]["target-version"] == "v2"
    assert json.loads(configmap["data"]["pinned-sequences"]) == pinned

    for name, data in first_v2.items():  # the older build written back: a replay
        store.write(f"mlp/v2/{name}", data)
    await cluster.patch({"spec": {"version": "v1"}})  # and back
    await cluster.wait(available("v1"))
    await cluster.patch({"spec": {"version": "v2"}})
    status = await cluster.wait(available("v2"))
    assert status["pinnedSequences"] == pinned  # the pin never goes back to the replay


# --- spec.store.id, and what the pods are given ---------------------------------------


def example() -> dict[str, Any]:
    [doc] = yaml.safe_load_all((ROOT / "examples" / "modeldeployment.yaml").read_text())
    return dict(doc)


@pytest.mark.parametrize(
    ("store", "accepted"),
    [
        ({"pvc": "models", "id": "team-a"}, True),
        ({"pvc": "models", "id": "models.prod-2"}, True),
        ({"pvc": "models"}, True),
        ({"url": "s3://models/team-a", "id": "team-a"}, False),  # S3: named by its URL
        ({"pvc": "models", "id": "Team-A"}, False),
        ({"pvc": "models", "id": "a" * 64}, False),
        ({"pvc": "models", "id": ""}, False),
        ({"pvc": "models", "id": 7}, False),
    ],
)
def test_the_store_id_is_validated_by_the_schema_and_the_operator(
    store: dict[str, Any], accepted: bool
) -> None:
    doc = example()
    doc["spec"]["store"] = store
    schema = ResourceSchema.load(ROOT / "deploy" / "crds" / "modeldeployment.yaml")
    assert (not schema.problems(doc)) == accepted, schema.problems(doc)
    if accepted:
        assert parse_spec(doc["spec"]).store.id == store.get("id")
    else:
        with pytest.raises(SpecError, match=r"spec\.store\.id"):
            parse_spec(doc["spec"])


def test_pinned_sequences_in_the_status_are_validated_by_the_schema() -> None:
    schema = ResourceSchema.load(ROOT / "deploy" / "crds" / "modeldeployment.yaml")
    doc = example()
    for pins, accepted in (
        ({"v1": 1764700000123456789, "v2": 0}, True),
        ({"v1": -1}, False),
        ({"v1": "17"}, False),
        ({f"v{i}": i for i in range(33)}, False),
    ):
        doc["status"] = {"pinnedSequences": pins}
        assert (not schema.problems(doc)) == accepted, pins


def test_the_pods_get_the_store_id_and_the_configmaps_pins() -> None:
    """Every sidecar (init and watch, the deployment's and a tenant's) names the store as
    the publisher did and reads its track's pins from the ConfigMap."""
    doc = example()
    doc["spec"]["store"] = {"pvc": "models", "id": "team-a"}
    doc["spec"]["tenants"] = {
        "secretName": "tenants",
        "models": [{"name": "acme-mlp", "tenant": "acme", "model": "mlp", "version": "v1"}],
    }
    spec = parse_spec(doc["spec"])
    pins = {None: {"v2": 20, "v1": 10}, "acme-mlp": {"v1": 11}}
    objects = children("resnet", "ns", spec, "v2", {"acme-mlp": "v1"}, pins)
    [cm] = [o for o in objects if o["kind"] == "ConfigMap"]
    assert json.loads(cm["data"]["pinned-sequences"]) == {"v1": 10, "v2": 20}
    assert json.loads(cm["data"]["pinned-sequences.acme-mlp"]) == {"v1": 11}
    [deployment] = [o for o in objects if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    sidecars = [c for c in pod["initContainers"] + pod["containers"] if c["name"] != "server"]
    assert len(sidecars) == 4
    for container in sidecars:
        config = parse_args(container["args"][1:])  # as the sidecar reads its command line
        assert isinstance(config, InitConfig | WatchConfig)
        assert config.fetch.store.store_id == "team-a"
        key = "pinned-sequences" + (".acme-mlp" if config.fetch.track else "")
        assert str(config.fetch.pins_file) == f"/etc/model-rollout/config/{key}"


def test_a_release_to_a_store_with_another_id_is_refused_before_publishing(
    tmp_path: Path,
) -> None:
    """Published with another id (or none), every pod would refuse the version."""
    from model_rollout_cli.errors import USAGE, CliError
    from model_rollout_cli.release import _check, build_parser

    md = {"spec": {"model": "mlp", "store": {"pvc": "models", "id": "team-a"}}}
    line = ["release", "--model", "mlp", "--version", "v2", "--file", "m.onnx", "--key", "k",
            "--deployment", "mlp", "--store", "file:///mnt/models"]  # fmt: skip
    for extra in ([], ["--store-id", "team-b"]):
        with pytest.raises(CliError) as info:
            _check(build_parser().parse_args([*line, *extra]), md)
        assert info.value.code == USAGE and "--store-id team-a" in str(info.value)
    _check(build_parser().parse_args([*line, "--store-id", "team-a"]), md)


def test_a_real_api_server_enforces_the_store_id_and_the_pins(
    control_plane: ControlPlane,
) -> None:
    """The API server's own answer to the new fields (the CEL rule, the status schema)."""
    admin = control_plane.kubectl
    crd = ROOT / "deploy" / "crds" / "modeldeployment.yaml"
    admin("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    admin("wait", "--for=condition=Established", "--timeout=60s", "-f", str(crd))
    namespace = f"pins-{uuid.uuid4().hex[:8]}"
    admin("create", "namespace", namespace)
    doc = example()
    doc["metadata"] = {"name": "resnet", "namespace": namespace}
    doc["spec"]["store"] = {"url": "s3://models-prod/vision", "id": "team-a"}
    refused = admin.run("apply", "-f", "-", stdin=json.dumps(doc))
    assert refused.code != 0
    assert "spec.store.id names a volume store (pvc)" in refused.err, refused.err
    doc["spec"]["store"] = {"pvc": "models", "id": "team-a"}
    admin.apply(doc)
    assert admin.get("md", "resnet", "-n", namespace)["spec"]["store"]["id"] == "team-a"

    def patch_status(pins: dict[str, Any]) -> Any:
        body = json.dumps({"status": {"pinnedSequences": pins}})
        return admin.run(
            "patch", "md", "resnet", "-n", namespace, "--subresource=status",
            "--type=merge", "-p", body,
        )  # fmt: skip

    assert patch_status({"v1": 1764700000123456789}).code == 0
    bad = patch_status({"v2": -5})
    assert bad.code != 0 and "pinnedSequences.v2" in bad.err, bad.err
    stored = admin.get("md", "resnet", "-n", namespace)["status"]["pinnedSequences"]
    assert stored == {"v1": 1764700000123456789}  # an int64 kept exactly
