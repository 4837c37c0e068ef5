"""One map for several cameras (runtime/multi_map.py): the alignment maths against hand-computed
transforms, and MapAligner's choice of frame per camera. No ROS."""
from __future__ import annotations

import numpy as np
import pytest

from lingbot_map_ros.geometry import OPTICAL_TO_REP103, quaternion_to_matrix
from lingbot_map_ros.robot.map_offset import OutputTransform
from lingbot_map_ros.runtime.multi_map import (MapAligner, base_motion_from_odometry, map_alignment, own_map_frame,
                                           published, transform_points, transform_poses, unpublished)
from lingbot_map_ros.robot.scale import apply_scale, scale_points

M = np.asarray(OPTICAL_TO_REP103, dtype=np.float64)  # an optical frame looking along map x: T_map_cam of c2w = I
RZ180 = np.diag([-1.0, -1.0, 1.0])


def rigid(R=np.eye(3), t=(0.0, 0.0, 0.0)) -> np.ndarray:
    T = np.eye(4)
    T[:3, :3], T[:3, 3] = R, t
    return T


# A robot base (REP 103: x forward, z up) with a front camera 0.2 m ahead and a rear camera 0.3 m behind
# the base origin, both 0.5 m up; the rear one looks backwards.
T_BASE_FRONT = rigid(M[:3, :3], (0.2, 0.0, 0.5))
T_BASE_REAR = rigid(RZ180 @ M[:3, :3], (-0.3, 0.0, 0.5))


def test_rear_map_in_the_front_map_hand_computed():
    # both first poses are the cameras themselves (c2w = I): T_map_cam = M
    T = map_alignment(M, T_BASE_FRONT, T_BASE_REAR, M)
    # map = base axes at the front camera; map_rear = base axes turned 180 deg about z at the rear camera,
    # which is 0.5 m behind the front one
    np.testing.assert_allclose(T, rigid(RZ180, (-0.5, 0.0, 0.0)), atol=1e-12)
    # 1 m in front of the rear camera is 1.5 m behind the front one
    np.testing.assert_allclose(transform_points(T, np.array([[1.0, 0.0, 0.0]])), [[-1.5, 0.0, 0.0]], atol=1e-12)


def test_scales_of_both_cameras_enter_their_own_poses():
    # the robot drove 2 m forward (the front camera's model says 1 unit, 2 m per unit) before the rear
    # camera's sequence started; the rear camera's units are 1/3 m
    T_map_front_now = M.copy()
    T_map_front_now[:3, 3] = (1.0, 0.0, 0.0)
    T = map_alignment(T_map_front_now, T_BASE_FRONT, T_BASE_REAR, M, ref_scale=2.0, cam_scale=3.0)
    # the rear camera is now at 2 - 0.3 - 0.2 = 1.5 m along map x, looking back
    np.testing.assert_allclose(T, rigid(RZ180, (1.5, 0.0, 0.0)), atol=1e-12)
    # 1 rear unit (3 m) in front of the rear camera: 1.5 - 3 = -1.5 m along map x
    p = transform_points(T, scale_points(np.array([[1.0, 0.0, 0.0]]), 3.0))
    np.testing.assert_allclose(p, [[-1.5, 0.0, 0.0]], atol=1e-12)


def test_base_motion_from_odometry_between_the_two_stamps():
    # the rear camera's first pose came 1 s later, after the base moved 1 m forward (odometry)
    D = base_motion_from_odometry(rigid(t=(5.0, 2.0, 0.0)), rigid(t=(6.0, 2.0, 0.0)))
    np.testing.assert_allclose(D, rigid(t=(1.0, 0.0, 0.0)), atol=1e-12)
    T = map_alignment(M, T_BASE_FRONT, T_BASE_REAR, M, base_motion=D)
    np.testing.assert_allclose(T, rigid(RZ180, (0.5, 0.0, 0.0)), atol=1e-12)
    # a turn of the base by 90 deg left, odometry in a rotated odom frame
    yaw = np.array([[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    D = base_motion_from_odometry(rigid(yaw, (1.0, 1.0, 0.0)), rigid(yaw @ yaw, (1.0, 1.0, 0.0)))
    np.testing.assert_allclose(D, rigid(yaw), atol=1e-12)


def random_rigid(rng) -> np.ndarray:
    q = rng.normal(size=4)
    return rigid(quaternion_to_matrix(q / np.linalg.norm(q)), rng.normal(size=3))


def test_the_aligned_pose_closes_the_extrinsic_chain_for_random_transforms():
    rng = np.random.default_rng(0)
    for _ in range(20):
        T_map_ref, E_ref, E_cam, T_mapc_cam, D = (random_rigid(rng) for _ in range(5))
        sr, sc = rng.uniform(0.1, 10.0, size=2)
        T = map_alignment(T_map_ref, E_ref, E_cam, T_mapc_cam, D, sr, sc)
        # camera c's pose in map two ways: through the alignment, and through the base from the reference
        left = T @ apply_scale(T_mapc_cam, sc)
        right = apply_scale(T_map_ref, sr) @ np.linalg.inv(E_ref) @ D @ E_cam
        np.testing.assert_allclose(left, right, atol=1e-9)
        np.testing.assert_allclose(T[:3, :3] @ T[:3, :3].T, np.eye(3), atol=1e-9)  # still rigid
        poses = np.stack([T_mapc_cam, D])
        np.testing.assert_allclose(transform_poses(T, poses)[1], T @ D)


def test_placement_through_the_engines_output_transforms():
    """Each engine may publish its model-unit poses through a scale and a map offset (a lost reset
    that continued the map): the camera's published poses still land where the extrinsics say."""
    rng = np.random.default_rng(1)
    for _ in range(10):
        out_ref = OutputTransform(float(rng.uniform(0.5, 3.0)), random_rigid(rng))
        out_cam = OutputTransform(float(rng.uniform(0.5, 3.0)), random_rigid(rng))
        T_ref, T_cam = random_rigid(rng), random_rigid(rng)
        np.testing.assert_allclose(unpublished(published(T_cam, out_cam), out_cam), T_cam, atol=1e-9)
        np.testing.assert_allclose(unpublished(published(T_cam, 2.5), 2.5), T_cam, atol=1e-12)
        a, _ = aligner()
        a.observe("front", 1, 10.0, "front_optical", T_ref)
        a.observe("rear", 1, 10.0, "rear_optical", T_cam)
        T = a.placement("rear", out_ref, out_cam).transform
        # rear's published pose, placed, is the reference's published pose through the two extrinsics
        np.testing.assert_allclose(T @ out_cam.pose(T_cam),
                                   out_ref.pose(T_ref) @ np.linalg.inv(T_BASE_FRONT) @ T_BASE_REAR, atol=1e-9)


# ------------------------------------------------------------------ MapAligner
class Recorder:
    def __init__(self) -> None:
        self.warnings, self.infos = [], []


def aligner(base_frame="base_link", extrinsics=None, base_motion=None, **kwargs):
    known = {"front_optical": T_BASE_FRONT, "rear_optical": T_BASE_REAR} if extrinsics is None else extrinsics
    log = Recorder()
    a = MapAligner(("front", "rear"), "map", base_frame, known.get, base_motion, scale_frames=2,
                   warn=log.warnings.append, info=log.infos.append, clock=lambda: 0.0, **kwargs)
    return a, log


def test_without_base_frame_every_camera_keeps_its_own_map_frame():
    a, _ = aligner(base_frame="")
    a.observe("front", 1, 10.0, "front_optical", M)
    a.observe("rear", 1, 10.0, "rear_optical", M)
    for cam in ("front", "rear"):
        p = a.placement(cam)
        assert (p.frame, p.transform) == (own_map_frame("map", cam), None) == (f"map_{cam}", None)
        assert "base_frame is empty" in a.describe(cam) and not a.aligned(cam)


def test_the_reference_is_the_map_and_the_other_camera_joins_it_once_both_have_poses():
    a, log = aligner()
    assert a.placement("front").frame == "map" and a.placement("front").transform is None
    a.observe("rear", 1, 10.0, "rear_optical", M)  # rear first: front has no pose yet
    assert a.placement("rear").frame == "map_rear" and "first pose of camera front" in a.describe("rear")
    before = a.placement("rear").version
    a.observe("front", 1, 10.02, "front_optical", M)
    p = a.placement("rear")
    assert p.frame == "map" and p.version != before and a.aligned("rear")
    np.testing.assert_allclose(p.transform, rigid(RZ180, (-0.5, 0.0, 0.0)), atol=1e-12)
    assert any("aligned to map" in line and "0.020 s apart" in line for line in log.infos)
    # scales on use: the same pair, the reference's units now 2 m
    np.testing.assert_allclose(a.placement("rear", ref_output=2.0, cam_output=1.0).transform,
                               rigid(RZ180, (-0.5, 0.0, 0.0)), atol=1e-12)  # first poses carry no translation


def test_a_missing_extrinsic_keeps_the_own_frame_and_warns_why():
    a, log = aligner(extrinsics={"front_optical": T_BASE_FRONT})
    a.observe("front", 1, 10.0, "front_optical", M)
    a.observe("rear", 1, 10.0, "rear_optical", M)
    assert a.placement("rear").frame == "map_rear"
    assert "waiting for TF base_link -> rear_optical" in a.describe("rear")
    assert any("outputs stay in map_rear" in w and "rear_optical" in w for w in log.warnings)


def test_a_reset_of_either_camera_re_aligns_with_the_nearest_poses():
    a, _ = aligner()
    for i in range(1, 6):  # both cameras drive forward 1 model unit per second, from t = 10 s
        for cam, frame in (("front", "front_optical"), ("rear", "rear_optical")):
            T = M.copy()
            T[:3, 3] = (i - 1.0, 0.0, 0.0) if cam == "front" else (-(i - 1.0), 0.0, 0.0)  # rear looks back
            a.observe(cam, i, 10.0 + i - 1, frame, T)
    np.testing.assert_allclose(a.placement("rear").transform, rigid(RZ180, (-0.5, 0.0, 0.0)), atol=1e-12)
    # rear resets at t = 15: its new map starts at its camera there, 5 units ahead of where the map's rear was
    a.observe("front", 6, 15.0, "front_optical", rigid(M[:3, :3], (5.0, 0.0, 0.0)))
    a.observe("rear", 1, 15.0, "rear_optical", M)
    np.testing.assert_allclose(a.placement("rear").transform, rigid(RZ180, (4.5, 0.0, 0.0)), atol=1e-12)
    # front resets at t = 16 (a new map at the front camera there); rear moved on 1 unit back in its map
    a.observe("rear", 2, 16.0, "rear_optical", _pose_at(M, (-1.0, 0.0, 0.0)))
    a.observe("front", 1, 16.0, "front_optical", M)
    np.testing.assert_allclose(a.placement("rear").transform, rigid(RZ180, (-0.5 - 1.0, 0.0, 0.0)), atol=1e-12)


def _pose_at(T: np.ndarray, t) -> np.ndarray:
    out = np.array(T, dtype=np.float64)
    out[:3, 3] = t
    return out


def test_poses_too_far_apart_wait_unless_the_odometry_gives_the_base_motion():
    a, _ = aligner()
    a.observe("front", 1, 10.0, "front_optical", M)
    a.observe("rear", 1, 12.0, "rear_optical", M)  # 2 s later, nothing of front near it
    assert a.placement("rear").frame == "map_rear" and "2.00 s apart" in a.describe("rear")
    a.observe("front", 2, 12.1, "front_optical", _pose_at(M, (1.0, 0.0, 0.0)))  # now a pose 0.1 s away
    np.testing.assert_allclose(a.placement("rear").transform, rigid(RZ180, (0.5, 0.0, 0.0)), atol=1e-12)

    calls = []

    def odometry(t_ref, t_cam):
        calls.append((t_ref, t_cam))
        return base_motion_from_odometry(rigid(t=(0.0, 0.0, 0.0)), rigid(t=(t_cam - t_ref, 0.0, 0.0)))

    b, log = aligner(base_motion=odometry)
    b.observe("front", 1, 10.0, "front_optical", M)
    b.observe("rear", 1, 12.0, "rear_optical", M)  # the base moved 2 m in between (odometry)
    np.testing.assert_allclose(b.placement("rear").transform, rigid(RZ180, (1.5, 0.0, 0.0)), atol=1e-12)
    assert calls[-1] == (10.0, 12.0) and any("base motion from odometry" in line for line in log.infos)


def test_two_cameras_reporting_one_optical_frame_are_warned_about():
    a, log = aligner()
    a.observe("front", 1, 10.0, "camera_optical_frame", M)
    a.observe("rear", 1, 10.0, "camera_optical_frame", M)
    assert any("cameras rear and front report the same optical frame 'camera_optical_frame'" in w
               for w in log.warnings)


def test_aligner_arguments():
    with pytest.raises(ValueError, match="at least one camera"):
        MapAligner((), "map", "base_link", lambda f: None)
