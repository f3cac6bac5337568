"""The on-disk model repository (Triton-style): ``<root>/[<tenant>/]<model>/<version>/``.

Model files are read through :mod:`.trusted_files`: no link below the root is followed,
and the bytes handed to a backend are the very bytes that were hashed. A version's
manifest and the golden set it names are read from the same open directory as its model
file, so files of two builds are never mixed. The manifest is read first: where it has
chunk digests of the model file, the file is checked by them as it is read
(:mod:`.chunk_verifier`), not hashed whole."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from model_rollout_contract.canary import GOLDEN_FILE, InvalidPolicy, TrafficPolicy
from model_rollout_contract.layout import CURRENT_FILE, TRAFFIC_FILE
from model_rollout_contract.manifest import (
    MANIFEST_NAME,
    MODEL_FILE_NAMES,
    Manifest,
    ManifestError,
)
from model_rollout_contract.names import InvalidName, ModelKey, check_name, is_valid_name
from model_rollout_contract.versions import sorted_versions
from model_server.backends.base import ModelFile
from model_server.errors import BadRequest, Forbidden, LoadRefused, VersionNotFound
from model_server.files.chunk_verifier import ExpectedBytes, Mismatch
from model_server.files.private_copy import free
from model_server.files.spare_copies import SpareCopies
from model_server.files.trusted_files import (
    UntrustedPath,
    check_regular,
    open_directory,
    read_regular,
    read_regular_private,
    relative_parts,
)
from model_server.lifecycle.load_stages import HASH_WAIT, READ, READ_HASH, LoadStages

# CURRENT and TRAFFIC are a line of JSON or a name: a larger one is not the sidecar's
SMALL_FILE_LIMIT = 64 * 1024


@dataclass(frozen=True)
class VersionFiles:
    """A version's model file, manifest and golden set, read from one open directory."""

    model: ModelFile
    manifest: Manifest | None
    golden: bytes | None = None  # the golden set the manifest names (not yet checked)


