"""The keyframe pose graph (lingbot_map_ros/slam): loops cut the drift of synthetic trajectories,
a false loop is held off by the robust kernel, priors pull, the ROS covariance mapping, the
serialisation round trip, and every refusal of bad input."""
from __future__ import annotations

import io
import math
import subprocess
import sys

import numpy as np
import pytest

gtsam = pytest.importorskip("gtsam")

from lingbot_map_ros.slam import EdgeNoise, PoseGraph, PoseGraphConfig, Sim3, ate, relative  # noqa: E402
from lingbot_map_ros.slam.noise import (  # noqa: E402
    health_weight,
    ros_covariance_to_tangent,
    ros_to_tangent_jacobian,
    tangent_covariance_to_ros,
)
from lingbot_map_ros.slam.synthetic import Drift, drifted_odometry, figure_eight, loop_measurement, square  # noqa: E402

N = 120
NOISE = EdgeNoise(rotation_deg=0.3, translation=0.005, translation_fraction=0.02, log_scale=0.005)
LOOP_SIGMAS = [0.01] * 3 + [0.02] * 3 + [0.01]
PATHS = {"square": square, "figure_eight": figure_eight}


def rot_z(deg: float) -> np.ndarray:
    a = math.radians(deg)
    return np.array([[math.cos(a), -math.sin(a), 0], [math.sin(a), math.cos(a), 0], [0, 0, 1.0]])


def rpy_matrix(roll: float, pitch: float, yaw: float) -> np.ndarray:
    cr, sr, cp, sp, cy, sy = (f(a) for a in (roll, pitch, yaw) for f in (math.cos, math.sin))
    rx = np.array([[1, 0, 0], [0, cr, -sr], [0, sr, cr]])
    ry = np.array([[cp, 0, sp], [0, 1, 0], [-sp, 0, cp]])
    rz = np.array([[cy, -sy, 0], [sy, cy, 0], [0, 0, 1]])
    return rz @ ry @ rx


def chain(path: str, n: int = N, seed: int = 0, **config):
    """(truth, odometry, graph with every keyframe and odometry edge, updated per keyframe)."""
    truth = PATHS[path](n)
    odom = drifted_odometry(truth, Drift(), np.random.default_rng(seed))
    graph = PoseGraph(PoseGraphConfig(**config))
    for k, pose in enumerate(odom):
        graph.add_keyframe(k, pose)
        if k:
            graph.add_odometry(k - 1, k, sigmas=NOISE.sigmas_for(relative(odom[k - 1], pose)))
        graph.update()
    return truth, odom, graph


def centres(poses) -> np.ndarray:
    return np.array([p.translation for p in poses])


def graph_ate(graph: PoseGraph, truth) -> float:
    _, mats = graph.poses()
    return ate(mats[:, :3, 3], centres(truth))


def false_loop(n: int) -> tuple[int, int, Sim3]:
    """A wildly wrong loop: the last keyframe 'seen' from one a third of the way round, turned 90°
    and 8 units off."""
    return n // 3, n - 1, Sim3(np.array([[0, 0, 1.0], [0, 1, 0], [-1, 0, 0]]), np.array([8.0, 0, 3.0]), 1.0)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_pose_graph_one_true_loop_cuts_the_drift_tenfold(path):
    truth, odom, graph = chain(path)
    drifted = ate(centres(odom), centres(truth))
    assert graph_ate(graph, truth) == pytest.approx(drifted, rel=1e-6)  # odometry alone: no change
    graph.add_loop(N - 1, 0, loop_measurement(truth, Drift(), N - 1, 0), sigmas=LOOP_SIGMAS)
    graph.update()
    closed = graph_ate(graph, truth)
    assert drifted > 0.5  # the injected drift is substantial
    assert closed * 10 <= drifted, (closed, drifted)
    # scale drift corrected too: the last keyframe's scale relative to the first's
    assert graph.pose(N - 1).scale / graph.pose(0).scale == pytest.approx(1.003 ** (N - 1), rel=0.05)
    # the batch re-solve agrees with iSAM2 (whose linearisation points lag by up to the
    # relinearisation threshold, 0.01)
    _, incremental = graph.poses()
    graph.batch_solve()
    _, batch = graph.poses()
    assert np.abs(batch[:, :3, 3] - incremental[:, :3, 3]).max() < 5e-3
    assert graph_ate(graph, truth) == pytest.approx(closed, rel=0.1)
    assert graph.edge_counts() == {"anchor": 1, "odometry": N - 1, "loop": 1}
    assert graph.node_count == N and graph.last_solve_seconds > 0


