"""The node's inference loop without ROS: a real tiny session (random weights, CPU), a
recording sink, and injected faults (non-finite outputs, exceptions). Runs without rclpy or
any ROS message package (checked by the first test)."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from lingbot_map_ros.config import ModelConfig
from lingbot_map_ros.geometry import select_points, unproject_depth
from lingbot_map_ros.io.checkpoint import load_model
from lingbot_map_ros.io.export import read_ply, read_tum
from lingbot_map_ros.io.preprocess import preprocess_array
from lingbot_map_ros.geometry import optical_pose_to_map, points_to_map
from lingbot_map_ros.runtime.engine import InferenceEngine
from lingbot_map_ros.runtime.frames import InputFrame, State
from lingbot_map_ros.runtime.model_input import gpu_device
from lingbot_map_ros.runtime.params import resolve_settings
from lingbot_map_ros.runtime.saving import SaveError, write_map_files
from lingbot_map_ros.runtime.scheduler import CameraScheduler
from lingbot_map_ros.stream.long_stream import LongStreamSession
from lingbot_map_ros.stream.session import SessionError, StreamingSession

from engine_fakes import Log, Sink  # test/ is on sys.path (conftest.py)


WIDTH = 98
SETTINGS = dict(image_width=WIDTH, num_scale_frames=2, sliding_window=3, backend="sdpa", point_stride=1,
                conf_threshold=0.0, map_voxel_size=0.0)


def test_the_engine_imports_no_ros():
    """runtime/engine.py is the node's logic without ROS: importing it pulls in no rclpy and no message package."""
    import subprocess
    import sys

    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in BLOCKED: raise ImportError('blocked: ' + name)\n"
            "BLOCKED = {'rclpy', 'sensor_msgs', 'geometry_msgs', 'nav_msgs', 'std_msgs', 'builtin_interfaces',\n"
            "           'tf2_ros', 'diagnostic_msgs', 'std_srvs', 'rcl_interfaces'}\n"
            "sys.meta_path.insert(0, Block())\n"
            "import lingbot_map_ros.runtime.engine, lingbot_map_ros.runtime.worker, lingbot_map_ros.runtime.params\n"
            "print('ok')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


@pytest.fixture(scope="module")
def model():
    return load_model(ModelConfig.preset("tiny"), None, seed=3)


def frames(n: int, seed: int = 0) -> list[np.ndarray]:
    """n RGB frames [294, 518, 3] uint8 of a sliding random texture."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (40, 120, 3)).astype(np.float32)
    big = np.kron(base, np.ones((8, 8, 1)))  # blocky texture 320x960
    return [big[10 + i: 10 + i + 294, 20 + 7 * i: 20 + 7 * i + 518].astype(np.uint8) for i in range(n)]


class Faulty:
    """Wraps a session; ``fault`` ("pose" | "depth" | "raise") applies to the next submitted frame:
    its results come non-finite, or the submit raises."""

    def __init__(self, session) -> None:
        self._s = session
        self.fault = None
        self._faults: list = []  # (pending, fault)

    def __getattr__(self, name):
        return getattr(self._s, name)

    def submit(self, image, keyframe=None, stamp=None, tag=None):
        fault, self.fault = self.fault, None
        if fault == "raise":
            raise RuntimeError("CUDA out of memory (simulated)")
        pending = self._s.submit(image, keyframe, stamp, tag)
        if fault is not None:
            self._faults.append((pending, fault))
        return pending

    def results(self, pending):
        results = self._s.results(pending)
        faults = [f for p, f in self._faults if p is pending]
        self._faults = [(p, f) for p, f in self._faults if p is not pending]
        for fault in faults:
            for r in results:
                if fault == "pose":
                    r.c2w = np.full((4, 4), np.nan)
                elif fault == "depth":
                    r.depth = r.depth.copy()
                    r.depth[0, 0] = np.inf
        return results

    def push(self, image, keyframe=None):
        return self.results(self.submit(image, keyframe))


def make_engine(model, wants=("points", "depth"), camera_pose=None, **overrides):
    settings = resolve_settings({**SETTINGS, **overrides})
    session = Faulty(LongStreamSession(StreamingSession(model, settings.stream)))  # one window
    sink, log = Sink(wants), Log()
    clock = [1000.0]
    engine = InferenceEngine(session, settings, sink, log, now=lambda: clock[0], camera_pose=camera_pose)
    return engine, sink, log, session


def feed(engine, rgb, stamp: float) -> None:
    """One frame, run to the end; its clouds too (the output thread)."""
    engine.submit_frame(InputFrame(rgb=rgb, stamp=stamp, stamp_s=stamp, camera_frame="cam"))
    while engine.run_once(0):
        pass
    assert engine.outputs.flush(30)


def save_map(engine, directory: str):
    """~/save_map in one call: the engine's snapshot (inference thread), then the files."""
    s = engine.settings
    return write_map_files(engine.commands.save_snapshot(), directory, s.output_directory, s.service_timeout)


def replay(model, images) -> list:
    session = StreamingSession(model, resolve_settings(SETTINGS).stream)
    out = []
    for rgb in images:
        out += session.push(preprocess_array(rgb, WIDTH))
    return out


def test_clouds_are_the_viewers_selection_of_the_unprojected_depth(model):
    """The output thread unprojects only the selected pixels; same points, colours and
    confidences as selecting from the whole unprojected map (threshold, then stride)."""
    engine, sink, _, _ = make_engine(model, conf_threshold=2.00086, point_stride=3)
    images = frames(3)
    for i, rgb in enumerate(images):
        feed(engine, rgb, 10.0 + i)
    expected = replay(model, images)
    assert len(sink.frames) == 3
    for out, r in zip(sink.frames, expected):
        rgb = np.clip(np.rint(r.image.transpose(1, 2, 0) * 255.0), 0, 255).astype(np.uint8)
        pts, colors, conf = select_points(unproject_depth(r.depth, r.intrinsics, r.c2w), rgb, r.confidence, 2.00086, 3)
        assert 0 < len(pts) < r.depth.size // 3  # the threshold (about the median) removed some, then every third
        np.testing.assert_allclose(out.points, points_to_map(pts), atol=1e-4)
        np.testing.assert_array_equal(out.colors, colors)
        np.testing.assert_allclose(out.confidence, conf, rtol=1e-6)


def test_outputs_follow_the_session_in_the_map_frame(model):
    engine, sink, _, _ = make_engine(model)
    images = frames(4)
    for i, rgb in enumerate(images):
        feed(engine, rgb, 10.0 + i)
    expected = replay(model, images)
    assert [o.frame_index for o in sink.frames] == [1, 2, 3, 4]
    assert [o.stamp for o in sink.frames] == [10.0, 11.0, 12.0, 13.0]
    first = sink.statuses[0][0]
    assert (first.state, first.frame_index) == (State.INITIALIZING, 1)  # collecting the scale frames
    for out, r in zip(sink.frames, expected):
        np.testing.assert_allclose(out.T_map_cam, optical_pose_to_map(r.c2w), atol=1e-6)
        world = unproject_depth(r.depth, r.intrinsics, r.c2w)
        pts, _, conf = select_points(world, None, r.confidence, 0.0, 1)
        np.testing.assert_allclose(out.points, points_to_map(pts), atol=1e-4)
        assert out.points.dtype == np.float32 and out.colors.dtype == np.uint8
        assert out.depth.shape == r.depth.shape and out.camera_frame == "cam"
    assert sink.paths[-1] == [0, 1, 2, 3]
    last = sink.statuses[-1][0]
    assert (last.state, last.frames_processed, last.frames_received, last.frame_index) == (State.TRACKING, 4, 4, 4)
    assert last.stored_frames > 0 and last.latency_model_ms > 0


