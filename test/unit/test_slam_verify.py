"""Geometric verification of a loop candidate (lingbot_map_ros/slam/verify.py) on depth maps rendered
from a synthetic box room: the right relative Sim(3) passes, wrong ones fail with the right reason."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lingbot_map_ros.slam import Sim3, relative
from lingbot_map_ros.slam.verify import DepthView, LoopCheck, reprojection, spread, verify_loop

H, W, F = 96, 128, 100.0
K = np.array([[F, 0, W / 2], [0, F, H / 2], [0, 0, 1.0]])
# the room: planes n·x = c (world = camera a's optical axes: x right, y down, z forward)
PLANES = [((1, 0, 0), 3.0), ((1, 0, 0), -3.0), ((0, 1, 0), 1.5), ((0, 1, 0), -2.0), ((0, 0, 1), 8.0),
          ((0, 0, 1), -8.0)]
# a box standing in the room, seen by both cameras (depth edges)
BOX = (np.array([-0.8, 0.3, 3.5]), np.array([0.4, 1.5, 4.5]))


def rot_y(deg: float) -> np.ndarray:
    a = math.radians(deg)
    return np.array([[math.cos(a), 0, math.sin(a)], [0, 1, 0], [-math.sin(a), 0, math.cos(a)]])


def render(pose: Sim3) -> np.ndarray:
    """z-depth [H, W] of the room from camera ``pose`` (camera-to-world; depth in the camera's own
    units, i.e. world lengths / pose.scale)."""
    v, u = np.mgrid[0:H, 0:W].astype(np.float64)
    rays = np.stack([(u - K[0, 2]) / F, (v - K[1, 2]) / F, np.ones_like(u)], -1) @ pose.rotation.T
    origin = pose.translation
    best = np.full((H, W), np.inf)
    for normal, c in PLANES:
        n = np.array(normal, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            t = (c - n @ origin) / (rays @ n)
        best = np.where((t > 1e-6) & (t < best), t, best)
    lo, hi = BOX  # slab test
    with np.errstate(divide="ignore", invalid="ignore"):
        t0, t1 = (lo - origin) / rays, (hi - origin) / rays
    near = np.max(np.minimum(t0, t1), axis=-1)
    far = np.min(np.maximum(t0, t1), axis=-1)
    hit = (near <= far) & (near > 1e-6)
    best = np.where(hit & (near < best), near, best)
    return best / pose.scale  # t is the z-depth: the camera ray has z = 1


POSE_A = Sim3(np.eye(3), np.zeros(3), 1.0)
POSE_B = Sim3(rot_y(12.0), np.array([0.5, -0.1, 0.8]), 1.3)  # another keyframe, other units


def view(pose: Sim3, conf: float = 3.0) -> DepthView:
    depth = render(pose)
    return DepthView(depth, np.full(depth.shape, conf), K)


@pytest.fixture(scope="module")
def views():
    return view(POSE_A), view(POSE_B)


def test_verify_the_right_relative_pose_passes(views):
    a, b = views
    verdict = verify_loop(a, b, relative(POSE_A, POSE_B))
    assert verdict.accepted, verdict.reason
    assert verdict.reason.startswith("accepted")
    assert verdict.reprojection.inlier_ratio > 0.95
    assert verdict.reprojection.median_error < 0.01
    assert 0.5 < verdict.reprojection.overlap <= 1.0


@pytest.mark.parametrize("wrong, reason", [
    (Sim3(np.eye(3), np.zeros(3), 1.25), "inlier ratio"),  # scale 25 % off
    (Sim3(np.eye(3), np.array([0.0, 0.0, 0.6]), 1.0), "inlier ratio"),  # 0.6 units along the view
    (Sim3(np.eye(3), np.array([0.5, 0.0, 0.0]), 1.0), "inlier ratio"),  # 0.5 units sideways
    (Sim3(rot_y(8.0), np.zeros(3), 1.0), "inlier ratio"),  # turned 8°
])
def test_verify_a_perturbed_relative_pose_fails_with_the_reason(views, wrong, reason):
    a, b = views
    verdict = verify_loop(a, b, relative(POSE_A, POSE_B) @ wrong)
    assert not verdict.accepted
    assert verdict.reason.startswith(reason), verdict.reason
    assert f"{verdict.reprojection.inlier_ratio:.2f} < 0.8" in verdict.reason


def test_verify_no_overlap_is_named():
    away = Sim3(rot_y(180.0), np.array([0.0, 0.0, 0.5]), 1.0)
    verdict = verify_loop(view(POSE_A), view(away), relative(POSE_A, away))
    assert not verdict.accepted
    assert verdict.reason == "overlap 0.00 < 0.3"


def test_verify_low_confidence_is_named(views):
    a, b = views
    dim = DepthView(a.depth, np.ones_like(a.depth), K)  # nothing above 1.5
    verdict = verify_loop(dim, b, relative(POSE_A, POSE_B))
    assert not verdict.accepted and verdict.reason == "only 0 confident points < 200"


def test_verify_disagreeing_estimates_are_named(views):
    a, b = views
    rel = relative(POSE_A, POSE_B)
    close = rel @ Sim3(rot_y(0.5), np.array([0.01, 0, 0]), 1.01)
    assert verify_loop(a, b, rel, others=[close]).accepted
    turned = verify_loop(a, b, rel, others=[close, rel @ Sim3(rot_y(5.0), np.zeros(3), 1.0)])
    assert not turned.accepted and turned.reason.startswith("rotation spread 5") and "> 3°" in turned.reason
    scaled = verify_loop(a, b, rel, others=[rel @ Sim3(np.eye(3), np.zeros(3), 1.1)])
    assert not scaled.accepted and scaled.reason.startswith("log-scale spread 0.0953")
    moved = verify_loop(a, b, rel, others=[rel @ Sim3(np.eye(3), np.array([0.5, 0, 0]), 1.0)])
    assert not moved.accepted and moved.reason.startswith("translation spread")


def test_verify_spread_measures_pairwise_extremes():
    base = Sim3(np.eye(3), np.zeros(3), 1.0)
    got = spread([base, Sim3(rot_y(2.0), np.array([0.3, 0, 0]), 1.2), Sim3(rot_y(-1.0), np.zeros(3), 0.9)], 3.0)
    assert got.rotation_deg == pytest.approx(3.0)
    assert got.translation == pytest.approx(0.1)
    assert got.log_scale == pytest.approx(math.log(1.2 / 0.9))


def test_verify_reprojection_counts(views):
    a, b = views
    check = LoopCheck(stride=8)
    rep = reprojection(a, b, relative(POSE_A, POSE_B), check)
    assert rep.points == (H // 8) * (W // 8)
    assert rep.landed <= rep.points and rep.overlap == pytest.approx(rep.landed / rep.points)


@pytest.mark.parametrize("field, value", [("depth_tolerance", 0.0), ("min_overlap", 1.5), ("stride", 0),
                                          ("min_points", 2.5), ("max_rotation_spread_deg", float("nan")),
                                          ("conf_threshold", float("inf"))])
def test_verify_loop_check_names_the_bad_value(field, value):
    with pytest.raises(ValueError, match=field):
        LoopCheck(**{field: value})


def test_verify_depth_view_refuses_bad_input():
    with pytest.raises(ValueError, match="same shape"):
        DepthView(np.ones((4, 5)), np.ones((5, 4)), K)
    with pytest.raises(ValueError, match="non-finite"):
        DepthView(np.ones((4, 5)), np.ones((4, 5)), np.full((3, 3), np.nan))
    with pytest.raises(ValueError, match="positive focal"):
        DepthView(np.ones((4, 5)), np.ones((4, 5)), np.zeros((3, 3)))
