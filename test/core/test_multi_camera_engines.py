"""Two InferenceEngines on one CameraSessions driven by one CameraScheduler (the node's multi-camera
inference thread, without ROS): each camera's poses equal a single-camera replay of its frames,
and a camera holding a frame for a keyframe decision never holds up the other camera."""
from __future__ import annotations

import numpy as np
import pytest

from lingbot_map_ros.config import ModelConfig
from lingbot_map_ros.geometry import optical_pose_to_map
from lingbot_map_ros.io.checkpoint import load_model
from lingbot_map_ros.io.preprocess import preprocess_array
from lingbot_map_ros.runtime.engine import InferenceEngine
from lingbot_map_ros.runtime.frames import InputFrame
from lingbot_map_ros.runtime.params import resolve_settings
from lingbot_map_ros.runtime.scheduler import CameraScheduler
from lingbot_map_ros.stream.multi import CameraSessions
from lingbot_map_ros.stream.session import StreamingSession

from engine_fakes import Log, Sink, drain  # test/ is on sys.path (conftest.py)
from multi_camera_helpers import EagerStaticSteps

WIDTH = 98
SETTINGS = dict(image_width=WIDTH, num_scale_frames=2, sliding_window=3, backend="sdpa", point_stride=1,
                conf_threshold=0.0, map_voxel_size=0.0, device="cpu")


@pytest.fixture(scope="module")
def model():
    return load_model(ModelConfig.preset("tiny"), None, seed=3)


