"""Latest-frame slot, command ordering, throttled warnings, rates, map and trajectory (no graph)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from lingbot_map_ros.runtime.mapping import MapAccumulator, PoseEntry, Trajectory
from lingbot_map_ros.runtime.worker import Command, Counters, RateMeter, Throttle, WorkQueue, message_kind



class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_latest_frame_slot_keeps_only_the_newest():
    q = WorkQueue()
    assert q.put_frame("f1") is None
    assert q.put_frame("f2") == "f1"  # f1 is stale
    assert q.put_frame("f3") == "f2"
    assert q.get(0) == "f3"
    assert q.get(0) is None


def test_items_leave_in_arrival_order():
    q = WorkQueue()
    a, b = Command("a", lambda: 1), Command("b", lambda: 2)
    q.put_frame("f1")
    q.put_command(a)
    q.put_command(b)
    assert [q.get(0), q.get(0), q.get(0)] == ["f1", a, b]
    q.put_command(a)
    q.put_frame("f2")  # arrived after the command: runs after it
    assert [q.get(0), q.get(0)] == [a, "f2"]
    # a frame replaced after a command keeps the new arrival position
    q.put_frame("f3")
    q.put_command(b)
    q.put_frame("f4")
    assert [q.get(0), q.get(0)] == [b, "f4"]


def test_get_times_out_and_wakes_up_for_new_items():
    q = WorkQueue()
    t0 = time.monotonic()
    assert q.get(0.05) is None
    assert time.monotonic() - t0 >= 0.04
    threading.Timer(0.05, q.put_frame, args=("late",)).start()
    assert q.get(2.0) == "late"


def test_command_runs_once_reports_errors_and_can_be_cancelled_only_while_pending():
    calls = []
    ok = Command("ok", lambda: calls.append(1) or "result")
    ok.run()
    ok.run()
    assert calls == [1] and ok.result == "result" and ok.wait(0) and not ok.cancel()

    def boom():
        raise ValueError("no")

    bad = Command("bad", boom)
    bad.run()
    assert isinstance(bad.error, ValueError) and bad.state == Command.DONE

    pending = Command("p", lambda: calls.append(2))
    assert pending.cancel() and pending.wait(0)
    pending.run()
    assert calls == [1] and pending.state == Command.CANCELLED


def test_close_cancels_queued_commands():
    q = WorkQueue()
    c = q.put_command(Command("c", lambda: None))
    assert q.close() == [c]
    assert c.state == Command.CANCELLED and q.get(0.01) is None


def test_throttle_once_per_kind_per_period_and_counts_suppressed():
    clock = FakeClock()
    th = Throttle(5.0, clock=clock)
    out = []
    assert th.emit(out.append, "empty image: 640x0")
    assert not th.emit(out.append, "empty image: 320x0")  # same kind (numbers blanked)
    assert th.emit(out.append, "unsupported image encoding 'bayer'")  # another kind
    clock.t += 5.1
    assert th.emit(out.append, "empty image: 1x0")
    assert out == ["empty image: 640x0", "unsupported image encoding 'bayer'",
                   "empty image: 1x0 (1 similar message(s) suppressed)"]
    assert message_kind("step 10 is smaller than 'rgb8'") == message_kind("step 99 is smaller than 'bgr8'")


def test_rate_meter_and_counters():
    clock = FakeClock()
    rate = RateMeter(window=5.0, clock=clock)
    assert rate.rate() == 0.0 and rate.last() is None
    for _ in range(11):
        rate.tick()
        clock.t += 0.1
    assert rate.rate() == pytest.approx(10 / 1.1, rel=1e-6)
    clock.t += 10
    assert rate.rate() == 0.0
    c = Counters()
    c.add("frames_received", 3)
    c.add("frames_dropped_invalid")
    snap = c.snapshot()
    assert (snap.frames_received, snap.frames_dropped_invalid, snap.frames_processed) == (3, 1, 0)
    c.reset()
    assert c.snapshot().frames_received == 0


def _cloud(n: int, offset: float) -> tuple[np.ndarray, np.ndarray]:
    pts = np.arange(n * 3, dtype=np.float32).reshape(n, 3) + offset
    return pts, np.full((n, 3), 7, np.uint8)


def test_map_removes_recent_frames_and_keeps_older_ones():
    m = MapAccumulator(voxel_size=0.0, max_points=10_000)
    for i in range(5):
        m.add(i, *_cloud(10, 1000.0 * i))
    m.protect_from(3)
    v = m.version
    assert m.remove_from(3) == 20 and len(m) == 30 and m.version > v
    pts, cols, _ = m.snapshot()
    assert pts.shape == (30, 3) and cols.dtype == np.uint8 and pts.max() < 3000
    m.clear()
    assert len(m) == 0 and m.snapshot()[0].shape == (0, 3)


def test_map_stays_bounded_and_protects_rollback_candidates():
    m = MapAccumulator(voxel_size=0.0, max_points=1000)
    for i in range(100):
        m.protect_from(i)
        m.add(i, *_cloud(50, 100.0 * i))
        assert len(m) <= 1000 + 50
    assert m.thinned
    assert m.frames()[-1] == 99  # the latest frame is still separate, so it can be removed exactly
    before = len(m)
    assert m.remove_from(99) == 50 and len(m) == before - 50


def test_map_voxel_downsampling_merges_points():
    m = MapAccumulator(voxel_size=1.0, max_points=1000)
    pts = np.array([[0.1, 0.1, 0.1], [0.2, 0.2, 0.2], [5.0, 5.0, 5.0], [np.nan, 0, 0]], np.float32)
    m.add(0, pts, np.zeros((4, 3), np.uint8))
    assert len(m) == 2


def test_trajectory_bounded_and_removal_from_index():
    t = Trajectory(max_length=3)
    for i in range(5):
        t.append(PoseEntry(i, None, float(i), np.eye(4)))
    assert [e.frame_index for e in t.entries()] == [2, 3, 4]
    assert t.remove_from(4) == 1 and len(t) == 2
    assert t.stamps().tolist() == [2.0, 3.0] and t.poses().shape == (2, 4, 4)
    assert t.remove_from(0) == 2 and t.poses().shape == (0, 4, 4)


def test_map_merge_keeps_one_point_per_voxel_across_frames():
    """Consolidation merges by voxel key: a voxel already in the map keeps its point, new
    voxels come in, the result equals a from-scratch downsample's voxel set."""
    from lingbot_map_ros.runtime.mapping import MERGE_EVERY, voxel_keys

    rng = np.random.default_rng(1)
    m = MapAccumulator(voxel_size=0.5, max_points=100_000)
    clouds = []
    for i in range(MERGE_EVERY + 4):
        pts = (rng.random((300, 3)) * 6 - 3).astype(np.float32)
        clouds.append(pts)
        m.protect_from(i)
        m.add(i, pts, np.full((300, 3), i, np.uint8))
    assert len(m.frames()) < MERGE_EVERY + 4  # a consolidation ran
    pts, cols, _ = m.snapshot()
    keys, valid = voxel_keys(pts, 0.5)
    assert valid.all() and np.unique(keys[: len(m._base_keys)]).size == len(m._base_keys)
    assert np.all(np.diff(m._base_keys) > 0)  # the base is sorted by voxel, one point each
    base_voxels = set(m._base_keys.tolist())
    merged = np.concatenate(clouds[: MERGE_EVERY])
    assert set(voxel_keys(merged, 0.5)[0].tolist()) <= base_voxels | set(keys.tolist())
    # a far-away point cannot be keyed and stays out of the consolidated map
    k, ok = voxel_keys(np.array([[1e9, 0, 0], [np.nan, 0, 0], [1.0, 2.0, 3.0]]), 0.5)
    assert ok.tolist() == [False, False, True]


