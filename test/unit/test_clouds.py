"""A frame's clouds (runtime/clouds.py) alone: the selection by confidence and stride, the map's
model-unit points vs the published (scaled) ones, depth NaNs and scale; confidence statistics."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from lingbot_map_ros.robot.map_offset import OutputTransform
from lingbot_map_ros.runtime.clouds import CONFIDENCE_SAMPLE, ConfidenceSample, frame_clouds
from lingbot_map_ros.runtime.frames import FrameOutput


def result(h: int = 4, w: int = 6):
    depth = np.full((h, w), 2.0, np.float32)
    depth[0, 0] = 0.0
    confidence = np.arange(h * w, dtype=np.float32).reshape(h, w)
    colors = np.arange(h * w * 3, dtype=np.uint8).reshape(-1, 3)
    K = np.array([[3.0, 0, w / 2], [0, 3.0, h / 2], [0, 0, 1]])
    return SimpleNamespace(depth=depth, confidence=confidence, intrinsics=K, c2w=np.eye(4),
                           colors=lambda index: colors[index])


def pose(scale: float = 1.0) -> FrameOutput:
    return FrameOutput(1, 0.0, 0.0, "cam", True, np.eye(4), np.eye(3), None, None, None, None, scale=scale)


def test_points_are_the_confident_pixels_every_stride_th_in_the_map_frame():
    r = result()
    out, for_map = frame_clouds(r, pose(), True, False, conf_threshold=9.5, point_stride=3)
    index = np.flatnonzero(r.confidence.reshape(-1) > 9.5)[::3]
    assert out.points.shape == (len(index), 3) and out.depth is None
    np.testing.assert_array_equal(out.confidence, r.confidence.reshape(-1)[index])
    np.testing.assert_array_equal(out.colors, r.colors(index))
    # REP-103: x forward = optical z (the depth, 2), so every point is 2 ahead of the camera
    np.testing.assert_allclose(out.points[:, 0], 2.0)
    np.testing.assert_array_equal(for_map[0], out.points)


def test_the_map_gets_model_units_and_the_published_cloud_the_frame_transform():
    r = result()
    out, for_map = frame_clouds(r, pose(scale=3.0), True, True, 0.0, 1, OutputTransform(3.0))
    np.testing.assert_allclose(out.points, 3.0 * for_map[0], rtol=1e-6)
    assert np.isnan(out.depth[0, 0]) and np.allclose(out.depth[1:, :], 6.0)  # 0 -> NaN, then scaled


def test_without_points_the_map_gets_nothing():
    out, for_map = frame_clouds(result(), pose(), False, True, 0.0, 1)
    assert for_map is None and out.points is None and out.depth is not None


def test_confidence_sample_reads_every_nth_pixel():
    conf = np.arange(40, dtype=np.float32).reshape(5, 8)
    sample = ConfidenceSample(conf, threshold=19.5)
    strided = conf.reshape(-1)[::CONFIDENCE_SAMPLE]
    assert sample.valid == np.count_nonzero(strided > 19.5) / strided.size
    assert sample.summary() == (float(strided.mean()), float(np.median(strided)), sample.valid)
    assert ConfidenceSample(None, 1.0).summary() == (0.0, 0.0, 0.0) and ConfidenceSample(None, 1.0).valid is None
