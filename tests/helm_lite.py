"""Render this project's Helm chart without helm (it is not installable here).

Supports the subset of Go templates the chart uses, and nothing more, so a template
that drifts outside it fails loudly: ``{{ .Values.x }}``, ``$``, ``.``, ``if``/``else``/
``end``, ``range``, ``not``, and the pipeline functions ``quote``, ``default``, ``toYaml``,
``indent`` and ``nindent``, with ``{{-``/``-}}`` whitespace trimming.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ACTION = re.compile(r"(\{\{-?\s*.*?\s*-?\}\})", re.S)


@dataclass
class Node:
    kind: str  # text | expr | if | range
    value: str = ""
    body: list[Node] = field(default_factory=list)
    orelse: list[Node] = field(default_factory=list)


def _tokens(template: str) -> list[tuple[str, str]]:
    parts = ACTION.split(template)
    out: list[tuple[str, str]] = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            out.append(("text", part))
            continue
        if part.startswith("{{-") and out:
            out[-1] = ("text", out[-1][1].rstrip())
        if part.endswith("-}}") and i + 1 < len(parts):
            parts[i + 1] = parts[i + 1].lstrip()
        out.append(("action", part.strip("{}").strip("-").strip()))
    return out


def _parse(tokens: list[tuple[str, str]], pos: int = 0) -> tuple[list[Node], int, str]:
    nodes: list[Node] = []
    while pos < len(tokens):
        kind, value = tokens[pos]
        pos += 1
        if kind == "text":
            nodes.append(Node("text", value))
        elif value in ("end", "else"):
            return nodes, pos, value
        elif value.startswith(("if ", "range ")):
            word, expr = value.split(" ", 1)
            body, pos, closer = _parse(tokens, pos)
            node = Node(word, expr, body)
            if closer == "else":
                node.orelse, pos, closer = _parse(tokens, pos)
            if closer != "end":
                raise ValueError(f"unterminated {word}")
            nodes.append(node)
        else:
            nodes.append(Node("expr", value))
    return nodes, pos, "eof"


def _lookup(path: str, dot: Any, root: Any) -> Any:
    if path == ".":
        return dot
    base, rest = (root, path[1:]) if path.startswith("$") else (dot, path)
    value = base
    for part in [p for p in rest.split(".") if p]:
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _term(word: str, dot: Any, root: Any) -> Any:
    if word.startswith('"'):
        return json.loads(word)
    if word.isdigit():
        return int(word)
    if word.startswith((".", "$")):
        return _lookup(word, dot, root)
    raise ValueError(f"unsupported template term {word!r}")


def _to_yaml(value: Any) -> str:
    return (
        yaml.safe_dump(value, default_flow_style=False, sort_keys=False).rstrip("\n")
        if value not in (None, {}, [])
        else ("{}" if isinstance(value, dict) else "[]")
    )


FUNCS = {
    "quote": lambda v: json.dumps("" if v is None else str(v)),
    "toYaml": _to_yaml,
    "indent": lambda n, v: "\n".join(" " * n + line for line in str(v).splitlines()),
    "nindent": lambda n, v: "\n" + "\n".join(" " * n + line for line in str(v).splitlines()),
    "default": lambda d, v: v if v not in (None, "", [], {}) else d,
    "not": lambda v: not v,
}


def _evaluate(expr: str, dot: Any, root: Any) -> Any:
    value: Any = None
    for i, command in enumerate(c.strip() for c in expr.split("|")):
        words = shlex.split(command, posix=False)
        if words[0] in FUNCS:
            args = [_term(w, dot, root) for w in words[1:]]
            value = FUNCS[words[0]](*args, *([value] if i else []))
        elif len(words) == 1 and i == 0:
            value = _term(words[0], dot, root)
        else:
            raise ValueError(f"unsupported template command {command!r}")
    return value


def _render(nodes: list[Node], dot: Any, root: Any) -> str:
    out = []
    for node in nodes:
        if node.kind == "text":
            out.append(node.value)
        elif node.kind == "expr":
            value = _evaluate(node.value, dot, root)
            out.append("" if value is None else str(value))
        elif node.kind == "if":
            branch = node.body if _evaluate(node.value, dot, root) else node.orelse
            out.append(_render(branch, dot, root))
        elif node.kind == "range":
            items = _evaluate(node.value, dot, root) or []
            out.append("".join(_render(node.body, item, root) for item in items))
    return "".join(out)


def render_chart(
    chart: Path, release: str, namespace: str, values: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Render every template (plus crds/) into parsed Kubernetes objects."""
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    merged = yaml.safe_load((chart / "values.yaml").read_text())
    merged.update(values or {})
    root = {
        "Values": merged,
        "Release": {"Name": release, "Namespace": namespace},
        "Chart": {
            "Name": meta["name"],
            "AppVersion": meta["appVersion"],
            "Version": meta["version"],
        },
    }
    docs: list[dict[str, Any]] = []
    for crd in sorted((chart / "crds").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(crd.read_text()) if d]
    for template in sorted((chart / "templates").glob("*.yaml")):
        nodes, _, closer = _parse(_tokens(template.read_text()))
        if closer != "eof":
            raise ValueError(f"{template.name}: stray {{{{ {closer} }}}}")
        text = _render(nodes, root, root)
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs
