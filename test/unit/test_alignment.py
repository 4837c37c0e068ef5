"""Window alignment maths on synthetic poses and depths with a known Sim(3)."""
from __future__ import annotations

import numpy as np
import pytest

from lingbot_map_ros.geometry import quaternion_to_matrix
from lingbot_map_ros.geometry import rotation_angle_deg
from lingbot_map_ros.stream.alignment import Sim3, depth_ratio_scale, estimate_window_sim3


def random_poses(rng, n, spread=1.0):
    c2w = np.tile(np.eye(4), (n, 1, 1))
    c2w[:, :3, :3] = quaternion_to_matrix(rng.normal(size=(n, 4)))
    c2w[:, :3, 3] = rng.normal(scale=spread, size=(n, 3))
    return c2w


def known_sim3(rng, scale=1.7):
    return Sim3(scale, quaternion_to_matrix(rng.normal(size=4)).astype(np.float64), rng.normal(size=3))


def window_view(sim: Sim3, global_c2w, global_depth):
    """What a new window reports for frames whose global pose/depth are given."""
    return sim.inverse().apply_to_poses(global_c2w), global_depth / sim.scale


def assert_sim3_close(got: Sim3, want: Sim3, atol=1e-9):
    assert got.scale == pytest.approx(want.scale, rel=atol)
    np.testing.assert_allclose(got.rot, want.rot, atol=atol)
    np.testing.assert_allclose(got.trans, want.trans, atol=atol)


def test_sim3_inverse_and_pose_mapping_agree_with_points():
    rng = np.random.default_rng(0)
    sim = known_sim3(rng)
    pts = rng.normal(size=(5, 3))
    np.testing.assert_allclose(sim.inverse().apply_to_points(sim.apply_to_points(pts)), pts, atol=1e-12)
    c2w = random_poses(rng, 3)
    cam = rng.normal(size=3)
    # a camera point mapped through the pose then the Sim(3) = the scaled camera point through the mapped pose
    world = c2w[:, :3, :3] @ cam + c2w[:, :3, 3]
    mapped = sim.apply_to_poses(c2w)
    np.testing.assert_allclose(sim.apply_to_points(world), mapped[:, :3, :3] @ (sim.scale * cam) + mapped[:, :3, 3],
                               atol=1e-12)
    assert Sim3().is_identity and not sim.is_identity
    np.testing.assert_allclose(sim.matrix()[:3, :3], sim.scale * sim.rot)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_recovers_known_sim3_exactly_from_depth(n):
    rng = np.random.default_rng(n)
    sim = known_sim3(rng, scale=0.37)
    old_c2w = random_poses(rng, n)
    old_depth = rng.uniform(0.5, 4.0, size=(n, 7, 9))
    new_c2w, new_depth = window_view(sim, old_c2w, old_depth)
    conf = rng.uniform(1.0, 3.0, size=(n, 7, 9))
    fit = estimate_window_sim3(old_c2w, new_c2w, old_depth, new_depth, conf, conf)
    assert fit.scale_source == "depth" and fit.pairs == n and fit.depth_pixels > 0
    assert_sim3_close(fit.sim3, sim)
    assert fit.rotation_residual_deg < 1e-5 and fit.centre_rmse < 1e-9


def test_without_depth_scale_comes_from_camera_centres():
    rng = np.random.default_rng(3)
    sim = known_sim3(rng, scale=2.5)
    old_c2w = random_poses(rng, 4)
    new_c2w, _ = window_view(sim, old_c2w, np.ones((4, 2, 2)))
    fit = estimate_window_sim3(old_c2w, new_c2w)
    assert fit.scale_source == "centres"
    assert_sim3_close(fit.sim3, sim)


def test_single_frame_without_depth_keeps_scale_one():
    rng = np.random.default_rng(4)
    sim = Sim3(1.0, quaternion_to_matrix(rng.normal(size=4)).astype(np.float64), rng.normal(size=3))
    old_c2w = random_poses(rng, 1)
    new_c2w, _ = window_view(sim, old_c2w, np.ones((1, 2, 2)))
    fit = estimate_window_sim3(old_c2w, new_c2w)
    assert fit.scale_source == "none"
    assert_sim3_close(fit.sim3, sim)


def test_outliers_in_low_confidence_and_invalid_pixels_and_non_finite_frames_are_ignored():
    rng = np.random.default_rng(5)
    sim = known_sim3(rng, scale=1.3)
    old_c2w = random_poses(rng, 3)
    old_depth = rng.uniform(1.0, 2.0, size=(3, 6, 6))
    new_c2w, new_depth = window_view(sim, old_c2w, old_depth)
    conf = np.full((3, 6, 6), 5.0)
    new_depth[:, :2] *= 10.0  # a third of the pixels disagree wildly...
    conf[:, :2] = 1.0  # ...and are the unconfident ones
    new_depth[:, 2, 0] = np.nan
    old_depth[:, 2, 1] = -1.0
    # a fourth frame whose new-window pose is not finite (e.g. a failed prediction)
    old_c2w = np.concatenate([old_c2w, random_poses(rng, 1)])
    new_c2w = np.concatenate([new_c2w, np.full((1, 4, 4), np.nan)])
    pad = np.ones((1, 6, 6))
    fit = estimate_window_sim3(old_c2w, new_c2w, np.concatenate([old_depth, pad]), np.concatenate([new_depth, pad]),
                               np.concatenate([conf, pad]), np.concatenate([conf, pad]))
    assert fit.pairs == 3
    assert_sim3_close(fit.sim3, sim)


def test_no_usable_pair_gives_identity():
    fit = estimate_window_sim3(np.full((2, 4, 4), np.nan), np.tile(np.eye(4), (2, 1, 1)))
    assert fit.pairs == 0 and fit.sim3.is_identity


def test_noisy_overlap_gives_a_close_fit():
    rng = np.random.default_rng(6)
    sim = known_sim3(rng, scale=0.8)
    old_c2w = random_poses(rng, 8, spread=0.05)  # a short overlap: centres nearly coincide
    old_depth = rng.uniform(1.0, 3.0, size=(8, 10, 10))
    new_c2w, new_depth = window_view(sim, old_c2w, old_depth)
    new_c2w[:, :3, 3] += rng.normal(scale=1e-3, size=(8, 3))
    new_c2w[:, :3, :3] = quaternion_to_matrix(rng.normal(scale=1e-3, size=(8, 4)) + [0, 0, 0, 1]) @ new_c2w[:, :3, :3]
    new_depth *= rng.uniform(0.98, 1.02, size=new_depth.shape)
    fit = estimate_window_sim3(old_c2w, new_c2w, old_depth, new_depth)
    assert fit.sim3.scale == pytest.approx(sim.scale, rel=5e-3)
    assert rotation_angle_deg(fit.sim3.rot, sim.rot) < 0.2
    np.testing.assert_allclose(fit.sim3.trans, sim.trans, atol=5e-3)


def test_depth_ratio_scale_needs_a_valid_pixel():
    assert depth_ratio_scale(np.zeros((1, 2, 2)), np.ones((1, 2, 2))) == (None, 0)
    scale, count = depth_ratio_scale(np.full((1, 2, 2), 3.0), np.ones((1, 2, 2)))
    assert scale == 3.0 and count == 4
