"""Judge an admission request as the API server's ValidatingAdmissionPolicy plugin does,
evaluating the policy's own CEL expressions (``common-expression-language``): resource
rules, then match conditions, then variables, then every validation (its
``messageExpression`` when it has one, else its message); with ``failurePolicy: Fail``
an expression that cannot be evaluated denies. What the library lacks of the API
server's CEL environment is given here as the server defines it: ``<list>.join(sep)``
(Kubernetes' string library) and ``authorizer`` (its authorization checks), whose
answers a test states as the set of checks the requesting user passes."""

from __future__ import annotations

from collections.abc import Callable
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


@dataclass(frozen=True)
class Check:
    """One ``authorizer...check(verb)``: what the API server's authorizer is asked."""

    verb: str
    group: str = ""
    resource: str = ""
    namespace: str = ""
    name: str = ""
    subresource: str = ""


Authorizes = Callable[[Check], bool]  # the user's answer to each check


def _join(items: list[str], separator: str = "") -> str:
    return separator.join(items)


def _authorizer_functions(authorizes: Authorizes) -> dict[str, Callable[..., Any]]:
    """``authorizer.group(g).resource(r)...check(verb).allowed()`` as the API server's
    library reads it: each builder adds an attribute, ``check`` names the verb, and
    ``allowed`` asks ``authorizes``."""

    def builder(field: str) -> Callable[[dict[str, Any], str], dict[str, Any]]:
        return lambda target, value: {**target, field: value}

    functions: dict[str, Callable[..., Any]] = {
        field: builder(field) for field in ("group", "resource", "namespace", "name", "subresource")
    }
    functions["check"] = builder("verb")
    functions["allowed"] = lambda target: authorizes(
        Check(**{k: v for k, v in target.items() if k != "authorizer"})
    )
    return functions


def _evaluate(expression: str, env: dict[str, Any] | cel.Context) -> tuple[Any, str | None]:
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
    authorizes: Authorizes | None = None,
) -> Verdict:
    """The verdict on ``request`` (``obj``: the object after the change, ``old``: before;
    ``None`` where the operation has none; ``authorizes``: the requesting user's answer
    to each authorizer check, for a policy that asks; without it ``authorizer`` is
    undefined and an expression using it fails)."""
    spec = policy["spec"]
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert "matchResources" not in binding["spec"], "this harness binds cluster-wide only"
    assert spec["failurePolicy"] == "Fail"
    rules = spec["matchConstraints"]["resourceRules"]
    if not any(_rule_matches(rule, request) for rule in rules):
        return Verdict(False)
    functions: dict[str, Callable[..., Any]] = {"join": _join}
    base: dict[str, Any] = {"request": request, "object": obj, "oldObject": old}
    if authorizes is not None:
        base["authorizer"] = {"authorizer": True}
        functions.update(_authorizer_functions(authorizes))

    def env(variables: dict[str, Any] | None = None) -> cel.Context:
        extra = {} if variables is None else {"variables": variables}
        return cel.Context(variables={**base, **extra}, functions=functions)

    for condition in spec.get("matchConditions", []):
        value, error = _evaluate(condition["expression"], env())
        if error is not None:
            return Verdict(True, (f"match condition {condition['name']}: {error}",))
        if value is not True:
            return Verdict(False)
    variables: dict[str, Any] = {}
    for variable in spec.get("variables", []):
        value, error = _evaluate(variable["expression"], env(variables))
        if error is not None:
            return Verdict(True, (f"variable {variable['name']}: {error}",))
        variables[variable["name"]] = value
    denials = []
    for validation in spec["validations"]:
        value, error = _evaluate(validation["expression"], env(variables))
        if value is not True:
            denials.append(_message(validation, env(variables)) + (f" ({error})" if error else ""))
    return Verdict(True, tuple(denials))


def _message(validation: dict[str, Any], env: cel.Context) -> str:
    """The ``messageExpression``'s string if it evaluates to one, else the message."""
    if "messageExpression" in validation:
        value, error = _evaluate(validation["messageExpression"], env)
        if error is None and isinstance(value, str) and value.strip():
            return value
    return str(validation["message"])


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