def test_unwanted_outputs_are_not_computed(model):
    engine, sink, _, _ = make_engine(model, wants=(), accumulate_map=False)
    for i, rgb in enumerate(frames(3)):
        feed(engine, rgb, float(i))
    assert len(sink.frames) == 3
    assert all(o.points is None and o.depth is None for o in sink.frames)


def test_stale_frames_are_replaced_and_counted(model):
    engine, sink, _, _ = make_engine(model)
    imgs = frames(3)
    for i, rgb in enumerate(imgs):  # no inference in between: only the last survives
        engine.submit_frame(InputFrame(rgb=rgb, stamp=float(i), stamp_s=float(i), camera_frame="cam"))
    assert engine.run_once(0) and not engine.run_once(0)
    c = engine.seq.counter_values()
    assert (c.frames_received, c.frames_dropped_stale) == (3, 2)


def test_old_frames_are_dropped_by_max_frame_age(model):
    engine, sink, _, _ = make_engine(model, max_frame_age=0.5)
    feed(engine, frames(1)[0], 999.0)  # engine clock is 1000.0
    assert engine.seq.counter_values().frames_dropped_stale == 1 and engine.session.frames_pushed == 0


def test_invalid_and_resized_input_is_dropped_and_state_kept(model):
    engine, sink, log, session = make_engine(model)
    imgs = frames(3)
    feed(engine, imgs[0], 0.0)
    feed(engine, imgs[1], 1.0)
    engine.reject_frame(2.0, "unsupported image encoding 'bayer_rggb16'")
    engine.run_once(0)
    feed(engine, imgs[2][:200], 3.0)  # another aspect ratio -> other model size
    pushed = session.frames_pushed
    feed(engine, np.zeros((1, 1, 3), np.uint8), 4.0)  # too small for the model
    c = engine.seq.counter_values()
    assert c.frames_dropped_invalid == 3 and session.frames_pushed == pushed == 2
    assert sum("dropped invalid image" in m for lvl, m in log.lines if lvl == "warning") >= 2
    feed(engine, imgs[2], 5.0)
    assert [o.frame_index for o in sink.frames] == [1, 2, 3]


def test_non_finite_pose_is_rolled_back_so_the_next_frame_matches_a_replay_without_it(model):
    engine, sink, log, session = make_engine(model)
    imgs = frames(6)
    for i in range(4):
        feed(engine, imgs[i], float(i))
    def occupancy():
        st = session.stats()
        return st.temporal_index, st.resident_frames, st.scale_pages, st.window_pages, st.free_pages

    before = occupancy()
    session.fault = "pose"
    feed(engine, imgs[4], 4.0)
    assert occupancy() == before  # rolled back: the cache is as before
    assert engine.seq.counter_values().frames_dropped_invalid == 1
    assert [o.frame_index for o in sink.frames] == [1, 2, 3, 4]
    assert any("non-finite pose" in m for _, m in log.lines)
    feed(engine, imgs[5], 5.0)
    expected = replay(model, imgs[:4] + imgs[5:6])[-1]
    np.testing.assert_array_equal(sink.frames[-1].T_map_cam, optical_pose_to_map(expected.c2w))
    assert sink.frames[-1].frame_index == 5


def test_non_finite_scale_frames_roll_back_all_of_them(model):
    engine, sink, _, session = make_engine(model)
    imgs = frames(2)
    feed(engine, imgs[0], 0.0)
    session.fault = "pose"
    feed(engine, imgs[1], 1.0)
    assert engine.seq.counter_values().frames_dropped_invalid == 2 and session.frames_pushed == 0
    assert sink.frames == []


def test_non_finite_depth_drops_outputs_but_keeps_the_cache(model):
    engine, sink, _, session = make_engine(model)
    imgs = frames(4)
    for i in range(3):
        feed(engine, imgs[i], float(i))
    before = session.stats().temporal_index
    session.fault = "depth"
    feed(engine, imgs[3], 3.0)
    assert session.stats().temporal_index == before + 1  # stored
    assert engine.seq.counter_values().frames_dropped_invalid == 1 and len(sink.frames) == 3


def test_inference_exception_resets_cleanly_and_recovers(model):
    engine, sink, log, session = make_engine(model)
    imgs = frames(5)
    for i in range(3):
        feed(engine, imgs[i], float(i))
    session.fault = "raise"
    feed(engine, imgs[3], 3.0)
    states = [s.state for s, _ in sink.statuses[-2:]]
    assert states == [State.ERROR, State.INITIALIZING]
    assert "out of memory" in sink.statuses[-2][0].state_text
    assert engine.seq.counter_values().frames_dropped_error == 1
    assert session.frames_pushed == 0 and len(engine.seq.path) == 0 and sink.paths[-1] == []
    assert any(lvl == "error" and "resetting the session" in m for lvl, m in log.lines)
    feed(engine, imgs[3], 4.0)
    feed(engine, imgs[4], 5.0)  # a new sequence: two scale frames again
    assert [o.frame_index for o in sink.frames[-2:]] == [1, 2]


def test_rollback_command_removes_points_and_pose_and_guards_the_index(model):
    engine, sink, _, session = make_engine(model)
    imgs = frames(5)
    for i in range(4):
        feed(engine, imgs[i], float(i))
    n_map = len(engine.seq.map)
    last_points = sink.frames[-1].points.shape[0]
    with pytest.raises(SessionError, match="the last stored frame is 4, not 3"):
        engine.keyframes.rollback(3)  # 1-based: the latest is 4
    assert engine.outputs.flush(10)  # map changes run on the output thread, in order
    assert len(engine.seq.path) == 4 and len(engine.seq.map) == n_map
    assert engine.keyframes.rollback(0) == 4
    assert engine.outputs.flush(10)
    assert len(engine.seq.path) == 3 and len(engine.seq.map) == n_map - last_points
    assert sink.paths[-1] == [0, 1, 2]
    with pytest.raises(SessionError, match="nothing to roll back"):
        engine.keyframes.rollback(0)
    feed(engine, imgs[4], 4.0)
    assert sink.frames[-1].frame_index == 4
    expected = replay(model, imgs[:3] + imgs[4:5])[-1]
    np.testing.assert_array_equal(sink.frames[-1].T_map_cam, optical_pose_to_map(expected.c2w))


def test_commands_run_between_frames_in_arrival_order(model):
    engine, sink, _, session = make_engine(model)
    imgs = frames(3)
    order = []

    def seen():
        return session.frames_pushed + len(engine.recovery.collected)

    engine.submit("a", lambda: order.append(("a", seen())))
    engine.submit_frame(InputFrame(rgb=imgs[0], stamp=0.0, stamp_s=0.0, camera_frame="c"))
    engine.submit("b", lambda: order.append(("b", seen())))
    while engine.run_once(0):
        pass
    assert order == [("a", 0), ("b", 1)]
    # a newer frame replaces a waiting one even across a command (latest-frame slot)
    engine.submit_frame(InputFrame(rgb=imgs[1], stamp=1.0, stamp_s=1.0, camera_frame="c"))
    engine.submit("c", lambda: order.append(("c", seen())))
    engine.submit_frame(InputFrame(rgb=imgs[2], stamp=2.0, stamp_s=2.0, camera_frame="c"))
    while engine.run_once(0):
        pass
    assert order[-1] == ("c", 1) and seen() == 2 and engine.seq.counter_values().frames_dropped_stale == 1