def frames(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    big = np.kron(rng.integers(0, 256, (40, 120, 3)).astype(np.float32), np.ones((8, 8, 1)))
    return [big[10 + i: 304 + i, 20 + 7 * i: 538 + 7 * i].astype(np.uint8) for i in range(n)]


def cameras(model, batch: bool = False, pipeline: bool = False, **per_camera):
    """A scheduler over one engine per named camera; ``batch``: batched steps (the node's
    ``camera_batching``), with the sessions' static-shape graph path run eagerly on the CPU;
    ``pipeline``: pipelined steps (the node's ``camera_pipelining``)."""
    settings = {name: resolve_settings({**SETTINGS, **own}) for name, own in per_camera.items()}
    sessions = CameraSessions(model, {name: (s.stream, None) for name, s in settings.items()},
                              steps=EagerStaticSteps() if batch else None)
    sinks = {name: Sink(wants=()) for name in settings}
    engines = {name: InferenceEngine(sessions.sessions[name], s, sinks[name], Log(), now=lambda: 1000.0)
               for name, s in settings.items()}
    sched = CameraScheduler(engines, batch=sessions.submit_many if batch else None, pipeline=pipeline)
    sched.sessions = sessions
    return sched, engines, sinks


def submit(engine, rgb, stamp: float) -> None:
    engine.submit_frame(InputFrame(rgb=rgb, stamp=stamp, stamp_s=stamp, camera_frame="cam"))


def replay(model, images) -> list[np.ndarray]:
    session = StreamingSession(model, resolve_settings(SETTINGS).stream)
    out = []
    for rgb in images:
        out += session.push(preprocess_array(rgb, WIDTH))
    return [optical_pose_to_map(r.c2w) for r in out]


@pytest.mark.parametrize("pipeline", [False, True])
def test_two_cameras_in_turn_equal_their_single_camera_replays(model, pipeline):
    sched, engines, sinks = cameras(model, pipeline=pipeline, a={}, b={})
    images = {"a": frames(5, seed=1), "b": frames(5, seed=2)}
    for k in range(5):  # both slots filled, then the scheduler takes them in turn
        submit(engines["a"], images["a"][k], 100.0 + k)
        submit(engines["b"], images["b"][k], 100.0 + k)
        assert drain(sched) == 2
    for name in ("a", "b"):
        got = [f.T_map_cam for f in sinks[name].frames]
        assert [f.frame_index for f in sinks[name].frames] == [1, 2, 3, 4, 5]
        for T, expected in zip(got, replay(model, images[name])):
            np.testing.assert_allclose(T, expected, atol=1e-4)
    assert sched.served == {"a": 5, "b": 5}
    assert sched.overlapped == (5 if pipeline else 0)  # a's step completed after b's was launched


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_camera_waiting_for_a_keyframe_decision_does_not_hold_up_the_other(model, pipeline):
    sched, engines, sinks = cameras(model, pipeline=pipeline, a={"keyframe_decision_timeout": 30.0}, b={})
    images = {"a": frames(5, seed=3), "b": frames(5, seed=4)}
    for k in range(4):
        submit(engines["a"], images["a"][k], 200.0 + k)
        submit(engines["b"], images["b"][k], 200.0 + k)
        drain(sched)
    # a: scale frames 1-2, frame 3 stored and held for a decision: frame 4 waits in its slot
    assert [f.frame_index for f in sinks["a"].frames] == [1, 2, 3]
    assert [f.frame_index for f in sinks["b"].frames] == [1, 2, 3, 4]  # b went on
    submit(engines["b"], images["b"][4], 204.0)
    assert drain(sched) == 1 and sinks["b"].frames[-1].frame_index == 5
    decision = engines["a"].submit("keep", lambda: engines["a"].keyframes.commit_eviction(3))
    drain(sched)  # the decision, then a's waiting frame
    assert decision.error is None
    assert [f.frame_index for f in sinks["a"].frames] == [1, 2, 3, 4]
    assert engines["a"].seq.counter_values().decisions_kept == 1


def test_batched_steps_of_two_cameras_equal_their_single_camera_replays(model):
    sched, engines, sinks = cameras(model, batch=True, a={}, b={})
    images = {"a": frames(6, seed=1), "b": frames(6, seed=2)}
    for k in range(6):
        submit(engines["a"], images["a"][k], 100.0 + k)
        submit(engines["b"], images["b"][k], 100.0 + k)
        assert drain(sched) == 1  # one turn: both frames in one call
    for name in ("a", "b"):
        assert [f.frame_index for f in sinks[name].frames] == [1, 2, 3, 4, 5, 6]
        for f, expected in zip(sinks[name].frames, replay(model, images[name])):
            np.testing.assert_allclose(f.T_map_cam, expected, atol=1e-4)
    assert sched.served == {"a": 6, "b": 6} and sched.batches == 6
    # scale frames 1-2 together, frame 3 makes each camera's own step, frames 4-6 in the batched trunk
    assert [sched.sessions.inner[c].batched_steps for c in ("a", "b")] == [3, 3]


def test_batching_leaves_a_held_camera_and_a_bad_frame_to_their_engines(model):
    sched, engines, sinks = cameras(model, batch=True, a={"keyframe_decision_timeout": 30.0}, b={}, c={})
    images = {c: frames(6, seed=5 + i) for i, c in enumerate("abc")}
    for k in range(4):
        for c in "abc":
            submit(engines[c], images[c][k], 300.0 + k)
        drain(sched)
    # a holds frame 3 for a decision: its frame 4 waits; b and c went on together
    assert [f.frame_index for f in sinks["a"].frames] == [1, 2, 3]
    assert [f.frame_index for f in sinks["b"].frames] == [1, 2, 3, 4]
    assert engines["a"].queue.pending_frame()
    # a bad frame from c in the next batch: dropped by its engine, b's frame runs
    submit(engines["b"], images["b"][4], 304.0)
    submit(engines["c"], np.zeros((10, 10, 3), np.uint8), 304.0)
    drain(sched)
    assert [f.frame_index for f in sinks["b"].frames] == [1, 2, 3, 4, 5]
    assert [f.frame_index for f in sinks["c"].frames] == [1, 2, 3, 4]
    assert engines["c"].seq.counter_values().frames_dropped_invalid == 1
    decision = engines["a"].submit("keep", lambda: engines["a"].keyframes.commit_eviction(3))
    drain(sched)
    assert decision.error is None
    assert [f.frame_index for f in sinks["a"].frames] == [1, 2, 3, 4]
    for name in ("b", "c"):
        n = len(sinks[name].frames)
        for f, expected in zip(sinks[name].frames, replay(model, images[name][:n])):
            np.testing.assert_allclose(f.T_map_cam, expected, atol=1e-4)
