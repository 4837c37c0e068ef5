"""The model's focal estimate in input pixels vs CameraInfo (robot/intrinsics.py): a model that
saw the true field of view must give back the calibration's focal lengths."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lingbot_map_ros.geometry import fov_to_intrinsics
from lingbot_map_ros.io.preprocess import target_size
from lingbot_map_ros.robot.intrinsics import WARN_FRACTION, FocalTracker, focal_in_input_pixels


def perfect_model_K(fx: float, fy: float, w_in: int, h_in: int, width: int) -> tuple[np.ndarray, tuple[int, int]]:
    """Intrinsics a perfect model would give at its input resolution: the fields of view the
    model image really spans (full width; the rows kept after the centre crop)."""
    w_m, h_r = target_size(w_in, h_in, width)
    h_m = min(h_r, w_m)
    rows_in = h_in * h_m / h_r  # input rows inside the model image
    fov_w, fov_h = 2 * math.atan(w_in / 2 / fx), 2 * math.atan(rows_in / 2 / fy)
    return fov_to_intrinsics(fov_h, fov_w, h_m, w_m), (w_m, h_m)


@pytest.mark.parametrize("w_in, h_in, width", [(1280, 720, 518), (640, 480, 98), (480, 960, 98)])
def test_a_perfect_model_gives_back_the_calibration(w_in, h_in, width):
    K, size = perfect_model_K(900.0, 880.0, w_in, h_in, width)
    fx, fy = focal_in_input_pixels(K, size, (w_in, h_in))
    assert fx == pytest.approx(900.0, rel=1e-9) and fy == pytest.approx(880.0, rel=1e-9)


def test_tracker_compares_the_median_with_camera_info():
    tracker = FocalTracker(window=5)
    camera_K = (900.0, 0.0, 640.0, 0.0, 880.0, 360.0, 0.0, 0.0, 1.0)
    assert tracker.compare(camera_K, (1280, 720)).problem == "no frame processed yet"
    for f in (0.9, 1.0, 1.1, 1.0, 5.0, 1.0):  # one wild frame; the first leaves the window
        K, size = perfect_model_K(900.0 * f, 880.0 * f, 1280, 720, 518)
        tracker.add(K, size, (1280, 720))
    c = tracker.compare(camera_K, (1280, 720))
    assert c.frames == 5 and not c.problem and not c.warn
    assert c.fx_model == pytest.approx(900.0) and c.fy_model == pytest.approx(880.0) and c.fx_error == pytest.approx(0)
    assert "within 0 %" in c.message()
    values = c.values()
    assert values["camera_info fx (px)"] == "900.0" and values["model fy, median of the last 5 frames (px)"] == "880.0"
    assert values["fx difference (%)"] == "+0.0"


def test_tracker_warns_when_far_off_and_refuses_other_sizes():
    tracker = FocalTracker()
    K, size = perfect_model_K(900.0 * (1 + 2 * WARN_FRACTION), 880.0, 1280, 720, 518)
    tracker.add(K, size, (1280, 720))
    c = tracker.compare((900.0, 0, 640, 0, 880.0, 360, 0, 0, 1), (1280, 720))
    assert c.warn and c.fx_error == pytest.approx(2 * WARN_FRACTION) and "50 % off camera_info" in c.message()
    other = tracker.compare((900.0, 0, 320, 0, 880.0, 240, 0, 0, 1), (640, 480))
    assert not other.warn and other.message() == "not comparable: camera_info is 640x480, the images are 1280x720"
    assert other.values()["fx difference (%)"] == "n/a"
    assert tracker.compare((0.0,) * 9, (1280, 720)).problem == "camera_info has no usable K"
    tracker.clear()
    assert len(tracker) == 0 and tracker.median() is None
