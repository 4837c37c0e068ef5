"""Crash-safe file replacement: temp file in the target folder, fsync, ``os.replace``.

A file written through this module is either its old content or its complete new
content, also after a crash or a power cut:

1. the new content goes to a temp file ``.<name>.tmp-<random>`` in the destination's
   folder, created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (never an existing file,
   never through a link) and locked with ``flock`` while it is written;
2. the temp file is flushed and ``fsync``-ed;
3. ``os.replace`` renames it over the destination (atomic on POSIX within one folder);
4. the folder is ``fsync``-ed so that the rename itself is durable.

A destination that is a symbolic link is refused (``UnsafeDestinationError``), never
followed: its target stays untouched. A temp file left by a killed writer keeps its
recognisable name, is never visible under the final name, and is deleted by the next
write to the same destination once no live process holds its lock.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

__all__ = ["StagedFile", "UnsafeDestinationError", "atomic_write", "check_destination",
           "fsync_directory", "remove_stale_temps", "stage", "temp_prefix"]

_LOG = logging.getLogger(__name__)

STALE_AFTER_S = 2.0
"""A leftover temp file younger than this is never removed (its writer may have just created it)."""


class UnsafeDestinationError(OSError):
    """The destination is a symbolic link, a folder or another non-regular file."""


def temp_prefix(final: Path) -> str:
    """Name prefix of the temp files for ``final``: ``.<name>.tmp-``."""
    return f".{final.name}.tmp-"


def check_destination(final: Path) -> None:
    """Refuse a destination that exists and is not a regular file (symlinks are not followed).

    Raises:
        UnsafeDestinationError: ``final`` is a symlink, a folder or a special file.
    """
    try:
        st = os.lstat(final)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeDestinationError(
            errno.EEXIST, f"{final} is a symbolic link (to {os.readlink(final)!r}); refusing to replace or follow it")
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise UnsafeDestinationError(errno.EEXIST, f"{final} is {kind}; refusing to replace it")


@dataclass
class StagedFile:
    """A complete, fsync-ed temp file waiting to replace ``final`` (see ``stage``)."""

    final: Path
    temp: Path

    def commit(self) -> None:
        """Rename the temp file over ``final`` (atomic; the folder is not fsync-ed here)."""
        check_destination(self.final)
        os.replace(self.temp, self.final)

    def discard(self) -> None:
        """Delete the temp file (no error if it is already gone)."""
        try:
            os.unlink(self.temp)
        except FileNotFoundError:
            pass


def stage(final: str | Path, write: Callable[[BinaryIO], None]) -> StagedFile:
    """Write a temp file next to ``final`` with ``write(f)`` and fsync it; ``final`` is not touched.

    The temp file gets mode 0666 minus the umask (like a plain ``open``). On any
    error (including one raised by ``write``) the temp file is deleted and the
    error propagates.

    Raises:
        UnsafeDestinationError: ``final`` is a symlink, folder or special file.
        OSError: the folder is missing or not writable, the disk is full, ...
    """
    final = Path(final)
    check_destination(final)
    remove_stale_temps(final)
    fd, temp = _create_temp(final)
    try:
        with os.fdopen(fd, "wb") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # tells remove_stale_temps that a writer is alive
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink_quietly(temp)
        raise
    return StagedFile(final, temp)


def atomic_write(final: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """Replace ``final`` by what ``write(f)`` writes, crash-safely (see the module docstring).

    Returns:
        ``final`` as a Path.
    """
    staged = stage(final, write)
    try:
        staged.commit()
    except BaseException:
        staged.discard()
        raise
    fsync_directory(staged.final.parent)
    return staged.final


class GroupWriteError(OSError):
    """``write_group`` failed: ``committed`` names the files already renamed (in order), ``cause``
    the error; the temp files of the others are gone."""

    def __init__(self, committed: list[Path], cause: OSError) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.committed, self.cause = committed, cause


def write_group(files: list[tuple[Path, Callable[[BinaryIO], None]]],
                on_partial: Callable[[list[Path]], None] | None = None) -> None:
    """Stage every file first (nothing is replaced while one cannot be written), then rename them
    in order and fsync their folder. GroupWriteError (``committed``: how far the renames got) on an
    OS error; temp files never outlive a failure; ``on_partial(committed)`` runs after any failure
    that left some but not all files renamed (whatever the exception)."""
    staged: list[StagedFile] = []
    committed: list[Path] = []
    try:
        for final, write in files:
            staged.append(stage(final, write))
        for item in staged:
            item.commit()
            committed.append(item.final)
        fsync_directory(staged[-1].final.parent)
    except OSError as exc:
        raise GroupWriteError(list(committed), exc) from None
    finally:
        for item in staged:
            if item.final not in committed:
                item.discard()
        if on_partial is not None and 0 < len(committed) < len(files):
            on_partial(list(committed))


def fsync_directory(folder: str | Path) -> None:
    """fsync a folder so that renames inside it survive a power cut."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temps(final: str | Path) -> list[Path]:
    """Delete temp files of ``final`` left by writers that died (no lock held, older than STALE_AFTER_S).

    Returns:
        The paths removed. Errors (permissions, races with other writers) are logged at debug and skipped.
    """
    final = Path(final)
    prefix = temp_prefix(final)
    removed = []
    try:
        names = [n for n in os.listdir(final.parent) if n.startswith(prefix)]
    except OSError:
        return removed
    for name in names:
        path = final.parent / name
        try:
            if _is_abandoned(path):
                os.unlink(path)
                removed.append(path)
                _LOG.info("removed %s, left by an interrupted write", path)
        except OSError as exc:
            _LOG.debug("left %s in place: %s", path, exc)
    return removed


def _is_abandoned(path: Path) -> bool:
    """True when ``path`` is a regular file, old enough, and no process holds its flock."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or time.time() - st.st_mtime < STALE_AFTER_S:
        return False
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # releases the probe's lock
    return True


def _create_temp(final: Path) -> tuple[int, Path]:
    """Create a new temp file next to ``final`` (O_EXCL | O_NOFOLLOW); returns (fd, path)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        temp = final.parent / f"{temp_prefix(final)}{secrets.token_hex(4)}"
        try:
            return os.open(temp, flags, 0o666), temp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temp file name next to {final}")


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
