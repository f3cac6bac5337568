"""The on-disk model repository (Triton-style): ``<root>/[<tenant>/]<model>/<version>/``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from model_rollout_contract.manifest import MANIFEST_NAME, MODEL_FILE_NAMES, Manifest, ManifestError
from model_rollout_contract.names import check_name, is_valid_name
from model_rollout_contract.versions import sorted_versions

from .errors import BadRequest, Forbidden, VersionNotFound


def model_key(name: str, tenant: str | None = None) -> str:
    """Models of the default namespace are keyed by name, tenants' by ``tenant/name``."""
    check_name("model name", name)
    return f"{check_name('tenant', tenant)}/{name}" if tenant else name


@dataclass(frozen=True)
class ResolvedVersion:
    path: Path
    manifest: Manifest | None


class ModelRepository:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()

    def model_dir(self, key: str) -> Path:
        return self.root.joinpath(*key.split("/"))

    def versions(self, key: str) -> list[str]:
        """The versions on disk, oldest first (the contract's version order)."""
        directory = self.model_dir(key)
        if not directory.is_dir():
            return []
        return sorted_versions(
            p.name
            for p in directory.iterdir()
            if p.is_dir() and is_valid_name(p.name) and self._model_file(p) is not None
        )

    @staticmethod
    def _model_file(version_dir: Path) -> Path | None:
        for name in MODEL_FILE_NAMES:
            if (version_dir / name).is_file():
                return version_dir / name
        return None

    def is_trusted(self, path: Path) -> bool:
        """True if ``path`` (after resolving links) lies inside the repository root."""
        return path.resolve().is_relative_to(self.root)

    def check_trusted(self, path: Path) -> Path:
        if not self.is_trusted(path):
            raise Forbidden(f"{path} is outside the trusted model directory {self.root}")
        return path.resolve()

    def resolve(self, key: str, version: str) -> ResolvedVersion:
        check_name("version", version)
        version_dir = self.model_dir(key) / version
        model_file = self._model_file(version_dir)
        if model_file is None:
            raise VersionNotFound(f"model {key!r} has no version {version!r} in {self.root}")
        self.check_trusted(model_file)
        manifest = None
        manifest_path = version_dir / MANIFEST_NAME
        if manifest_path.is_file():
            try:
                manifest = Manifest.from_bytes(manifest_path.read_bytes())
            except ManifestError as exc:
                raise BadRequest(f"{key}:{version}: {exc}") from exc
        return ResolvedVersion(model_file, manifest)
