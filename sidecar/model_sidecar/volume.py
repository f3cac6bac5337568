"""The shared volume, reached only through directory file descriptors that never follow a
symbolic link.

The server's container (or whatever took it over) writes to the same volume: a link
planted there must not make the sidecar write, read or delete anything outside it. So
every directory below a configured path is opened with ``O_DIRECTORY | O_NOFOLLOW`` from
its parent's descriptor, files are opened with ``O_NOFOLLOW`` (new ones with ``O_EXCL``
under a random name), renames and deletes name their directories by descriptor
(``dir_fd``), and trees are removed with :func:`shutil.rmtree` over a descriptor, which
checks each directory it enters. A link where the sidecar expects a directory or a file
is refused with :class:`~model_sidecar.errors.UnsafeVolume`; no space is
:class:`~model_sidecar.errors.VolumeFull`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from model_rollout_contract.names import ModelKey

from .errors import UnsafeVolume, VolumeError, VolumeFull

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def write_error(exc: OSError, what: str) -> Exception:
    """The sidecar's error for a failed write: no space is its own, the rest stay as
    they are (the same object)."""
    if exc.errno in _NO_SPACE:
        return VolumeFull(f"{what}: no space left on the volume ({exc.strerror})")
    return exc


def _valid_entry(name: str) -> str:
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"{name!r} is not a single directory entry")
    return name


class SafeDir:
    """One open directory of the volume (close it, or use it as a context manager)."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path  # for messages only: never used to reach anything

    @classmethod
    def open(cls, path: Path, create: bool = False) -> SafeDir:
        """A configured directory (the volume, the status file's): the path the
        administrator gave is taken as it is; only what lies below it is guarded."""
        if create:
            path.mkdir(parents=True, exist_ok=True)
        return cls(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SafeDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _refusal(self, name: str, exc: OSError) -> Exception:
        """Why opening ``name`` failed: a link (or a non-directory) is unsafe."""
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
            kind = self.kind(name)
            if kind == "link":
                target = os.readlink(name, dir_fd=self.fd)
                return UnsafeVolume(
                    f"refusing to follow the symbolic link {self.path / name} -> {target}"
                )
            return UnsafeVolume(f"{self.path / name} is a {kind}, not what the sidecar wrote")
        return write_error(exc, str(self.path / name))

    def kind(self, name: str) -> str | None:
        """``dir``, ``file``, ``link``, ``other``, or ``None`` when absent (never followed)."""
        try:
            mode = os.lstat(_valid_entry(name), dir_fd=self.fd).st_mode
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(mode):
            return "link"
        if stat.S_ISDIR(mode):
            return "dir"
        return "file" if stat.S_ISREG(mode) else "other"

    @contextlib.contextmanager
    def _guard(self, name: str) -> Iterator[None]:
        """Turn an ``OSError`` about ``name`` into the sidecar's error when it is one."""
        try:
            yield
        except FileNotFoundError:
            raise
        except OSError as exc:
            error = self._refusal(name, exc)
            if error is exc:
                raise
            raise error from exc

    def child(self, name: str, create: bool = False) -> SafeDir:
        """The subdirectory ``name``, created when asked; a link there is refused.
        Raises ``FileNotFoundError`` when it is absent and not to be created."""
        _valid_entry(name)
        with self._guard(name):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=self.fd)
            return SafeDir(os.open(name, _DIR_FLAGS, dir_fd=self.fd), self.path / name)

    def model_dir(self, key: str, create: bool = False) -> SafeDir:
        """The directory of the model ``key``: ``name``, or ``tenant/name`` (a tenant's
        models lie in its own directory), opened one component at a time, so a link at
        either level is refused like any other. Raises ``FileNotFoundError`` as
        :meth:`child` does."""
        first, *rest = ModelKey.parse(key).parts
        directory = self.child(first, create)
        for name in rest:
            parent = directory
            try:
                directory = parent.child(name, create)
            finally:
                parent.close()
        return directory

    def open_read(self, name: str) -> BinaryIO:
        """A regular file of this directory, for reading; a link is refused."""
        with self._guard(name):
            fd = os.open(_valid_entry(name), _READ_FLAGS, dir_fd=self.fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UnsafeVolume(f"{self.path / name} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")

    def read_bytes(self, name: str, limit: int) -> bytes:
        with self.open_read(name) as f:
            if os.fstat(f.fileno()).st_size > limit:
                raise VolumeError(f"{self.path / name} is larger than {limit} bytes")
            return f.read(limit + 1)

    def create(self, name: str) -> BinaryIO:
        """A new file (never an existing one, never through a link), for writing."""
        try:
            with self._guard(name):
                fd = os.open(_valid_entry(name), _CREATE_FLAGS, 0o644, dir_fd=self.fd)
        except FileExistsError as exc:
            raise UnsafeVolume(f"{self.path / name} exists already") from exc
        return os.fdopen(fd, "wb")

    def write_atomic(self, name: str, data: bytes) -> None:
        """Replace ``name`` with ``data``: written under a random name, synced, renamed
        over it (a link at ``name`` is replaced, never followed)."""
        tmp = f".{_valid_entry(name)}.{secrets.token_hex(6)}.tmp"
        try:
            with self._guard(name):
                with self.create(tmp) as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
                self.fsync()
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
            raise

    def move(self, name: str, destination: SafeDir, new_name: str) -> None:
        """Rename an entry of this directory into ``destination`` (same filesystem)."""
        os.rename(
            _valid_entry(name),
            _valid_entry(new_name),
            src_dir_fd=self.fd,
            dst_dir_fd=destination.fd,
        )

    def remove(self, name: str) -> None:
        """Delete ``name``: a directory with everything in it, else the entry itself (a
        link is unlinked, its target left alone). Absent is fine."""
        kind = self.kind(name)
        if kind is None:
            return
        if kind == "dir":
            shutil.rmtree(name, dir_fd=self.fd)
        else:
            os.unlink(name, dir_fd=self.fd)

    def entries(self) -> Iterator[tuple[str, str]]:
        """``(name, kind)`` of each entry, as :meth:`kind` names them."""
        with os.scandir(self.fd) as scan:
            for entry in scan:
                if entry.is_symlink():
                    yield entry.name, "link"
                elif entry.is_dir(follow_symlinks=False):
                    yield entry.name, "dir"
                elif entry.is_file(follow_symlinks=False):
                    yield entry.name, "file"
                else:
                    yield entry.name, "other"

    def fsync(self) -> None:
        os.fsync(self.fd)
