"""Metric scale sources on synthetic trajectories and depth maps with a known scale."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lingbot_map_ros.config import ConfigError
from lingbot_map_ros.geometry import quaternion_to_matrix, unproject_depth
from lingbot_map_ros.robot.scale import (
    DepthScaleEstimator,
    FixedScale,
    OdometryScaleEstimator,
    ScaleSource,
    apply_scale,
    depth_to_metres,
    resample_nearest,
    scale_depth,
    scale_points,
)
from lingbot_map_ros.robot.scale_fit import robust_fit

S_TRUE = 2.5  # metres per model unit


def odom_path(n: int, step: float = 0.05, seed: int = 0) -> np.ndarray:
    """[n, 3] a wandering planar path in the odometry frame (metres), ~``step`` per frame."""
    rng = np.random.default_rng(seed)
    heading = np.cumsum(rng.normal(scale=0.15, size=n))
    xy = np.cumsum(step * np.stack([np.cos(heading), np.sin(heading)], -1), axis=0)
    return np.concatenate([xy, np.full((n, 1), 0.3)], axis=1)


def model_view(odom: np.ndarray, scale: float, seed: int = 1, noise: float = 0.0) -> np.ndarray:
    """The same points in a rotated, shifted model world with ``metres = scale · model``."""
    rng = np.random.default_rng(seed)
    rot = quaternion_to_matrix(rng.normal(size=4)).astype(np.float64)
    model = odom @ rot.T / scale + rng.normal(size=3)
    return model + rng.normal(scale=noise, size=model.shape)


def feed(est: OdometryScaleEstimator, model: np.ndarray, odom: np.ndarray) -> int:
    return sum(est.update(m, o) for m, o in zip(model, odom))


# ----------------------------------------------------------------------------- odometry

def test_odometry_converges_to_the_known_scale_under_noise():
    odom = odom_path(200)
    est = OdometryScaleEstimator()
    added = feed(est, model_view(odom, S_TRUE, noise=0.002), odom)
    assert added >= est.samples >= 5
    assert est.converged and est.source == "odometry"
    assert est.scale == pytest.approx(S_TRUE, rel=0.02)
    assert 0 < est.spread < 0.10
    status = est.as_status()
    assert status["converged"] is True and status["scale"] == est.scale and status["samples"] == est.samples


def test_odometry_needs_min_samples_before_converging():
    odom = odom_path(200)
    est = OdometryScaleEstimator(min_samples=5)
    model = model_view(odom, S_TRUE)
    accepted = 0
    for m, o in zip(model, odom):
        accepted += est.update(m, o)
        assert est.converged == (accepted >= 5)
        if accepted >= 5:
            break
    assert est.scale == pytest.approx(S_TRUE, rel=1e-9)  # noise-free: exact


def test_no_motion_never_divides_by_zero_and_never_converges():
    """A stationary robot, or one turning about the tracked point: positions only jitter."""
    rng = np.random.default_rng(2)
    n = 300
    odom = np.full((n, 3), 1.0) + rng.normal(scale=0.001, size=(n, 3))  # 1 mm jitter
    model = rng.normal(scale=1e-4, size=(n, 3))
    est = OdometryScaleEstimator()
    with np.errstate(all="raise"):
        assert feed(est, model, odom) == 0
    assert not est.converged and est.scale is None and est.samples == 0 and math.isnan(est.spread)


def test_turning_in_place_with_an_offset_camera_measures_the_circle():
    """The camera 0.3 m ahead of the rotation axis moves on a circle: valid increments."""
    angle = np.linspace(0, 2 * np.pi, 200)
    odom = np.stack([0.3 * np.cos(angle), 0.3 * np.sin(angle), np.full_like(angle, 0.2)], -1)
    est = OdometryScaleEstimator()
    feed(est, model_view(odom, S_TRUE, noise=0.0005), odom)
    assert est.converged and est.scale == pytest.approx(S_TRUE, rel=0.02)


def test_odometry_motion_the_model_does_not_see_is_rejected():
    odom = odom_path(100)
    model = np.zeros_like(odom)  # the model's position is stuck
    est = OdometryScaleEstimator()
    with np.errstate(all="raise"):
        assert feed(est, model, odom) == 0
    assert est.rejected["model_static"] > 10 and not est.converged


def test_odometry_rejects_outlier_increments():
    odom = odom_path(400)
    model = model_view(odom, S_TRUE, noise=0.001)
    rng = np.random.default_rng(3)
    bad = rng.random(len(model)) < 0.15  # 15 % of the frames jump in the model
    model[bad] += rng.normal(scale=0.2, size=(bad.sum(), 3))
    est = OdometryScaleEstimator(window=40)
    feed(est, model, odom)
    assert est.converged and est.scale == pytest.approx(S_TRUE, rel=0.03)
    assert est.as_status()["inliers"] < est.samples  # some samples were rejected by the MAD test


def test_converged_scale_holds_through_noise_and_small_changes():
    est = OdometryScaleEstimator(window=10, min_samples=5, hold_tolerance=0.02)
    odom = odom_path(600)
    feed(est, model_view(odom[:150], S_TRUE), odom[:150])
    held = est.scale
    assert held == pytest.approx(S_TRUE)
    # a burst of garbage: the refit does not converge and the held value stays
    rng = np.random.default_rng(4)
    garbage = model_view(odom[150:300], S_TRUE) * rng.uniform(0.3, 3.0, size=(150, 1))
    feed(est, garbage, odom[150:300])
    assert est.estimate != pytest.approx(held, rel=1e-3) and est.scale == held and est.converged
    # consistent data 1 % off: within the hold tolerance, not replaced
    feed(est, model_view(odom[300:450], S_TRUE * 1.01, seed=5), odom[300:450])
    assert est.estimate == pytest.approx(S_TRUE * 1.01) and est.scale == held
    # consistent data 20 % off: replaced
    feed(est, model_view(odom[450:], S_TRUE * 1.2, seed=6), odom[450:])
    assert est.scale == pytest.approx(S_TRUE * 1.2)


def test_restart_window_refits_while_holding_the_old_value():
    est = OdometryScaleEstimator(window=10, min_samples=5, hold_tolerance=0.5)
    odom = odom_path(400)
    feed(est, model_view(odom[:150], S_TRUE), odom[:150])
    est.restart_window()
    assert est.converged and est.scale == pytest.approx(S_TRUE) and est.refitting and est.samples == 0
    # the first pair after the restart is only an anchor: no increment spans the restart
    # (here the odometry is 1 m away from the last pair before it)
    new_odom = odom[150:] + np.array([1.0, 0.0, 0.0])
    new_model = model_view(new_odom, S_TRUE * 1.1, seed=7)
    assert not est.update(new_model[0], new_odom[0])
    assert est.samples == 0
    accepted = 0
    for m, o in zip(new_model[1:], new_odom[1:]):
        accepted += est.update(m, o)
        if accepted < 5:
            assert est.scale == pytest.approx(S_TRUE) and est.refitting
    # the new window's first converged fit replaces the held value despite hold_tolerance 50 %
    assert est.scale == pytest.approx(S_TRUE * 1.1) and not est.refitting


def test_reset_forgets_everything():
    est = OdometryScaleEstimator()
    odom = odom_path(150)
    feed(est, model_view(odom, S_TRUE), odom)
    assert est.converged
    est.reset()
    assert not est.converged and est.scale is None and est.samples == 0 and est.estimate is None
    assert est.as_status()["rejected"] == {}


def test_odometry_bad_input_is_refused_and_keeps_state():
    est = OdometryScaleEstimator()
    odom = odom_path(150)
    feed(est, model_view(odom, S_TRUE), odom)
    before = est.as_status()
    with pytest.raises(ValueError, match="model_position must be 3 numbers"):
        est.update(np.eye(4), odom[0])
    with pytest.raises(ValueError, match="odom_position"):
        est.update(np.zeros(3), [1.0, 2.0])
    assert est.as_status() == before
    assert not est.update([math.nan, 0, 0], odom[0])
    assert est.rejected["non_finite"] == 1 and est.scale == before["scale"]


@pytest.mark.parametrize("kwargs, field", [
    ({"window": 0}, "window"), ({"min_samples": 50, "window": 10}, "min_samples"),
    ({"max_spread": 0.0}, "max_spread"), ({"min_motion": -1.0}, "min_motion"),
    ({"min_model_motion": math.nan}, "min_model_motion"), ({"outlier_k": 0}, "outlier_k"),
    ({"hold_tolerance": -0.1}, "hold_tolerance"),
])
def test_odometry_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        OdometryScaleEstimator(**kwargs)


def test_robust_fit_ignores_a_minority_of_outliers():
    samples = np.r_[np.full(7, 2.0) + np.linspace(-0.01, 0.01, 7), 10.0, 0.1]
    fit = robust_fit(samples, outlier_k=3.0)
    assert fit.inliers == 7 and fit.outliers == 2
    assert fit.estimate == pytest.approx(2.0) and fit.spread < 0.01


# ----------------------------------------------------------------------------- depth sensor

COLOR_HW, MODEL_HW = (480, 640), (42, 56)  # 640x480 resized to width 56 -> 56x42, no crop


def depth_field(hw: tuple[int, int]) -> np.ndarray:
    """A smooth scene depth (metres) sampled at the pixel centres of an image covering the view."""
    h, w = hw
    y, x = np.mgrid[0:h, 0:w]
    return 2.0 + 1.0 * (x + 0.5) / w + 0.5 * (y + 0.5) / h


def depth_frame(sensor_hw=(240, 320), seed=0):
    """(model depth, confidence, sensor depth uint16 mm) of one frame; truth S_TRUE."""
    rng = np.random.default_rng(seed)
    model = (depth_field(MODEL_HW) / S_TRUE).astype(np.float32)
    conf = np.full(MODEL_HW, 3.0, dtype=np.float32)
    sensor = np.round(depth_field(sensor_hw) * 1000 + rng.normal(scale=2.0, size=sensor_hw)).astype(np.uint16)
    return model, conf, sensor


def test_depth_scale_converges_from_a_lower_resolution_uint16_sensor():
    est = DepthScaleEstimator(min_pixels=50, pixel_step=1)
    for i in range(3):
        model, conf, sensor = depth_frame(seed=i)
        assert est.update(model, conf, sensor, color_hw=COLOR_HW)
    assert est.converged and est.source == "depth" and est.samples == 3
    assert est.scale == pytest.approx(S_TRUE, rel=0.01)
    assert est.spread < 0.01 and est.as_status()["last_pixels"] == MODEL_HW[0] * MODEL_HW[1]


def test_depth_ignores_low_confidence_and_invalid_pixels():
    model, conf, sensor = depth_frame()
    sensor_m = depth_to_metres(sensor)
    # corrupt 40 % of the model's pixels where it is not confident, and punch holes in the sensor
    conf[:, :22] = 1.2
    model[:, :22] *= 3.0
    sensor_m[:60, :] = np.nan
    sensor_m[60:80, :] = 0.0
    est = DepthScaleEstimator(min_samples=1, min_pixels=50, pixel_step=1)
    assert est.update(model, conf, sensor_m, color_hw=COLOR_HW)
    assert est.scale == pytest.approx(S_TRUE, rel=0.01)
    assert est.last_pixels < MODEL_HW[0] * 34


def test_depth_uint16_and_float_metres_agree():
    model, conf, sensor = depth_frame()
    a, b = DepthScaleEstimator(min_samples=1, min_pixels=10), DepthScaleEstimator(min_samples=1, min_pixels=10)
    a.update(model, conf, sensor, color_hw=COLOR_HW)
    b.update(model, conf, sensor.astype(np.float32) / 1000.0, color_hw=COLOR_HW)
    assert a.scale == pytest.approx(b.scale, rel=1e-6)


def test_depth_frames_with_too_few_pixels_are_rejected():
    model, conf, sensor = depth_frame()
    conf[:] = 1.0  # nothing confident
    est = DepthScaleEstimator(min_samples=1)
    assert not est.update(model, conf, sensor, color_hw=COLOR_HW)
    assert est.rejected == {"few_pixels": 1} and not est.converged and est.samples == 0


def test_depth_one_bad_frame_does_not_move_the_held_scale():
    est = DepthScaleEstimator(min_pixels=50, hold_tolerance=0.0, window=7)
    for i in range(5):
        est.update(*depth_frame(seed=i), color_hw=COLOR_HW)
    held = est.scale
    model, conf, sensor = depth_frame(seed=9)
    est.update(model * 0.5, conf, sensor, color_hw=COLOR_HW)  # a frame whose model depth halved
    assert est.scale == pytest.approx(held, rel=1e-3)
    assert est.as_status()["inliers"] == est.samples - 1


def test_depth_bad_input_is_refused_and_keeps_state():
    est = DepthScaleEstimator(min_samples=1, min_pixels=10)
    model, conf, sensor = depth_frame()
    est.update(model, conf, sensor, color_hw=COLOR_HW)
    before = est.as_status()
    with pytest.raises(ValueError, match="uint16 .mm. or float"):
        est.update(model, conf, sensor.astype(np.int32), color_hw=COLOR_HW)
    with pytest.raises(ValueError, match="confidence must both be"):
        est.update(model, conf[:-1], sensor, color_hw=COLOR_HW)
    with pytest.raises(ValueError, match="is not what a 56x42 model input comes from"):
        est.update(model, conf, sensor, color_hw=(480, 480))
    assert est.as_status() == before


def test_resample_nearest_follows_the_centre_crop():
    # portrait 640x960 (WxH) at width 56: resized to 56x84, centre-cropped to 56x56 (14 rows cut each side)
    rows = np.repeat(np.arange(960)[:, None], 640, axis=1)
    cols = np.repeat(np.arange(640)[None, :], 960, axis=0)
    got_rows = resample_nearest(rows, (56, 56))
    got_cols = resample_nearest(cols, (56, 56))
    assert got_rows.shape == (56, 56)
    # the sensor's top and bottom sixths (160 rows each) are what the crop removed
    assert got_rows.min() >= 160 and got_rows.max() < 800
    assert got_rows[0, 0] < 160 + 960 / 84 and got_rows[-1, 0] > 800 - 960 / 84
    assert np.all(np.diff(got_rows[:, 0]) > 0) and np.all(got_rows == got_rows[:, :1])
    assert got_cols.min() < 640 / 56 and got_cols.max() > 640 - 640 / 56 and np.all(got_cols == got_cols[:1])
    # a sensor at half the resolution picks the pixel holding the same centre
    half = resample_nearest(rows[::2, ::2] // 2, (56, 56), color_hw=(960, 640))
    assert np.all(np.abs(half * 2 - got_rows) <= 2)


# ----------------------------------------------------------------------------- fixed + applying

def test_fixed_scale_and_protocol():
    fixed = FixedScale(0.8)
    assert fixed.scale == 0.8 and fixed.converged and fixed.spread == 0.0 and fixed.source == "fixed"
    fixed.restart_window()
    fixed.reset()
    assert fixed.scale == 0.8 and fixed.as_status()["scale"] == 0.8
    for src in (fixed, OdometryScaleEstimator(), DepthScaleEstimator()):
        assert isinstance(src, ScaleSource)
    for bad in (0.0, -1.0, math.inf, "2"):
        with pytest.raises(ConfigError, match="fixed scale must be"):
            FixedScale(bad)


def test_apply_scale_is_consistent_with_scaled_points_and_depth():
    rng = np.random.default_rng(8)
    c2w = np.eye(4)
    c2w[:3, :3] = quaternion_to_matrix(rng.normal(size=4)).astype(np.float64)
    c2w[:3, 3] = rng.normal(size=3)
    depth = rng.uniform(1.0, 3.0, size=(4, 5))
    K = np.array([[5.0, 0, 2.5], [0, 5.0, 2.0], [0, 0, 1]])
    scaled = apply_scale(c2w, S_TRUE)
    np.testing.assert_allclose(scaled[:3, :3], c2w[:3, :3])
    np.testing.assert_allclose(scaled[:3, 3], S_TRUE * c2w[:3, 3])
    np.testing.assert_allclose(unproject_depth(scale_depth(depth, S_TRUE), K, scaled),
                               scale_points(unproject_depth(depth, K, c2w), S_TRUE), atol=1e-12)
    batch = apply_scale(np.stack([c2w, c2w]), 2.0)
    np.testing.assert_allclose(batch[1, :3, 3], 2.0 * c2w[:3, 3])
    assert scale_points(np.ones(3, dtype=np.float32), 2.0).dtype == np.float32
    with pytest.raises(ValueError, match="4, 4"):
        apply_scale(np.eye(3), 2.0)
