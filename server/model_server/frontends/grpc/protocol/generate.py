"""Regenerate the Python code of the vendored protos (``make grpc-protocol``; a test
checks that what is committed is what this writes).

protoc's Python output assumes that its modules are top-level (``import
model_config_pb2``) and registers every file in protobuf's default descriptor pool. Two
rewrites make it a package of its own that can live beside any other copy of the same
protocol (tritonclient ships one: a second ``inference.ModelInferRequest`` in the
default pool is a ``TypeError`` at import): imports are made relative, and the files are
added to this package's own pool (:data:`model_server.frontends.grpc.protocol.POOL`). Messages keep
their full names (``inference.…``), so the wire format is exactly Triton's.

Needs the ``dev`` extra's grpcio-tools (pinned there: another protoc writes other code).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = ("grpc_service.proto", "model_config.proto")
# what protoc writes that is committed (model_config has no service: no *_pb2_grpc.py)
OUTPUTS = (
    "grpc_service_pb2.py",
    "grpc_service_pb2.pyi",
    "grpc_service_pb2_grpc.py",
    "model_config_pb2.py",
    "model_config_pb2.pyi",
)
_REWRITES = (
    # sibling modules of this package, not top-level ones
    (re.compile(r"^import (\w+_pb2) as ", re.M), r"from . import \1 as "),
    # this package's pool, not the process-wide default one
    (
        re.compile(r"^(DESCRIPTOR = )_descriptor_pool\.Default\(\)\.", re.M),
        r"from . import POOL as _POOL\n\1_POOL.",
    ),
    # the classes' __module__: this module's real name
    (
        re.compile(r"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, )'\w+'"),
        r"\1__name__",
    ),
)


def rewrite(text: str) -> str:
    for pattern, replacement in _REWRITES:
        text = pattern.sub(replacement, text)
    return text


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on the vendored protos and write the rewritten code to ``out_dir``."""
    from grpc_tools import protoc  # the dev extra only

    with tempfile.TemporaryDirectory() as raw:
        args = [
            "grpc_tools.protoc",
            f"-I{HERE}",
            f"--python_out={raw}",
            f"--pyi_out={raw}",
            f"--grpc_python_out={raw}",
            *(str(HERE / p) for p in PROTOS),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        written = []
        for name in OUTPUTS:
            target = out_dir / name
            target.write_text(rewrite((Path(raw) / name).read_text()))
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only report files that differ")
    a = p.parse_args(argv)
    if not a.check:
        for path in generate(HERE):
            print(f"wrote {path}")
        return 0
    with tempfile.TemporaryDirectory() as fresh:
        stale = [
            p.name
            for p in generate(Path(fresh))
            if not (HERE / p.name).is_file() or p.read_text() != (HERE / p.name).read_text()
        ]
    for name in stale:
        print(f"{name} differs from a fresh generation: run make grpc-protocol", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
