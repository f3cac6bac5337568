"""Every TensorRT and CUDA call the backend makes, checked against the real bindings.

Full TensorRT cannot be installed here (its library wheels download from NVIDIA's index),
but the lean runtime bindings can: ``make install`` puts TensorRT 10.8, 10.16 and 11.4's
(and cuda-bindings 12.9 and 13.5) each in a directory of their own under
``.venv/compat``. The calls are read from the backend's source (its AST), not from a list
kept by hand, and each is resolved in a subprocess that imports one version.

Runtime-side calls (runtime, engine, context, optimization profile, timing cache, enums)
exist in the lean bindings and are checked there. Builder-side calls (builder, network,
builder config, ONNX parser, ITensor) are not in the lean runtime: they are checked
against the documented API, NVIDIA's TensorRT Python API reference for 10.x and 11.x
(docs.nvidia.com/deeplearning/tensorrt/latest/_static/python-api/ and the 10.x -> 11.x
migration guide's "Removed Python APIs" list, none of which the backend calls).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from model_rollout_contract.defaults import PRECISIONS
from model_server.backends import tensorrt_backend, tensorrt_build
from model_server.backends.tensorrt_build import plan_build

REPO = Path(__file__).resolve().parents[3]
BACKEND_DIR = REPO / "server" / "model_server" / "backends"
COMPAT = Path(sys.prefix) / "compat"
TRT_VERSIONS = ("10.8.0.43", "10.16.1.11", "11.4.0.106")
CUDA_VERSIONS = ("12.9.10", "13.5.0")

MODULE_RECEIVERS = {"trt", "_trt"}
RUNTIME_RECEIVERS = {  # the backend's variable (or attribute) names -> binding classes
    "engine": "ICudaEngine",
    "_engine": "ICudaEngine",
    "context": "IExecutionContext",
    "_runtime": "Runtime",
    "_plan_runtime": "Runtime",
    "runtime": "Runtime",
    "registry": "IPluginRegistry",
    "opt_profile": "IOptimizationProfile",
    "timing_cache": "ITimingCache",
    "on_disk": "ITimingCache",
}
BUILDER_RECEIVERS = {
    "builder": "IBuilder",
    "network": "INetworkDefinition",
    "config": "IBuilderConfig",
    "parser": "OnnxParser",
    "tensor": "ITensor",
}
# the documented builder-side API the backend may use, identical in 10.x and 11.x
DOCUMENTED_BUILDER_API = {
    "IBuilder": {
        "create_network",
        "create_builder_config",
        "create_optimization_profile",
        "build_serialized_network",
    },
    "INetworkDefinition": {"num_inputs", "get_input"},
    "ITensor": {"name", "shape", "is_shape_tensor"},
    "IBuilderConfig": {
        "set_memory_pool_limit",
        "set_flag",
        "clear_flag",
        "add_optimization_profile",
        "create_timing_cache",
        "set_timing_cache",
    },
    "OnnxParser": {"parse", "get_error", "num_errors"},
}
# module-level names of the full library that the lean runtime does not have; the second
# set is reached on TensorRT 10 only (see test_strongly_typed_flag_only_on_10)
FULL_LIBRARY_ONLY = {
    "Builder",
    "OnnxParser",
    "init_libnvinfer_plugins",
    "NetworkDefinitionCreationFlag",
}
DOCUMENTED_FULL_LIBRARY = {  # per major version: the full library's names the backend uses
    10: {("Builder",), ("OnnxParser",), ("init_libnvinfer_plugins",),
         ("NetworkDefinitionCreationFlag", "STRONGLY_TYPED")},
    11: {("Builder",), ("OnnxParser",), ("init_libnvinfer_plugins",)},
}  # fmt: skip


# every other name an attribute is read from in the two files, none a TensorRT object;
# a new name fails test_every_receiver_is_classified until it is put here or in a map
NOT_TENSORRT = frozenset(
    {
        "_NUMPY_TYPES",
        "_add_slot",
        "_allocate",
        "_borrow",
        "_cached",
        "_check_shape",
        "_closed",
        "_cuda",
        "_describe",
        "_deserialize",
        "_dynamic",
        "_logger",
        "_major",
        "_names",
        "_plan_bytes",
        "_pool",
        "_profile_shapes",
        "_profiled",
        "_profiles_to_use",
        "_run",
        "_slots",
        "array",
        "arrays",
        "batch",
        "bounds",
        "buffer",
        "build",
        "c",
        "cache",
        "cache_key",
        "close",
        "contextlib",
        "copy",
        "copy_from",
        "copy_to",
        "cuda_memory",
        "device",
        "devices",
        "dtype",
        "dynamic",
        "e",
        "example",
        "exists",
        "fcntl",
        "graph",
        "hit",
        "host",
        "info",
        "init",
        "initializer",
        "inputs",
        "is_absolute",
        "itemsize",
        "join",
        "log",
        "logging",
        "model",
        "node",
        "np",
        "onnx",
        "onnx_path",
        "opt_shape",
        "options",
        "os",
        "other",
        "out_path",
        "output",
        "outputs",
        "parts",
        "path",
        "plan",
        "profile",
        "ptr",
        "queue",
        "runtime_tag",
        "shape",
        "shapes",
        "slot",
        "spec",
        "stream",
        "t",
        "tempfile",
        "text",
        "timing_cache_path",
        "tmp",
        "view",
    }
)  # with attributes of this backend's own objects (self.<name>)


@dataclass
class Calls:
    module: set[tuple[str, ...]] = field(default_factory=set)
    runtime: set[tuple[str, str]] = field(default_factory=set)
    builder: set[tuple[str, str]] = field(default_factory=set)
    # hasattr(receiver, name) -> the calls made only when it holds; the guard's receiver
    # is a binding class, or "" for the module
    guarded: dict[tuple[str, str], Calls] = field(default_factory=dict)


def _chain(node: ast.expr) -> list[str]:
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def _record(calls: Calls, chain: list[str]) -> None:
    for i, name in enumerate(chain[:-1]):
        if name in MODULE_RECEIVERS:
            calls.module.add(tuple(chain[i + 1 :]))
            return
        if name in RUNTIME_RECEIVERS:
            calls.runtime.add((RUNTIME_RECEIVERS[name], chain[i + 1]))
            return
        if name in BUILDER_RECEIVERS:
            calls.builder.add((BUILDER_RECEIVERS[name], chain[i + 1]))
            return


def _guard(test: ast.expr) -> tuple[str, str] | None:
    """``hasattr(receiver, "name")`` as (binding class or "" for the module, name)."""
    if not (isinstance(test, ast.Call) and getattr(test.func, "id", None) == "hasattr"):
        return None
    receiver, name = _chain(test.args[0]), test.args[1]
    assert isinstance(name, ast.Constant) and isinstance(name.value, str)
    last = receiver[-1]
    if last in MODULE_RECEIVERS:
        return "", name.value
    return RUNTIME_RECEIVERS[last], name.value


def read_calls(*files: Path) -> Calls:
    calls = Calls()
    for path in files:
        tree = ast.parse(path.read_text())
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        hidden: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and (guard := _guard(node.test)) is not None:
                group = calls.guarded.setdefault(guard, Calls())
                for statement in node.body:
                    for sub in ast.walk(statement):
                        if isinstance(sub, ast.Attribute) and id(sub) not in inner:
                            _record(group, _chain(sub))
                            hidden.add(id(sub))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and id(node) not in inner | hidden:
                _record(calls, _chain(node))
    return calls


def _builder_flags(major: int) -> set[str]:
    flags = {"TF32"}  # cleared on fp32 builds
    for asked in PRECISIONS:
        for carried in ("fp32", "fp16", "int8"):
            try:
                flags |= set(plan_build(major, asked, carried).flags)
            except ValueError:
                pass
    return flags


_RESOLVE = """
import json, sys
import tensorrt_lean_bindings as trt
need = json.loads(sys.stdin.read())