@pytest.mark.ros
def test_gil_switch_interval_is_shortened_to_the_measured_default():
    import sys

    pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")
    from lingbot_map_ros.ros.main import set_gil_switch_interval

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        assert set_gil_switch_interval() == pytest.approx(0.0005)  # the node's default
        assert set_gil_switch_interval(0.2) == pytest.approx(0.0002)  # a benchmark's other value
        for bad in (0.0, -3.0, float("nan")):
            with pytest.raises(ValueError, match="must be > 0 ms"):
                set_gil_switch_interval(bad)
        assert sys.getswitchinterval() == pytest.approx(0.0002)  # a refused value changes nothing
    finally:
        sys.setswitchinterval(before)


def test_executor_choice():
    """auto/events take rclpy's events executor where it exists, single the single-threaded one; an
    unknown kind is refused; an rclpy without the events executor (ROS 2 Jazzy) falls back to
    single-threaded, said only when events was asked for."""
    import sys

    rclpy = pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")
    from rclpy.executors import SingleThreadedExecutor

    from lingbot_map_ros.ros.executors import make_executor

    has_events = True
    try:
        from rclpy.experimental import EventsExecutor  # noqa: F401
    except ImportError:
        has_events = False
    lines: list[str] = []
    rclpy.init()
    try:
        executor, kind = make_executor("single", lines.append)
        assert kind == "single" and isinstance(executor, SingleThreadedExecutor)
        executor.shutdown()
        for value in ("auto", "events"):
            executor, kind = make_executor(value, lines.append)
            assert kind == ("events" if has_events else "single")
            executor.shutdown()
        executor, kind = make_executor()
        assert kind == ("events" if has_events else "single")
        executor.shutdown()
        with pytest.raises(ValueError, match="executor must be one of auto, events, single, got 'fastest'"):
            make_executor("fastest", lines.append)
        assert lines == ([] if has_events else ["this rclpy has no events executor; using the single-threaded one"])
        lines.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(sys.modules, "rclpy.experimental", None)  # an rclpy without it
            executor, kind = make_executor("auto", lines.append)
            assert kind == "single" and isinstance(executor, SingleThreadedExecutor) and lines == []
            executor.shutdown()
            executor, kind = make_executor("events", lines.append)
            assert kind == "single" and "this rclpy has no events executor" in lines[0]
            executor.shutdown()
    finally:
        rclpy.try_shutdown()


