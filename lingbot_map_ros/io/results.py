"""Replay outputs written as the frames come, with bounded memory.

- ``TumStreamWriter``: a TUM trajectory, one line a frame.
- ``PlyStreamWriter``: a binary PLY point cloud (x, y, z float32; red, green, blue
  uint8), appended a frame at a time; the vertex count in the header is filled in
  at the end.
- ``PredictionStore``: the per-frame arrays. The small ones (pose_enc [S, 9],
  pose_c2w [S, 4, 4], intrinsics [S, 3, 3], is_keyframe [S], stamp_ns [S], window
  [S]: ~150 bytes a frame) are kept and go into one npz at the end. Depth and its
  confidence [H, W] float32 (the ``DepthPolicy`` chooses which frames keep them) are
  held for at most ``chunk_frames`` frames, in two arrays allocated once: a run that keeps no more than that puts
  them into the same npz (``depth`` / ``depth_conf`` [D, H, W], ``depth_frames`` [D]
  row indices), a longer one writes one npz per ``chunk_frames`` frames into the
  folder ``<name>.chunks`` next to it and lists them in ``depth_chunks``.
  ``load_predictions`` reads either layout back.

Files get their final name only when complete: while a run goes on they are
``<name>.partial`` (the chunk folder ``<name>.chunks.partial``); ``close()`` flushes,
fsyncs and renames them (``os.replace``, the folder fsync-ed; npz files through
``atomic.stage``/``atomic_write``); ``abort()`` finishes them as far as they go and leaves
them under the ``.partial`` names, which it returns. When ``close()`` raises (a full or
read-only disk) the final name is untouched and ``abort()`` may still be called; when
``abort()`` raises too, ``leftovers()`` names what is on disk (incomplete). A destination
that is a link, a folder or a special file is refused (``atomic.UnsafeDestinationError``);
with ``overwrite=False`` one that exists when ``close()`` renames is refused too
(``FileExistsError``). Frames and units are the caller's (the replay writes the model's
OpenCV world, model units).
"""
from __future__ import annotations

import errno
import io
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ..geometry import matrix_to_quaternion
from .atomic import atomic_write, check_destination, fsync_directory, stage

PARTIAL = ".partial"


def partial_path(path: Path) -> Path:
    """Where ``path`` is written until it is complete."""
    return path.with_name(path.name + PARTIAL)


