"""TrackingHealth state machine and covariance on scripted frame sequences."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lingbot_map_ros.config import ConfigError
from lingbot_map_ros.robot.health import HealthConfig, TrackingHealth, TrackingState

T, D, L, I = TrackingState.TRACKING, TrackingState.DEGRADED, TrackingState.LOST, TrackingState.INITIALIZING


def pose(x: float = 0.0, yaw_deg: float = 0.0) -> np.ndarray:
    """Camera-to-world: centre at (x, 0, 0), rotated about the camera's y axis."""
    a = math.radians(yaw_deg)
    out = np.eye(4)
    out[:3, :3] = [[math.cos(a), 0, math.sin(a)], [0, 1, 0], [-math.sin(a), 0, math.cos(a)]]
    out[0, 3] = x
    return out


def tracking(cfg: HealthConfig | None = None, frames: int = 6, step: float = 0.02) -> tuple[TrackingHealth, float]:
    """A monitor fed ``frames`` good frames moving ``step`` each; returns it and the last x."""
    health = TrackingHealth(cfg)
    for i in range(frames):
        health.update(0.9, pose(i * step))
    assert health.state == T
    return health, (frames - 1) * step


def test_initializing_then_tracking_after_init_frames():
    health = TrackingHealth(HealthConfig(init_frames=3))
    states = [health.update(0.9, pose(0.01 * i)).state for i in range(4)]
    assert states == [I, I, T, T]


def test_low_confidence_degrades_and_good_frames_recover():
    health, x = tracking(HealthConfig(recover_after=3))
    st = health.update(0.1, pose(x + 0.02))
    assert st.state == D and st.reasons == ("low_confidence",) and st.changed
    states = [health.update(0.9, pose(x + 0.02 * (i + 2))).state for i in range(3)]
    assert states == [D, D, T]


def test_confidence_collapse_is_lost_after_n_consecutive_frames():
    health, x = tracking(HealthConfig(lost_after=4))
    states = [health.update(0.01, pose(x)).state for _ in range(4)]
    assert states == [D, D, D, L]
    # an interrupted run restarts the count
    health2, x = tracking(HealthConfig(lost_after=3))
    states = [health2.update(v, pose(x)).state for v in (0.01, 0.01, 0.9, 0.01, 0.01)]
    assert L not in states


def test_nan_valid_fraction_counts_as_collapse():
    health, x = tracking()
    assert health.update(math.nan, pose(x)).reasons == ("confidence_collapse",)


def test_non_finite_outputs_are_lost_at_once_and_recover():
    health, x = tracking(HealthConfig(recover_after=2))
    st = health.update(0.9, None, finite=False)
    assert st.state == L and st.reasons == ("non_finite",)
    bad_pose = pose(x)
    bad_pose[0, 3] = math.nan
    assert health.update(0.9, bad_pose).state == L
    # low confidence while lost keeps it lost; then two good frames recover
    assert health.update(0.1, pose(x + 0.02)).state == L
    assert [health.update(0.9, pose(x + 0.02 * i)).state for i in (2, 3)] == [L, T]


def test_translation_jump_against_the_recent_median_and_the_floor():
    cfg = HealthConfig(jump_factor=5.0, jump_floor=0.1)
    health, x = tracking(cfg, frames=8, step=0.02)
    # 0.09: > 5 x 0.02 median but below the floor: not a jump
    st = health.update(0.9, pose(x + 0.09))
    assert st.state == T and st.translation_step == pytest.approx(0.09)
    # 0.5: both criteria
    st = health.update(0.9, pose(x + 0.59))
    assert st.state == D and st.reasons == ("translation_jump",)
    # faster steady motion (0.15 per frame, 7.5 x the old median, above the floor) is a jump only at first:
    # the median adapts
    health2, x = tracking(cfg, frames=8, step=0.02)
    reasons = [health2.update(0.9, pose(x + 0.15 * (i + 1))).reasons for i in range(12)]
    assert reasons[0] == ("translation_jump",) and reasons[-1] == ()


def test_stationary_jitter_is_not_a_jump():
    health = TrackingHealth()
    rng = np.random.default_rng(0)
    for _ in range(30):
        st = health.update(0.9, pose(float(rng.normal(scale=1e-4))))
    assert st.state == T


def test_rotation_jump_degrades():
    health, x = tracking(HealthConfig(max_rotation_step_deg=30.0))
    assert health.update(0.9, pose(x, yaw_deg=20.0)).state == T
    st = health.update(0.9, pose(x, yaw_deg=65.0))
    assert st.state == D and st.reasons == ("rotation_jump",) and st.rotation_step_deg == pytest.approx(45.0)


def test_scale_spread_degrades_and_nan_spread_is_ignored():
    health, x = tracking(HealthConfig(max_scale_spread=0.2))
    assert health.update(0.9, pose(x), scale_spread=0.1).state == T
    assert health.update(0.9, pose(x), scale_spread=math.nan).state == T
    st = health.update(0.9, pose(x), scale_spread=0.5)
    assert st.state == D and st.reasons == ("scale_spread",)


