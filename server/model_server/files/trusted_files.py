"""Reading a file inside a trusted directory so that what is checked is what is read.

Every component below the root is opened relative to its parent's descriptor with
``O_NOFOLLOW``, so a symbolic link anywhere below the root is refused, never followed,
even when it is swapped in between two steps; the file itself is checked (``fstat``: a
regular file) on the descriptor its bytes are then read from, once. Resolving a path and
reopening it later would leave a window for a directory or file swap."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath

from model_server.files.chunk_verifier import ExpectedBytes
from model_server.files.private_copy import HashedCopy, read_into_private_copy
from model_server.files.spare_copies import SpareCopies

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO put in the file's place makes the open return instead of hang; it
# is then refused as not a regular file (reads of regular files ignore the flag)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class UntrustedPath(Exception):
    """A path that leaves the trusted directory, or that goes through a link or a
    special file on the way."""


def relative_parts(path: Path, roots: Sequence[Path]) -> tuple[str, ...]:
    """The components of ``path`` below the first of ``roots`` it is written under,
    judged on the text alone (``..`` is refused, not resolved)."""
    if not path.is_absolute():
        raise UntrustedPath(f"{path} is not an absolute path")
    if ".." in PurePosixPath(path).parts:
        raise UntrustedPath(f"{path} contains '..'")
    for root in roots:
        if path.is_relative_to(root) and path != root:
            return path.relative_to(root).parts
    raise UntrustedPath(f"{path} is outside the trusted model directory {roots[0]}")


def _is_link(parent: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _open_below(parent: int, name: str, flags: int, shown: str) -> int:
    try:
        return os.open(name, flags, dir_fd=parent)
    except OSError as exc:
        # a link gives ELOOP, or ENOTDIR when a directory was asked for
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and _is_link(parent, name)):
            raise UntrustedPath(f"{shown} is a symbolic link: links are not followed") from exc
        if exc.errno == errno.ENOTDIR:
            raise UntrustedPath(f"{shown} is not a directory") from exc
        raise


@contextlib.contextmanager
def open_directory(root: Path, parts: Sequence[str]) -> Iterator[int]:
    """A descriptor of ``root/parts…``, reached without following any link below
    ``root`` (the root itself is trusted as configured)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        shown = root
        for part in parts:
            shown = shown / part
            child = _open_below(fd, part, _DIR_FLAGS, str(shown))
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def read_regular(directory: int, name: str, shown: str, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``name`` in the open ``directory``, read once from
    the descriptor that was checked. ``FileNotFoundError`` if there is none; a file of
    more than ``limit`` bytes is refused unread (``UntrustedPath``)."""
    fd = _open_below(directory, name, _FILE_FLAGS, shown)
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise UntrustedPath(f"{shown} is not a regular file")
        if limit is not None and status.st_size > limit:
            raise UntrustedPath(f"{shown} is {status.st_size} bytes, more than {limit}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read() if limit is None else f.read(limit + 1)
        if limit is not None and len(data) > limit:  # grown since the fstat
            raise UntrustedPath(f"{shown} is more than {limit} bytes")
        return data
    finally:
        os.close(fd)


def read_regular_private(
    directory: int,
    name: str,
    shown: str,
    expected: ExpectedBytes | None = None,
    spares: SpareCopies | None = None,
) -> HashedCopy:
    """Like :func:`read_regular` with no limit, into a :class:`PrivateCopy` (model files:
    large bytes that are read and let go without holding the GIL), hashed as it is read
    (checked against ``expected``'s chunk digests where given)."""
    fd = _open_below(directory, name, _FILE_FLAGS, shown)
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise UntrustedPath(f"{shown} is not a regular file")
        return read_into_private_copy(
            fd, status.st_size, name, shown, expected=expected, spares=spares
        )
    finally:
        os.close(fd)


def check_regular(directory: int, name: str, shown: str) -> None:
    """Raise unless ``name`` in ``directory`` is a regular file (no link), without
    reading it."""
    fd = _open_below(directory, name, _FILE_FLAGS, shown)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UntrustedPath(f"{shown} is not a regular file")
    finally:
        os.close(fd)