@pytest.mark.parametrize("path", sorted(PATHS))
def test_pose_graph_false_loop_is_not_worse_than_no_loop(path):
    truth, odom, graph = chain(path)
    no_loop = graph_ate(graph, truth)
    i, j, wrong = false_loop(N)
    graph.add_loop(i, j, wrong, sigmas=LOOP_SIGMAS)
    graph.update()
    assert graph_ate(graph, truth) <= no_loop
    graph.add_loop(N - 1, 0, loop_measurement(truth, Drift(), N - 1, 0), sigmas=LOOP_SIGMAS)
    graph.update()
    both = graph_ate(graph, truth)
    assert both * 5 <= no_loop, (both, no_loop)  # the true loop still closes


def test_pose_graph_false_loop_without_robust_kernel_does_harm():
    """The control of the test above: with no kernel the same false loop bends the square."""
    truth, odom, graph = chain("square", robust_kernel="none")
    no_loop = graph_ate(graph, truth)
    graph.add_loop(*false_loop(N), sigmas=LOOP_SIGMAS)
    graph.update()
    assert graph_ate(graph, truth) > 1.5 * no_loop


def test_pose_graph_priors_pull_the_trajectory():
    truth, odom, graph = chain("square")
    no_prior = graph_ate(graph, truth)
    cov = np.diag([0.02 ** 2] * 3 + [math.radians(1.0) ** 2] * 3)
    for k in range(20, N, 20):
        graph.add_prior(k, truth[k].pose(), cov)
    graph.update()
    graph.update()
    assert graph_ate(graph, truth) * 5 <= no_prior
    assert np.linalg.norm(graph.pose(60).translation - truth[60].translation) < 0.1
    assert graph.edge_counts()["prior"] == 5


def test_pose_graph_correction_maps_odom_onto_map():
    truth, odom, graph = chain("figure_eight")
    assert np.allclose(graph.correction().matrix(), np.eye(4), atol=1e-6)  # odometry only: none
    graph.add_loop(N - 1, 0, loop_measurement(truth, Drift(), N - 1, 0), sigmas=LOOP_SIGMAS)
    graph.update()
    corr = graph.correction()
    assert abs(math.log(corr.scale)) > 0.1  # the loop corrected the scale drift
    assert np.allclose((corr @ odom[-1]).matrix(), graph.pose(N - 1).matrix(), atol=1e-9)
    # a keyframe added now starts at the corrected pose
    step = relative(odom[-2], odom[-1])
    nxt = odom[-1] @ step
    graph.add_keyframe(N, nxt)
    assert np.allclose(graph.pose(N).matrix(), (corr @ nxt).matrix(), atol=1e-9)


# ----------------------------------------------------------------------------- ROS covariance
def to_gtsam(p: Sim3, with_scale: bool):
    if with_scale:
        return gtsam.Similarity3(gtsam.Rot3(p.rotation), p.translation / p.scale, p.scale)
    return gtsam.Pose3(gtsam.Rot3(p.rotation), p.translation)


@pytest.mark.parametrize("with_scale", [False, True])
def test_pose_graph_ros_covariance_jacobian_matches_gtsam_retraction(with_scale):
    """J maps a ROS perturbation (position along the world axes, small rotation about the world's
    fixed axes, log-scale) to GTSAM's local coordinates: checked against GTSAM's own
    localCoordinates by finite differences, column by column."""
    pose = Sim3(rpy_matrix(0.3, -0.4, 2.0), np.array([1.0, -2.0, 0.5]), 1.7 if with_scale else 1.0)
    jac = ros_to_tangent_jacobian(pose, with_scale)
    dim, eps = (7 if with_scale else 6), 1e-6
    base = to_gtsam(pose, with_scale)
    for col in range(dim):
        d = np.zeros(7)
        d[col] = eps
        turned = gtsam.Rot3.Expmap(d[3:6]).matrix() @ pose.rotation  # about the world axes
        moved = Sim3(turned, pose.translation + d[:3], pose.scale * math.exp(d[6]))
        numeric = base.localCoordinates(to_gtsam(moved, with_scale)) / eps
        assert np.allclose(numeric, jac[:, col], atol=1e-5), (col, numeric, jac[:, col])


