"""lingbot-map-demo: input/model fallbacks (no graph), options, and one short end-to-end run.

The measurement around the demo's graph (warm-up, JSON, probe script) is
``benchmarks/node/node_latency.py``: test/ros/test_node_latency_bench.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lingbot_map_ros.cli import demo, demo_graph
from lingbot_map_ros.io.preprocess import list_images

pytestmark = pytest.mark.ros


def test_without_shared_data_it_generates_frames_and_uses_random_tiny_weights(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "SHARED", tmp_path / "no_shared")
    args = demo.build_parser().parse_args(["--frames", "6"])
    images, what, model = demo.resolve_inputs(args, tmp_path)
    assert len(list_images(images)) == 6 and "generated" in what
    assert model["checkpoint"] == "" and json.loads(Path(model["model_config"]).read_text())["embed_dim"] == 128
    assert (model["num_scale_frames"], model["sliding_window"]) == (2, 3)
    assert "RANDOM" in capsys.readouterr().err


def test_named_folder_and_checkpoint_are_used(tmp_path):
    demo.synthetic_sequence(tmp_path / "mine", 3, size=(112, 84))
    args = demo.build_parser().parse_args(["--images", str(tmp_path / "mine"), "--checkpoint", "org/repo",
                                           "--model-config", "/m.json"])
    images, _, model = demo.resolve_inputs(args, tmp_path)
    assert images == tmp_path / "mine"
    assert (model["checkpoint"], model["model_config"], model["num_scale_frames"]) == ("org/repo", "/m.json", 8)


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path):
    out = tmp_path / "out"
    domain = 1 + (os.getpid() * 13 + 29) % 100
    # 2 Hz: on a loaded 2-core CI machine the first steps (first use of every op) can take
    # longer than the 0.2 s a 5 Hz stream leaves, and frames that wait behind them go stale
    result = subprocess.run([sys.executable, "-m", "lingbot_map_ros.cli.demo", "--frames", "8", "--rate", "2",
                             "--out", str(out), "--domain-id", str(domain), "--timeout", "60"],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("frames processed"))
    numbers = [int(w) for w in line.replace("(", " ").replace(",", " ").split() if w.isdigit()]
    processed, stale, invalid, error = numbers
    assert processed + stale == 8 and processed >= 4 and invalid == error == 0, line  # stale: a busy machine
    for name in ("trajectory.tum", "map.ply", "trajectory.png", "params.yaml", "node.log"):
        assert (out / name).is_file(), name
    assert "Traceback" not in (out / "node.log").read_text()


# ------------------------------------------------------------------ random weights, generated frames, node parameters
def test_preset_lingbot_map_means_the_released_architecture_with_seeded_random_weights(tmp_path, capsys):
    args = demo.build_parser().parse_args(["--preset", "lingbot-map", "--seed", "7", "--width", "518",
                                           "--height", "378", "--frames", "3"])
    images, what, model = demo.resolve_inputs(args, tmp_path)
    # model_config "" is the node's own default: ModelConfig.preset("lingbot-map")
    assert (model["checkpoint"], model["model_config"], model["seed"]) == ("", "", 7)
    assert (model["num_scale_frames"], model["sliding_window"]) == (8, 64)
    assert "RANDOM" in capsys.readouterr().err and "518x378" in what
    from PIL import Image

    files = list_images(images)
    assert len(files) == 3 and all(Image.open(f).size == (518, 378) for f in files)


def test_preset_tiny_ignores_the_fixture_and_refuses_a_checkpoint(tmp_path):
    args = demo.build_parser().parse_args(["--preset", "tiny", "--frames", "2", "--height", "70"])
    _, _, model = demo.resolve_inputs(args, tmp_path)
    assert model["checkpoint"] == "" and json.loads(Path(model["model_config"]).read_text())["embed_dim"] == 128
    assert (model["num_scale_frames"], model["sliding_window"], model["seed"]) == (2, 3, 0)
    with pytest.raises(demo.DemoError, match="--checkpoint"):
        demo.resolve_inputs(demo.build_parser().parse_args(["--preset", "tiny", "--checkpoint", "x.pt"]), tmp_path)
    demo.synthetic_sequence(tmp_path / "mine", 1, size=(98, 70))
    with pytest.raises(demo.DemoError, match="--height"):
        demo.resolve_inputs(demo.build_parser().parse_args(["--images", str(tmp_path / "mine"), "--height", "70"]),
                            tmp_path)


def test_node_parameters_from_the_options(tmp_path):
    parser = demo.build_parser()
    args = parser.parse_args(["--device", "cuda", "--backend", "flashinfer-fa3", "--dtype", "bf16",
                              "--no-cuda-graphs", "--width", "518", "--node-param", "window_frames=1000",
                              "--node-param", "tf_mode=map_to_odom", "--node-param", "map_voxel_size=0.01"])
    values = demo.node_parameters(args, {"checkpoint": "", "model_config": "", "seed": 0}, tmp_path)
    assert values["backend"] == "flashinfer-fa3" and values["dtype"] == "bf16" and values["cuda_graphs"] is False
    assert (values["device"], values["image_width"], values["window_frames"]) == ("cuda", 518, 1000)
    assert (values["tf_mode"], values["map_voxel_size"]) == ("map_to_odom", 0.01)
    # Without the options the node's own defaults stay (no backend/dtype/cuda_graphs keys).
    plain = demo.node_parameters(parser.parse_args([]), {"checkpoint": ""}, tmp_path)
    assert not {"backend", "dtype", "cuda_graphs"} & set(plain)
    with pytest.raises(demo.DemoError, match="NAME=VALUE"):
        demo.parse_node_params(["novalue"])
    from lingbot_map_ros.runtime.params import resolve_settings

    settings = resolve_settings({k: v for k, v in values.items() if k != "tf_mode"})
    assert settings.stream.backend == "flashinfer-fa3" and settings.stream.dtype == "bf16"
    assert settings.model.embed_dim == 1024 and settings.long_stream.window_frames == 1000


@pytest.mark.parametrize("argv, message", [
    (["--height", "100"], "--height"), (["--height", "112", "--width", "98"], "--height"),
    (["--width", "100"], "--width"), (["--rate", "0"], "--rate")])
def test_bad_options_are_one_line_errors(argv, message, tmp_path, capsys):
    assert demo.main(argv + ["--out", str(tmp_path / "o")]) == 1
    assert message in capsys.readouterr().err


def test_publisher_count_is_read_from_its_log(tmp_path):
    log = tmp_path / "publisher.log"
    log.write_text("[INFO] [1.0] [image_folder_publisher]: publishing x on /image at 15.0 Hz (300 frames)\n"
                   "[INFO] [2.0] [image_folder_publisher]: published 297 frame(s); done\n")
    assert demo_graph.published_count(log) == 297
    assert demo_graph.published_count(tmp_path / "missing.log") is None


def test_library_log_records_of_mixed_severity_reach_the_node_logger():
    """A warning then an info record through the node's forwarding handler (random weights, then
    the attention backend's choice) once stopped the node: rclpy refuses a call site whose
    severity changes."""
    import logging

    from rclpy.logging import get_logger

    from lingbot_map_ros.ros.startup import ForwardToRos

    handler = ForwardToRos(get_logger("lingbot_map_test_forward"))
    for level in (logging.WARNING, logging.INFO, logging.ERROR, logging.DEBUG, logging.WARNING):
        handler.emit(logging.LogRecord("lingbot_map_ros.x", level, __file__, 1, "message %d", (level,), None))