def test_reset_and_save_map(model, tmp_path):
    engine, sink, _, session = make_engine(model)
    imgs = frames(4)
    for i in range(4):
        feed(engine, imgs[i], 100.0 + i)
    ply, tum = save_map(engine, str(tmp_path / "out"))
    points, colors = read_ply(ply)
    assert points.shape[0] == len(engine.seq.map) > 0 and colors is not None
    stamps, poses = read_tum(tum)
    np.testing.assert_allclose(stamps, [100.0, 101.0, 102.0, 103.0])
    np.testing.assert_allclose(poses, engine.seq.path.poses(), atol=1e-6)
    engine.commands.reset()
    assert engine.outputs.flush(10)  # the map's clear runs on the output thread
    c = engine.seq.counter_values()
    assert (c.frames_received, c.frames_processed) == (0, 0)
    assert len(engine.seq.map) == 0 and len(engine.seq.path) == 0 and session.frames_pushed == 0
    assert sink.statuses[-1][0].state == State.WAITING_FOR_IMAGES
    before = (ply.read_bytes(), tum.read_bytes())
    with pytest.raises(SaveError, match="empty"):  # before: an empty map silently replaced the saved one
        save_map(engine, str(tmp_path / "out"))
    assert (ply.read_bytes(), tum.read_bytes()) == before
    for i in range(3):
        feed(engine, imgs[i], 200.0 + i)
    with pytest.raises(SaveError, match="outside output_directory"):  # a relative path may not leave it
        save_map(engine, "../../..")
    off, _, _, _ = make_engine(model, accumulate_map=False)
    with pytest.raises(SaveError, match="accumulate_map"):
        save_map(off, str(tmp_path))


def test_thread_processes_frames_and_commands(model):
    """The engine has no thread of its own: the node's one inference thread (the scheduler) drives it."""
    engine, sink, _, _ = make_engine(model)
    driver = CameraScheduler({"": engine})
    driver.start()
    try:
        for i, rgb in enumerate(frames(3)):
            engine.submit_frame(InputFrame(rgb=rgb, stamp=float(i), stamp_s=float(i), camera_frame="c"))
            cmd = engine.submit("sync", lambda: None)
            assert cmd.wait(30)
        assert engine.seq.counter_values().frames_processed == 3
    finally:
        driver.stop()
    assert torch.get_num_threads() >= 1


def test_full_cache_while_deferred_drops_the_frame_and_keeps_the_state(model):
    engine, sink, log, session = make_engine(model, deferred_eviction=True, max_pending_evictions=1)
    imgs = frames(8)
    for i in range(6):  # 2 scale frames + a window of 3 + 1 pending eviction
        feed(engine, imgs[i], float(i))
    assert session.stats().pending_evictions == 1
    before = (session.stats(), len(engine.seq.path))
    feed(engine, imgs[6], 6.0)
    assert (session.stats(), len(engine.seq.path)) == before
    assert engine.seq.counter_values().frames_dropped_error == 1
    assert any("commit_eviction" in m for lvl, m in log.lines if lvl == "warning")
    assert engine.keyframes.commit_eviction() > 0
    feed(engine, imgs[7], 7.0)
    assert sink.frames[-1].frame_index == 7 and engine.seq.state == State.TRACKING


def test_windowed_restarts_keep_one_continuous_trajectory(model):
    """The node's session (LongStreamSession) restarts its cache window and keeps going:
    frame indices and the path continue, status reports the window index."""
    from lingbot_map_ros.stream.long_stream import LongStreamSession

    settings = resolve_settings({**SETTINGS, "window_frames": 4})
    session = LongStreamSession(StreamingSession(model, settings.stream), settings.long_stream)
    sink, log = Sink(), Log()
    engine = InferenceEngine(session, settings, sink, log, now=lambda: 1000.0)
    images = frames(14)
    for i, rgb in enumerate(images):
        feed(engine, rgb, 10.0 + i)
    assert [o.frame_index for o in sink.frames] == list(range(1, 15))
    windows = [s.window_index for s, _ in sink.statuses]
    assert windows == sorted(windows) and windows[-1] >= 3
    assert sink.paths[-1] == list(range(14))
    assert all(np.isfinite(o.T_map_cam).all() for o in sink.frames)
    last = sink.statuses[-1][0]
    assert last.frames_dropped_error == 0 and last.frames_dropped_invalid == 0
    assert not [m for level, m in log.lines if level == "error"]


def test_window_must_fit_the_model_horizon():
    from lingbot_map_ros.config import ConfigError

    with pytest.raises(ConfigError, match="window_frames 2000 must be below the model's max_frame_num 1024"):
        resolve_settings({**SETTINGS, "window_frames": 2000})
    with pytest.raises(ConfigError, match="overlap_frames"):
        resolve_settings({**SETTINGS, "overlap_frames": 50})


def test_poses_do_not_wait_for_the_map(model):
    """With the engine's threads running, a map that does not make progress (its first add
    blocks) delays no pose: every frame's pose goes out, the output thread keeps at most
    two frames waiting and skips the rest (counted), and once it is free the map holds the
    frames it did handle, with their clouds published."""
    engine, sink, _, _ = make_engine(model)
    gate = threading.Event()
    real_add, added = engine.seq.map.add, []

    def blocking_add(index, points, colors):
        gate.wait(30)
        added.append(index)
        real_add(index, points, colors)

    engine.seq.map.add = blocking_add
    driver = CameraScheduler({"": engine})
    driver.start()
    try:
        images = frames(8)
        for i, rgb in enumerate(images):  # one frame at a time, each fully handled by the inference thread
            engine.submit_frame(InputFrame(rgb=rgb, stamp=float(i), stamp_s=float(i), camera_frame="cam"))
            assert engine.submit("sync", lambda: None).wait(60)
        poses = [o.frame_index for o in sink.frames]
        assert poses == list(range(1, 9)) and not added  # all 8 poses out, the map still blocked
        assert engine.clouds.skipped == 8 - 1 - 2  # one job running, two waiting, the rest skipped
        gate.set()
        assert engine.outputs.flush(30)
    finally:
        driver.stop()
    assert len(added) == 3 and len(engine.seq.map) > 0
    with_clouds = [o.frame_index for o in sink.frames if o.points is not None]
    assert with_clouds == [i + 1 for i in added]


def test_model_sized_frames_go_to_the_session_as_bytes(model):
    """A camera frame already at the model's size is pushed as uint8 (the session divides on
    its device); the outputs equal those of the float32 preprocessing, colours included."""
    engine, sink, _, session = make_engine(model, point_stride=1)
    pushed = []
    submit = session.submit

    def spy(image, keyframe=None, stamp=None, tag=None):
        pushed.append((image.dtype, image.shape))
        return submit(image, keyframe, stamp, tag)

    session.submit = spy
    images = [f[:56, :WIDTH].copy() for f in frames(4)]  # 98x56: the model's size at image_width 98
    for i, rgb in enumerate(images):
        feed(engine, rgb, 10.0 + i)
    assert pushed == [(np.uint8, (56, WIDTH, 3))] * 4
    expected = replay(model, images)
    assert len(sink.frames) == 4
    for out, r, rgb in zip(sink.frames, expected, images):
        np.testing.assert_array_equal(out.T_map_cam, optical_pose_to_map(r.c2w))
        world = unproject_depth(r.depth, r.intrinsics, r.c2w)
        pts, colors, _ = select_points(world, rgb, r.confidence, 0.0, 1)
        np.testing.assert_allclose(out.points, points_to_map(pts), atol=1e-4)
        np.testing.assert_array_equal(out.colors, colors)


