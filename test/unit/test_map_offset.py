"""Published map frame across sequences (robot/map_offset.py) against hand-computed transforms."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lingbot_map_ros.robot.map_offset import OutputTransform, SequenceAnchor, invert_rigid, odometry_alignment


def rigid(seed: int, t_scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    q = rng.normal(size=4)
    q /= np.linalg.norm(q)
    x, y, z, w = q
    T = np.eye(4)
    T[:3, :3] = [[1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
                 [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
                 [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)]]
    T[:3, 3] = t_scale * rng.normal(size=3)
    return T


def yaw(deg: float, x: float = 0.0, y: float = 0.0) -> np.ndarray:
    a = math.radians(deg)
    T = np.eye(4)
    T[:2, :2] = [[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]]
    T[:2, 3] = (x, y)
    return T


def test_invert_rigid():
    T = rigid(0)
    np.testing.assert_allclose(invert_rigid(T) @ T, np.eye(4), atol=1e-12)


def test_odometry_alignment_by_hand():
    """Last good pose: map (2, 1), heading 90 deg. The odometry says the camera then drove 1 m
    along its own x and turned 90 deg left: the new pose is (2, 2), heading 180 deg."""
    good = yaw(90.0, 2.0, 1.0)
    odom_good, odom_new = yaw(30.0, 5.0, -3.0), yaw(30.0, 5.0, -3.0) @ yaw(90.0, 1.0, 0.0)
    np.testing.assert_allclose(odometry_alignment(good, odom_good, odom_new), yaw(180.0, 2.0, 2.0), atol=1e-12)
    # no motion: the new frame starts exactly at the last good pose
    np.testing.assert_allclose(odometry_alignment(good, odom_good, odom_good), good, atol=1e-12)


def test_output_transform_poses_and_points_agree():
    """A point seen by a camera lands where the published pose of that camera puts it."""
    out = OutputTransform(2.5, rigid(1))
    T_seq = rigid(2, 0.3)
    p_cam = np.random.default_rng(3).normal(size=(5, 3))
    p_seq = p_cam @ T_seq[:3, :3].T + T_seq[:3, 3]  # model units, sequence map frame
    T_pub = out.pose(T_seq)
    expected = (2.5 * p_cam) @ T_pub[:3, :3].T + T_pub[:3, 3]  # the camera frame's points scale too
    np.testing.assert_allclose(out.points(p_seq), expected, atol=1e-10)
    np.testing.assert_allclose(out.pose(np.stack([T_seq, T_seq]))[1], T_pub)
    f32 = out.points(p_seq.astype(np.float32))
    assert f32.dtype == np.float32 and np.allclose(f32, expected, atol=1e-4)
    plain = OutputTransform()
    assert plain.identity and plain.points(p_seq) is p_seq and np.array_equal(plain.pose(T_seq), T_seq)
    assert OutputTransform(2.0, np.eye(4)) == OutputTransform(2.0, np.eye(4)) != OutputTransform(2.0)
    assert OutputTransform(2.0) != OutputTransform(3.0)


def test_a_lost_reset_sequence_continues_the_map_exactly():
    """Ground truth: camera poses in a world (metres), odometry = another rigid frame of the same
    world. Sequence 1 published metric poses; sequence 2 starts at frame 6 in its own frame (REP-103
    axes at its first camera) and units (metres / 3.7). Aligned through the odometry at the last good
    frame (4) and the new sequence's first frame, every published pose of sequence 2 is the truth."""
    world_cam = [rigid(10) @ yaw(12.0 * k, 0.3 * k, 0.05 * k * k) for k in range(12)]  # T_world_cam, metres
    T_map_world, T_odom_world = rigid(20), rigid(21)
    truth = [T_map_world @ T for T in world_cam]
    odom = [T_odom_world @ T for T in world_cam]
    s2, rep = 3.7, rigid(22, 0.0)  # sequence 2: metres per model unit, and its map axes vs its first camera
    seq2 = {j: rep @ OutputTransform(1.0 / s2).pose(invert_rigid(world_cam[6]) @ world_cam[j]) for j in range(6, 12)}
    good, first = 4, 6
    anchor = SequenceAnchor(odometry_alignment(truth[good], odom[good], odom[first]), seq2[first])
    out = OutputTransform(s2, anchor.offset(s2))
    for j in range(6, 12):
        np.testing.assert_allclose(out.pose(seq2[j]), truth[j], atol=1e-9)
    # before the new sequence's scale is known (s = 1) the anchor frame is still exactly in place
    np.testing.assert_allclose(OutputTransform(1.0, anchor.offset(1.0)).pose(seq2[first]), truth[first], atol=1e-9)
    # the anchor may be any frame of the new sequence with odometry: same published poses
    later = SequenceAnchor(odometry_alignment(truth[good], odom[good], odom[8]), seq2[8])
    np.testing.assert_allclose(later.offset(s2), anchor.offset(s2), atol=1e-9)


def test_bad_transforms_are_refused_with_their_name():
    bad = np.eye(4)
    bad[0, 3] = math.nan
    with pytest.raises(ValueError, match="T_odom_cam_new must be a finite"):
        odometry_alignment(np.eye(4), np.eye(4), bad)
    with pytest.raises(ValueError, match=r"first must be a finite \[4, 4\]"):
        SequenceAnchor(np.eye(4), np.eye(3))
