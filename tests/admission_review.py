"""Judge an admission request as the API server's ValidatingAdmissionPolicy plugin does,
evaluating the policy's own CEL expressions (``common-expression-language``): resource
rules, then match conditions, then variables, then every validation; with
``failurePolicy: Fail`` an expression that cannot be evaluated denies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cel


@dataclass(frozen=True)
class Verdict:
    matched: bool  # the policy applies to this request at all
    denials: tuple[str, ...] = ()  # the messages of the validations that failed

    @property
    def allowed(self) -> bool:
        return not self.denials


def _listed(values: list[str], value: str) -> bool:
    return "*" in values or value in values


def _rule_matches(rule: dict[str, Any], request: dict[str, Any]) -> bool:
    resource = request["resource"]
    sub = request.get("subResource") or ""
    name = f"{resource['resource']}/{sub}" if sub else resource["resource"]
    resources = rule["resources"]
    by_resource = name in resources or "*" in resources
    if sub and f"{resource['resource']}/*" in resources:
        by_resource = True
    return (
        by_resource
        and _listed(rule["apiGroups"], resource["group"])
        and _listed(rule["apiVersions"], resource["version"])
        and _listed(rule["operations"], request["operation"])
    )


def _evaluate(expression: str, env: dict[str, Any]) -> tuple[Any, str | None]:
    try:
        return cel.evaluate(expression, env), None
    except Exception as exc:  # parse, type and runtime errors alike
        return None, f"{type(exc).__name__}: {exc}"


def review(
    policy: dict[str, Any],
    binding: dict[str, Any],
    request: dict[str, Any],
    obj: dict[str, Any] | None,
    old: dict[str, Any] | None,
) -> Verdict:
    """The verdict on ``request`` (``obj``: the object after the change, ``old``: before;
    ``None`` where the operation has none)."""
    spec = policy["spec"]
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert "matchResources" not in binding["spec"], "this harness binds cluster-wide only"
    assert spec["failurePolicy"] == "Fail"
    rules = spec["matchConstraints"]["resourceRules"]
    if not any(_rule_matches(rule, request) for rule in rules):
        return Verdict(False)
    env: dict[str, Any] = {"request": request, "object": obj, "oldObject": old}
    for condition in spec.get("matchConditions", []):
        value, error = _evaluate(condition["expression"], env)
        if error is not None:
            return Verdict(True, (f"match condition {condition['name']}: {error}",))
        if value is not True:
            return Verdict(False)
    variables: dict[str, Any] = {}
    for variable in spec.get("variables", []):
        value, error = _evaluate(variable["expression"], {**env, "variables": variables})
        if error is not None:
            return Verdict(True, (f"variable {variable['name']}: {error}",))
        variables[variable["name"]] = value
    denials = []
    for validation in spec["validations"]:
        value, error = _evaluate(validation["expression"], {**env, "variables": variables})
        if value is not True:
            denials.append(validation["message"] + (f" ({error})" if error else ""))
    return Verdict(True, tuple(denials))


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: what a merge patch makes of ``target`` (``None`` deletes a key)."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out
