"""Parameter table -> ModelConfig/StreamConfig/NodeSettings mapping (no graph)."""
from __future__ import annotations

import json

import pytest

from lingbot_map_ros.config import ConfigError, ModelConfig, StreamConfig
from lingbot_map_ros.runtime.params import (PARAMETER_NAMES, PARAMETERS, check_value, params_file_text,
                                        resolve_settings)

pytestmark = pytest.mark.ros

ISSUE_PARAMETERS = {  # named in the issue; must exist with these names
    "checkpoint", "model_config", "device", "backend", "dtype", "image_width", "num_scale_frames",
    "sliding_window", "keyframe_interval", "camera_iterations", "deferred_eviction", "conf_threshold",
    "point_stride", "map_voxel_size", "map_publish_rate", "publish_tf", "map_frame", "odom_frame",
    "base_frame", "tf_mode", "max_frame_age", "input_transport",
}


def test_every_issue_parameter_is_declared_with_description():
    assert ISSUE_PARAMETERS <= set(PARAMETER_NAMES)
    assert len(PARAMETER_NAMES) == len(set(PARAMETER_NAMES))
    for p in PARAMETERS:
        assert p.description, p.name
        check_value(p, p.default)  # defaults satisfy their own ranges
        if isinstance(p.default, (int, float)) and not isinstance(p.default, bool):
            assert p.limits is not None, f"{p.name} has no range"


def test_defaults_map_onto_released_configs():
    logged = []
    s = resolve_settings({}, log=logged.append)
    assert s.model == ModelConfig.preset("lingbot-map")
    assert s.stream == StreamConfig()
    assert s.checkpoint is None and s.image_width == 518
    # one line per parameter, naming its resolved value
    for p in PARAMETERS:
        assert any(line.startswith(f"parameter {p.name} = ") for line in logged), p.name


def test_values_reach_the_configs(tmp_path):
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({**ModelConfig.preset("tiny").to_dict(), "num_scale_frames": 2,
                               "preprocess_width": 98}))
    logged = []
    s = resolve_settings({"checkpoint": "/w.pt", "model_config": str(cfg), "device": "cuda:1", "backend": "sdpa",
                          "dtype": "bf16", "image_width": 224, "num_scale_frames": 4, "sliding_window": 16,
                          "keyframe_interval": 3, "camera_iterations": 2, "deferred_eviction": True,
                          "conf_threshold": 2.5, "point_stride": 4, "tf_mode": "map_to_odom", "base_frame": "base_link",
                          "cuda_graphs": False},
                         log=logged.append)
    assert s.model == ModelConfig.preset("tiny")
    assert s.stream == StreamConfig(num_scale_frames=4, sliding_window=16, keyframe_interval=3, camera_iterations=2,
                                    deferred_eviction=True, backend="sdpa", dtype="bf16", device="cuda:1",
                                    cuda_graphs=False)
    assert (s.checkpoint, s.image_width, s.conf_threshold, s.point_stride) == ("/w.pt", 224, 2.5, 4)
    # streaming keys of the JSON are reported, not applied
    assert any("num_scale_frames=2" in line and "num_scale_frames=4" in line for line in logged)
    assert any("preprocess_width=98" in line for line in logged)


@pytest.mark.parametrize("values, match", [
    ({"image_width": 100}, "image_width"),
    ({"image_width": 0}, "image_width"),
    ({"num_scale_frames": 0}, "num_scale_frames"),
    ({"backend": "cudnn"}, "backend"),
    ({"dtype": "fp16"}, "dtype"),
    ({"input_transport": "theora"}, "input_transport"),
    ({"tf_mode": "odom"}, "tf_mode"),
    ({"point_stride": 1.5}, "point_stride"),
    ({"conf_threshold": "high"}, "conf_threshold"),
    ({"device": "tpu"}, "device"),
    ({"map_frame": ""}, "map_frame"),
    ({"model_config": "/nonexistent/config.json"}, "not found"),
    ({"no_such_parameter": 1}, "no_such_parameter"),
])
def test_bad_values_name_the_parameter(values, match):
    with pytest.raises(ConfigError, match=match):
        resolve_settings(values)


def test_params_file_round_trips_through_yaml(tmp_path):
    yaml = pytest.importorskip("yaml")
    values = {"checkpoint": "/a b/w.pt", "image_width": 98, "conf_threshold": 1.0, "publish_tf": False}
    data = yaml.safe_load(params_file_text(values))
    assert data == {"/**": {"ros__parameters": values}}
    assert isinstance(data["/**"]["ros__parameters"]["conf_threshold"], float)
