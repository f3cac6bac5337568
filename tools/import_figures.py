"""The import structure of a package, in figures: modules, import edges between them, the
longest import chain (through the graph of strongly connected components, so a cycle
counts once) and the edges that go up the layers declared in pyproject.toml.

    python tools/import_figures.py model_server
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grimp
import tomllib

ROOT = Path(__file__).resolve().parent.parent


def declared_layers(package: str) -> list[list[str]]:
    """The layers of ``package`` (top first), as import-linter's contract lists them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract["type"] == "layers" and contract["layers"][0].startswith(package + "."):
            return [[p.strip() for p in layer.split("|")] for layer in contract["layers"]]
    return []


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    for index, layer in enumerate(layers):
        if any(module == p or module.startswith(p + ".") for p in layer):
            return index
    return None


def longest_chain(graph: dict[str, set[str]]) -> int:
    """Modules on the longest import chain, each strongly connected component once."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    component: dict[str, int] = {}
    counter = [0]

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component[member] = len(set(component.values()))
                if member == node:
                    break

    sys.setrecursionlimit(10_000)
    for node in graph:
        if node not in index:
            visit(node)
    dag: dict[int, set[int]] = {c: set() for c in component.values()}
    for node, targets in graph.items():
        dag[component[node]] |= {component[t] for t in targets} - {component[node]}
    depth: dict[int, int] = {}

    def chain(c: int) -> int:
        if c not in depth:
            depth[c] = 1 + max((chain(n) for n in dag[c]), default=0)
        return depth[c]

    return max((chain(c) for c in dag), default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", help="a top-level package, e.g. model_server")
    package = parser.parse_args().package
    imports = grimp.build_graph(package)
    modules = sorted(m for m in imports.modules if m.split(".")[0] == package)
    graph = {m: set(imports.find_modules_directly_imported_by(m)) & set(modules) for m in modules}
    edges = [(a, b) for a, targets in graph.items() for b in targets]
    layers = declared_layers(package)
    upward = []
    for a, b in edges:
        la, lb = layer_of(a, layers), layer_of(b, layers)
        if la is not None and lb is not None and lb < la:
            upward.append(f"{a} -> {b}")
    print(f"{package}: {len(modules)} modules, {len(edges)} import edges, "
          f"longest chain {longest_chain(graph)} modules, {len(upward)} upward edges")  # fmt: skip
    for edge in sorted(upward):
        print("  up:", edge)


if __name__ == "__main__":
    main()