# ---------------------------------------------------------------- robot-facing behaviour (issues 15, 16)
class InfoSink(Sink):
    """Also records ~/frame summaries (wants "frame")."""

    def __init__(self) -> None:
        super().__init__(wants=("frame",))
        self.infos = []

    def publish_frame_info(self, info, out):
        self.infos.append(info)


def clocked_engine(model, **overrides):
    """An engine whose monotonic clock the test moves by hand: ``mono[0]`` seconds."""
    settings = resolve_settings({**SETTINGS, **overrides})
    session = LongStreamSession(StreamingSession(model, settings.stream))  # one window
    sink, log, mono = InfoSink(), Log(), [0.0]
    engine = InferenceEngine(session, settings, sink, log, now=lambda: 1000.0, monotonic=lambda: mono[0])
    return engine, sink, log, session, mono


def test_deferred_eviction_without_commit_is_committed_after_the_timeout(model):
    """A keyframe client that never commits (it crashed) must not blind the robot."""
    engine, sink, log, session, mono = clocked_engine(model, deferred_eviction=True, max_pending_evictions=1,
                                                      deferred_eviction_timeout=2.0)
    imgs = frames(9)
    for i in range(6):  # 2 scale + window of 3 + 1 pending eviction: the cache is full now
        feed(engine, imgs[i], 1.0 + i)
    assert session.stats().pending_evictions == 1
    mono[0] = 1.0
    feed(engine, imgs[6], 7.0)  # within the timeout: dropped, as before (the client may still commit)
    assert engine.seq.counter_values().frames_dropped_error == 1
    mono[0] = 2.5  # the pending eviction is older than deferred_eviction_timeout
    feed(engine, imgs[7], 8.0)
    feed(engine, imgs[8], 9.0)  # no waiting any more: the client is taken as gone until it commits again
    c = engine.seq.counter_values()
    assert c.evictions_auto_committed == 2 and c.frames_processed == 8 and c.frames_dropped_error == 1
    assert sink.frames[-1].frame_index == 8 and engine.seq.state == State.TRACKING
    assert any("deferred_eviction_timeout" in m for lvl, m in log.lines if lvl == "warning")
    assert sink.statuses[-1][0].evictions_auto_committed == c.evictions_auto_committed
    engine.keyframes.commit_eviction()  # the client is back: evictions wait for it again
    feed(engine, imgs[0], 10.0)
    assert session.stats().pending_evictions == 1 and engine.seq.counter_values().evictions_auto_committed == 2


def test_deferred_eviction_timeout_zero_waits_forever(model):
    engine, sink, _, session, mono = clocked_engine(model, deferred_eviction=True, max_pending_evictions=1,
                                                    deferred_eviction_timeout=0.0)
    imgs = frames(8)
    for i in range(6):
        feed(engine, imgs[i], 1.0 + i)
    mono[0] = 1e6
    feed(engine, imgs[6], 7.0)
    assert engine.seq.counter_values().evictions_auto_committed == 0
    assert engine.seq.counter_values().frames_dropped_error == 1


def test_repeated_and_older_stamps_are_dropped_and_the_trajectory_stays_monotonic(model):
    engine, sink, log, session, _ = clocked_engine(model)
    imgs = frames(6)
    feed(engine, imgs[0], 10.0)
    feed(engine, imgs[1], 11.0)
    feed(engine, imgs[2], 11.0)  # repeated
    feed(engine, imgs[3], 10.8)  # 0.2 s back: out of order, below time_jump_threshold
    feed(engine, imgs[4], 12.0)
    c = engine.seq.counter_values()
    assert c.frames_dropped_stamp == 2 and c.time_jumps == 0 and c.frames_processed == 3
    stamps = engine.seq.path.stamps()
    assert list(stamps) == [10.0, 11.0, 12.0]
    assert any("same stamp" in m for _, m in log.lines) and any("older than the previous" in m for _, m in log.lines)


def test_time_jump_resets_by_default(model):
    engine, sink, log, session, _ = clocked_engine(model)
    imgs = frames(6)
    for i in range(3):
        feed(engine, imgs[i], 100.0 + i)
    feed(engine, imgs[3], 5.0)  # a bag played again from the start
    assert engine.seq.counter_values().time_jumps == 1
    assert len(engine.recovery.collected) == 1 and len(engine.seq.path) == 0  # a new sequence collects scale frames
    feed(engine, imgs[4], 6.0)
    assert [o.frame_index for o in sink.frames[-2:]] == [1, 2]
    assert list(engine.seq.path.stamps()) == [5.0, 6.0]
    assert any("time jump" in m and "new sequence" in m for lvl, m in log.lines if lvl == "warning")


def test_time_jump_drop_mode_waits_until_the_stamps_pass_the_last_one(model):
    engine, sink, _, session, _ = clocked_engine(model, on_time_jump="drop")
    imgs = frames(7)
    for i in range(3):
        feed(engine, imgs[i], 100.0 + i)
    feed(engine, imgs[3], 5.0)
    feed(engine, imgs[4], 6.0)
    c = engine.seq.counter_values()
    assert c.time_jumps == 1 and c.frames_dropped_stamp == 2 and session.frames_pushed == 3
    feed(engine, imgs[5], 103.0)
    assert sink.frames[-1].frame_index == 4 and list(engine.seq.path.stamps())[-1] == 103.0


def test_frame_summary_reports_motion_since_the_last_keyframe(model):
    engine, sink, _, session, _ = clocked_engine(model, keyframe_interval=2)
    imgs = frames(6)
    for i in range(6):
        feed(engine, imgs[i], 1.0 + i)
    infos = {i.frame_index: i for i in sink.infos}
    poses = {o.frame_index: o.T_map_cam for o in sink.frames}
    assert set(infos) == set(range(1, 7))
    stored = [i for i, info in infos.items() if info.stored]
    assert stored == [i for i in range(1, 7) if session.inner.is_keyframe_index(i - 1) or i <= 2]
    for i, info in infos.items():
        ref = max(k for k in stored if k < i) if any(k < i for k in stored) else None
        if ref is None:
            assert info.translation_since_keyframe == 0.0
            continue
        want = np.linalg.norm(poses[i][:3, 3] - poses[ref][:3, 3])
        assert info.translation_since_keyframe == pytest.approx(want, rel=1e-6, abs=1e-9)
        assert 0.0 <= info.valid_fraction <= 1.0 and info.confidence_median > 0
        assert not info.decision_pending


def held_engine(model, **overrides):
    engine, sink, log, session, mono = clocked_engine(model, **{"keyframe_decision_timeout": 0.5, **overrides})
    imgs = frames(8)
    for i in range(3):  # 2 scale frames (never held) + frame 3, held
        feed(engine, imgs[i], 1.0 + i)
    return engine, sink, log, session, mono, imgs


