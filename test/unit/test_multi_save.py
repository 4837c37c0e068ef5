"""``~/save_map`` files of several cameras (runtime/multi_save.py): one PLY per map frame, a TUM per
camera, one save id, refusals that leave existing files alone. No ROS."""
from __future__ import annotations

import os

import numpy as np
import pytest

from lingbot_map_ros.io.export import read_ply, read_tum
from lingbot_map_ros.io.map_save import MapSaveError, read_save_tag
from lingbot_map_ros.runtime.multi_save import CameraMap, check_camera_maps, save_camera_maps


def camera_map(camera: str, frame: str, n_poses: int, n_points: int, offset: float = 0.0) -> CameraMap:
    poses = np.tile(np.eye(4), (n_poses, 1, 1))
    poses[:, 0, 3] = offset + np.arange(n_poses)
    points = (np.arange(3 * n_points, dtype=np.float32).reshape(-1, 3) + offset).astype(np.float32)
    colors = np.full((n_points, 3), 7 if camera == "front" else 9, np.uint8)
    return CameraMap(camera, frame, 100.0 + np.arange(n_poses, dtype=np.float64), poses, points, colors)


def test_cameras_in_one_map_share_the_ply_and_get_a_trajectory_each(tmp_path):
    saved = save_camera_maps(str(tmp_path), "unused", [camera_map("front", "map", 3, 5),
                                                       camera_map("rear", "map", 2, 4, offset=50.0)], "map")
    assert saved.maps == {"map.ply": tmp_path / "map.ply"} and saved.skipped == {}
    assert saved.trajectories == {c: tmp_path / f"trajectory_{c}.tum" for c in ("front", "rear")}
    points, colors = read_ply(tmp_path / "map.ply")
    assert points.shape == (9, 3) and (colors[:5] == 7).all() and (colors[5:] == 9).all()
    np.testing.assert_allclose(points[5], [50.0, 51.0, 52.0])
    times, poses = read_tum(tmp_path / "trajectory_rear.tum")
    np.testing.assert_allclose(times, [100.0, 101.0])
    np.testing.assert_allclose(poses[:, 0, 3], [50.0, 51.0])
    assert check_camera_maps(tmp_path / "map.ply", list(saved.trajectories.values())) == saved.save_id
    assert read_save_tag(tmp_path / "map.ply").count == 5  # the poses of both trajectories
    assert read_save_tag(tmp_path / "trajectory_front.tum").count == 9  # the points of the shared PLY
    with pytest.raises(MapSaveError, match="incomplete: 3 poses"):  # a trajectory missing from the set
        check_camera_maps(tmp_path / "map.ply", [saved.trajectories["front"]])


def test_a_camera_in_its_own_frame_gets_its_own_ply(tmp_path):
    saved = save_camera_maps(str(tmp_path), "unused", [camera_map("front", "map", 2, 3),
                                                       camera_map("rear", "map_rear", 2, 4)], "map")
    assert set(saved.maps) == {"map.ply", "map_rear.ply"}
    assert check_camera_maps(tmp_path / "map.ply", [saved.trajectories["front"]]) == saved.save_id
    assert check_camera_maps(tmp_path / "map_rear.ply", [saved.trajectories["rear"]]) == saved.save_id
    assert "camera rear frame map_rear" in (tmp_path / "trajectory_rear.tum").read_text()


def test_cameras_without_poses_or_points_are_skipped_and_nothing_left_is_refused(tmp_path):
    saved = save_camera_maps(str(tmp_path), "unused", [camera_map("front", "map", 2, 3),
                                                       camera_map("rear", "map_rear", 0, 0),
                                                       camera_map("side", "map_side", 2, 0)], "map")
    assert set(saved.trajectories) == {"front"} and set(saved.maps) == {"map.ply"}
    assert "no poses" in saved.skipped["rear"] and "empty" in saved.skipped["side"]
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(MapSaveError, match="nothing to save .*front: no poses.*rear: no poses"):
        save_camera_maps(str(tmp_path), "unused", [camera_map("front", "map", 0, 0),
                                                   camera_map("rear", "map", 0, 3)], "map")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # existing files as they were


def test_a_refused_destination_writes_nothing_and_leaves_no_temp_file(tmp_path):
    (tmp_path / "target").write_text("someone else's file")
    os.symlink(tmp_path / "target", tmp_path / "trajectory_rear.tum")
    with pytest.raises(MapSaveError):
        save_camera_maps(str(tmp_path), "unused", [camera_map("front", "map", 2, 3),
                                                   camera_map("rear", "map", 2, 3)], "map")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target", "trajectory_rear.tum"]
    assert (tmp_path / "target").read_text() == "someone else's file"


def test_relative_folders_stay_inside_the_output_directory(tmp_path):
    out = tmp_path / "out"
    saved = save_camera_maps("run1", str(out), [camera_map("front", "map", 1, 1)], "map")
    assert saved.maps["map.ply"] == out.resolve() / "run1" / "map.ply"
    with pytest.raises(MapSaveError, match="outside output_directory"):
        save_camera_maps("../elsewhere", str(out), [camera_map("front", "map", 1, 1)], "map")