def test_shutdown_joins_our_threads_and_names_one_that_hangs():
    """The node's exit waits for its threads (a thread still in C++ code when the interpreter
    finalizes aborts the process); one that never returns is named, within the time given."""
    import threading
    import time

    pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")
    from lingbot_map_ros.ros.main import _join_threads

    release = threading.Event()
    slow = threading.Thread(target=lambda: time.sleep(0.3), name="lingbot_map_slow", daemon=True)
    stuck = threading.Thread(target=release.wait, name="lingbot_map_stuck", daemon=True)
    unnamed = threading.Thread(target=lambda: time.sleep(0.2), name="services", daemon=True)
    for thread in (slow, stuck, unnamed):
        thread.start()
    try:
        start = time.monotonic()
        left = _join_threads([unnamed], timeout=1.0)
        took = time.monotonic() - start
        mine = {"lingbot_map_slow", "lingbot_map_stuck"}  # other tests' idle output threads may still be ending
        assert [name for name in left if name in mine] == ["lingbot_map_stuck"]
        assert not slow.is_alive() and not unnamed.is_alive()
        assert took < 5.0  # bounded by the timeout, not by the stuck thread
    finally:
        release.set()
        stuck.join(5)
    assert not [name for name in _join_threads([], timeout=1.0) if name in mine]


def test_discard_frame_empties_the_slot_and_keeps_the_commands():
    q = WorkQueue()
    q.put_frame("f1")
    cmd = q.put_command(Command("c", lambda: 1))
    assert q.discard_frame() == "f1" and not q.pending_frame()
    assert q.get(0) is cmd and q.discard_frame() is None