def test_covariance_grows_with_bad_health_and_scales_translation_only():
    cfg = HealthConfig(base_translation_std=0.02, base_rotation_std_deg=1.0)
    health = TrackingHealth(cfg)
    var_r = math.radians(1.0) ** 2
    np.testing.assert_allclose(np.diag(health.covariance()), [4e-4 * 100] * 3 + [var_r * 100] * 3)  # initializing
    health, x = tracking(cfg)
    cov = health.covariance(scale=3.0)
    assert cov.shape == (6, 6) and np.count_nonzero(cov - np.diag(np.diag(cov))) == 0
    np.testing.assert_allclose(np.diag(cov), [4e-4 * 9] * 3 + [var_r] * 3)
    health.update(0.1, pose(x))
    np.testing.assert_allclose(np.diag(health.covariance()), [4e-4 * 10] * 3 + [var_r * 10] * 3)
    health.update(0.9, None, finite=False)
    np.testing.assert_allclose(np.diag(health.covariance()), [4e-4 * 1000] * 3 + [var_r * 1000] * 3)


def test_reset_returns_to_initializing_and_forgets_the_pose():
    health, x = tracking()
    health.reset()
    assert health.state == I
    st = health.update(0.9, pose(x + 100.0))  # a new world: no jump against the old pose
    assert st.reasons == () and math.isnan(st.translation_step)


def test_bad_pose_shape_is_refused_and_keeps_state():
    health, x = tracking()
    with pytest.raises(ValueError, match=r"pose must be \[4, 4\]"):
        health.update(0.9, np.eye(3))
    assert health.state == T
    assert health.update(0.9, pose(x + 0.02)).translation_step == pytest.approx(0.02)


@pytest.mark.parametrize("kwargs, field", [
    ({"lost_after": 0}, "lost_after"), ({"recover_after": 1.5}, "recover_after"),
    ({"jump_factor": 0.0}, "jump_factor"), ({"jump_floor": -1.0}, "jump_floor"),
    ({"max_rotation_step_deg": math.inf}, "max_rotation_step_deg"), ({"factor_lost": 0}, "factor_lost"),
    ({"lost_valid_fraction": 0.5, "degraded_valid_fraction": 0.2}, "lost_valid_fraction"),
    ({"jump_min_history": 20, "jump_window": 10}, "jump_min_history"), ({"init_frames": True}, "init_frames"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        HealthConfig(**kwargs)
    assert issubclass(ConfigError, ValueError)


# ------------------------------------------------------------------ node parameters
def test_every_health_parameter_is_declared_with_the_config_default():
    """The node declares each ``health_*`` parameter, run-time settable, with HealthConfig's default."""
    from lingbot_map_ros.robot.health import HEALTH_PARAMETERS
    from lingbot_map_ros.runtime.params import PARAMETERS, NodeSettings

    table = {p.name: p for p in PARAMETERS}
    defaults = HealthConfig()
    for param, field in HEALTH_PARAMETERS.items():
        assert table[param].dynamic and table[param].description, param
        assert table[param].default == getattr(defaults, field), param
        assert NodeSettings.__dataclass_fields__[param].default == getattr(defaults, field), param
        assert type(table[param].default) is type(getattr(defaults, field)), param
    assert sorted(p for p in table if p.startswith("health_")) == sorted(HEALTH_PARAMETERS)


def test_config_from_parameters_maps_the_names_and_errors_name_the_parameters():
    from lingbot_map_ros.robot.health import config_from_parameters
    from lingbot_map_ros.runtime.params import apply_dynamic, resolve_settings

    cfg = config_from_parameters({"health_max_rotation_deg": 180.0, "health_lost_after": 2})
    assert (cfg.max_rotation_step_deg, cfg.lost_after, cfg.jump_factor) == (180.0, 2, HealthConfig().jump_factor)
    settings = resolve_settings({"health_jump_factor": 50.0, "health_recover_after": 1})
    cfg = config_from_parameters(settings)
    assert (cfg.jump_factor, cfg.recover_after) == (50.0, 1)
    with pytest.raises(ConfigError, match=r"need health_lost_valid_fraction \(0\.5\) <= health_degraded_valid_"):
        config_from_parameters({"health_lost_valid_fraction": 0.5})
    # the combination is checked at start and on a run-time set; the settings stay as they were
    with pytest.raises(ConfigError, match="health_degraded_valid_fraction"):
        resolve_settings({"health_degraded_valid_fraction": 0.01})
    with pytest.raises(ConfigError, match="health_lost_valid_fraction"):
        apply_dynamic(settings, "health_lost_valid_fraction", 0.9)
    assert settings.health_lost_valid_fraction == 0.05


def test_reconfigure_keeps_the_state_and_applies_from_the_next_frame():
    health, x = tracking(HealthConfig(max_rotation_step_deg=30.0))
    health.update(0.9, pose(x, yaw_deg=40.0))
    assert health.state == D
    health.reconfigure(HealthConfig(max_rotation_step_deg=90.0, recover_after=1, jump_window=3,
                                    jump_min_history=3))
    assert health.state == D  # kept
    st = health.update(0.9, pose(x + 0.02, yaw_deg=100.0))  # 60 degrees: a jump before, not now
    assert st.reasons == () and st.state == T
    assert health._steps.maxlen == 3 and len(health._steps) == 3  # the recent steps kept, trimmed
