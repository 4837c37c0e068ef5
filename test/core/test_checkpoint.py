"""Checkpoint formats, misfits named by key, hub ids, dtype policy."""
from __future__ import annotations

import builtins

import pytest
import torch
from safetensors.torch import save_file

from lingbot_map_ros.config import ModelConfig
from lingbot_map_ros.io.checkpoint import CheckpointError, check_state_dict, load_model, read_state_dict

TINY = ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def state(fixtures):
    return read_state_dict(fixtures / "weights.safetensors")


@pytest.mark.parametrize("layout", ["nested", "bare", "module_prefix"])
def test_pt_layouts_load(state, tmp_path, layout):
    sd = {f"module.{k}": v for k, v in state.items()} if layout == "module_prefix" else state
    obj = {"model": sd, "epoch": 3} if layout == "nested" else sd
    path = tmp_path / "ckpt.pt"
    torch.save(obj, path)
    model = load_model(TINY, path)
    assert torch.equal(model.aggregator.camera_token, state["aggregator.camera_token"])
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_point_head_is_ignored(state, tmp_path):
    """Released checkpoints may carry a point head this model does not have: its keys are
    dropped, every other tensor loads as given, and the same key under another prefix is
    still refused as unexpected."""
    extra = {"point_head.scratch.output_conv2.2.weight": torch.zeros(4, 32, 1, 1),
             "point_head.norm.bias": torch.ones(7)}
    path = tmp_path / "with_point_head.safetensors"
    save_file({**state, **extra}, str(path))
    model = load_model(TINY, path)
    loaded = model.state_dict()
    assert not any(k.startswith("point_head.") for k in loaded)
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    usable = check_state_dict(model, {**state, **extra})
    assert usable.keys() == state.keys()
    with pytest.raises(CheckpointError, match="unexpected keys: pointhead.norm.bias"):
        check_state_dict(model, {**state, "pointhead.norm.bias": torch.ones(7)})


def test_misfits_are_named(state, tmp_path):
    sd = dict(state)
    del sd["camera_head.pose_branch.fc2.bias"]
    sd["aggregator.extra_thing"] = torch.zeros(1)
    sd["depth_head.norm.weight"] = torch.zeros(7)
    path = tmp_path / "bad.safetensors"
    save_file(sd, str(path))
    with pytest.raises(CheckpointError) as err:
        load_model(TINY, path)
    text = str(err.value)
    assert "missing keys: camera_head.pose_branch.fc2.bias" in text
    assert "unexpected keys: aggregator.extra_thing" in text
    assert "depth_head.norm.weight (7,) != (256,)" in text


def test_released_config_refuses_tiny_weights(fixtures):
    with pytest.raises(CheckpointError, match="mis-shaped"):
        with torch.device("meta"):
            from lingbot_map_ros.io.checkpoint import check_state_dict
            from lingbot_map_ros.model.lingbot import LingBotMap

            check_state_dict(LingBotMap(ModelConfig()), read_state_dict(fixtures / "weights.safetensors"))


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        read_state_dict(tmp_path / "nope.pt")
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        read_state_dict(garbage)
    torch.save({"model": {"a": 1}}, tmp_path / "notensors.pt")
    with pytest.raises(CheckpointError, match="state dict of tensors"):
        read_state_dict(tmp_path / "notensors.pt")


def test_hub_id_without_huggingface_hub_is_clear(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name == "huggingface_hub":
            raise ImportError("no hub")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(CheckpointError, match="huggingface_hub is not installed"):
        read_state_dict("robbyant/lingbot-map")


def test_hub_download_failure_is_clear(monkeypatch):
    import types
    import sys

    def failing(**kwargs):
        raise OSError("offline")

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(hf_hub_download=failing))
    with pytest.raises(CheckpointError, match="cannot download 'lingbot-map-long.pt' from Hugging Face repo "
                                              "'robbyant/lingbot-map'.*offline"):
        read_state_dict("robbyant/lingbot-map/lingbot-map-long.pt")


def test_bf16_policy_casts_only_the_aggregator(fixtures):
    model = load_model(TINY, fixtures / "weights.safetensors", dtype="bf16")
    assert {p.dtype for p in model.aggregator.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.camera_head.parameters()} == {torch.float32}
    assert {p.dtype for p in model.depth_head.parameters()} == {torch.float32}


def test_random_weights_are_seeded():
    a = load_model(TINY, None, seed=3)
    b = load_model(TINY, None, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
