"""The README and docs/ show only commands that are checked: each shell command there is
either run by a test (``RUN_BY_TESTS`` names the tests) or marked in its block as not run
by one (``MARKERS``), so a reader knows which commands the suite vouches for. Every
relative link there, and in the benchmarks' dated notes, points at a file that exists
(and at a heading that exists, where it names one)."""

from __future__ import annotations

import argparse
import ast
import importlib
import re
from dataclasses import dataclass
from pathlib import Path

import pytest


def repository_root() -> Path:
    """The folder holding pyproject.toml, wherever under tests/ this file lives."""
    here = Path(__file__).resolve()
    return next(p for p in here.parents if (p / "pyproject.toml").is_file())


ROOT = repository_root()
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BENCH = ROOT / "bench"
NOTES = sorted((BENCH / "results").rglob("NOTES.md"))
SHELL = {"bash", "sh", "shell", "console", "zsh"}

# A comment line in a shell block marks every command of the block; a comment after a
# command marks that command. What follows the marker says why, where it is not obvious.
MARKERS = (
    "# needs a real cluster",
    "# needs an NVIDIA GPU",
    "# benchmark, not run by the tests",
    "# not run by the tests:",
)

# Each command shown unmarked, and the tests that run it (or its exact equivalent through
# the same entry point), by test file name and function: tests/ is being reorganised
# into folders, so the file is looked up by name anywhere under tests/.
INSTALL_GUIDE = [("test_install_guide.py", "test_the_install_guide_runs_on_a_real_control_plane")]
RUN_BY_TESTS: dict[str, list[tuple[str, str]]] = {
    "python tools/import_figures.py model_server": [
        ("test_import_figures.py", "test_the_import_figures_command_counts_the_servers_layers"),
    ],
    # the test's own namespaces stand for ml and ci
    "kubectl create rolebinding ci-release -n ml --clusterrole=model-rollout-rollout-editor"
    " --serviceaccount=ci:release": [
        (
            "test_user_roles.py",
            "test_a_ci_account_of_another_namespace_bound_as_the_readme_says_releases",
        ),
    ],
    "kubectl plugin list": [
        ("test_cli_plugin.py", "test_kubectl_finds_the_plugin_and_runs_it"),
    ],
    # docs/logging.md: the test's repository holds one model (the docs' holds any)
    "model-server --repository models --log-format json --log-level warning": [
        ("test_server_logs.py", "test_the_level_asked_for_is_the_least_severe_written"),
    ],
    "kubectl __complete model pa": [
        ("test_cli_parity.py", "test_kubectl_completes_the_plugins_words"),
    ],
    # the test's namespace and resource stand for ml-serving and resnet
    "kubectl scale modeldeployment/resnet -n ml-serving --replicas 12": [
        (
            "test_control_plane_scale.py",
            "test_kubectl_scale_moves_the_deployment_and_starts_no_rollout",
        ),
    ],
    "kubectl get --raw /apis/serving.model-rollout.io/v1alpha1/namespaces/ml-serving"
    "/modeldeployments/resnet/scale": [
        (
            "test_control_plane_scale.py",
            "test_kubectl_scale_moves_the_deployment_and_starts_no_rollout",
        ),
    ],
    # docs/install.md, in the guide's order: test_install_guide.py reads and runs them all
    # (the exports with the test's values: a SeaweedFS bucket and its credentials)
    "export REGISTRY=registry.example.com/ml": INSTALL_GUIDE,
    "export STORE=s3://models/recommender": INSTALL_GUIDE,
    "export AWS_ENDPOINT_URL=https://s3.example.com": INSTALL_GUIDE,
    "export AWS_ACCESS_KEY_ID=publisher": INSTALL_GUIDE,
    "export AWS_SECRET_ACCESS_KEY=change-me": INSTALL_GUIDE,
    "kubectl create namespace ml-serving": INSTALL_GUIDE,
    "model-sidecar keygen --private signing.key --public public.pem": INSTALL_GUIDE,
    "kubectl -n ml-serving create secret generic model-signing-key "
    "--from-file=public.pem": INSTALL_GUIDE,
    "kubectl -n ml-serving create secret generic model-store-credentials "
    '--from-literal=AWS_ACCESS_KEY_ID="$AWS_ACCESS_KEY_ID" '
    '--from-literal=AWS_SECRET_ACCESS_KEY="$AWS_SECRET_ACCESS_KEY"': INSTALL_GUIDE,
    "helm install model-rollout ./deploy/helm/model-rollout -n model-rollout-system "
    "--create-namespace --set image.repository=$REGISTRY/model-rollout-operator --set "
    "watchNamespaces={ml-serving}": INSTALL_GUIDE,
    "kubectl -n model-rollout-system rollout status deployment/model-rollout-operator "
    "--timeout=5m": INSTALL_GUIDE,
    'model-sidecar publish --store "$STORE" --model recommender --version v1 --file '
    "model-v1.onnx --key signing.key": INSTALL_GUIDE,
    'sed -e "s|registry.example.com/ml|$REGISTRY|" -e "s|s3://models/recommender|$STORE|" '
    '-e "s|https://s3.example.com|$AWS_ENDPOINT_URL|" examples/quickstart.yaml > '
    "recommender.yaml": INSTALL_GUIDE,
    "kubectl apply -f recommender.yaml": INSTALL_GUIDE,
    "kubectl -n ml-serving wait modeldeployment/recommender "
    "--for=jsonpath='{.status.phase}'=Available --timeout=10m": INSTALL_GUIDE,
    "kubectl model status recommender -n ml-serving --watch --timeout 10": INSTALL_GUIDE,
    "model-rollout release --model recommender --version v2 --file model-v2.onnx --key "
    'signing.key --deployment recommender --store "$STORE" -n ml-serving': INSTALL_GUIDE,
    "kubectl -n ml-serving wait modeldeployment/recommender "
    "--for=jsonpath='{.status.phase}'=Canary --timeout=10m": INSTALL_GUIDE,
    "kubectl model status recommender -n ml-serving": INSTALL_GUIDE,
    "kubectl model promote recommender -n ml-serving --wait": INSTALL_GUIDE,
    "kubectl model rollback recommender -n ml-serving --wait": INSTALL_GUIDE,
    "kubectl -n ml-serving patch modeldeployment recommender --type merge -p "
    '\'{"spec":{"version":"v2"}}\'': INSTALL_GUIDE,
    "kubectl -n ml-serving patch modeldeployment recommender --type merge -p "
    '\'{"spec":{"version":"v1"}}\'': INSTALL_GUIDE,
    "kubectl model history recommender -n ml-serving": INSTALL_GUIDE,
    "kubectl apply --server-side --force-conflicts "
    "-f deploy/helm/model-rollout/crds/": INSTALL_GUIDE,
    "helm upgrade model-rollout ./deploy/helm/model-rollout -n model-rollout-system "
    "--reuse-values": INSTALL_GUIDE,
    "kubectl delete -f recommender.yaml": INSTALL_GUIDE,
    "helm uninstall model-rollout -n model-rollout-system": INSTALL_GUIDE,
    "kubectl get crd modeldeployments.serving.model-rollout.io": INSTALL_GUIDE,
    "kubectl delete crd modeldeployments.serving.model-rollout.io": INSTALL_GUIDE,
    "kubectl delete namespace ml-serving model-rollout-system": INSTALL_GUIDE,
}


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str
    marked: bool


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    language: str
    lines: tuple[str, ...]