def missing_of(group):
    missing = []
    for chain in group["module"]:
        obj = trt
        for name in chain:
            if not hasattr(obj, name):
                missing.append(".".join(chain)); break
            obj = getattr(obj, name)
    for cls, attr in group["runtime"]:
        if not hasattr(getattr(trt, cls), attr):
            missing.append(cls + "." + attr)
    return missing

missing = missing_of(need)
for enum, names in need["members"].items():
    missing += [enum + "." + n for n in names if n not in getattr(trt, enum).__members__]
present = []
for group in need["guarded"]:
    cls, name = group["guard"]
    if hasattr(getattr(trt, cls) if cls else trt, name):
        present.append(name)
        missing += missing_of(group)
print(json.dumps({"version": trt.__version__, "missing": missing, "present": present}))
"""


def _lean_checkable(calls: Calls) -> dict[str, list[list[str]]]:
    """The calls the lean bindings can answer for: full-library names are checked against
    the documentation instead (test_every_builder_call_is_documented_for_10_and_11)."""
    return {
        "module": [list(c) for c in sorted(calls.module) if c[0] not in FULL_LIBRARY_ONLY],
        "runtime": [list(c) for c in sorted(calls.runtime)],
    }


def _run_in(env_dir: Path, script: str, stdin: str) -> dict[str, object]:
    if not env_dir.is_dir():
        pytest.skip(f"{env_dir} is missing: run make install")
    env = {**os.environ, "PYTHONPATH": str(env_dir)}
    out = subprocess.run(
        [sys.executable, "-c", script], input=stdin, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_every_receiver_is_classified() -> None:
    """The check above only sees calls on names it knows: a TensorRT object reached
    through a new name (``ctx = slot.context``) would hide its calls, so every name an
    attribute is read from must be classified, as TensorRT or not."""
    roots: set[str] = set()
    for path in (Path(tensorrt_backend.__file__), Path(tensorrt_build.__file__)):
        tree = ast.parse(path.read_text())
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and id(node) not in inner:
                chain = _chain(node)
                if chain:
                    roots.add(chain[1] if chain[0] == "self" else chain[0])
    known = NOT_TENSORRT | MODULE_RECEIVERS | set(RUNTIME_RECEIVERS) | set(BUILDER_RECEIVERS)
    assert roots - known == set()


def test_reading_the_calls_finds_what_the_backend_uses() -> None:
    """The reader itself must not go blind: a renamed variable would hide its calls."""
    calls = read_calls(Path(tensorrt_backend.__file__), Path(tensorrt_build.__file__))
    used_classes = {cls for cls, _ in calls.runtime | calls.builder}
    assert used_classes >= {"ICudaEngine", "IExecutionContext", "Runtime", "ITimingCache"}
    assert set(BUILDER_RECEIVERS.values()) <= used_classes
    assert ("IExecutionContext", "execute_async_v3") in calls.runtime
    weights = calls.guarded[("ICudaEngine", "get_engine_stat")]
    assert ("EngineStat", "TOTAL_WEIGHTS_SIZE") in weights.module


@pytest.mark.parametrize("version", TRT_VERSIONS)
def test_every_runtime_call_exists_in_the_real_bindings(version: str) -> None:
    calls = read_calls(Path(tensorrt_backend.__file__), Path(tensorrt_build.__file__))
    major = int(version.split(".")[0])
    need = {
        **_lean_checkable(calls),
        "members": {
            "BuilderFlag": sorted(_builder_flags(major)),
            "DataType": sorted(tensorrt_backend._NUMPY_TYPES),
        },
        "guarded": [
            {"guard": list(guard), **_lean_checkable(group)}
            for guard, group in sorted(calls.guarded.items())
        ],
    }
    result = _run_in(COMPAT / f"tensorrt-{version}", _RESOLVE, json.dumps(need))
    assert result["version"] == version
    assert result["missing"] == []
    # get_engine_stat arrived in 10.14: below it the plan size stands in for the weights
    numbers = tuple(int(n) for n in version.split(".")[:2])
    assert ("get_engine_stat" in result["present"]) == (numbers >= (10, 14))


def test_guarded_calls_are_the_known_optional_ones() -> None:
    """hasattr() makes a call optional: only these may be."""
    calls = read_calls(Path(tensorrt_backend.__file__), Path(tensorrt_build.__file__))
    assert set(calls.guarded) == {
        ("ICudaEngine", "get_engine_stat"),
        ("", "init_libnvinfer_plugins"),
    }


def test_every_builder_call_is_documented_for_10_and_11() -> None:
    calls = read_calls(Path(tensorrt_backend.__file__), Path(tensorrt_build.__file__))
    undocumented = {
        (cls, attr) for cls, attr in calls.builder if attr not in DOCUMENTED_BUILDER_API[cls]
    }
    assert undocumented == set()
    full = {c for c in calls.module if c[0] in FULL_LIBRARY_ONLY}
    for group in calls.guarded.values():
        full |= {c for c in group.module if c[0] in FULL_LIBRARY_ONLY}
    # every full-library name is documented for 10; on 11 only those reached on 11
    assert full == DOCUMENTED_FULL_LIBRARY[10]
    assert (
        full - {("NetworkDefinitionCreationFlag", "STRONGLY_TYPED")}
        == (DOCUMENTED_FULL_LIBRARY[11])
    )


def test_weak_typing_flags_are_never_asked_of_tensorrt_11() -> None:
    assert _builder_flags(11) == {"TF32"}
    assert "FP16" in _builder_flags(10)


def test_strongly_typed_flag_only_on_10() -> None:
    class Eleven:  # TensorRT 11 has no NetworkDefinitionCreationFlag to ask for
        pass

    plan = plan_build(11, "model", "fp32")
    assert tensorrt_build._network_flags(Eleven(), 11, plan) == 0


_CUDA_CHECK = """
import json, sys
from cuda.bindings import runtime as cudart
from model_server.backends import cuda_memory
from model_server.backends.base import BackendUnavailable
need = json.loads(sys.stdin.read())
missing = [n for n in need if not hasattr(cudart, n)]
try:
    cuda_memory.cuda_report()
    reason = None
