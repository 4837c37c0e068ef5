"""lingbot-map-demo: input/model fallbacks (no graph) and one short end-to-end run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lingbot_map_ros.cli import demo
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


# ------------------------------------------------------------------ benchmark options (benchmarks/node_latency.sh)
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
    from lingbot_map_ros.ros.params import resolve_settings

    settings = resolve_settings({k: v for k, v in values.items() if k != "tf_mode"})
    assert settings.stream.backend == "flashinfer-fa3" and settings.stream.dtype == "bf16"
    assert settings.model.embed_dim == 1024 and settings.long_stream.window_frames == 1000


@pytest.mark.parametrize("argv, message", [
    (["--height", "100"], "--height"), (["--height", "112", "--width", "98"], "--height"),
    (["--warmup-poses", "-1"], "--warmup-poses")])
def test_bad_benchmark_options_are_one_line_errors(argv, message, tmp_path, capsys):
    assert demo.main(argv + ["--out", str(tmp_path / "o")]) == 1
    assert message in capsys.readouterr().err


class _FakeRecorder:
    """What measurement() reads from a Recorder: poses, the latest status, per-frame statuses."""

    def __init__(self, poses, status, frame_status):
        self.poses, self.status, self.frame_status = poses, status, frame_status

    def snapshot(self):
        return list(self.poses), self.status

    def frame_statuses(self, since_s=None):
        return [f for f in self.frame_status if since_s is None or f.stamp_s >= since_s]


def test_measurement_leaves_the_warm_up_out_and_counts_relative_to_the_baseline(tmp_path):
    from types import SimpleNamespace

    import numpy as np

    from lingbot_map_ros.ros.recorder import FrameStatus, PoseRecord

    demo.synthetic_sequence(tmp_path / "frames", 1, size=(98, 70))
    warm = [PoseRecord(10.0 + i, 10.0 + i + 5.0, np.eye(4)) for i in range(4)]  # 5 s latency: excluded
    timed = [PoseRecord(100.0 + i / 10, 100.0 + i / 10 + 0.040 + 0.001 * i, np.eye(4)) for i in range(10)]
    statuses = [FrameStatus(p.stamp_s, i + 1, 0 if i < 8 else 1, 30.0 + i, 35.0, 1.0, 2.0, 0.5, 100.0 * i, 200.0)
                for i, p in enumerate(warm + timed)]
    final = SimpleNamespace(frames_received=16, frames_processed=14, frames_dropped_stale=2,
                            frames_dropped_invalid=0, frames_dropped_error=0)
    baseline = {"frames_received": 4, "frames_processed": 4, "frames_dropped_stale": 0,
                "frames_dropped_invalid": 0, "frames_dropped_error": 0}
    args = demo.build_parser().parse_args(["--preset", "lingbot-map", "--rate", "10", "--frames", "12",
                                           "--warmup-poses", "4"])
    result = demo.measurement(_FakeRecorder(warm + timed, final, statuses), 100.0, baseline, 12, {"node_up_s": 1.0},
                              args, {"device": "cuda", "backend": "flashinfer-fa3", "dtype": "bf16"},
                              tmp_path / "frames")
    assert result["frames"] == {"published": 12, "received": 12, "processed": 10, "dropped_stale": 2,
                                "dropped_invalid": 0, "dropped_error": 0, "poses_received": 10}
    lat = result["latency_ms"]
    assert lat["n"] == 10 and lat["min"] == pytest.approx(40.0) and lat["max"] == pytest.approx(49.0)
    assert lat["median"] == pytest.approx(44.5)
    assert result["output_rate_hz"] == pytest.approx(9 / 0.909, rel=1e-3)
    assert result["input_rate_of_poses_hz"] == pytest.approx(10.0, rel=1e-3)
    assert result["node_ms"]["model"]["n"] == 10 and result["node_ms"]["model"]["median"] == pytest.approx(38.5)
    assert result["window_restarts"] == 1 and result["window_indices"] == [0, 1]
    assert result["gpu_memory_mb"]["allocated_max"] == pytest.approx(1300.0)
    assert result["setting"]["frame_size"] == [98, 70] and result["setting"]["dtype"] == "bf16"
    assert result["setting"]["weights"] == "random lingbot-map (seed 0)"
    json.dumps(result, default=demo._json_default)


def test_publisher_count_is_read_from_its_log(tmp_path):
    log = tmp_path / "publisher.log"
    log.write_text("[INFO] [1.0] [image_folder_publisher]: publishing x on /image at 15.0 Hz (300 frames)\n"
                   "[INFO] [2.0] [image_folder_publisher]: published 297 frame(s); done\n")
    assert demo._published(log) == 297
    assert demo._published(tmp_path / "missing.log") is None


@pytest.mark.slow
def test_demo_with_warm_up_writes_the_measurement(tmp_path):
    out = tmp_path / "out"
    domain = 1 + (os.getpid() * 17 + 31) % 100
    result = subprocess.run([sys.executable, "-m", "lingbot_map_ros.cli.demo", "--preset", "tiny", "--frames", "8",
                             "--rate", "5", "--width", "98", "--height", "70", "--warmup-poses", "4",
                             "--startup-timeout", "90", "--no-save-map", "--out", str(out), "--json",
                             str(out / "m.json"), "--domain-id", str(domain), "--timeout", "60"],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    m = json.loads((out / "m.json").read_text())
    f = m["frames"]
    assert f["published"] == 8 and f["received"] == 8 and f["processed"] + f["dropped_stale"] == 8, f
    assert f["processed"] >= 4 and f["poses_received"] == f["processed"] and f["dropped_error"] == 0, f
    assert m["startup"]["warmup_poses"] >= 4 and m["startup"]["first_pose_s"] > 0
    assert m["latency_ms"]["n"] == f["poses_received"] and 0 < m["latency_ms"]["median"] < 5000
    assert m["node_ms"]["model"]["n"] == f["processed"] and m["setting"]["frame_size"] == [98, 70]
    assert not (out / "map.ply").exists() and (out / "warmup_publisher.log").is_file()
    assert "Traceback" not in (out / "node.log").read_text()


def test_library_log_records_of_mixed_severity_reach_the_node_logger():
    """A warning then an info record through the node's forwarding handler (random weights, then
    the attention backend's choice) once stopped the node: rclpy refuses a call site whose
    severity changes."""
    import logging

    from rclpy.logging import get_logger

    from lingbot_map_ros.ros.node import _ForwardToRos

    handler = _ForwardToRos(get_logger("lingbot_map_test_forward"))
    for level in (logging.WARNING, logging.INFO, logging.ERROR, logging.DEBUG, logging.WARNING):
        handler.emit(logging.LogRecord("lingbot_map_ros.x", level, __file__, 1, "message %d", (level,), None))


@pytest.mark.slow
def test_node_probe_runs_the_real_node_with_a_simulated_step(tmp_path):
    """benchmarks/node_probe.py under the demo: the node's own code around a simulated 20 ms
    step, and a probe report that saw that step, the node's threads and the image ages."""
    repo = Path(__file__).resolve().parents[2]
    out, report, result_json = tmp_path / "out", tmp_path / "probe.json", tmp_path / "result.json"
    domain = 1 + (os.getpid() * 17 + 41) % 100
    env = {**os.environ, "LINGBOT_SIM_STEP_MS": "20", "LINGBOT_SIM_HOST_MS": "1", "LINGBOT_PROBE_OUT": str(report)}
    result = subprocess.run([sys.executable, "-m", "lingbot_map_ros.cli.demo", "--preset", "tiny", "--width", "98",
                             "--height", "70", "--frames", "10", "--rate", "10", "--warmup-poses", "3",
                             "--no-save-map", "--node-script", str(repo / "benchmarks" / "node_probe.py"),
                             "--out", str(out), "--domain-id", str(domain), "--timeout", "60",
                             "--json", str(result_json)],
                            capture_output=True, text=True, timeout=180, env=env, cwd=repo)
    assert result.returncode == 0, result.stdout + result.stderr
    measured = json.loads(result_json.read_text())
    assert measured["setting"]["node_script"].endswith("node_probe.py")
    assert measured["frames"]["processed"] + measured["frames"]["dropped_stale"] == 10
    assert measured["node_ms"]["model"]["median"] >= 20.0  # the simulated step, not a model
    assert "SIMULATED model" in (out / "node.log").read_text()
    probe = json.loads(report.read_text())
    assert probe["calls_ms"]["push"]["n"] >= 10 and probe["calls_ms"]["push"]["median"] >= 20.0
    assert probe["calls_ms"]["image age at the callback (stamp -> executor)"]["n"] >= 10
    waits = probe["gil_wait_ms"]
    assert waits["n"] > 0 and sum(waits["histogram"].values()) == waits["n"]
    assert "lingbot_map_inference" in probe["thread_cpu_s"] and "lingbot_map_outputs" in probe["thread_cpu_s"]
    rss = probe["rss_mb"]
    assert rss["samples"] >= 1 and 50 < rss["first"] <= rss["max"] and rss["last"] <= rss["max"]