def test_pose_graph_metric_jacobian_matches_gtsam_retraction():
    """The Sim(3) → SE(3)-in-metres covariance map (slam/metric.py), checked the same way."""
    from lingbot_map_ros.slam.metric import sim3_to_se3_jacobian

    z, unit, eps = Sim3(rpy_matrix(0.5, 0.2, -1.0), np.array([0.3, -0.2, 1.1]), 1.3), 2.5, 1e-6
    jac = sim3_to_se3_jacobian(z, unit)
    base = gtsam.Pose3(gtsam.Rot3(z.rotation), unit * z.translation)
    for col in range(7):
        xi = np.zeros(7)
        xi[col] = eps
        moved = to_gtsam(z, True).compose(gtsam.Similarity3.Expmap(xi))
        rigid = gtsam.Pose3(moved.rotation(), unit * moved.scale() * moved.translation())
        assert np.allclose(base.localCoordinates(rigid) / eps, jac[:, col], atol=1e-5), col


def test_pose_graph_ros_covariance_is_read_in_the_world_frame():
    """Two anisotropic priors on one keyframe turned 90° about z: the estimate takes x from the
    prior tight in world x and y from the one tight in world y (a body-frame reading would swap)."""
    graph = PoseGraph(PoseGraphConfig(mode="se3", anchor=False))
    rot = rot_z(90)
    graph.add_keyframe(0, Sim3(rot, np.array([0.5, 0.5, 0.0])))
    tight, loose = 1e-6, 1.0
    graph.add_prior(0, Sim3(rot, np.zeros(3)), np.diag([tight, loose, tight, tight, tight, tight]))
    graph.add_prior(0, Sim3(rot, np.array([1.0, 1.0, 0.0])), np.diag([loose, tight, tight, tight, tight, tight]))
    graph.update()
    graph.update()
    assert np.allclose(graph.pose(0).translation, [0.0, 1.0, 0.0], atol=1e-3)


def test_pose_graph_ros_covariance_order_is_position_then_rotation():
    """One prior tight in rotation (ROS's last three), another tight in position (the first three):
    the estimate takes its rotation from the first and its position from the second."""
    graph = PoseGraph(PoseGraphConfig(mode="se3", anchor=False))
    graph.add_keyframe(0, Sim3(rot_z(45), np.array([0.5, 0.5, 0.5])))
    tight, loose = 1e-8, 1e2
    graph.add_prior(0, Sim3(rot_z(90), np.array([5.0, 5.0, 5.0])), np.diag([loose] * 3 + [tight] * 3))
    graph.add_prior(0, Sim3(rot_z(0), np.array([1.0, 2.0, 3.0])), np.diag([tight] * 3 + [loose] * 3))
    for _ in range(3):
        graph.update()
    est = graph.pose(0)
    assert np.allclose(est.translation, [1.0, 2.0, 3.0], atol=1e-3)
    assert np.allclose(est.rotation, rot_z(90), atol=1e-3)


def test_pose_graph_ros_covariance_round_trip():
    pose = Sim3(rpy_matrix(0.2, 0.1, -1.0), np.array([3.0, 1.0, -2.0]), 2.5)
    a = np.random.default_rng(1).normal(size=(6, 6))
    cov = a @ a.T + 0.1 * np.eye(6)
    for sigma in (None, 0.3):
        tangent = ros_covariance_to_tangent(pose if sigma else Sim3(pose.rotation, pose.translation), cov, sigma)
        assert tangent.shape == ((7, 7) if sigma else (6, 6))
        back = tangent_covariance_to_ros(pose if sigma else Sim3(pose.rotation, pose.translation), tangent)
        assert np.allclose(back, cov, atol=1e-9)
    flat = ros_covariance_to_tangent(Sim3.identity(), cov.reshape(-1))  # 36 values as in the message
    assert np.allclose(flat[3:, 3:], cov[:3, :3]) and np.allclose(flat[:3, :3], cov[3:, 3:])


