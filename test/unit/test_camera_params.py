"""Several cameras' parameters (runtime/params.py): ``cameras``, ``camera.<c>.<p>`` parsing, checks,
per-camera settings and run-time changes. No ROS graph."""
from __future__ import annotations

import pytest

from lingbot_map_ros.config import ConfigError
from lingbot_map_ros.runtime.params import (CAMERA_PARAMETERS, DYNAMIC_PARAMETERS, PARAMETER_NAMES, apply_camera_dynamic,
                                        camera_param_name, camera_values, check_camera_names,
                                        resolve_camera_settings, resolve_settings, split_camera_param)

BASE = {"image_width": 98, "num_scale_frames": 2, "sliding_window": 3, "device": "cpu", "cameras": ["front", "rear"]}


def test_cameras_default_to_one_camera_and_names_are_checked():
    assert resolve_settings({}).cameras == ()
    assert resolve_settings(BASE).cameras == ("front", "rear")
    assert check_camera_names(["a_1", "B"]) == ("a_1", "B")
    for bad, match in ((["front", "front"], "names front more than once"), (["a.b"], "'a.b' is not a valid"),
                       (["1st"], "'1st' is not a valid"), ([""], "'' is not a valid"), (["a/b"], "not a valid")):
        with pytest.raises(ConfigError, match=match):
            resolve_settings({**BASE, "cameras": bad})
    with pytest.raises(ConfigError, match="parameter cameras must be a list of strings"):
        resolve_settings({"cameras": "front"})


def test_per_camera_parameters_exist_and_are_known():
    assert set(CAMERA_PARAMETERS) <= set(PARAMETER_NAMES)
    assert {"image_width", "keyframe_interval", "camera_frame", "deferred_eviction",
            "keyframe_decision_timeout"} <= set(CAMERA_PARAMETERS)
    assert camera_param_name("rear", "image_width") == "camera.rear.image_width"
    assert split_camera_param("camera.rear.image_width", ("front", "rear")) == ("rear", "image_width")


@pytest.mark.parametrize("name, value, match", [
    ("camera.side.image_width", 98, r"unknown parameter camera.side.image_width: 'side' is not in cameras "
                                    r"\(listed: front, rear\)"),
    ("camera.rear.sliding_window", 4, "sliding_window is not a per-camera parameter"),
    ("camera.rear", 4, "named camera.<camera>.<parameter>"),
    ("camera.rear.image_width.x", 4, "named camera.<camera>.<parameter>"),
    ("camera.rear.image_width", "wide", "parameter camera.rear.image_width must be a int"),
    ("camera.rear.image_width", 100, r"parameter camera.rear.image_width must be in \[14, 4088\] in steps of 14"),
    ("camera.front.keyframe_decision_default", "maybe", r"camera.front.keyframe_decision_default must be one of"),
])
def test_bad_camera_values_name_the_camera_parameter(name, value, match):
    with pytest.raises(ConfigError, match=match):
        camera_values(("front", "rear"), {name: value})


def test_camera_values_in_single_camera_mode_are_refused():
    with pytest.raises(ConfigError, match=r"not in cameras \(listed: none \(single-camera mode\)\)"):
        camera_values((), {"camera.front.image_width": 98})
    assert camera_values((), {}) == {}


def test_each_camera_resolves_the_global_values_with_its_own_on_top():
    logged = []
    own = camera_values(("front", "rear"), {"camera.rear.image_width": 112, "camera.rear.camera_frame": "rear_opt",
                                            "camera.front.keyframe_interval": 3, "camera.front.image_width": 98})
    settings = resolve_camera_settings(BASE, own, log=logged.append)
    front, rear = settings["front"], settings["rear"]
    assert (front.image_width, front.stream.keyframe_interval, front.camera_frame) == (98, 3, "")
    assert (rear.image_width, rear.stream.keyframe_interval, rear.camera_frame) == (112, 1, "rear_opt")
    assert front.stream.num_scale_frames == rear.stream.num_scale_frames == 2  # shared
    # one line per value that differs from the global one (front's image_width equals it)
    assert sorted(logged) == ["parameter camera.front.keyframe_interval = 3",
                              "parameter camera.rear.camera_frame = 'rear_opt'",
                              "parameter camera.rear.image_width = 112"]


def test_a_camera_value_the_configs_refuse_is_named():
    with pytest.raises(ConfigError, match="parameter camera.rear.keyframe_interval"):
        resolve_camera_settings(BASE, {"rear": {"keyframe_interval": 0}})
    with pytest.raises(ConfigError, match="^camera rear: .*overlap"):  # a rule broken by a shared value
        resolve_camera_settings({**BASE, "overlap_frames": 10}, {"rear": {"image_width": 112}})


def test_run_time_changes_per_camera():
    settings = resolve_camera_settings(BASE, {"front": {}, "rear": {}})
    changed = apply_camera_dynamic(settings, "camera.rear.deferred_eviction", True)
    assert changed["rear"].deferred_eviction and not changed["front"].deferred_eviction
    assert settings["rear"].deferred_eviction is False  # the input is left as it was
    both = apply_camera_dynamic(settings, "conf_threshold", 2.5)  # a shared parameter: every camera
    assert both["front"].conf_threshold == both["rear"].conf_threshold == 2.5
    dynamic_per_camera = sorted(set(CAMERA_PARAMETERS) & DYNAMIC_PARAMETERS)
    assert "deferred_eviction" in dynamic_per_camera
    for name in dynamic_per_camera:
        with pytest.raises(ConfigError, match=f"parameter {name} is per camera when cameras are listed: set "
                                              f"camera.front.{name}, camera.rear.{name}"):
            apply_camera_dynamic(settings, name, settings["front"].__getattribute__(name))
    with pytest.raises(ConfigError, match="camera.rear.image_width is read-only"):
        apply_camera_dynamic(settings, "camera.rear.image_width", 112)
    with pytest.raises(ConfigError, match="camera.rear.keyframe_decision_timeout must be in"):
        apply_camera_dynamic(settings, "camera.rear.keyframe_decision_timeout", -1.0)
    with pytest.raises(ConfigError, match="'side' is not in cameras"):
        apply_camera_dynamic(settings, "camera.side.deferred_eviction", True)


def test_cameras_cannot_share_an_optical_or_tf_frame():
    with pytest.raises(ConfigError, match=r"parameter camera_frame 'cam' is shared by cameras front, rear: each camera "
                                          r"needs its own \(set camera.front.camera_frame, camera.rear.camera_frame\)"):
        resolve_camera_settings({**BASE, "camera_frame": "cam"}, {"front": {}, "rear": {}})
    with pytest.raises(ConfigError, match="camera_tf_frame 'x' is shared by cameras front, rear"):
        resolve_camera_settings(BASE, {"front": {"camera_tf_frame": "x"}, "rear": {"camera_tf_frame": "x"}})
    ok = resolve_camera_settings({**BASE, "camera_frame": "cam"}, {"front": {}, "rear": {"camera_frame": "rear"}})
    assert (ok["front"].camera_frame, ok["rear"].camera_frame) == ("cam", "rear")