def open_partial(final: Path, text: bool = False):
    """A new file ``<final>.partial`` for writing (an earlier run's is replaced; links are not followed).

    Raises:
        UnsafeDestinationError: ``final`` itself is a link, a folder or a special file.
    """
    check_destination(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    path = partial_path(final)
    try:
        if not path.is_dir():
            path.unlink()
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    return os.fdopen(fd, "w", encoding="ascii") if text else os.fdopen(fd, "w+b")


def check_replaceable(final: Path, overwrite: bool) -> None:
    """Refuse ``final`` when it is a link, a folder or a special file, or (``overwrite`` False) when it exists.

    Raises:
        UnsafeDestinationError, FileExistsError.
    """
    check_destination(final)
    if not overwrite and os.path.lexists(final):
        raise FileExistsError(errno.EEXIST, f"{final} exists already (not replaced without overwrite)")


def finish_file(handle, final: Path, overwrite: bool = True) -> None:
    """Flush, fsync and close ``handle`` (open on ``partial_path(final)``), then rename it to ``final``."""
    handle.flush()
    os.fsync(handle.fileno())
    handle.close()
    check_replaceable(final, overwrite)
    os.replace(partial_path(final), final)
    fsync_directory(final.parent)


def replace_folder(new: Path, final: Path, overwrite: bool = True) -> Path | None:
    """Rename folder ``new`` to ``final``. An existing ``final`` (``overwrite`` only, else FileExistsError)
    is first renamed aside to a hidden name, returned: delete it with ``shutil.rmtree`` once the
    replacement is final, or put it back with ``restore_folder``. None when there was none."""
    aside = None
    if os.path.lexists(final):
        if not overwrite:
            raise FileExistsError(errno.EEXIST, f"{final} exists already (not replaced without overwrite)")
        if final.is_symlink() or not final.is_dir():
            raise FileExistsError(errno.EEXIST, f"{final} exists and is not a folder; refusing to replace it")
        aside = final.with_name(f".{final.name}.replaced-{secrets.token_hex(4)}")
        os.replace(final, aside)
    try:
        os.replace(new, final)
    except BaseException:
        if aside is not None:
            os.replace(aside, final)
        raise
    return aside


def restore_folder(final: Path, new: Path, aside: Path | None) -> None:
    """Undo ``replace_folder``: ``final`` back to ``new``, the folder it replaced back to ``final``."""
    os.replace(final, new)
    if aside is not None:
        os.replace(aside, final)


def save_npz_atomic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """``np.savez`` written crash-safely to ``path`` (``atomic.atomic_write``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: np.savez(f, **arrays))


# ----------------------------------------------------------------------------- TUM

class TumStreamWriter:
    """A TUM trajectory written line by line: ``t tx ty tz qx qy qz qw`` (as ``export.write_tum``)."""

    def __init__(self, path: str | Path, overwrite: bool = True) -> None:
        self.path, self.overwrite = Path(path), overwrite
        self._file = open_partial(self.path, text=True)
        self._file.write("# timestamp tx ty tz qx qy qz qw\n")
        self.count = 0

    def add(self, stamp_s: float, c2w: np.ndarray) -> None:
        """One pose: ``stamp_s`` seconds, ``c2w`` [4, 4] camera-to-world (rotation camera -> world)."""
        c2w = np.asarray(c2w, dtype=np.float64)
        quat = matrix_to_quaternion(c2w[:3, :3])
        values = " ".join(f"{v:.9g}" for v in (*c2w[:3, 3], *quat))
        self._file.write(f"{stamp_s:.9f} {values}\n")
        self.count += 1

    def close(self) -> Path:
        finish_file(self._file, self.path, self.overwrite)
        return self.path

    def abort(self) -> Path:
        self._file.close()
        return partial_path(self.path)

    def leftovers(self) -> list[Path]:
        """What this writer may have left on disk when ``abort`` failed."""
        return [partial_path(self.path)]


# ----------------------------------------------------------------------------- PLY

_COUNT_DIGITS = 12  # the header's vertex count, zero-padded so that it can be rewritten in place
_PLY_DTYPE = np.dtype([("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("red", "u1"), ("green", "u1"), ("blue", "u1")])


class PlyStreamWriter:
    """A binary little-endian PLY appended a frame at a time (readable by ``export.read_ply``)."""

    def __init__(self, path: str | Path, overwrite: bool = True) -> None:
        self.path, self.overwrite = Path(path), overwrite
        self._file = open_partial(self.path)
        self._file.write(self._header(0))
        self.count = 0

    @staticmethod
    def _header(count: int) -> bytes:
        lines = ["ply", "format binary_little_endian 1.0", f"element vertex {count:0{_COUNT_DIGITS}d}",
                 "property float x", "property float y", "property float z",
                 "property uchar red", "property uchar green", "property uchar blue", "end_header"]
        return ("\n".join(lines) + "\n").encode("ascii")

    def add(self, points: np.ndarray, colors: np.ndarray) -> None:
        """Append ``points`` [N, 3] (stored as float32) with ``colors`` [N, 3] uint8 RGB."""
        points, colors = np.asarray(points), np.asarray(colors)
        if points.ndim != 2 or points.shape[1] != 3 or colors.shape != points.shape or colors.dtype != np.uint8:
            raise ValueError(f"points [N, 3] and uint8 colors [N, 3] expected, got {points.shape} and "
                             f"{colors.dtype} {colors.shape}")
        rows = np.empty(points.shape[0], _PLY_DTYPE)
        for i, axis in enumerate("xyz"):
            rows[axis] = points[:, i]
        for i, channel in enumerate(("red", "green", "blue")):
            rows[channel] = colors[:, i]
        self._file.write(rows.tobytes())
        self.count += points.shape[0]

    def _write_count(self) -> None:
        self._file.seek(0)
        self._file.write(self._header(self.count))
        self._file.seek(0, io.SEEK_END)

    def close(self) -> Path:
        self._write_count()
        finish_file(self._file, self.path, self.overwrite)
        return self.path

    def abort(self) -> Path:
        if not self._file.closed:  # (closed: a close() that failed at the rename left it complete)
            try:
                self._write_count()  # what is there stays a valid PLY
            finally:
                self._file.close()
        return partial_path(self.path)

    def leftovers(self) -> list[Path]:
        """What this writer may have left on disk when ``abort`` failed."""
        return [partial_path(self.path)]


# ----------------------------------------------------------------------------- per-frame arrays

@dataclass(frozen=True)
class DepthPolicy:
    """Which frames keep depth and confidence: ``none``, ``all`` or ``every-K`` (rows 0, K, 2K, ...)."""

    every: int  # 0 = none, 1 = all

    @classmethod
    def parse(cls, text: str) -> "DepthPolicy":
        if text == "none":
            return cls(0)
        if text == "all":
            return cls(1)
        match = re.fullmatch(r"every-([1-9][0-9]*)", text)
        if match is None:
            raise ValueError(f"--save-depth must be none, all or every-K (K a positive integer, e.g. every-10), "
                             f"got {text!r}")
        return cls(int(match.group(1)))

    def keeps(self, row: int) -> bool:
        return self.every > 0 and row % self.every == 0


class _Column:
    """A growable array of fixed-shape rows (amortised doubling)."""

    def __init__(self, shape: tuple[int, ...], dtype) -> None:
        self._data = np.empty((64, *shape), dtype)
        self.size = 0

    def append(self, value) -> None:
        if self.size == self._data.shape[0]:
            grown = np.empty((2 * self.size, *self._data.shape[1:]), self._data.dtype)
            grown[:self.size] = self._data
            self._data = grown
        self._data[self.size] = value
        self.size += 1

    def array(self) -> np.ndarray:
        return self._data[:self.size].copy()


_SMALL = {  # name -> (row shape, dtype)
    "pose_enc": ((9,), np.float32), "pose_c2w": ((4, 4), np.float32), "intrinsics": ((3, 3), np.float32),
    "is_keyframe": ((), np.bool_), "stamp_ns": ((), np.int64), "window": ((), np.int32),
}


class _DepthBuffer:
    """Depth and confidence of up to ``capacity`` frames in two float32 arrays [capacity, H, W],
    allocated at the first frame and reused chunk after chunk (no allocation per frame or chunk)."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.size = capacity, 0
        self._rows = np.zeros(capacity, np.int64)
        self._depth: np.ndarray | None = None
        self._conf: np.ndarray | None = None

    @property
    def full(self) -> bool:
        return self.size == self.capacity

    def append(self, row: int, depth: np.ndarray, confidence: np.ndarray) -> None:
        if self._depth is None:
            self._depth = np.empty((self.capacity, *np.shape(depth)), np.float32)
            self._conf = np.empty_like(self._depth)
        if np.shape(depth) != self._depth.shape[1:] or np.shape(confidence) != self._depth.shape[1:]:
            raise ValueError(f"depth and confidence must be {self._depth.shape[1:]} like the first frame's, got "
                             f"{np.shape(depth)} and {np.shape(confidence)}")
        self._rows[self.size], self._depth[self.size], self._conf[self.size] = row, depth, confidence
        self.size += 1

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows [n], depth [n, H, W], confidence [n, H, W]) held, as views; the buffer is emptied
        (the views stay valid until the next ``append``)."""
        views = self.peek()
        self.size = 0
        return views

    def peek(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """As ``arrays``, but the buffer keeps them."""
        n = self.size
        return self._rows[:n], self._depth[:n], self._conf[:n]


class PredictionStore:
    """The per-frame arrays of a replay (see the module docstring for the layout)."""

    def __init__(self, path: str | Path, depth: DepthPolicy = DepthPolicy(1), chunk_frames: int = 100,
                 overwrite: bool = True) -> None:
        if chunk_frames < 1:
            raise ValueError(f"chunk_frames must be >= 1, got {chunk_frames}")
        self.path, self.overwrite = Path(path), overwrite
        check_destination(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial_path(self.path).unlink(missing_ok=True)  # an earlier run's (this run's replaces it)
        self.policy, self.chunk_frames = depth, chunk_frames
        self._columns = {name: _Column(shape, dtype) for name, (shape, dtype) in _SMALL.items()}
        self._depth_rows: list[int] = []  # every row that kept depth
        self._buffer = _DepthBuffer(chunk_frames)  # depth not yet in a chunk
        self._chunks: list[str] = []  # chunk file names, relative to the npz's folder

    @property
    def count(self) -> int:
        return self._columns["pose_enc"].size

    @property
    def chunk_dir(self) -> Path:
        return self.path.with_name(self.path.stem + ".chunks")

    def add(self, pose_enc: np.ndarray, c2w: np.ndarray, intrinsics: np.ndarray, is_keyframe: bool, stamp_ns: int,
            window: int, depth: np.ndarray | None = None, confidence: np.ndarray | None = None) -> None:
        """One frame: pose_enc [9], c2w [4, 4], intrinsics [3, 3] (pixels), depth / confidence [H, W]
        (None when the model ran without its depth head)."""
        row = self.count
        for name, value in (("pose_enc", pose_enc), ("pose_c2w", c2w), ("intrinsics", intrinsics),
                            ("is_keyframe", is_keyframe), ("stamp_ns", stamp_ns), ("window", window)):
            self._columns[name].append(value)
        if depth is not None and confidence is not None and self.policy.keeps(row):
            self._depth_rows.append(row)
            self._buffer.append(row, depth, confidence)
            if self._buffer.full:
                self._flush_chunk()

    def _flush_chunk(self) -> None:
        n = self._buffer.size
        rows, depth, conf = self._buffer.arrays()
        name = f"{self.chunk_dir.name}/depth_{rows[0]:08d}_{rows[-1]:08d}.npz"
        folder = partial_path(self.chunk_dir)
        try:
            if not self._chunks:
                if folder.exists():
                    shutil.rmtree(folder)  # left by an earlier run that was interrupted
                folder.mkdir(parents=True)
            save_npz_atomic(folder / Path(name).name, {"depth": depth, "depth_conf": conf, "depth_frames": rows})
        except BaseException:
            self._buffer.size = n  # still held (the views stay valid): abort() may try again
            raise
        self._chunks.append(name)

    def _arrays(self, folder: str | None = None) -> dict[str, np.ndarray]:
        """The npz's arrays; ``folder`` renames the chunks' folder in ``depth_chunks``."""
        arrays = {name: column.array() for name, column in self._columns.items()}
        arrays["depth_frames"] = np.array(self._depth_rows, dtype=np.int64)
        if self._chunks:
            names = [name if folder is None else f"{folder}/{name.split('/', 1)[1]}" for name in self._chunks]
            arrays["depth_chunks"] = np.array(names)
        elif self._buffer.size:
            _, arrays["depth"], arrays["depth_conf"] = self._buffer.peek()  # kept: abort() may follow close()
        return arrays

    def close(self) -> list[Path]:
        """Write the npz (and the last chunk); returns the final paths.

        With chunks: the npz is staged (complete and fsync-ed under a temp name) before the chunk
        folder gets its final name, and renamed last; when a step fails, what was renamed is put
        back (the chunks stay in ``<name>.chunks.partial`` for ``abort``) and the error propagates."""
        if self._chunks and self._buffer.size:
            self._flush_chunk()
        check_replaceable(self.path, self.overwrite)
        if not self._chunks:
            save_npz_atomic(self.path, self._arrays())
            if self.overwrite and self.chunk_dir.is_dir() and not self.chunk_dir.is_symlink():
                shutil.rmtree(self.chunk_dir, ignore_errors=True)  # the replaced npz's chunks
            return [self.path]
        staged = stage(self.path, lambda f: np.savez(f, **self._arrays()))
        try:
            aside = replace_folder(partial_path(self.chunk_dir), self.chunk_dir, self.overwrite)
        except BaseException:
            staged.discard()
            raise
        try:
            check_replaceable(self.path, self.overwrite)
            staged.commit()
            fsync_directory(self.path.parent)
        except BaseException:
            staged.discard()
            restore_folder(self.chunk_dir, partial_path(self.chunk_dir), aside)
            raise
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)  # the replaced run's chunks
        return [self.path, self.chunk_dir]

    def abort(self) -> list[Path]:
        """Write what there is as ``<name>.partial`` (chunks stay in ``<name>.chunks.partial``),
        crash-safely: on an error nothing of the npz is left (``leftovers`` names the chunks)."""
        folder = partial_path(self.chunk_dir)
        if not self._chunks:
            _remove_empty_folder(folder)  # a first chunk that could not be written
        if self._chunks and self._buffer.size:
            self._flush_chunk()
        atomic_write(partial_path(self.path), lambda f: np.savez(f, **self._arrays(folder.name)))
        kept = [partial_path(self.path)]
        return kept + ([folder] if self._chunks else [])

    def leftovers(self) -> list[Path]:
        """What this writer may have left on disk when ``abort`` failed."""
        return [partial_path(self.path), partial_path(self.chunk_dir)]


def _remove_empty_folder(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:  # missing, or not empty
        pass


def load_predictions(path: str | Path, depth: bool = True) -> dict[str, np.ndarray]:
    """Read a replay's npz; with ``depth``, chunked depth is read and concatenated into
    ``depth`` / ``depth_conf`` [D, H, W] (rows ``depth_frames``). Mind the memory of long runs:
    ``iter_depth`` reads one chunk at a time."""
    path = Path(path)
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    if depth and "depth_chunks" in arrays:
        parts = list(iter_depth(path, arrays["depth_chunks"]))
        if parts:
            arrays["depth"] = np.concatenate([p[1] for p in parts])
            arrays["depth_conf"] = np.concatenate([p[2] for p in parts])
    return arrays


def iter_depth(path: str | Path, chunks: np.ndarray | None = None) -> Iterator[tuple[np.ndarray, np.ndarray,
                                                                                        np.ndarray]]:
    """(rows [n], depth [n, H, W], depth_conf [n, H, W]) of each depth chunk of a replay's npz, in order
    (one block with every kept frame when the run was short enough to keep depth in the npz)."""
    path = Path(path)
    if chunks is None:
        with np.load(path) as data:
            if "depth_chunks" not in data.files:
                if "depth" in data.files:
                    yield data["depth_frames"], data["depth"], data["depth_conf"]
                return
            chunks = data["depth_chunks"]
    for name in chunks:
        with np.load(path.parent / str(name)) as chunk:
            yield chunk["depth_frames"], chunk["depth"], chunk["depth_conf"]


__all__ = ["PARTIAL", "partial_path", "open_partial", "check_replaceable", "finish_file", "replace_folder",
           "restore_folder", "save_npz_atomic", "TumStreamWriter",
           "PlyStreamWriter", "DepthPolicy", "PredictionStore", "load_predictions", "iter_depth"]
