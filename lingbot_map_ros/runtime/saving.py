"""~/save_map of one camera: ``SaveSnapshot`` (taken on the inference thread, fast) and
``write_map_files`` (any thread: the files, crash-safe, through ``io.map_save``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..io.atomic import atomic_write
from ..io.export import tum_text
from ..io.map_save import MAP_FILE, TRAJECTORY_FILE, MapSaveError, save_map_pair
from ..robot.map_offset import OutputTransform
from .worker import Command


RAW_TRAJECTORY_FILE = "trajectory_raw.tum"  # loop closure: the front end's path, beside the corrected one


class SaveError(RuntimeError):
    """~/save_map cannot write what was asked."""


@dataclass
class SaveSnapshot:
    """What one ~/save_map writes: poses [N] (TUM: image stamps, camera optical frame in the map
    frame) and the map [M] (map frame), taken at one moment of the stream."""

    stamps: np.ndarray  # [N] float64 seconds
    poses: np.ndarray  # [N, 4, 4] T_map_cam
    map: Command  # runs on the output thread; result (points [M, 3] float32, colors [M, 3] uint8, version)
    scale: float = 1.0  # metres per model unit applied to both files (1 = model units)
    offset: np.ndarray | None = None  # [4, 4] map offset T_map_seq applied after the scale (None = identity)
    raw_poses: np.ndarray | None = None  # [N, 4, 4] the front end's poses (loop closure on: poses are corrected)

    def output(self, timeout: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(points [M, 3] float32, colors [M, 3] uint8, poses [N, 4, 4]) as they leave the node:
        the map once the output thread has taken it (SaveError after ``timeout`` s or on its
        error), both through the scale and the map offset."""
        if not self.map.wait(timeout):
            raise SaveError("the output thread did not catch up in time; try again")
        if self.map.error is not None:
            raise SaveError(f"cannot take the map: {self.map.error}")
        points, colors, _ = self.map.result
        poses = self.poses
        transform = OutputTransform(self.scale, self.offset)
        if not transform.identity:
            points, poses = transform.points(points).astype(np.float32), transform.pose(poses)
        return points, colors, poses


def write_map_files(snapshot: SaveSnapshot, directory: str, output_directory: str,
                    timeout: float) -> tuple[Path, Path]:
    """Write ``snapshot`` as one crash-safe PLY + TUM pair (``io.map_save.save_map_pair``): ``directory``
    empty = ``output_directory``, relative = under it (may not leave it), absolute = as given; an empty
    map is refused and existing files stay as they were (any thread; see ``save_snapshot``)."""
    points, colors, poses = snapshot.output(timeout)
    try:
        ply, tum = save_map_pair(directory, output_directory, points, colors, snapshot.stamps, poses,
                                 map_name=MAP_FILE, trajectory_name=TRAJECTORY_FILE)
    except MapSaveError as exc:
        raise SaveError(str(exc)) from None
    if snapshot.raw_poses is not None:  # the front end's path beside the corrected one (loop closure)
        raw = OutputTransform(snapshot.scale, snapshot.offset).pose(snapshot.raw_poses)
        text = tum_text(snapshot.stamps, raw, ["front-end (odom) poses before loop closure; trajectory.tum: corrected"])
        try:
            atomic_write(tum.with_name(RAW_TRAJECTORY_FILE), lambda f: f.write(text.encode("ascii")))
        except OSError as exc:
            raise SaveError(f"wrote {ply.name} and {tum.name} but not {RAW_TRAJECTORY_FILE}: {exc.strerror or exc}") \
                from None
    return ply, tum


__all__ = ["SaveSnapshot", "SaveError", "write_map_files", "RAW_TRAJECTORY_FILE"]
