"""lingbot-map-replay --compare-precision: the arguments, the refusal on a CPU, and the table on a GPU."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lingbot_map_ros.cli import replay, replay_args


def write_images(folder, fixtures, n=8):
    from PIL import Image

    images = np.load(fixtures / "reference_kf1.npz")["images"]
    folder.mkdir()
    for i in range(n):
        rgb = (images[i % len(images)].transpose(1, 2, 0) * 255).round().astype(np.uint8)
        Image.fromarray(rgb).save(folder / f"{i:03d}.png")
    return folder


def test_choices_are_checked(capsys):
    with pytest.raises(SystemExit):
        replay_args.build_parser().parse_args(["--images", "x", "--compare-precision", "int4"])
    assert "invalid choice" in capsys.readouterr().err


def test_on_a_cpu_it_asks_for_cuda(tmp_path, fixtures, capsys):
    folder = write_images(tmp_path / "imgs", fixtures, 4)
    code = replay.main(["--images", str(folder), "--model-config", str(fixtures / "config.json"),
                        "--checkpoint", str(fixtures / "weights.safetensors"), "--width", "98",
                        "--compare-precision", "fp8", "-q"])
    assert code == 2
    assert "--compare-precision runs bf16 and FP8 sessions: give --device cuda" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prints_the_table_on_a_gpu(tmp_path, fixtures, capsys):
    folder = write_images(tmp_path / "imgs", fixtures, 12)
    out = tmp_path / "table.json"
    code = replay.main(["--images", str(folder), "--model-config", str(fixtures / "config.json"),
                        "--checkpoint", str(fixtures / "weights.safetensors"), "--width", "98", "--device", "cuda",
                        "--backend", "sdpa", "--compare-precision", "fp8-kv", "--compare-out", str(out), "-q"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "bf16 vs fp32" in text and "fp8-kv vs fp32" in text and "fp8-kv vs bf16" in text
    table = json.loads(out.read_text())
    assert table["frames"] == 12 and table["fp8-kv vs fp32"]["depth_rel"] < 0.05