except BackendUnavailable as exc:
    reason = str(exc)
handle = cuda_memory.native_handle(cudart.cudaStream_t(0))
print(json.dumps({"missing": missing, "reason": reason, "devices": cuda_memory.device_count(),
                  "handle": handle}))
"""


@pytest.mark.parametrize("version", CUDA_VERSIONS)
def test_cuda_calls_exist_and_a_missing_driver_is_named(version: str) -> None:
    """Real cuda-bindings 12 and 13 on a machine without an NVIDIA driver: every call the
    memory module makes exists, and the failure says "no driver", not "no GPU"."""
    tree = ast.parse((BACKEND_DIR / "cuda_memory.py").read_text())
    need = sorted(
        {
            chain[1]
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and (chain := _chain(node))[0] == "cudart"
        }
    )
    assert {"cudaStreamCreateWithFlags", "cudaHostAlloc", "cudaMemcpyAsync"} <= set(need)
    result = _run_in(COMPAT / f"cuda-bindings-{version}", _CUDA_CHECK, json.dumps(need))
    assert result["missing"] == []
    assert result["devices"] == 0
    assert result["handle"] == 0
    assert "no NVIDIA driver" in str(result["reason"])


def test_the_pinned_ranges_are_the_checked_ones() -> None:
    """pyproject's and the image's TensorRT and cuda-python ranges cover exactly what the
    tests above check, and the backend refuses what lies outside them."""
    import tomllib

    from model_server.backends.cuda_memory import SUPPORTED_CUDA_PYTHON_MAJORS
    from model_server.backends.tensorrt_backend import MAX_MAJOR, MIN_VERSION

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    low = ".".join(map(str, MIN_VERSION))
    newest = max(TRT_VERSIONS, key=lambda v: tuple(int(n) for n in v.split(".")))
    high = f"{MAX_MAJOR}.{int(newest.split('.')[1]) + 1}"
    assert newest.startswith(f"{MAX_MAJOR}.")
    assert min(TRT_VERSIONS, key=lambda v: tuple(int(n) for n in v.split("."))).startswith(low)
    for extra, cuda_major in (("tensorrt", 13), ("tensorrt-cu12", 12)):
        assert f"tensorrt-cu{cuda_major}>={low},<{high}" in extras[extra]
        assert any(
            pin.startswith("cuda-python>=") and pin.endswith(f",<{cuda_major + 1}")
            for pin in extras[extra]
        )
        assert cuda_major in SUPPORTED_CUDA_PYTHON_MAJORS
        assert any(v.startswith(f"{cuda_major}.") for v in CUDA_VERSIONS)
    dockerfile = (REPO / "Dockerfile.server").read_text()
    # the GPU image's cuda-python: its lock's input, the [tensorrt] extra's (CUDA 13) range
    gpu_input = (REPO / "requirements" / "server-gpu.in").read_text()
    assert "\ncuda-python>=13,<14\n" in gpu_input and "cuda-python>=13,<14" in extras["tensorrt"]
    assert "COPY requirements/server-gpu.txt /tmp/requirements.txt" in dockerfile
    assert "check_version(tensorrt.__version__)" in dockerfile