class ModelRepository:
    def __init__(self, root: str | Path, spares: SpareCopies | None = None) -> None:
        """``spares``: where private copies are kept between loads (none: each goes)."""
        self.root = Path(root).resolve()
        self.spares = spares
        # an announced path may use the root as configured (say /models, a link) or resolved
        self._spellings = tuple(dict.fromkeys((self.root, Path(root).absolute())))

    def close(self) -> None:
        """Give back the private copies kept for later loads."""
        if self.spares is not None:
            for spare in self.spares.close():
                free(spare.mapping, spare.closer, spare.pins)

    def model_dir(self, key: str) -> Path:
        return self.root.joinpath(*ModelKey.parse(key).parts)

    def versions(self, key: str) -> list[str]:
        """The versions on disk, oldest first (the contract's version order)."""
        directory = self.model_dir(key)
        if not directory.is_dir():
            return []
        return sorted_versions(
            p.name
            for p in directory.iterdir()
            if p.is_dir()
            and is_valid_name(p.name)
            and any((p / n).is_file() for n in MODEL_FILE_NAMES)
        )

    def _model_file(self, key: str, name: str) -> tuple[Path, bytes | None]:
        """The model directory's file ``name`` (its path for messages, and its bytes or
        None if there is none), read like model files: a link is refused, never
        followed (``UntrustedPath``)."""
        parts = ModelKey.parse(key).parts
        shown = self.root.joinpath(*parts, name)
        try:
            with open_directory(self.root, parts) as directory:
                return shown, read_regular(directory, name, str(shown), SMALL_FILE_LIMIT)
        except (FileNotFoundError, NotADirectoryError):
            return shown, None

    def current_version(self, key: str) -> str | None:
        """The version the model's ``CURRENT`` file names (the sidecar writes it on every
        swap, so a restarted server serves what was served), or None if there is none.
        Read like model files: a link in its place is refused, never followed."""
        shown, text = self._model_file(key, CURRENT_FILE)
        if text is None:
            return None
        try:
            return check_name("version", text.decode("utf-8", "replace").strip())
        except InvalidName as exc:
            raise InvalidName(f"{shown}: {exc}") from None

    def traffic_policy(self, key: str) -> TrafficPolicy | None:
        """The canary traffic policy in the model's ``TRAFFIC`` file (the sidecar writes it
        beside ``CURRENT`` on a canary pod, so that a restarted server splits from its
        first request), or None if there is none. Read like ``CURRENT``; raises
        ``InvalidPolicy`` for a file that is not a policy, ``UntrustedPath`` for a link or
        a special file, ``OSError`` when it cannot be read."""
        shown, text = self._model_file(key, TRAFFIC_FILE)
        if text is None:
            return None
        try:
            return TrafficPolicy.from_annotation(text.decode("utf-8", "replace"))
        except InvalidPolicy as exc:
            raise InvalidPolicy(f"{shown}: {exc}") from None

    def read_version(
        self, key: str, version: str, stages: LoadStages | None = None
    ) -> VersionFiles:
        """The model file and manifest of ``key:version``, from the same directory
        descriptor, so a version directory swapped meanwhile cannot mix two versions
        (the read's and the hash's time added to ``stages``)."""
        stages = stages or LoadStages()
        try:
            parts = (*ModelKey.parse(key).parts, check_name("version", version))
        except InvalidName as exc:
            raise BadRequest(str(exc)) from exc
        shown = self.root.joinpath(*parts)
        what = f"{key}:{version}"
        try:
            with open_directory(self.root, parts) as directory:
                with stages.stage(READ):
                    manifest = _manifest(directory, shown, what)
                for name in MODEL_FILE_NAMES:
                    try:
                        model = _read_model(
                            directory, name, shown / name, stages, manifest, what, self.spares
                        )
                    except FileNotFoundError:
                        continue
                    with stages.stage(READ):
                        return self._golden_or_release(directory, shown, model, manifest, what)
        except UntrustedPath as exc:
            raise Forbidden(str(exc)) from exc
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as exc:
            raise LoadRefused(f"cannot read {shown}: {exc}") from exc
        raise VersionNotFound(f"model {key!r} has no version {version!r} in {self.root}")

    @classmethod
    def _golden_or_release(
        cls, directory: int, shown: Path, model: ModelFile, manifest: Manifest | None, what: str
    ) -> VersionFiles:
        """:meth:`_golden`; if that refuses the version, its model bytes go here (the
        reading thread), not with the error wherever it ends."""
        try:
            return cls._golden(directory, shown, model, manifest, what)
        except BaseException:
            model.release()
            raise

    @staticmethod
    def _golden(
        directory: int, shown: Path, model: ModelFile, manifest: Manifest | None, what: str
    ) -> VersionFiles:
        """``model`` with its manifest and the golden set beside it in ``directory``."""
        if manifest is None or manifest.golden is None:
            return VersionFiles(model, manifest)
        try:
            golden = read_regular(directory, GOLDEN_FILE, str(shown / GOLDEN_FILE))
        except FileNotFoundError:
            raise LoadRefused(
                f"{what}: its manifest names a golden set, but {shown / GOLDEN_FILE} does not exist"
            ) from None
        return VersionFiles(model, manifest, golden)

    def read_announced(
        self, path: Path, what: str, stages: LoadStages | None = None
    ) -> VersionFiles:
        """An announced model file (the sidecar's ``path``: inside the repository, no
        link on the way, a regular file; read once) with the manifest and golden set
        beside it; ``what`` names the version in messages."""
        parts = self._parts(path)
        stages = stages or LoadStages()
        try:
            with open_directory(self.root, parts[:-1]) as directory:
                with stages.stage(READ):
                    manifest = _manifest(directory, path.parent, what)
                model = _read_model(directory, parts[-1], path, stages, manifest, what, self.spares)
                with stages.stage(READ):
                    return self._golden_or_release(directory, path.parent, model, manifest, what)
        except UntrustedPath as exc:
            raise Forbidden(str(exc)) from exc
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise LoadRefused(f"{path} does not exist") from exc
        except OSError as exc:
            raise LoadRefused(f"cannot read {path}: {exc}") from exc

    def check_model_path(self, path: Path) -> None:
        """The checks of :meth:`read_announced` without reading: for an announced path whose
        version is already loaded (a pointer swap must not accept what a load refuses)."""
        parts = self._parts(path)
        try:
            with open_directory(self.root, parts[:-1]) as directory:
                check_regular(directory, parts[-1], str(path))
        except UntrustedPath as exc:
            raise Forbidden(str(exc)) from exc
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise LoadRefused(f"{path} does not exist") from exc
        except OSError as exc:
            raise LoadRefused(f"cannot read {path}: {exc}") from exc

    def _parts(self, path: Path) -> tuple[str, ...]:
        try:
            parts = relative_parts(path, self._spellings)
        except UntrustedPath as exc:
            raise Forbidden(str(exc)) from exc
        if parts[-1] not in MODEL_FILE_NAMES:
            raise Forbidden(f"{path} is not a model file (one of {', '.join(MODEL_FILE_NAMES)})")
        return parts


def _manifest(directory: int, shown: Path, what: str) -> Manifest | None:
    """The manifest in the open version ``directory``, or None if it has none."""
    try:
        raw = read_regular(directory, MANIFEST_NAME, str(shown / MANIFEST_NAME))
    except FileNotFoundError:
        return None
    try:
        return Manifest.from_bytes(raw)
    except ManifestError as exc:
        raise BadRequest(f"{what}: {exc}") from exc


def _read_model(
    directory: int,
    name: str,
    shown: Path,
    stages: LoadStages,
    manifest: Manifest | None,
    what: str,
    spares: SpareCopies | None = None,
) -> ModelFile:
    """The model file ``name`` of the open ``directory``, read once into its private copy
    and hashed as it is read, or checked by ``manifest``'s chunk digests where it has
    them (``read_hash``, then ``hash_wait`` for the hash to catch up after the last
    byte, in ``stages``); a size or chunk that differs from the manifest's is refused."""
    started = time.perf_counter()
    try:
        expected = ExpectedBytes.of(manifest, name)
        hashed = read_regular_private(directory, name, str(shown), expected, spares)
    except Mismatch as exc:
        raise LoadRefused(f"{what}: {exc}") from exc
    took = time.perf_counter() - started
    stages.add(READ_HASH, max(0.0, took - hashed.hash_wait_s))
    stages.add(HASH_WAIT, hashed.hash_wait_s)
    return ModelFile(shown, hashed.copy.view, hashed.sha256, hashed.copy)