def test_hold_keeps_the_next_frame_waiting_until_a_decision(model):
    engine, sink, _, session, mono, imgs = held_engine(model)
    assert sink.infos[-1].frame_index == 3 and sink.infos[-1].decision_pending
    assert not sink.infos[0].decision_pending  # scale frames are not held
    feed(engine, imgs[3], 4.0)  # waits in the slot: frame 3 is not decided
    assert session.frames_pushed == 3 and engine.queue.pending_frame()
    with pytest.raises(SessionError, match="not the frame waiting for a decision"):
        engine.keyframes.commit_eviction(2)
    assert session.frames_pushed == 3 and engine.seq.counter_values().decisions_refused == 1
    engine.keyframes.commit_eviction(3)  # keep
    with pytest.raises(SessionError, match="already decided"):
        engine.keyframes.rollback(3)  # a second decision about frame 3
    while engine.run_once(0):
        pass
    assert session.frames_pushed == 4 and sink.infos[-1].frame_index == 4 and sink.infos[-1].decision_pending
    c = engine.seq.counter_values()
    assert (c.decisions_kept, c.decisions_refused) == (1, 2)


def test_hold_drop_rolls_the_frame_back_and_the_timeout_applies_the_default(model):
    engine, sink, log, session, mono, imgs = held_engine(model, keyframe_decision_default="drop")
    before = session.stats().temporal_index
    assert engine.keyframes.rollback(3) == 3  # drop
    assert session.stats().temporal_index == before - 1 and len(engine.seq.path) == 2
    feed(engine, imgs[3], 4.0)  # held again (index 3 again: the dropped frame left no trace)
    assert sink.infos[-1].frame_index == 3 and sink.infos[-1].decision_pending
    mono[0] = 0.6  # nobody decides (a client that died)
    assert engine.run_once(0) is False  # the deadline passes: default "drop" applies
    c = engine.seq.counter_values()
    assert (c.decisions_dropped, c.decisions_timed_out) == (1, 1) and session.frames_pushed == 2
    with pytest.raises(SessionError, match="already decided"):
        engine.keyframes.commit_eviction(3)  # too late
    assert any("keyframe_decision_timeout" in m for lvl, m in log.lines if lvl == "warning")
    feed(engine, imgs[4], 5.0)
    assert sink.frames[-1].frame_index == 3


def test_reset_during_a_hold_releases_it(model):
    engine, sink, _, session, mono, imgs = held_engine(model)
    engine.commands.reset()
    assert not engine.queue.pending_frame() and session.frames_pushed == 0
    feed(engine, imgs[3], 10.0)
    assert len(engine.recovery.collected) == 1 and engine.seq.counter_values().decisions_timed_out == 0


def test_reset_discards_a_frame_that_waited_behind_the_hold(model):
    """A frame that arrived before ~/reset (waiting in the slot behind a held decision) belongs to
    the old sequence: the reset discards it, and the next frame is frame 1 of the new one."""
    engine, sink, _, session, mono, imgs = held_engine(model)
    engine.submit_frame(InputFrame(rgb=imgs[3], stamp=9.0, stamp_s=9.0, camera_frame="cam"))  # arrives while frame 3 is held: it waits in the slot
    assert engine.queue.pending_frame()
    engine.commands.reset()
    assert not engine.queue.pending_frame()
    assert engine.run_once(0) is False and session.frames_pushed == 0 and not engine.recovery.collected  # nothing old runs
    feed(engine, imgs[4], 10.0)
    assert len(engine.recovery.collected) == 1  # the first scale frame of the new sequence


def test_a_shorter_decision_timeout_set_during_a_hold_counts_from_now(model):
    """keyframe_decision_timeout lowered at run time while a frame is held: the held frame's
    deadline becomes now + the new timeout (0: released at once, with the default decision),
    not its old deadline; a longer timeout does not extend the hold."""
    from dataclasses import replace

    engine, sink, log, session, mono, imgs = held_engine(model, keyframe_decision_timeout=20.0)
    feed(engine, imgs[3], 4.0)  # waits in the slot behind held frame 3 (deadline 20 s)
    mono[0] = 5.0
    engine.configure(replace(engine.settings, keyframe_decision_timeout=2.0))  # as a parameter set does
    assert engine.run_once(0) is True and engine.seq.decisions.hold is not None  # the settings; deadline now 7 s
    assert engine.run_once(0) is False and engine.seq.decisions.hold.deadline == pytest.approx(7.0)
    mono[0] = 6.9
    engine.configure(replace(engine.settings, keyframe_decision_timeout=60.0))  # longer: no extension
    assert engine.run_once(0) is True and engine.run_once(0) is False and engine.seq.decisions.hold is not None
    mono[0] = 7.0
    while engine.run_once(0):
        pass
    c = engine.seq.counter_values()
    assert (c.decisions_timed_out, c.decisions_kept) == (1, 0)  # released at 7 s, not at 20 s
    assert session.frames_pushed == 4 and sink.infos[-1].frame_index == 4 and sink.infos[-1].decision_pending
    assert engine.seq.decisions.hold.deadline == pytest.approx(67.0)  # the next held frame gets the timeout in force
    engine.configure(replace(engine.settings, keyframe_decision_timeout=0.0))  # hold mode off, frame 4 held
    assert engine.run_once(0) is True  # the settings: frame 4 released now (mono 7 s), not at 67 s
    assert engine.seq.decisions.hold is None and engine.seq.counter_values().decisions_timed_out == 2
    assert sink.statuses[-1][0].state_text == "frame 4: keep by timeout"
    feed(engine, imgs[4], 5.0)  # and the next frame is not held
    assert session.frames_pushed == 5 and not sink.infos[-1].decision_pending and engine.seq.decisions.hold is None


def _odometry_variance_xx(out) -> float:
    return float(out.covariance[0])


def test_non_finite_pose_turns_tracking_lost_and_good_frames_bring_it_back(model):
    engine, sink, log, session = make_engine(model)
    imgs = frames(10)
    for i in range(5):
        feed(engine, imgs[i], float(i))
    assert sink.statuses[-1][0].tracking_state == "tracking"
    tracking_var = _odometry_variance_xx(sink.frames[-1])
    assert sink.frames[-1].covariance.shape == (36,)
    session.fault = "pose"
    feed(engine, imgs[5], 5.0)
    st = sink.statuses[-1][0]
    assert (st.tracking_state, st.tracking_reasons) == ("lost", "non_finite")
    assert engine.seq.tracking.lost_resets == 0 and session.frames_pushed == 5  # on_lost=continue keeps the sequence
    feed(engine, imgs[6], 6.0)  # the first good frame after it: still lost, covariance x1000
    assert sink.statuses[-1][0].tracking_state == "lost"
    assert _odometry_variance_xx(sink.frames[-1]) == pytest.approx(1000 * tracking_var)
    feed(engine, imgs[7], 7.0)
    feed(engine, imgs[8], 8.0)  # recover_after = 3 good frames in a row
    assert sink.statuses[-1][0].tracking_state == "tracking"
    assert _odometry_variance_xx(sink.frames[-1]) == pytest.approx(tracking_var)
    assert any(level == "warning" and "tracking lost" in m for level, m in log.lines)


def test_on_lost_reset_starts_a_new_sequence_and_counts_it(model):
    engine, sink, log, session = make_engine(model, on_lost="reset")
    imgs = frames(7)
    for i in range(4):
        feed(engine, imgs[i], float(i))
    session.fault = "depth"
    feed(engine, imgs[4], 4.0)
    st = sink.statuses[-1][0]
    assert engine.seq.tracking.lost_resets == 1 and st.lost_resets == 1 and session.frames_pushed == 0
    assert st.state == State.INITIALIZING and st.tracking_state == "initializing"
    assert sink.paths[-1] == []
    feed(engine, imgs[5], 5.0)  # the next frames start the new sequence (2 scale frames)
    feed(engine, imgs[6], 6.0)
    assert [o.frame_index for o in sink.frames[-2:]] == [1, 2] and session.frames_pushed == 2
    engine.commands.reset()
    assert engine.seq.tracking.lost_resets == 0