def fenced_blocks(doc: str, text: str) -> list[Block]:
    """Fenced code blocks (``` at any indentation), with their info string's first word."""
    blocks: list[Block] = []
    fence: tuple[int, str, list[str]] | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if fence is None:
            if stripped.startswith("```"):
                info = stripped[3:].strip()
                fence = (number, info.split()[0] if info else "", [])
        elif stripped.startswith("```"):
            blocks.append(Block(doc, fence[0], fence[1], tuple(fence[2])))
            fence = None
        else:
            fence[2].append(raw)
    assert fence is None, f"{doc}:{fence[0]}: a code block is never closed"
    return blocks


def marked(comment: str) -> bool:
    return any(comment.strip().startswith(marker) for marker in MARKERS)


def commands(block: Block) -> list[Command]:
    """The block's commands, continuation lines joined, each with whether it is marked."""
    block_marked = any(line.strip().startswith("#") and marked(line) for line in block.lines)
    found: list[Command] = []
    pending = ""
    for offset, raw in enumerate(block.lines, 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        command, _, comment = line.partition(" #")
        if command.endswith("\\"):
            pending += command[:-1] + " "
            continue
        text = " ".join((pending + command).split())
        pending = ""
        found.append(
            Command(block.doc, block.line + offset, text, block_marked or marked("#" + comment))
        )
    return found


def shell_commands(doc: Path) -> list[Command]:
    name = str(doc.relative_to(ROOT))
    blocks = fenced_blocks(name, doc.read_text())
    return [c for b in blocks if b.language in SHELL for c in commands(b)]


def test_every_code_block_names_its_language() -> None:
    """An untagged block could hide a command from the check below."""
    untagged = [
        f"{b.doc}:{b.line}"
        for doc in DOCS
        for b in fenced_blocks(str(doc.relative_to(ROOT)), doc.read_text())
        if not b.language
    ]
    assert not untagged, f"code blocks without a language: {untagged}"


def test_every_shell_command_is_run_by_a_test_or_marked() -> None:
    unchecked = [
        f"{c.doc}:{c.line}: {c.text}"
        for doc in DOCS
        for c in shell_commands(doc)
        if not c.marked and c.text not in RUN_BY_TESTS
    ]
    assert not unchecked, (
        "commands shown but neither run by a test (RUN_BY_TESTS) nor marked "
        f"({', '.join(MARKERS)}): {unchecked}"
    )


def defined_tests(name: str) -> set[str]:
    """The test functions a test file defines, found by name anywhere under tests/."""
    paths = [p for p in (ROOT / "tests").rglob(name) if "__pycache__" not in p.parts]
    assert len(paths) == 1, f"{name}: {len(paths)} files under tests/"
    tree = ast.parse(paths[0].read_text(), str(paths[0]))
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    names = {n.name for n in tree.body if isinstance(n, functions)}
    for node in tree.body:  # and methods of test classes
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            names |= {f"{node.name}::{n.name}" for n in node.body if isinstance(n, functions)}
    return {n for n in names if n.split("::")[-1].startswith("test")}


@pytest.mark.parametrize("command", sorted(RUN_BY_TESTS))
def test_each_listed_command_is_shown_and_its_tests_exist(command: str) -> None:
    shown = {c.text for doc in DOCS for c in shell_commands(doc) if not c.marked}
    assert command in shown, f"{command!r} is listed but no longer shown unmarked in the docs"
    for file, function in RUN_BY_TESTS[command]:
        assert function in defined_tests(file), f"{file} has no test {function}"


def test_the_command_check_sees_unmarked_and_marked_commands() -> None:
    """The checks above cannot pass vacuously: the parser finds commands and markers."""
    text = (
        "```bash\nmake demo   # not run by the tests: the demo\nmake x \\\n  --flag\n```\n"
        "```sh\n# needs a real cluster\nkubectl get md\n```\n```\nuntagged\n```\n"
    )
    blocks = fenced_blocks("sample.md", text)
    assert [b.language for b in blocks] == ["bash", "sh", ""]
    found = [(c.text, c.marked) for b in blocks[:2] for c in commands(b)]
    assert found == [("make demo", True), ("make x --flag", False), ("kubectl get md", True)]
    assert any(shell_commands(doc) for doc in DOCS)


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(text: str) -> str:
    """The text outside fenced code blocks (a link in a code block is not a link)."""
    kept: list[str] = []
    inside = False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            inside = not inside
            continue
        if not inside:
            kept.append(line)
    return "\n".join(kept)


def anchors(doc: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in prose(doc.read_text()).splitlines():
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(doc: Path) -> list[str]:
    broken: list[str] = []
    for target in LINK.findall(prose(doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no such heading)")
    return broken


@pytest.mark.parametrize("doc", DOCS + NOTES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file_that_exists(doc: Path) -> None:
    assert not broken_links(doc), broken_links(doc)


def test_the_link_check_sees_links(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A heading, here\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](there.md) [ok](there.md#a-heading-here) ![img](there.md) [web](https://x.y)\n"
        "[gone](missing.md) [bad anchor](there.md#nowhere)\n```text\n[in code](nope.md)\n```\n"
    )
    assert broken_links(doc) == ["missing.md (no such file)", "there.md#nowhere (no such heading)"]


class _Parsed(Exception):
    """Raised in place of running a benchmark once its arguments parsed."""


def benchmark_commands() -> list[tuple[str, str, list[str]]]:
    """Every ``python bench/<script>.py ...`` shown in the docs and in the scripts' own
    docstrings: where it is shown, the script's name and its arguments."""
    shown = [(f"{c.doc}:{c.line}", c.text) for doc in DOCS for c in shell_commands(doc)]
    for script in sorted(BENCH.glob("*.py")):
        docstring = ast.get_docstring(ast.parse(script.read_text())) or ""
        for number, line in enumerate(docstring.splitlines(), 1):
            shown.append((f"bench/{script.name} docstring:{number}", line.strip()))
    found = []
    for where, text in shown:
        words = text.partition(" #")[0].replace("[", " ").replace("]", " ").split()
        if len(words) >= 2 and words[0] == "python" and words[1].startswith("bench/"):
            found.append((where, Path(words[1]).stem, words[2:]))
    return found


@pytest.mark.parametrize(("where", "script", "argv"), benchmark_commands(), ids=lambda v: str(v))
def test_each_benchmark_command_shown_parses(
    where: str, script: str, argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A benchmark's command shown with a flag it lost would mislead whoever copies it:
    each is parsed by the script's own parser (and not run)."""
    monkeypatch.syspath_prepend(str(BENCH))
    module = importlib.import_module(script)
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *args: object, **kw: object) -> None:
        parse(self, *args, **kw)  # type: ignore[arg-type]
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    with pytest.raises(_Parsed):
        module.main(argv)


def test_the_benchmark_command_check_sees_commands() -> None:
    scripts = {script for _, script, _ in benchmark_commands()}
    assert {"gpu_swap", "load_stages", "mlserver_side_by_side"} <= scripts
