"""The ~/status fields (runtime/status.py) and the model input (runtime/model_input.py) alone."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from lingbot_map_ros.io.preprocess import model_input
from lingbot_map_ros.runtime.frames import InputFrame
from lingbot_map_ros.runtime.model_input import MAX_RESIZE_ASPECT, ModelInput, check_resize, gpu_device
from lingbot_map_ros.runtime.status import Latency, Tracking, status_fields
from lingbot_map_ros.runtime.worker import Counters


class Session:
    window_index = 3
    deferred_eviction = True
    device = SimpleNamespace(type="cpu")

    def __init__(self, stats=None) -> None:
        self._stats = stats

    def stats(self):
        return self._stats


def test_status_fields_take_the_session_counters_tracking_and_latency():
    counters = Counters()
    counters.add("frames_received", 5)
    counters.add("decisions_refused")
    stats = SimpleNamespace(pending_evictions=2, resident_frames=7, temporal_index=9, scale_pages=1,
                            window_pages=4, free_pages=3, special_tokens=6)
    tracking = Tracking("degraded", ("low_confidence", "rotation_jump"), 1, 2.0, "fixed", 0.1, True)
    st = status_fields(1, "tracking", 8, Session(stats), counters.snapshot(), True, tracking, is_keyframe=True,
                       latency=Latency(1.0, 2.0, 3.0, 4.0), total_ms=12.5)
    assert (st.state, st.state_text, st.frame_index, st.window_index, st.is_keyframe) == (1, "tracking", 8, 3, True)
    assert st.deferred_eviction and st.decision_pending and st.frames_received == 5 and st.decisions_refused == 1
    assert (st.tracking_state, st.tracking_reasons, st.lost_resets) == ("degraded", "low_confidence,rotation_jump", 1)
    assert (st.scale, st.scale_source, st.scale_spread, st.scale_converged) == (2.0, "fixed", 0.1, True)
    assert (st.pending_evictions, st.stored_frames, st.free_pages, st.special_tokens) == (2, 7, 3, 6)
    assert (st.latency_preprocess_ms, st.latency_publish_ms, st.latency_total_ms) == (1.0, 4.0, 12.5)
    assert (st.gpu_memory_allocated_mb, st.gpu_memory_reserved_mb) == (0.0, 0.0)  # not a CUDA session


def test_status_fields_without_stats_or_latency_keep_the_defaults():
    st = status_fields(2, "waiting", 0, Session(None), Counters().snapshot(), False, Tracking())
    assert st.stored_frames == 0 and st.latency_total_ms == 0.0 and st.tracking_state == "initializing"


def test_model_input_without_a_distorted_camera_is_the_plain_preprocessing():
    rgb = np.random.default_rng(0).integers(0, 255, (60, 84, 3), dtype=np.uint8)
    inputs = ModelInput()
    frame = InputFrame(rgb=rgb, stamp=1.0, stamp_s=1.0, camera_frame="cam")
    np.testing.assert_array_equal(inputs.image(frame, 56, undistort=True), model_input(rgb, 56))
    assert inputs.frames_undistorted == 0 and gpu_device(Session()) is None


def test_an_image_too_tall_to_resize_is_refused_with_its_size():
    check_resize((100, 100, 3), 56)
    with pytest.raises(ValueError, match=rf"image 10x1000 \(WxH\) is too tall.*{MAX_RESIZE_ASPECT} times"):
        check_resize((1000, 10, 3), 56)
    frame = InputFrame(rgb=np.zeros((1000, 10, 3), np.uint8), stamp=1.0, stamp_s=1.0, camera_frame="cam")
    with pytest.raises(ValueError, match="cannot preprocess the image: image 10x1000"):
        ModelInput().image(frame, 56, undistort=True)