def test_confidence_collapse_degrades_then_loses_tracking(model):
    engine, sink, _, _ = make_engine(model, conf_threshold=1000.0)  # no pixel passes: valid fraction 0
    imgs = frames(9)
    states = []
    for i in range(9):
        feed(engine, imgs[i], float(i))
        states.append(sink.statuses[-1][0].tracking_state)
    # scale frames (2) come out on the second image; lost_after = 5 collapses in a row
    assert states[-1] == "lost" and "tracking" not in states
    assert "confidence_collapse" in sink.statuses[-1][0].tracking_reasons


def test_fixed_scale_multiplies_poses_points_depth_and_saved_files(model, tmp_path):
    plain, plain_sink, _, _ = make_engine(model)
    scaled, sink, _, _ = make_engine(model, scale_source="fixed", metric_scale=2.5)
    imgs = frames(4)
    for i, rgb in enumerate(imgs):
        feed(plain, rgb, float(i))
        feed(scaled, rgb, float(i))
    a, b = plain_sink.frames[-1], sink.frames[-1]
    np.testing.assert_allclose(b.T_map_cam[:3, 3], 2.5 * a.T_map_cam[:3, 3], rtol=1e-6)
    np.testing.assert_array_equal(b.T_map_cam[:3, :3], a.T_map_cam[:3, :3])
    np.testing.assert_allclose(b.points, 2.5 * a.points, rtol=1e-5)
    np.testing.assert_allclose(b.depth, 2.5 * a.depth, rtol=1e-5)
    assert b.covariance[0] == pytest.approx(2.5 ** 2 * a.covariance[0])
    st = sink.statuses[-1][0]
    assert (st.scale, st.scale_source, st.scale_converged, st.scale_spread) == (2.5, "fixed", True, 0.0)
    np.testing.assert_array_equal(scaled.seq.path.poses(), plain.seq.path.poses())  # kept in model units
    ply_a, tum_a = save_map(plain, str(tmp_path / "a"))
    ply_b, tum_b = save_map(scaled, str(tmp_path / "b"))
    np.testing.assert_allclose(read_ply(ply_b)[0], 2.5 * read_ply(ply_a)[0], rtol=1e-5)
    poses_a, poses_b = read_tum(tum_a)[1], read_tum(tum_b)[1]
    np.testing.assert_allclose(poses_b[:, :3, 3], 2.5 * poses_a[:, :3, 3], rtol=1e-5)
    np.testing.assert_allclose(poses_b[:, :3, :3], poses_a[:, :3, :3], atol=1e-6)


def test_odometry_scale_converges_to_the_odometry_ratio_and_scales_the_outputs(model):
    """The fake odometry is the replay's camera centres times 10, rotated and shifted (a Sim(3)
    of the model's map): the estimate converges to 10 and the published poses follow."""
    imgs = frames(14)
    truth = 10.0  # the fixture model moves ~0.03-0.06 units a frame: odometry steps above min_motion (0.1 m)
    centres = [optical_pose_to_map(r.c2w)[:3, 3] for r in replay(model, imgs)]
    c, s_ = np.cos(0.7), np.sin(0.7)
    R = np.array([[c, -s_, 0.0], [s_, c, 0.0], [0.0, 0.0, 1.0]])
    asked = []

    def odom_position(stamp, camera_frame):
        asked.append((stamp, camera_frame))
        k = int(stamp)
        return None if k == 3 else R @ (truth * centres[k]) + np.array([4.0, -1.0, 0.2])  # one gap

    settings = resolve_settings({**SETTINGS, "scale_source": "odometry"})
    session = LongStreamSession(StreamingSession(model, settings.stream))  # one window
    sink, log = Sink(("points",)), Log()
    engine = InferenceEngine(session, settings, sink, log, now=lambda: 1000.0, odom_position=odom_position)
    steps = np.linalg.norm(np.diff(np.array(centres), axis=0), axis=1)
    for i, rgb in enumerate(imgs):
        feed(engine, rgb, float(i))
    assert asked[0] == (0.0, "cam") and len(asked) == len(imgs)
    st = sink.statuses[-1][0]
    assert st.scale_source == "odometry" and st.scale_converged, (st, steps)
    assert st.scale == pytest.approx(truth, rel=0.02) and 0.0 <= st.scale_spread <= 0.10
    first = [o for o in sink.frames if o.scale != 1.0][0]
    assert all(o.scale == 1.0 and not o.scale_ready for o in sink.frames[:first.frame_index - 1])
    last = sink.frames[-1]
    np.testing.assert_allclose(last.T_map_cam[:3, 3], st.scale * centres[-1], rtol=1e-5)
    assert any("no odom -> camera transform" in m for _, m in log.lines)
    engine.commands.reset()
    assert engine.seq.anchor.applied_scale == 1.0 and not engine.seq.anchor.scale_source.converged


def _camera(width: int = 518, height: int = 294, d=(-0.25, 0.08, 0.001, -0.002, 0.0)):
    from lingbot_map_ros.robot.undistort import CameraModel

    return CameraModel(width, height, (300.0, 0.0, 259.0, 0.0, 300.0, 147.0, 0.0, 0.0, 1.0), tuple(d), "plumb_bob")


def test_distorted_camera_info_undistorts_frames_before_the_model(model):
    from lingbot_map_ros.robot.undistort import Undistorter

    engine, sink, _, _ = make_engine(model)
    camera = _camera()
    imgs = frames(3)
    for i, rgb in enumerate(imgs):
        engine.submit_frame(InputFrame(rgb=rgb, stamp=float(i), stamp_s=float(i), camera_frame="cam", camera=camera))
        while engine.run_once(0):
            pass
    assert engine.inputs.frames_undistorted == 3
    fixed = [Undistorter().undistort(rgb, camera) for rgb in imgs]
    assert not np.array_equal(fixed[0], imgs[0])
    expected = replay(model, fixed)
    np.testing.assert_array_equal(sink.frames[-1].T_map_cam, optical_pose_to_map(expected[-1].c2w))


def test_camera_info_of_another_size_refuses_the_frame_and_zero_distortion_passes(model):
    engine, sink, log, _ = make_engine(model)
    imgs = frames(3)
    engine.submit_frame(InputFrame(rgb=imgs[0], stamp=0.0, stamp_s=0.0, camera_frame="cam",
                                   camera=_camera(640, 480)))
    while engine.run_once(0):
        pass
    assert engine.seq.counter_values().frames_dropped_invalid == 1 and engine.session.frames_pushed == 0
    assert any("CameraInfo is 640x480" in m for _, m in log.lines)
    plain = _camera(d=(0.0, 0.0, 0.0, 0.0, 0.0))
    for i in (1, 2):
        engine.submit_frame(InputFrame(rgb=imgs[i], stamp=float(i), stamp_s=float(i), camera_frame="cam",
                                       camera=plain))
        while engine.run_once(0):
            pass
    assert engine.inputs.frames_undistorted == 0 and len(sink.frames) == 2
    expected = replay(model, imgs[1:3])
    np.testing.assert_array_equal(sink.frames[-1].T_map_cam, optical_pose_to_map(expected[-1].c2w))
    engine.configure(resolve_settings({**SETTINGS, "undistort": False}))  # a value through the queue
    engine.submit_frame(InputFrame(rgb=imgs[0], stamp=3.0, stamp_s=3.0, camera_frame="cam", camera=_camera()))
    while engine.run_once(0):
        pass
    assert engine.inputs.frames_undistorted == 0 and len(sink.frames) == 3  # undistort false: used as it came


