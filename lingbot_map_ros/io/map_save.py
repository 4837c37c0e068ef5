"""``~/save_map``'s files: the map (PLY) and the trajectory (TUM) written as one pair.

Rules (no ROS import here; the engine maps ``MapSaveError`` onto its own error):

- **Where.** An empty request writes into ``output_directory``. A relative request
  resolves under ``output_directory`` (after ``..`` and symbolic links of existing
  folders are resolved) and may not leave it; an absolute request (or ``~/...``) is
  used as given. Missing folders are created.
- **What.** An empty map (0 points) or an empty trajectory is refused before the disk
  is touched: existing files stay as they were (a ``~/reset`` followed by a save must
  not wipe the last map).
- **How.** Both files are written to temp files in the target folder and fsync-ed
  before either is renamed over its destination (PLY first, then TUM), then the
  folder is fsync-ed (``atomic``). A process killed while writing leaves the previous
  pair untouched. A symbolic link at either destination is refused, never followed.
- **Pair.** Both files carry the same save id, with the other file's size:
  PLY ``comment lingbot_map_ros save <id> poses <M>``, TUM
  ``# lingbot_map_ros save <id> points <N>``. ``check_map_pair`` verifies that two
  files come from one save and are complete (the one window a crash can split a
  pair is between the two renames; this check tells).
"""
from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lingbot_map_ros.io.atomic import GroupWriteError, write_group
from lingbot_map_ros.io.export import ply_content, tum_text, write_ply_to, read_ply, read_tum

__all__ = ["MAP_FILE", "MapSaveError", "SaveTag", "TRAJECTORY_FILE", "check_map_pair", "new_save_id",
           "read_save_id", "read_save_tag", "resolve_save_directory", "save_map_pair"]

MAP_FILE, TRAJECTORY_FILE = "map.ply", "trajectory.tum"
TAG = "lingbot_map_ros save"
_HEADER_LIMIT = 64 * 1024  # bytes of header read when looking for the tag


class MapSaveError(ValueError):
    """A map pair cannot be saved or checked; the message is a one-line reason."""


@dataclass(frozen=True)
class SaveTag:
    """The save id line of one file: ``kind`` is ``poses`` (in a PLY) or ``points`` (in a TUM),
    ``count`` the size of the other file of the pair."""

    save_id: str
    kind: str
    count: int


def new_save_id() -> str:
    """``YYYYmmddTHHMMSSZ-<8 hex>``: UTC time of the save and a random part."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(4)}"


def resolve_save_directory(requested: str, output_directory: str) -> Path:
    """The folder a save request names (see the module rules); nothing is created.

    Args:
        requested: the request's ``directory``: empty (or blank) = ``output_directory``,
            relative = under ``output_directory``, absolute or ``~/..`` = as given.
        output_directory: the node's parameter (relative to the working directory).

    Returns:
        Absolute path with symbolic links of existing folders resolved.

    Raises:
        MapSaveError: a relative request that leaves ``output_directory``, or a NUL byte.
    """
    try:
        base = Path(os.path.realpath(os.path.expanduser(output_directory or ".")))
        if not requested.strip():
            return base
        asked = os.path.expanduser(requested)
        if os.path.isabs(asked):
            return Path(os.path.realpath(asked))
        target = Path(os.path.realpath(base / asked))
    except ValueError as exc:  # embedded NUL byte
        raise MapSaveError(f"invalid directory {requested!r}: {exc}") from None
    if os.path.commonpath([base, target]) != str(base):
        raise MapSaveError(f"directory {requested!r} resolves to {target}, outside output_directory {base}: "
                           "a relative directory must stay inside it (an absolute one may go anywhere)")
    return target


def save_map_pair(requested: str, output_directory: str, points: np.ndarray, colors: np.ndarray | None,
                  stamps: np.ndarray, poses: np.ndarray, *, map_name: str = MAP_FILE,
                  trajectory_name: str = TRAJECTORY_FILE) -> tuple[Path, Path]:
    """Write the map and the trajectory crash-safely as one pair (see the module rules).

    Args:
        requested, output_directory: where (``resolve_save_directory``).
        points: [N, 3] map points (stored as float32), N > 0.
        colors: [N, 3] uint8 RGB, or None (PLY without colour).
        stamps: [M] pose times, seconds (float64), M > 0.
        poses: [M, 4, 4] camera-to-map transforms, written as TUM lines.
        map_name, trajectory_name: file names inside the folder.

    Returns:
        (PLY path, TUM path), absolute.

    Raises:
        MapSaveError: empty map or trajectory, bad shapes, a path outside
            output_directory, a symlink or folder at a destination, or an OS
            error (read-only folder, disk full, ...). Existing files are then
            unchanged, except in the reported case where only the PLY got renamed.
    """
    save_id = new_save_id()
    ply_header, vertices, trajectory_text = _content(points, colors, stamps, poses, save_id)
    folder = resolve_save_directory(requested, output_directory)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MapSaveError(f"cannot create folder {folder}: {exc.strerror or exc}") from None
    ply, tum = folder / map_name, folder / trajectory_name
    tum_bytes = trajectory_text.encode("ascii")
    _write_pair(ply, lambda f: write_ply_to(f, ply_header, vertices), tum, lambda f: f.write(tum_bytes))
    return ply, tum


def _content(points, colors, stamps, poses, save_id: str) -> tuple[bytes, np.ndarray, str]:
    """Validate and encode everything before the disk is touched: (PLY header, vertices, TUM text),
    each file tagged with ``save_id`` and the other file's size."""
    points = np.asarray(points)
    n_poses = np.asarray(stamps).reshape(-1).shape[0]
    if points.ndim == 2 and points.shape[0] == 0:
        raise MapSaveError("the map is empty (0 points): nothing saved, existing files left as they were")
    if n_poses == 0:
        raise MapSaveError("the trajectory is empty (0 poses): nothing saved, existing files left as they were")
    if colors is not None and np.asarray(colors).dtype != np.uint8:
        raise MapSaveError(f"map colours must be uint8, got {np.asarray(colors).dtype}")
    try:
        vertices, header = ply_content(points, colors, [f"{TAG} {save_id} poses {n_poses}"])
        text = tum_text(stamps, poses, [f"{TAG} {save_id} points {points.shape[0]}"])
    except ValueError as exc:
        raise MapSaveError(f"cannot encode the map: {exc}") from None
    return header, vertices, text


