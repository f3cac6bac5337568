"""Validate a custom resource as the API server does with the CRD's structural schema:
prune nulls, apply ``default:``s, check the OpenAPI schema (as JSON Schema, with
jsonschema) and evaluate the ``x-kubernetes-validations`` CEL rules (with the
``common-expression-language`` package), so that tests compare the operator with what a
cluster would accept, not with a weaker schema."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import cel
import jsonschema
import yaml


def load_crd_schema(crd_path: Path) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of the CRD's one version."""
    [crd] = [d for d in yaml.safe_load_all(crd_path.read_text()) if d]
    [version] = crd["spec"]["versions"]
    return dict(version["schema"]["openAPIV3Schema"])


def openapi_to_jsonschema(node: Any) -> Any:
    """OpenAPI v3 (Kubernetes flavour) -> JSON Schema: ``nullable`` becomes a null type,
    ``x-`` extensions go, and a pattern's closing ``$`` becomes ``\\Z``: Go's ``$`` matches
    only at the very end, Python's also before a final newline."""
    if isinstance(node, list):
        return [openapi_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: openapi_to_jsonschema(v) for k, v in node.items() if not k.startswith("x-")}
    if node.get("x-kubernetes-list-type") == "set":  # the API server refuses duplicates
        out["uniqueItems"] = True
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    pattern = out.get("pattern")
    if isinstance(pattern, str) and re.search(r"(?<!\\)\$$", pattern):
        out["pattern"] = pattern[:-1] + r"\Z"
    return out


def _nullable(schema: dict[str, Any]) -> bool:
    return bool(schema.get("nullable"))


def prune_and_default(schema: dict[str, Any], value: Any) -> Any:
    """What the API server stores: nulls of non-nullable fields dropped, then every absent
    field that has a ``default:`` set to it (and the defaults inside that default)."""
    if not isinstance(value, dict) or "properties" not in schema:
        return value
    out = {}
    for key, item in value.items():
        field = schema["properties"].get(key)
        if item is None and field is not None and not _nullable(field):
            continue
        out[key] = prune_and_default(field, item) if field is not None else item
    for key, field in schema["properties"].items():
        if key not in out and "default" in field:
            out[key] = prune_and_default(field, copy.deepcopy(field["default"]))
    return out


def _as_cel(schema: dict[str, Any], value: Any) -> Any:
    """CEL sees a ``type: number`` field as a double, even when written as 1."""
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict) and "properties" in schema:
        return {k: _as_cel(schema["properties"].get(k, {}), v) for k, v in value.items()}
    if isinstance(value, list) and "items" in schema:
        return [_as_cel(schema["items"], v) for v in value]
    return value


def cel_rule_failures(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Every ``x-kubernetes-validations`` rule on the way down that does not hold."""
    failures = []
    for rule in schema.get("x-kubernetes-validations", []):
        try:
            holds = cel.evaluate(rule["rule"], {"self": _as_cel(schema, value)}) is True
        except Exception as exc:  # the API server refuses an object a rule cannot judge
            holds, rule = False, {**rule, "message": f"{rule.get('message')} ({exc})"}
        if not holds:
            failures.append(f"{path or '<root>'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for key, field in (schema.get("properties") or {}).items():
            if key in value:
                failures += cel_rule_failures(field, value[key], f"{path}.{key}")
    return failures


class ResourceSchema:
    """A CRD version's schema, ready to judge many documents (the JSON Schema is built
    once)."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.schema = schema
        converted = openapi_to_jsonschema(schema)
        self._validator = jsonschema.validators.validator_for(converted)(converted)

    @classmethod
    def load(cls, crd_path: Path) -> ResourceSchema:
        return cls(load_crd_schema(crd_path))

    def stored(self, document: Any) -> Any:
        """What the API server would store (nulls pruned, defaults applied)."""
        return prune_and_default(self.schema, document)

    def problems(self, document: Any) -> list[str]:
        """Why the API server would refuse ``document``; ``[]`` if it would store it."""
        stored = self.stored(document)
        error = jsonschema.exceptions.best_match(self._validator.iter_errors(stored))
        if error is not None:
            return [f"{'.'.join(map(str, error.absolute_path))}: {error.message}"]
        return cel_rule_failures(self.schema, stored)