def test_depth_scale_converges_to_the_sensor_ratio(model):
    """Sensor depth = the replay's model depth x 4 in millimetres (16UC1, 20 ms off the colour
    stamp): the depth source converges to 4; a frame without a depth image within 50 ms gives
    no sample and a warning."""
    imgs = frames(8)
    truth = 4.0
    expected = replay(model, imgs)
    engine, sink, log, _ = make_engine(model, scale_source="depth", conf_threshold=1.0)
    for i, rgb in enumerate(imgs):
        if i != 2:  # one frame without a depth image
            mm = np.clip(np.rint(expected[i].depth * truth * 1000.0), 0, 65535).astype(np.uint16)
            engine.seq.anchor.depth_cache.put(float(i) + 0.02, mm)
        feed(engine, rgb, float(i))
    st = sink.statuses[-1][0]
    assert st.scale_source == "depth" and st.scale_converged, st
    assert st.scale == pytest.approx(truth, rel=0.02)
    np.testing.assert_allclose(sink.frames[-1].depth, truth * expected[-1].depth, rtol=0.02)
    assert any("no depth image within 50 ms" in m for _, m in log.lines)


def test_depth_cache_matches_within_50_ms_only():
    from lingbot_map_ros.runtime.anchor import DepthCache

    cache = DepthCache(size=2)
    a, b, c = (np.full((2, 2), v, np.uint16) for v in (1, 2, 3))
    cache.put(1.0, a)
    cache.put(2.0, b)
    cache.put(3.0, c)  # a leaves the cache
    assert cache.nearest(2.04) is b and cache.nearest(2.96) is c
    assert cache.nearest(1.0) is None and cache.nearest(2.5) is None


# ------------------------------------------------------------------ on_lost=reset: the map frame continues
def odometry_pose(stamp: float) -> np.ndarray:
    """A robot's camera in odom (metres) at ``stamp``: driving a curve, turning 10 deg per second."""
    a = np.radians(10.0 * stamp)
    T = np.eye(4)
    T[:3, :3] = [[np.cos(a), -np.sin(a), 0.0], [np.sin(a), np.cos(a), 0.0], [0.0, 0.0, 1.0]]
    T[:3, 3] = (0.2 * stamp, 0.05 * stamp ** 2, 0.01 * stamp)
    return T


def _lose_and_restart(engine, sink, session, imgs):
    """Frames 0-4 (tracking), a non-finite pose at 5 (lost: on_lost=reset), frames 6-9 (a new
    sequence: its scale frames come out with frame 7). Returns the last good published pose."""
    for i in range(5):
        feed(engine, imgs[i], float(i))
    assert sink.statuses[-1][0].tracking_state == "tracking"
    good = sink.frames[-1]
    session.fault = "pose"
    feed(engine, imgs[5], 5.0)
    assert engine.seq.tracking.lost_resets == 1
    for i in range(6, 10):
        feed(engine, imgs[i], float(i))
    return good


def test_lost_reset_with_odometry_continues_the_map_from_the_last_good_pose(model, tmp_path):
    """The new sequence's first frame is published at the last good pose moved by the odometry between
    the two stamps; its later frames follow by the model's own motion (a replay of the new frames
    alone); clouds, the node's path/map transform and the saved files agree. ~/reset starts a new origin."""
    asked = []

    def camera_pose(stamp, camera_frame):
        asked.append((stamp, camera_frame))
        return odometry_pose(stamp)

    engine, sink, log, session = make_engine(model, camera_pose=camera_pose, on_lost="reset")
    imgs = frames(12)
    good = _lose_and_restart(engine, sink, session, imgs)
    assert good.stamp == 4.0 and (4.0, "cam") in asked
    new = {o.stamp: o for o in sink.frames if o.stamp >= 6.0}
    assert sorted(new) == [6.0, 7.0, 8.0, 9.0]
    expected_first = good.T_map_cam @ np.linalg.inv(odometry_pose(4.0)) @ odometry_pose(6.0)
    np.testing.assert_allclose(new[6.0].T_map_cam, expected_first, atol=1e-9)
    replayed = replay(model, imgs[6:10])  # the new sequence in its own frame (origin at frame 6)
    own = [optical_pose_to_map(r.c2w) for r in replayed]
    for k, stamp in enumerate((6.0, 7.0, 8.0, 9.0)):
        np.testing.assert_allclose(new[stamp].T_map_cam, expected_first @ np.linalg.inv(own[0]) @ own[k], atol=1e-6)
    # the clouds: the replay's points moved into the map by the same offset
    out = engine.seq.anchor.output
    assert out.scale == 1.0 and out.offset is not None
    pts, _, _ = select_points(unproject_depth(replayed[-1].depth, replayed[-1].intrinsics, replayed[-1].c2w), None,
                              replayed[-1].confidence, 0.0, 1)
    np.testing.assert_allclose(new[9.0].points, out.points(points_to_map(pts)), atol=1e-4)
    # the path the node publishes (engine.seq.anchor.output over the model-unit trajectory) and the saved files
    np.testing.assert_allclose(out.pose(engine.seq.path.poses()), [new[t].T_map_cam for t in sorted(new)],
                               atol=1e-9)
    ply, tum = save_map(engine, str(tmp_path / "aligned"))
    np.testing.assert_allclose(read_tum(tum)[1], [new[t].T_map_cam for t in sorted(new)], atol=1e-5)
    assert read_ply(ply)[0].shape[0] > 0
    status = [st for st, _ in sink.statuses]
    assert any("aligned to the last good pose through odometry" in st.state_text for st in status)
    assert any("map continued from the last good pose" in st.state_text for st in status)
    assert "continued from frame 5 of the previous sequence" in engine.seq.anchor.map_alignment
    assert any(level == "warning" and "added in model units" in m for level, m in log.lines)  # scale_source none
    # ~/reset: a fresh map (no offset), the next frames are the replay itself
    engine.commands.reset()
    assert engine.seq.anchor.output.identity and engine.seq.anchor.map_alignment.startswith("origin at the first camera")
    for i in (10, 11):
        feed(engine, imgs[i], 100.0 + i)
    fresh = replay(model, imgs[10:12])
    np.testing.assert_allclose(sink.frames[-1].T_map_cam, optical_pose_to_map(fresh[-1].c2w), atol=1e-9)


def test_lost_reset_with_a_metric_scale_adds_the_odometry_in_metres(model):
    """scale_source fixed: the published units are metres, the odometry's motion is added as it is
    (no units warning), the new sequence's own motion is scaled."""
    engine, sink, log, session = make_engine(model, camera_pose=lambda stamp, frame: odometry_pose(stamp),
                                             on_lost="reset", scale_source="fixed", metric_scale=2.0)
    imgs = frames(10)
    good = _lose_and_restart(engine, sink, session, imgs)
    first = good.T_map_cam @ np.linalg.inv(odometry_pose(4.0)) @ odometry_pose(6.0)
    own = [optical_pose_to_map(r.c2w) for r in replay(model, imgs[6:10])]
    rel = np.linalg.inv(own[0]) @ own[3]
    rel[:3, 3] *= 2.0
    np.testing.assert_allclose(sink.frames[-1].T_map_cam, first @ rel, atol=1e-6)
    assert not any("model units" in m for _, m in log.lines)


