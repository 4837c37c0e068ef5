"""The replay CLI: fixture parity end to end, exports, and one-line errors on bad input."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from lingbot_map_ros.cli.replay import main

RTOL = 1e-4


def fixture_args(fixtures, out, *extra):
    return ["--images", str(fixtures / "frames"), "--checkpoint", str(fixtures / "weights.safetensors"),
            "--model-config", str(fixtures / "config.json"), "--out", str(out), "-q", *extra]


@pytest.mark.parametrize("interval", [1, 2])
def test_replay_matches_reference(fixtures, tmp_path, interval):
    out = tmp_path / "pred.npz"
    traj, ply = tmp_path / "traj.tum", tmp_path / "cloud.ply"
    assert main(fixture_args(fixtures, out, "--keyframe-interval", str(interval), "--backend", "sdpa",
                             "--trajectory", str(traj), "--ply", str(ply))) == 0
    pred, ref = np.load(out), np.load(fixtures / f"reference_kf{interval}.npz")
    assert pred["pose_enc"].shape == (12, 9) and pred["depth"].shape == (12, 56, 98)
    scale = np.abs(ref["pose_enc"]).max(axis=1, keepdims=True)
    assert np.max(np.abs(pred["pose_enc"] - ref["pose_enc"]) / scale) < RTOL
    for key in ("depth", "depth_conf"):
        assert np.max(np.abs(pred[key] - ref[key]) / np.abs(ref[key])) < RTOL
    np.testing.assert_allclose(pred["pose_c2w"][:, :3], ref["pose_3x4"], atol=1e-4)
    assert pred["is_keyframe"].tolist() == [i < 2 or (i - 2) % interval == 0 for i in range(12)]
    assert len([l for l in traj.read_text().splitlines() if not l.startswith("#")]) == 12
    assert ply.stat().st_size > 100


def run_cli(*argv):
    proc = subprocess.run([sys.executable, "-m", "lingbot_map_ros.cli.replay", *argv], capture_output=True,
                          text=True, timeout=120)
    return proc.returncode, proc.stderr


def test_missing_directory_is_one_line(tmp_path):
    code, err = run_cli("--images", str(tmp_path / "nope"), "--out", str(tmp_path / "o.npz"))
    assert code == 2
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("lingbot-map-replay: error:")
    assert "nope" in err


@pytest.mark.parametrize("case", ["empty", "corrupt", "width", "mismatch", "config", "too_few"])
def test_bad_input_errors(fixtures, tmp_path, case, capsys):
    images = tmp_path / "imgs"
    images.mkdir()
    frames = sorted((fixtures / "frames").glob("*.png"))
    extra = []
    if case == "empty":
        needle = "no image"
    else:
        for f in frames[:3]:
            (images / f.name).write_bytes(f.read_bytes())
        if case == "corrupt":
            (images / "000001.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
            needle = "000001.png"
        elif case == "width":
            extra = ["--width", "100"]
            needle = "multiple of the patch size"
        elif case == "mismatch":
            extra = ["--checkpoint", str(tmp_path / "bad.safetensors")]
            from safetensors.torch import save_file
            import torch
            save_file({"aggregator.camera_token": torch.zeros(1, 2, 1, 64)}, str(tmp_path / "bad.safetensors"))
            needle = "missing keys"
        elif case == "config":
            extra = ["--sliding-window", "0"]
            needle = "sliding_window"
        elif case == "too_few":
            extra = ["--num-scale-frames", "8"]
            needle = "fewer than the 8 scale frames"
    argv = fixture_args(fixtures, tmp_path / "o.npz")
    argv[1] = str(images)
    if case == "mismatch":
        argv[3] = extra[1]
        extra = []
    code = main(argv + extra)
    err = capsys.readouterr().err
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("lingbot-map-replay: error:") and needle in last, err