# ----------------------------------------------------------------------------- serialisation
def test_pose_graph_serialisation_round_trip():
    truth, odom, graph = chain("square", n=60)
    graph.add_loop(59, 0, loop_measurement(truth, Drift(), 59, 0), sigmas=LOOP_SIGMAS)
    graph.add_prior(30, truth[30].pose(), np.diag([0.1] * 6), robust=True)
    graph.update()
    buffer = io.BytesIO()
    np.savez(buffer, **graph.to_arrays())
    buffer.seek(0)
    with np.load(buffer) as stored:
        rebuilt = PoseGraph.from_arrays(dict(stored))
    keys_a, poses_a = graph.poses()
    keys_b, poses_b = rebuilt.poses()
    assert np.array_equal(keys_a, keys_b)
    assert np.abs(poses_a - poses_b).max() < 1e-9
    assert rebuilt.edge_counts() == graph.edge_counts() == {"anchor": 1, "odometry": 59, "loop": 1, "prior": 1}
    assert rebuilt.config == graph.config and rebuilt.newest == 59
    assert np.allclose(rebuilt.odom_pose(7).matrix(), graph.odom_pose(7).matrix(), atol=0)
    # both go on alike (iSAM2's linearisation points differ: within its relinearisation threshold;
    # a batch solve of each reaches the same optimum)
    for g in (graph, rebuilt):
        g.add_keyframe(60, odom[-1] @ relative(odom[-2], odom[-1]))
        g.add_odometry(59, 60, sigmas=NOISE.sigmas(1.0, 0.3))
        g.update()
    assert np.abs(graph.poses()[1] - rebuilt.poses()[1]).max() < 1e-2
    graph.batch_solve()
    rebuilt.batch_solve()
    assert np.abs(graph.poses()[1] - rebuilt.poses()[1]).max() < 1e-7


def test_pose_graph_to_se3_scales_to_metres():
    truth, odom, graph = chain("square", n=60)
    graph.add_loop(59, 0, loop_measurement(truth, Drift(), 59, 0), sigmas=LOOP_SIGMAS)
    graph.update()
    metric = graph.to_se3(2.0)
    assert metric.config.mode == "se3" and metric.edge_counts() == graph.edge_counts()
    assert np.allclose(metric.poses()[1][:, :3, 3], 2.0 * graph.poses()[1][:, :3, 3], atol=1e-9)
    metric.update()
    sim3_ate = graph_ate(graph, truth)
    se3_ate = ate(metric.poses()[1][:, :3, 3], 2.0 * centres(truth))
    assert se3_ate < 2.0 * 1.5 * sim3_ate
    with pytest.raises(ValueError, match="scale 1 only"):
        metric.add_loop(59, 0, Sim3(np.eye(3), np.zeros(3), 1.1), sigmas=[0.1] * 6)
    with pytest.raises(ValueError, match="needs a sim3 graph"):
        metric.to_se3(1.0)


# ----------------------------------------------------------------------------- refusals
def small_graph(**config) -> PoseGraph:
    graph = PoseGraph(PoseGraphConfig(**config))
    graph.add_keyframe(0, np.eye(4))
    pose = np.eye(4)
    pose[0, 3] = 1.0
    graph.add_keyframe(1, pose)
    return graph


@pytest.mark.parametrize("bad, match", [
    (np.full((4, 4), np.nan), "non-finite"),
    (np.diag([1.0, 1.0, 1.1, 1.0]), "not orthonormal"),
    (np.diag([1.0, 1.0, -1.0, 1.0]), "not a proper rotation"),
    (np.eye(3), r"shape \(4, 4\)"),
])
def test_pose_graph_refuses_bad_poses(bad, match):
    graph = small_graph()
    with pytest.raises(ValueError, match=match):
        graph.add_keyframe(2, bad)
    assert graph.node_count == 2


def test_pose_graph_refuses_bad_quaternions_and_scales():
    with pytest.raises(ValueError, match="not a unit quaternion"):
        Sim3.from_quaternion([0, 0, 0], [0.0, 0.0, 0.5, 0.9])
    with pytest.raises(ValueError, match="non-finite"):
        Sim3.from_quaternion([0, 0, 0], [0.0, 0.0, np.nan, 1.0])
    assert np.allclose(Sim3.from_quaternion([1, 2, 3], [0, 0, math.sin(0.5), math.cos(0.5)]).rotation,
                       rot_z(math.degrees(1.0)))
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        Sim3(np.eye(3), np.zeros(3), 0.0)
    with pytest.raises(ValueError, match="scale 1 only"):
        small_graph(mode="se3").add_keyframe(2, np.eye(4), scale=2.0)