def test_lost_reset_without_odometry_starts_a_new_origin_and_says_so(model):
    """No camera_pose look-up: today's behaviour (the new sequence's first camera is the origin), a
    warning and the status text say so. Odometry missing at the new frames: the same, said later."""
    engine, sink, log, session = make_engine(model, on_lost="reset")
    imgs = frames(10)
    _lose_and_restart(engine, sink, session, imgs)
    own = replay(model, imgs[6:10])
    np.testing.assert_allclose(sink.frames[-1].T_map_cam, optical_pose_to_map(own[-1].c2w), atol=1e-9)
    assert engine.seq.anchor.output.identity
    assert any(level == "warning" and "NEW map origin" in m and "no odometry look-up" in m for level, m in log.lines)
    assert any("new sequence at a new map origin (no odometry look-up" in st.state_text for st, _ in sink.statuses)

    engine, sink, log, session = make_engine(model, on_lost="reset",
                                             camera_pose=lambda stamp, frame: None if stamp > 5 else np.eye(4))
    _lose_and_restart(engine, sink, session, imgs)
    np.testing.assert_allclose(sink.frames[-1].T_map_cam, optical_pose_to_map(own[-1].c2w), atol=1e-9)
    assert any("no TF odom -> cam at its first frames' stamps (6.000, 7.000 s)" in m for _, m in log.lines)
    assert any("new map origin after a lost reset" in st.state_text for st, _ in sink.statuses)


def test_health_thresholds_follow_the_settings_at_run_time(model):
    """health_* from the settings; replaced settings (a parameter set) apply from the next frame and
    keep the state. (The tiny random model turns by more than 30 degrees between some frames: the
    rotation threshold is opened wide first.)"""
    loose = {**SETTINGS, "health_max_rotation_deg": 180.0, "health_jump_factor": 1e6}
    engine, sink, _, _ = make_engine(model, **loose, health_init_frames=6)
    imgs = frames(8)
    for i in range(5):
        feed(engine, imgs[i], float(i))
    assert [st.tracking_reasons for st, _ in sink.statuses if st.frames_processed] == [""] * 5
    assert sink.statuses[-1][0].tracking_state == "initializing"  # 5 good frames < 6
    engine.configure(resolve_settings({**loose, "health_init_frames": 6, "health_max_rotation_deg": 0.001}))
    feed(engine, imgs[5], 5.0)
    st = sink.statuses[-1][0]
    assert st.tracking_state == "initializing" and st.tracking_reasons == "rotation_jump"
    assert engine.seq.tracking.health.config.max_rotation_step_deg == 0.001
    engine.configure(resolve_settings({**loose, "health_init_frames": 2}))
    feed(engine, imgs[6], 6.0)
    assert sink.statuses[-1][0].tracking_state == "initializing"  # one good frame since the jump
    feed(engine, imgs[7], 7.0)
    assert sink.statuses[-1][0].tracking_state == "tracking"


def test_focal_lengths_are_tracked_in_input_pixels(model):
    engine, sink, _, _ = make_engine(model)
    for i, rgb in enumerate(frames(3)):
        feed(engine, rgb, float(i))
    assert len(engine.seq.focal) == 3 and engine.seq.focal.input_size == (518, 294)
    K = sink.frames[-1].intrinsics  # 98 x 56 model input from 518 x 294
    fx, fy = engine.seq.focal.median()
    assert fx == pytest.approx(np.median([o.intrinsics[0, 0] for o in sink.frames]) * 518 / 98)
    assert fy == pytest.approx(np.median([o.intrinsics[1, 1] for o in sink.frames]) * 294 / 56)
    assert K.shape == (3, 3)


class OnDevice:
    """A session wrapper that reports a non-CPU device (the tensors stay on the CPU) and records
    what it is given."""

    def __init__(self, session) -> None:
        self._s = session
        self.device = torch.device("cuda", 0)  # what the engine reads; nothing is put there
        self.pushed = []

    def __getattr__(self, name):
        return getattr(self._s, name)

    def submit(self, image, keyframe=None, stamp=None, tag=None):
        self.pushed.append(image)
        return self._s.submit(image, keyframe, stamp, tag)


def test_distorted_frames_are_undistorted_on_the_sessions_device_when_it_is_a_gpu(model, monkeypatch):
    """Session device not the CPU: the engine undistorts with the torch path on that device and pushes the
    float tensor it makes (run here on the CPU: the path is asked for "cuda:0" and computes on the CPU);
    the poses are the model's on exactly those tensors. The CPU session keeps the numpy path."""
    from lingbot_map_ros.robot.undistort import Undistorter

    settings = resolve_settings(SETTINGS)
    session = OnDevice(LongStreamSession(StreamingSession(model, settings.stream)))
    sink = Sink(())
    engine = InferenceEngine(session, settings, sink, Log(), now=lambda: 1000.0)
    devices = []
    real = Undistorter.model_input_torch

    def on_cpu(self, rgb, camera, width, device):
        devices.append(device)
        return real(self, rgb, camera, width, "cpu")

    monkeypatch.setattr(Undistorter, "model_input_torch", on_cpu)
    camera = _camera()
    imgs = frames(3)
    for i, rgb in enumerate(imgs):
        engine.submit_frame(InputFrame(rgb=rgb, stamp=float(i), stamp_s=float(i), camera_frame="cam", camera=camera))
        while engine.run_once(0):
            pass
    assert devices == [torch.device("cuda", 0)] * 3 and engine.inputs.frames_undistorted == 3
    assert all(isinstance(im, torch.Tensor) and im.dtype == torch.float32 and im.shape == (3, 56, 98)
               for im in session.pushed)
    check = StreamingSession(model, settings.stream)
    expected = [r for im in session.pushed for r in check.push(im.clone())]
    np.testing.assert_array_equal(sink.frames[-1].T_map_cam, optical_pose_to_map(expected[-1].c2w))
    # the same frames through the numpy path (CPU session): model inputs within 2/255
    host = [preprocess_array(Undistorter().undistort(rgb, camera), WIDTH) for rgb in imgs]
    assert max(np.abs(h - im.numpy()).max() for h, im in zip(host, session.pushed)) <= 2 / 255 + 1e-6
    cpu_engine, _, _, cpu_session = make_engine(model, wants=())
    assert gpu_device(cpu_engine.session) is None and devices == [torch.device("cuda", 0)] * 3


def test_settings_reach_the_inference_thread_as_a_value_through_the_queue(model):
    """``configure`` changes nothing on the caller's thread: the new settings take effect when the
    inference thread runs the command (between two items), the sink gets them there too, and a
    changed deferred_eviction is applied as by ~/set_deferred_eviction."""
    engine, sink, _, session = make_engine(model)
    new = resolve_settings({**SETTINGS, "conf_threshold": 3.0, "deferred_eviction": True})
    command = engine.configure(new)
    assert engine.settings.conf_threshold == 0.0 and not hasattr(sink, "settings")  # nothing yet
    assert not command.wait(0)
    assert engine.run_once(0) and command.wait(0) and command.error is None
    assert engine.settings.conf_threshold == 3.0 and sink.settings is new
    assert engine.settings.deferred_eviction and session.deferred_eviction
    assert sink.statuses[-1][0].deferred_eviction  # the status of set_deferred_eviction
