"""The default configuration has exactly the official parameter names and shapes."""
from __future__ import annotations

import json

import pytest
import torch

from lingbot_map_ros.config import ConfigError, ModelConfig
from lingbot_map_ros.model.lingbot import LingBotMap


def test_state_dict_matches_manifest(fixtures):
    manifest = json.loads((fixtures.parent / "state_dict_manifest.json").read_text())
    with torch.device("meta"):
        model = LingBotMap(ModelConfig.preset("lingbot-map"))
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert shapes == manifest["shapes"]
    assert sum(p.numel() for p in model.parameters()) == manifest["num_parameters"]
    assert len(shapes) == manifest["num_tensors"]


def test_tiny_config_from_fixture_json(fixtures):
    cfg = ModelConfig.from_json(fixtures / "config.json")
    assert cfg == ModelConfig.preset("tiny")


@pytest.mark.parametrize("field,value,needle", [
    ("num_heads", 3, "head_dim"),
    ("intermediate_layer_idx", (1, 2, 3, 99), "intermediate_layer_idx"),
    ("camera_dim", 100, "camera_dim"),
    ("patch_size", 0, "patch_size"),
])
def test_bad_model_config_names_the_value(field, value, needle):
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.preset("tiny").__class__(**{**ModelConfig.preset("tiny").to_dict(), field: value})
