"""Inline the core types' schemas, as a real API server serves them, into the CRD.

``spec.pod`` and ``spec.resources`` take fields of a pod spec as they are (tolerations,
affinity, topology spread, image pull secrets, a container's resources). Their schemas
are not written by hand: this reads ``/openapi/v3/api/v1`` of an API server and writes
each field's schema, made structural, between its marker comments in the CRD:

    # core: io.k8s.api.core.v1.PodSpec.tolerations
    ...
    # end core

Made structural (a CRD's schema may not refer or branch): each ``$ref`` (and the
``allOf: [$ref]`` wrapping one) replaced by what it names; descriptions dropped (the CRD
stays readable; the field's own description is the CRD's, above the markers); the
strategic-merge markers a CRD does not take dropped (``x-kubernetes-patch-*``); the
defaults dropped (the Go types' zero values, which a CRD refuses where they are no valid
value), so a list-map's keys are required instead (an image pull secret's name); a
Quantity (``oneOf`` string or number) written as controller-gen writes it, an integer
or a string of Kubernetes' quantity pattern. The list and map markers
(``x-kubernetes-list-type``, ``-list-map-keys``, ``-map-type``), enums and formats
stay. ``tests/deploy/test_core_schemas.py`` compares the CRD with what the session's API
server serves, so that the two cannot drift apart.

    python tools/core_schemas.py                 # kubectl's current context
    python tools/core_schemas.py --from FILE     # a saved /openapi/v3/api/v1
    python tools/core_schemas.py --check         # exit 1 if the CRD differs
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CRDS = (
    ROOT / "deploy" / "crds" / "modeldeployment.yaml",
    ROOT / "deploy" / "helm" / "model-rollout" / "crds" / "modeldeployment.yaml",
)
OPENAPI_PATH = "/openapi/v3/api/v1"
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
# Kubernetes' quantity, as controller-gen writes it into CRDs
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
# descriptions (readability), the strategic-merge markers a CRD does not take, and the
# defaults: the served ones are the Go types' zero values ("", 0, {}), which a CRD
# refuses where they are no valid value (an operator of ""), and the Deployment's own
# defaulting applies Kubernetes' real ones
DROPPED = {
    "description", "x-kubernetes-patch-strategy", "x-kubernetes-patch-merge-key", "default",
}  # fmt: skip
# the CRD's fields that are core types: (path under the spec, type, property of it or
# None for the type itself, the properties kept or None for all)
FRAGMENTS: tuple[tuple[str, str, str | None, tuple[str, ...] | None], ...] = (
    ("pod.nodeSelector", "io.k8s.api.core.v1.PodSpec", "nodeSelector", None),
    ("pod.tolerations", "io.k8s.api.core.v1.PodSpec", "tolerations", None),
    ("pod.affinity", "io.k8s.api.core.v1.PodSpec", "affinity", None),
    ("pod.topologySpreadConstraints", "io.k8s.api.core.v1.PodSpec", "topologySpreadConstraints",
     None),
    ("pod.imagePullSecrets", "io.k8s.api.core.v1.PodSpec", "imagePullSecrets", None),
    # a container's limits and requests (claims need the pod's resourceClaims: not offered)
    ("resources.sidecar", "io.k8s.api.core.v1.ResourceRequirements", None, ("limits", "requests")),
    ("resources.prefetch", "io.k8s.api.core.v1.ResourceRequirements", None,
     ("limits", "requests")),
)  # fmt: skip
MARKER = re.compile(r"^(?P<indent> *)# core: (?P<name>\S+)\n", re.MULTILINE)
END = "# end core"


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def structural(node: Any, schemas: dict[str, Any]) -> Any:
    """``node`` with every reference resolved and the rest made fit for a CRD."""
    if isinstance(node, list):
        return [structural(n, schemas) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    refs = []
    if "$ref" in node:
        refs.append(node.pop("$ref"))
    all_of = node.get("allOf")
    if isinstance(all_of, list) and all_of and all(set(a) == {"$ref"} for a in all_of):
        refs += [a["$ref"] for a in node.pop("allOf")]
    for ref in refs:
        name = _ref_name(ref)
        if name == QUANTITY:
            target = {
                "anyOf": [{"type": "integer"}, {"type": "string"}],
                "x-kubernetes-int-or-string": True,
                "pattern": QUANTITY_PATTERN,
            }
        else:
            target = structural(schemas[name], schemas)
        node = {**target, **node}
    out = {k: structural(v, schemas) for k, v in node.items() if k not in DROPPED}
    keys = out.get("x-kubernetes-list-map-keys")
    if keys and isinstance(out.get("items"), dict):  # a map's keys: required, or defaulted
        items = out["items"]
        required = list(items.get("required") or [])
        items["required"] = required + [k for k in keys if k not in required]
    return out


def fragment(openapi: dict[str, Any], type_name: str, prop: str | None,
             keep: tuple[str, ...] | None) -> dict[str, Any]:  # fmt: skip
    """One CRD field's schema from the served document."""
    schemas = openapi["components"]["schemas"]
    node = schemas[type_name]
    if prop is not None:
        node = node["properties"][prop]
    out = structural(node, schemas)
    if keep is not None:
        out["properties"] = {k: v for k, v in out["properties"].items() if k in keep}
    return dict(out)


def fragments(openapi: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each marked field's schema, by its marker's name (``Type.property``)."""
    return {marker(t, p): fragment(openapi, t, p, k) for _, t, p, k in FRAGMENTS}


def marker(type_name: str, prop: str | None) -> str:
    return f"{type_name}.{prop}" if prop else type_name


def rewrite(text: str, schemas: dict[str, dict[str, Any]]) -> str:
    """The CRD's text with each marked block written anew (nothing else changes)."""
    out, at = [], 0
    for found in MARKER.finditer(text):
        if found.start() < at:
            continue
        indent, name = found["indent"], found["name"]
        end = text.index(f"{indent}{END}\n", found.end())
        body = yaml.safe_dump(schemas[name], sort_keys=True, width=100, default_flow_style=None)
        block = "".join(f"{indent}{line}\n" for line in body.splitlines())
        out += [text[at : found.end()], block]
        at = end
    out.append(text[at:])
    return "".join(out)


def served(kubeconfig: str | None) -> dict[str, Any]:
    """``/openapi/v3/api/v1`` of the API server of ``kubeconfig`` (else kubectl's own)."""
    args = ["kubectl", *(["--kubeconfig", kubeconfig] if kubeconfig else [])]
    answer = subprocess.run(
        [*args, "get", "--raw", OPENAPI_PATH], check=True, capture_output=True, text=True
    )
    loaded: dict[str, Any] = json.loads(answer.stdout)
    return loaded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", help="the API server to ask (default: kubectl's)")
    parser.add_argument("--from", dest="source", type=Path, help="a saved /openapi/v3/api/v1")
    parser.add_argument("--check", action="store_true", help="only say whether the CRD differs")
    args = parser.parse_args(argv)
    openapi = json.loads(args.source.read_text()) if args.source else served(args.kubeconfig)
    schemas = fragments(openapi)
    stale = []
    for crd in CRDS:
        text = crd.read_text()
        new = rewrite(text, schemas)
        if new != text:
            stale.append(crd)
            if not args.check:
                crd.write_text(new)
    for crd in stale:
        print(f"{crd.relative_to(ROOT)}: {'differs' if args.check else 'rewritten'}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