def _write_pair(ply: Path, write_ply, tum: Path, write_tum) -> None:
    """Stage both files, then rename PLY and TUM and fsync the folder (``io.atomic.write_group``)."""
    try:
        write_group([(ply, write_ply), (tum, write_tum)])
    except GroupWriteError as exc:
        reason = exc.strerror or str(exc.cause)
        if len(exc.committed) == 1:
            raise MapSaveError(f"wrote {ply} but not {tum}: {reason}; the two files are not a pair now") from None
        if exc.committed:
            raise MapSaveError(f"wrote {ply} and {tum} but could not sync folder {ply.parent}: {reason}") from None
        raise MapSaveError(f"cannot write in {ply.parent}: {reason}") from None


# ----------------------------------------------------------------------------- checking a pair

def read_save_tag(path: str | Path) -> SaveTag | None:
    """The save id line of a PLY (header comment) or TUM (leading ``#`` lines); None when absent."""
    prefix = TAG.encode() + b" "
    with open(path, "rb") as f:
        head = f.read(_HEADER_LIMIT)
    lines = head.split(b"\n")
    is_ply = lines[0].strip() == b"ply"
    for line in lines[1:] if is_ply else lines:
        line = line.strip()
        if is_ply and line == b"end_header" or not is_ply and not line.startswith(b"#"):
            break
        text = line[len(b"comment "):] if is_ply and line.startswith(b"comment ") else line.lstrip(b"# ")
        if text.startswith(prefix):
            words = text[len(prefix):].decode("ascii", "replace").split()
            if len(words) == 3 and words[2].isdigit():
                return SaveTag(words[0], words[1], int(words[2]))
    return None


def read_save_id(path: str | Path) -> str | None:
    """The save id of a file written by ``save_map_pair``; None for any other file."""
    tag = read_save_tag(path)
    return tag.save_id if tag else None


def check_map_pair(ply: str | Path, tum: str | Path) -> str:
    """Verify that a PLY and a TUM come from one ``save_map_pair`` call and are complete.

    Returns:
        The save id.

    Raises:
        MapSaveError: a file without a save id, ids that differ, or sizes that do not
            match the other file's tag (truncated or edited file).
    """
    ply, tum = Path(ply), Path(tum)
    try:
        ply_tag, tum_tag = read_save_tag(ply), read_save_tag(tum)
    except OSError as exc:
        raise MapSaveError(f"cannot read {exc.filename}: {exc.strerror}") from None
    for path, tag, kind in ((ply, ply_tag, "poses"), (tum, tum_tag, "points")):
        if tag is None or tag.kind != kind:
            raise MapSaveError(f"{path} carries no save id (not written by save_map_pair)")
    if ply_tag.save_id != tum_tag.save_id:
        raise MapSaveError(f"{ply.name} is from save {ply_tag.save_id} but {tum.name} from save "
                           f"{tum_tag.save_id}: not one pair (a save interrupted between its two renames?)")
    try:
        n_points = read_ply(ply)[0].shape[0]
        n_poses = read_tum(tum)[0].shape[0]
    except ValueError as exc:
        raise MapSaveError(f"save {ply_tag.save_id} is damaged: {exc}") from None
    if n_points != tum_tag.count or n_poses != ply_tag.count:
        raise MapSaveError(f"save {ply_tag.save_id} is incomplete: {n_points} points and {n_poses} poses, "
                           f"its tags say {tum_tag.count} and {ply_tag.count}")
    return ply_tag.save_id