def test_pose_graph_refuses_unknown_and_duplicate_keyframes():
    graph = small_graph()
    with pytest.raises(ValueError, match="duplicate keyframe 1"):
        graph.add_keyframe(1, np.eye(4))
    with pytest.raises(ValueError, match="unknown keyframe 7"):
        graph.add_odometry(1, 7, sigmas=[0.1] * 7)
    with pytest.raises(ValueError, match="unknown keyframe 9"):
        graph.add_prior(9, np.eye(4), np.eye(6))
    with pytest.raises(ValueError, match="unknown keyframe 5"):
        graph.pose(5)
    with pytest.raises(ValueError, match="int >= 0"):
        graph.add_keyframe(-3, np.eye(4))
    with pytest.raises(ValueError, match="to itself"):
        graph.add_odometry(1, 1, sigmas=[0.1] * 7)


@pytest.mark.parametrize("kwargs, match", [
    (dict(covariance=np.diag([1.0] * 6 + [-1.0])), "not positive definite"),
    (dict(covariance=np.eye(7) + np.triu(np.ones((7, 7)), 1)), "not symmetric"),
    (dict(covariance=np.eye(6)), r"shape \(7, 7\)"),
    (dict(sigmas=[0.1] * 6 + [0.0]), "must all be > 0"),
    (dict(sigmas=[0.1] * 6 + [np.nan]), "non-finite"),
    (dict(), "exactly one of sigmas"),
])
def test_pose_graph_refuses_bad_covariances(kwargs, match):
    graph = small_graph()
    with pytest.raises(ValueError, match=match):
        graph.add_odometry(0, 1, **kwargs)
    assert graph.edge_counts() == {"anchor": 1}


def test_pose_graph_refuses_bad_prior_covariance():
    graph = small_graph()
    with pytest.raises(ValueError, match="not positive definite"):
        graph.add_prior(1, np.eye(4), np.diag([1.0, 1.0, 1.0, 1.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="log_scale_sigma must be finite and > 0"):
        graph.add_prior(1, np.eye(4), np.eye(6), log_scale_sigma=0.0)
    with pytest.raises(ValueError, match="no scale"):
        small_graph(mode="se3").add_prior(1, np.eye(4), np.eye(6), log_scale_sigma=0.1)
    assert graph.edge_counts() == {"anchor": 1}


def test_pose_graph_refuses_an_unanchored_update_and_keeps_its_input():
    graph = small_graph(anchor=False)
    graph.add_odometry(0, 1, sigmas=[0.01] * 7)
    with pytest.raises(ValueError, match=r"keyframes \[0, 1\] are connected to no anchor or prior"):
        graph.update()
    graph.add_prior(0, np.eye(4), np.eye(6) * 1e-6)
    graph.update()
    assert graph.pose(1).translation == pytest.approx([1.0, 0.0, 0.0], abs=1e-6)


@pytest.mark.parametrize("field, value", [("mode", "se2"), ("robust_kernel", "tukey"), ("robust_param", 0.0),
                                          ("anchor_sigma", float("nan")), ("relinearize_skip", 0),
                                          ("iterations_after_loop", 1.5)])
def test_pose_graph_config_names_the_bad_value(field, value):
    with pytest.raises(ValueError, match=field):
        PoseGraphConfig(**{field: value})


def test_pose_graph_edge_noise_from_weight():
    noise = EdgeNoise()
    full, degraded = noise.sigmas(1.0, step=0.5), noise.sigmas(health_weight("degraded"), step=0.5)
    assert full.shape == (7,) and noise.sigmas(with_scale=False).shape == (6,)
    assert np.allclose(degraded, full * math.sqrt(10))
    assert full[3] == pytest.approx(noise.translation + noise.translation_fraction * 0.5)
    assert np.allclose(noise.sigmas(0.0), noise.sigmas(noise.min_weight))  # clipped
    with pytest.raises(ValueError, match="unknown tracking state"):
        health_weight("confused")
    with pytest.raises(ValueError, match="rotation_deg"):
        EdgeNoise(rotation_deg=-1.0)


def test_pose_graph_package_imports_without_gtsam_or_torch():
    code = ("import sys; import lingbot_map_ros.slam, lingbot_map_ros.slam.pose_graph; "
            "print('gtsam' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
