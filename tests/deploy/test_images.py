"""The images build the same bytes from one commit (issue 32): every base pinned by
digest, every Python dependency from a lock file with hashes (``--require-hashes``), the
locks current with pyproject.toml's extras, and ``make images`` says so where no Docker
engine runs rather than failing obscurely."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ROOT / "requirements"
_spec = importlib.util.spec_from_file_location("check_images", ROOT / "tools" / "check_images.py")
assert _spec is not None and _spec.loader is not None
check_images = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_images)

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PROJECT["project"]["optional-dependencies"]
# each image: its lock, and the requirements that lock must satisfy
IMAGES = {
    "Dockerfile.server-cpu": ("server-cpu.txt", [*EXTRAS["server"], *EXTRAS["sidecar"]]),
    "Dockerfile.server": (
        "server-gpu.txt",
        [*EXTRAS["server"], *EXTRAS["sidecar"], *(r for r in EXTRAS["tensorrt"] if "cuda" in r)],
    ),
    "Dockerfile.sidecar": ("sidecar.txt", EXTRAS["sidecar"]),
    "Dockerfile.operator": ("operator.txt", EXTRAS["operator"]),
}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)\s*\\?$")


def locked(lock: Path) -> dict[str, tuple[str, int]]:
    """Each pinned package of a lock file: its version and how many hashes it carries."""
    pins: dict[str, tuple[str, int]] = {}
    name = None
    for line in lock.read_text().splitlines():
        if match := PIN.match(line):
            name = canonicalize_name(match[1])
            pins[name] = (match[2], 0)
        elif line.strip().startswith("--hash=sha256:") and name is not None:
            version, hashes = pins[name]
            pins[name] = (version, hashes + 1)
        elif line.strip() and not line.lstrip().startswith("#"):
            raise AssertionError(f"{lock.name}: not a pinned, hashed requirement: {line!r}")
    return pins


def unsatisfied(lock: Path, requirements: list[str]) -> list[str]:
    pins = locked(lock)
    missing = []
    for text in requirements:
        requirement = Requirement(text)
        pinned = pins.get(canonicalize_name(requirement.name))
        if pinned is None or not requirement.specifier.contains(pinned[0], prereleases=True):
            missing.append(f"{text} (locked: {pinned[0] if pinned else 'nothing'})")
    return missing


def test_every_dockerfile_is_an_image_here() -> None:
    assert {p.name for p in check_images.DOCKERFILES} == set(IMAGES)


@pytest.mark.parametrize("dockerfile", IMAGES)
def test_the_dockerfile_pins_its_base_and_installs_its_lock(dockerfile: str) -> None:
    text = (ROOT / dockerfile).read_text()
    assert check_images.problems(ROOT / dockerfile) == []
    lock = IMAGES[dockerfile][0]
    installs = [line for line in check_images.logical_lines(text) if "pip install" in line]
    assert any("--require-hashes --no-deps -r /tmp/requirements.txt" in i for i in installs)
    assert f"COPY requirements/{lock} /tmp/requirements.txt" in text
    assert "--require-hashes --no-deps -r requirements/build.txt" in text  # the build too


@pytest.mark.parametrize("dockerfile", IMAGES)
def test_the_lock_satisfies_pyproject(dockerfile: str) -> None:
    """Each of the extras' requirements is locked at a version it allows: a lock made
    before a pyproject change fails here (`make locks`)."""
    lock, requirements = IMAGES[dockerfile]
    assert unsatisfied(LOCKS / lock, requirements) == []
    pins = locked(LOCKS / lock)
    assert all(hashes > 0 for _, hashes in pins.values()), lock
    assert "tensorrt" not in " ".join(pins)  # TensorRT is the GPU base image's, or none


def test_the_build_lock_satisfies_the_build_system() -> None:
    assert unsatisfied(LOCKS / "build.txt", PROJECT["build-system"]["requires"]) == []


def test_a_stale_lock_is_caught(tmp_path: Path) -> None:
    lock = tmp_path / "lock.txt"
    lock.write_text("aiohttp==3.8.0 \\\n    --hash=sha256:" + "0" * 64 + "\n")
    assert unsatisfied(lock, ["aiohttp>=3.9", "numpy>=1.24"]) == [
        "aiohttp>=3.9 (locked: 3.8.0)",
        "numpy>=1.24 (locked: nothing)",
    ]
    lock.write_text("aiohttp>=3.9\n")
    with pytest.raises(AssertionError, match="not a pinned, hashed requirement"):
        locked(lock)


@pytest.mark.parametrize(
    ("dockerfile", "said"),
    [
        ("FROM python:3.12-slim\n", "FROM python:3.12-slim: not pinned by digest"),
        ("ARG BASE=python:3.12\nFROM ${BASE} AS build\n", "FROM python:3.12: not pinned"),
        ("FROM python@sha256:" + "a" * 64 + "\n", "not pinned by digest"),  # which tag?
        (
            "FROM python:3.12-slim@sha256:" + "a" * 64 + "\nRUN pip install onnx\n",
            "pip install onnx: not from a lock with --require-hashes",
        ),
        (
            "FROM python:3.12-slim@sha256:"
            + "a" * 64
            + "\nRUN true && \\\n  pip install -r r.txt\n",
            "pip install -r r.txt: not from a lock",
        ),
    ],
)
def test_the_check_refuses_a_tag_or_an_unhashed_install(
    tmp_path: Path, dockerfile: str, said: str
) -> None:
    path = tmp_path / "Dockerfile.x"
    path.write_text(dockerfile)
    assert any(said in problem for problem in check_images.problems(path)), check_images.problems(
        path
    )


def test_make_images_says_why_without_a_docker_engine(tmp_path: Path) -> None:
    """A ``docker`` whose engine does not answer (as here, or with no daemon running)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "docker").write_text(
        "#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n"
    )
    (fake / "docker").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    made = subprocess.run(
        ["make", "-s", "images", f"PYTHON={sys.executable}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert made.returncode == 2, made
    assert "make images: no Docker engine here" in made.stdout + made.stderr
    assert "bases pinned by digest, locks hashed" in made.stdout  # checked first


# imported only where present, each from elsewhere than the program's lock: TensorRT and
# cuda-python (the GPU image: its base and requirements/server-gpu.txt), torch (the torch
# extra), grpc_tools (dev: writes the committed gRPC code)
OPTIONAL_IMPORTS = {"tensorrt", "cuda", "torch", "grpc_tools"}
PROGRAMS = {  # each program's package: the lock of its image
    "server/model_server": "server-cpu.txt",
    "sidecar/model_sidecar": "sidecar.txt",
    "operator/model_operator": "operator.txt",
}
OWN = {
    "model_rollout_contract",
    "model_rollout_flags",
    "model_server",
    "model_sidecar",
    "model_operator",
}


def third_party_imports(package: Path) -> set[str]:
    modules = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    return {m for m in modules if m not in sys.stdlib_module_names} - OWN - OPTIONAL_IMPORTS


@pytest.mark.parametrize("package", PROGRAMS)
def test_everything_a_program_imports_is_in_its_images_lock(package: str) -> None:
    """The image installs the lock and nothing else: a module the program imports that
    no locked distribution provides is an image that fails at start."""
    distributions = importlib.metadata.packages_distributions()
    pins = locked(LOCKS / PROGRAMS[package])
    missing = []
    for module in sorted(third_party_imports(ROOT / package)):
        provided_by = {canonicalize_name(d) for d in distributions.get(module, [module])}
        if not provided_by & pins.keys():
            missing.append(f"{module} ({', '.join(sorted(provided_by))})")
    assert missing == [], f"{package} imports what {PROGRAMS[package]} does not lock"
