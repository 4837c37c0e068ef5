"""``~/save_map`` with several cameras: one map PLY per map frame, one TUM trajectory per camera.

The cameras in the node's one map frame (see ``multi_map``) share ``map.ply``; a camera
that has its own frame (not aligned) gets ``map_<camera>.ply``. Every camera with poses
gets ``trajectory_<camera>.tum`` (image stamps, camera optical frame in its map frame).
Where, refusals and crash safety follow ``io.map_save`` (same folder rules; every file is
written to a temp file in the folder and fsync-ed before any is renamed, then the folder
is fsync-ed; a process killed before the renames leaves the previous files untouched).

Tags: all files of one save carry the same save id. A PLY says ``poses <P>`` (the poses of
the trajectories that go with it), each TUM ``points <N>`` (the points of its camera's PLY)
and ``camera <name> frame <frame>``; ``check_camera_maps`` verifies a save from them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..io.atomic import StagedFile, fsync_directory, stage
from ..io.export import ply_content, tum_text, write_ply_to, read_ply, read_tum
from ..io.map_save import MAP_FILE, TAG, MapSaveError, new_save_id, read_save_tag, resolve_save_directory


@dataclass
class CameraMap:
    """What one camera contributes to a save (already scaled and in ``frame``)."""

    camera: str
    frame: str  # map frame of its poses and points
    stamps: np.ndarray  # [N] float64 s
    poses: np.ndarray  # [N, 4, 4] T_frame_cam
    points: np.ndarray  # [M, 3] float32
    colors: np.ndarray | None  # [M, 3] uint8


@dataclass
class SavedMaps:
    """Files written: PLY per map frame, TUM per camera; ``skipped`` = camera -> why it has no file."""

    save_id: str
    maps: dict[str, Path]
    trajectories: dict[str, Path]
    skipped: dict[str, str]


def map_file_name(frame: str, map_frame: str, camera: str) -> str:
    """``map.ply`` for the node's map frame, ``map_<camera>.ply`` for a camera's own frame."""
    return MAP_FILE if frame == map_frame else f"map_{camera}.ply"


def trajectory_file_name(camera: str) -> str:
    return f"trajectory_{camera}.tum"


def save_camera_maps(requested: str, output_directory: str, maps: list[CameraMap], map_frame: str) -> SavedMaps:
    """Write ``maps`` (see the module docstring). Cameras without poses are skipped; a map frame whose
    cameras have no point is skipped with them. Raises MapSaveError (nothing written) when nothing
    is left, or for the folder and disk errors of ``io.map_save``."""
    save_id = new_save_id()
    skipped = {m.camera: "no poses (no frame since start or reset)" for m in maps if len(m.stamps) == 0}
    groups: dict[str, list[CameraMap]] = {}
    for m in maps:
        if m.camera not in skipped:
            groups.setdefault(map_file_name(m.frame, map_frame, m.camera), []).append(m)
    for name, members in list(groups.items()):
        if sum(len(m.points) for m in members) == 0:
            for m in members:
                skipped[m.camera] = "its map is empty (0 points)"
            del groups[name]
    if not groups:
        reasons = "; ".join(f"{c}: {why}" for c, why in skipped.items()) or "no camera"
        raise MapSaveError(f"nothing to save ({reasons}); existing files left as they were")
    contents = _encode(groups, save_id)
    folder = resolve_save_directory(requested, output_directory)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MapSaveError(f"cannot create folder {folder}: {exc.strerror or exc}") from None
    written = _write_all(folder, contents)
    maps_out = {name: folder / name for name in groups}
    tums = {m.camera: folder / trajectory_file_name(m.camera) for members in groups.values() for m in members}
    assert set(written) == set(maps_out.values()) | set(tums.values())
    return SavedMaps(save_id, maps_out, tums, skipped)


def _encode(groups: dict[str, list[CameraMap]], save_id: str) -> list[tuple[str, object]]:
    """(file name, write function) of every file, all validated and encoded before the disk is touched."""
    out = []
    for name, members in groups.items():
        points = np.concatenate([np.asarray(m.points, np.float32).reshape(-1, 3) for m in members])
        with_colors = all(m.colors is not None for m in members)
        colors = np.concatenate([np.asarray(m.colors).reshape(-1, 3) for m in members]) if with_colors else None
        if colors is not None and colors.dtype != np.uint8:
            raise MapSaveError(f"map colours must be uint8, got {colors.dtype}")
        n_poses = sum(len(m.stamps) for m in members)
        frames = sorted({m.frame for m in members})
        try:
            vertices, header = ply_content(points, colors, [
                f"{TAG} {save_id} poses {n_poses}", f"cameras {' '.join(m.camera for m in members)} frame "
                f"{' '.join(frames)}"])
        except ValueError as exc:
            raise MapSaveError(f"cannot encode {name}: {exc}") from None
        out.append((name, lambda f, h=header, v=vertices: write_ply_to(f, h, v)))
        for m in members:
            try:
                text = tum_text(m.stamps, m.poses, [f"{TAG} {save_id} points {points.shape[0]}",
                                                     f"camera {m.camera} frame {m.frame}"])
            except ValueError as exc:
                raise MapSaveError(f"cannot encode the trajectory of camera {m.camera}: {exc}") from None
            data = text.encode("ascii")
            out.append((trajectory_file_name(m.camera), lambda f, d=data: f.write(d)))
    return out


def _write_all(folder: Path, contents: list[tuple[str, object]]) -> list[Path]:
    """Stage every file, then rename them all and fsync the folder; temp files never outlive a failure."""
    staged: list[StagedFile] = []
    committed: list[Path] = []
    try:
        for name, write in contents:
            staged.append(stage(folder / name, write))
        for item in staged:
            item.commit()
            committed.append(item.final)
        fsync_directory(folder)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if committed:
            done = ", ".join(p.name for p in committed)
            raise MapSaveError(f"wrote {done} in {folder} but not the rest: {reason}; the files of this save "
                               "are not complete") from None
        raise MapSaveError(f"cannot write in {folder}: {reason}") from None
    finally:
        for item in staged:
            if item.final not in committed:
                item.discard()
    return committed


def check_camera_maps(ply: str | Path, trajectories: list[str | Path]) -> str:
    """Verify that a PLY and the trajectories that go with it come from one save and are complete;
    returns the save id (MapSaveError says what does not match)."""
    tag = read_save_tag(ply)
    if tag is None or tag.kind != "poses":
        raise MapSaveError(f"{ply} carries no save id")
    n_points = read_ply(ply)[0].shape[0]
    n_poses = 0
    for path in trajectories:
        t = read_save_tag(path)
        if t is None or t.kind != "points":
            raise MapSaveError(f"{path} carries no save id")
        if t.save_id != tag.save_id:
            raise MapSaveError(f"{Path(path).name} is from save {t.save_id}, {Path(ply).name} from {tag.save_id}")
        if t.count != n_points:
            raise MapSaveError(f"{Path(path).name} expects {t.count} points, {Path(ply).name} has {n_points}")
        n_poses += read_tum(path)[0].shape[0]
    if n_poses != tag.count:
        raise MapSaveError(f"save {tag.save_id} is incomplete: {n_poses} poses, {Path(ply).name} says {tag.count}")
    return tag.save_id


__all__ = ["CameraMap", "SavedMaps", "save_camera_maps", "check_camera_maps", "map_file_name",
           "trajectory_file_name"]
