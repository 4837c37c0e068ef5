"""CameraScheduler (runtime/scheduler.py) with fake engines: fairness, commands between another
camera's frames, no busy waiting, shutdown. No model, no ROS."""
from __future__ import annotations

from types import SimpleNamespace

import threading
import time

import pytest

from lingbot_map_ros.runtime.scheduler import CameraScheduler
from lingbot_map_ros.runtime.worker import Command, WorkQueue

from engine_fakes import drain  # test/ is on sys.path (conftest.py)


class FakeOutputs:
    def __init__(self) -> None:
        self.started = self.stopped = 0

    def start(self) -> None:
        self.started += 1

    def stop(self, timeout: float = 5.0) -> None:
        self.stopped += 1


class FakeEngine:
    """What the scheduler uses of an InferenceEngine: ``queue``, ``outputs``, ``run_once``, ``stop``,
    and the stale count of ``submit_frame``. A frame "step" sleeps ``step_s`` and is logged."""

    def __init__(self, name: str, log: list, step_s: float = 0.0) -> None:
        self.name, self.log, self.step_s = name, log, step_s
        self.queue = WorkQueue()
        self.outputs = FakeOutputs()
        self.calls = 0  # run_once calls (busy-wait detector)
        self.stale = 0
        self.stopped = False

    def submit_frame(self, frame) -> None:
        if self.queue.put_frame(frame) is not None:
            self.stale += 1

    def run_idle(self) -> bool:
        return False

    def run_once(self, timeout: float = 0.0) -> bool:
        self.calls += 1
        item = self.queue.get(timeout)
        if item is None:
            return False
        if isinstance(item, Command):
            item.run()
        else:
            if self.step_s:
                time.sleep(self.step_s)
            self.log.append((self.name, item))
        return True

    def stop(self, timeout: float = 5.0) -> None:
        self.stopped = True
        self.queue.close()
        self.outputs.stop(timeout)


def engines(*names: str, step_s: float = 0.0):
    log: list = []
    return {n: FakeEngine(n, log, step_s) for n in names}, log


def test_round_robin_one_item_per_turn_while_a_camera_floods():
    cams, log = engines("a", "b", "c")
    sched = CameraScheduler(cams)
    for i in range(3):  # b and c have a few frames each, one at a time in their slots
        cams["b"].submit_frame(("b", i))
        cams["c"].submit_frame(("c", i))
        for _ in range(4):  # a floods: a new frame before each turn
            cams["a"].submit_frame(("a", i))
            assert sched.run_turn() is not None
    order = [name for name, _ in log]
    # a runs twice in a row only when b and c have nothing waiting
    assert order == ["a", "b", "c", "a"] + ["b", "c", "a", "a"] * 2
    assert [item for name, item in log if name == "b"] == [("b", 0), ("b", 1), ("b", 2)]
    assert cams["a"].stale > 0  # the flood replaced waiting frames: counted by a's engine, not by the others
    assert cams["b"].stale == cams["c"].stale == 0
    assert sched.served == {"a": order.count("a"), "b": 3, "c": 3}


def test_turn_order_rotates_after_the_camera_served_last():
    cams, log = engines("a", "b")
    sched = CameraScheduler(cams)
    cams["a"].submit_frame(1)
    assert sched.run_turn() == "a"
    cams["a"].submit_frame(2)
    cams["b"].submit_frame(1)
    assert sched.run_turn() == "b"  # b comes first after a was served, although a is first in order
    assert sched.run_turn() == "a"
    assert sched.run_turn() is None


def test_a_command_of_one_camera_runs_while_another_floods_frames():
    cams, log = engines("a", "b", step_s=0.01)
    sched = CameraScheduler(cams)
    stop = threading.Event()

    def flood() -> None:
        i = 0
        while not stop.is_set():
            cams["a"].submit_frame(i)
            i += 1
            time.sleep(0.001)

    producer = threading.Thread(target=flood, daemon=True)
    sched.start()
    producer.start()
    try:
        time.sleep(0.1)
        t0 = time.monotonic()
        done = cams["b"].queue.put_command(Command("reset b", lambda: "ok"))
        assert done.wait(2.0), "b's command did not run while a flooded"
        waited = time.monotonic() - t0
        a_steps_before = len(log)
        time.sleep(0.1)
        assert len(log) > a_steps_before  # a keeps going
    finally:
        stop.set()
        producer.join(1.0)
        sched.stop(2.0)
    assert done.result == "ok"
    assert waited < 0.5, f"b's command waited {waited:.3f} s behind a's frames (each step is 10 ms)"
    assert all(name == "a" for name, _ in log) and cams["a"].stale > 0


def test_frames_of_two_cameras_in_turn_from_the_thread():
    cams, log = engines("a", "b", step_s=0.005)
    sched = CameraScheduler(cams)
    sched.start()
    try:
        for i in range(5):
            cams["a"].submit_frame(("a", i))
            cams["b"].submit_frame(("b", i))
            deadline = time.monotonic() + 2.0
            while len(log) < 2 * (i + 1) and time.monotonic() < deadline:
                time.sleep(0.002)
    finally:
        sched.stop(2.0)
    assert sorted(item for _, item in log) == sorted([("a", i) for i in range(5)] + [("b", i) for i in range(5)])
    assert cams["a"].outputs.started == cams["b"].outputs.started == 1
    assert cams["a"].stopped and cams["b"].stopped and cams["a"].outputs.stopped == 1


def test_no_busy_wait_when_idle_and_a_prompt_wake_up():
    cams, log = engines("a", "b", "c")
    sched = CameraScheduler(cams, idle_wait=0.05)
    sched.start()
    try:
        time.sleep(0.6)
        calls = sum(e.calls for e in cams.values())
        # each idle pass polls 3 cameras once and then sleeps up to 50 ms: ~12 passes in 0.6 s
        assert calls <= 3 * (0.6 / 0.05 + 3), f"{calls} run_once calls in 0.6 s idle: busy waiting"
        assert sched.idle_waits >= 3
        t0 = time.monotonic()
        cams["c"].submit_frame("x")
        deadline = t0 + 2.0
        while not log and time.monotonic() < deadline:
            time.sleep(0.001)
        assert log == [("c", "x")]
    finally:
        sched.stop(2.0)


def test_pending_commands_are_cancelled_at_stop_and_bad_arguments_refused():
    cams, _ = engines("a")
    sched = CameraScheduler(cams)
    command = cams["a"].queue.put_command(Command("late", lambda: 1))
    sched.stop(1.0)  # never started: the engines still stop and close their queues
    assert command.state == Command.CANCELLED and cams["a"].stopped
    with pytest.raises(ValueError, match="at least one camera"):
        CameraScheduler({})
    with pytest.raises(ValueError, match="idle_wait"):
        CameraScheduler(engines("a")[0], idle_wait=0)


# ------------------------------------------------------------------ batched steps
class BatchEngine(FakeEngine):
    """A FakeEngine with the batched-step halves: ``admit`` refuses frames named "bad";
    ``finish_step`` logs the outcome it was handed."""

    def __init__(self, name: str, log: list) -> None:
        super().__init__(name, log)
        self.held = False
        self.completed: list = []

    def take_frame(self):
        return None if self.held else self.queue.take_frame()

    def admit(self, frame):
        return None if frame[1] == "bad" else SimpleNamespace(frame=frame, image=("image", frame))

    def finish_step(self, admitted, outcome) -> None:
        self.completed.append((admitted.frame, outcome))
        self.log.append((self.name, admitted.frame))


def batch_engines(*names: str):
    log: list = []
    return {n: BatchEngine(n, log) for n in names}, log


def test_waiting_frames_of_several_cameras_go_in_one_call_and_each_gets_its_outcome():
    cams, log = batch_engines("a", "b", "c")
    calls = []

    def batch(images):
        calls.append(sorted(images))
        return {c: f"result of {c}" for c in images}

    sched = CameraScheduler(cams, batch=batch)
    for c in ("a", "b", "c"):
        cams[c].submit_frame((c, 0))
    assert drain(sched) == 1  # one turn served all three
    assert calls == [["a", "b", "c"]] and sched.batches == 1
    assert all(cams[c].completed == [((c, 0), f"result of {c}")] for c in cams)
    assert sched.served == {"a": 1, "b": 1, "c": 1}


def test_commands_held_cameras_and_refused_frames_stay_out_of_the_batch():
    cams, log = batch_engines("a", "b", "c")
    calls = []
    sched = CameraScheduler(cams, batch=lambda images: calls.append(sorted(images)) or {c: "ok" for c in images})
    ran = []
    cams["a"].submit_frame(("a", 0))
    cams["a"].queue.put_command(Command("service", lambda: ran.append("a's command")))  # queued after its frame
    cams["b"].submit_frame(("b", 0))
    cams["c"].submit_frame(("c", "bad"))
    sched.run_turn()
    # a has a command queued: its frame stays for the round-robin (commands keep their order);
    # c's frame was taken but refused by its engine: b alone is submitted
    assert calls == [["b"]] and sched.batches == 0
    assert cams["a"].queue.pending_frame() and cams["c"].completed == []
    drain(sched)
    assert ran == ["a's command"] and ("a", ("a", 0)) in log
    cams["a"].held = True  # a keep/drop decision held: a's frame waits
    for c in ("a", "b", "c"):
        cams[c].submit_frame((c, 1))
    sched.run_turn()
    assert calls[-1] == ["b", "c"] and cams["a"].queue.pending_frame()


def test_a_failing_batch_call_reaches_every_camera_as_its_outcome():
    cams, _ = batch_engines("a", "b")

    def broken(images):
        raise RuntimeError("capture failed")

    sched = CameraScheduler(cams, batch=broken)
    cams["a"].submit_frame(("a", 0))
    cams["b"].submit_frame(("b", 0))
    drain(sched)
    for c in ("a", "b"):
        (frame, outcome), = cams[c].completed
        assert isinstance(outcome, RuntimeError) and "capture failed" in str(outcome)


def test_take_frame_leaves_a_frame_behind_a_command():
    q = WorkQueue()
    assert q.take_frame() is None
    q.put_frame("f1")
    assert q.take_frame() == "f1" and q.take_frame() is None
    q.put_frame("f2")
    q.put_command(Command("c", lambda: None))
    assert q.take_frame() is None and q.pending_frame()
    q.close()
    assert q.take_frame() is None


class PipeEngine(BatchEngine):
    """A BatchEngine with ``start_step``: every start and finish goes to the shared event log."""

    def __init__(self, name: str, log: list, events: list) -> None:
        super().__init__(name, log)
        self.events = events

    def start_step(self, admitted):
        self.events.append(("launch", self.name, admitted.frame[1]))
        return f"pending {admitted.frame}"

    def finish_step(self, admitted, outcome) -> None:
        self.events.append(("complete", self.name, admitted.frame[1]))
        super().finish_step(admitted, outcome)

    def run_once(self, timeout: float = 0.0) -> bool:
        item = self.queue.get(timeout, frames=not self.held)
        if item is None:
            return False
        if isinstance(item, Command):
            self.events.append(("command", self.name, item.name))
            item.run()
        else:  # a frame run the synchronous way
            self.events.append(("push", self.name, item[1]))
        return True


def pipe_engines(*names: str):
    log: list = []
    events: list = []
    return {n: PipeEngine(n, log, events) for n in names}, events


def test_pipelined_each_step_completes_after_the_next_cameras_launch():
    cams, events = pipe_engines("a", "b", "c")
    sched = CameraScheduler(cams, pipeline=True)
    for c in ("a", "b", "c"):
        cams[c].submit_frame((c, 0))
    assert drain(sched) == 3
    assert events == [("launch", "a", 0), ("launch", "b", 0), ("complete", "a", 0), ("launch", "c", 0),
                      ("complete", "b", 0), ("complete", "c", 0)]  # the last one: nobody else had work
    assert sched.overlapped == 2 and sched.served == {"a": 1, "b": 1, "c": 1}
    assert all(cams[c].completed == [((c, 0), f"pending {(c, 0)}")] for c in cams)


def test_pipelined_a_cameras_own_step_completes_before_its_next_frame_or_command():
    cams, events = pipe_engines("a", "b")
    sched = CameraScheduler(cams, pipeline=True)
    cams["a"].submit_frame(("a", 0))
    assert sched.run_turn() == "a" and events == [("launch", "a", 0)]  # in flight
    cams["a"].queue.put_command(Command("reset", lambda: None))
    cams["b"].submit_frame(("b", 0))
    drain(sched)
    # b's frame is launched while a's step runs; a's reset comes after a's own step completed
    assert events[1:] == [("launch", "b", 0), ("complete", "a", 0), ("command", "a", "reset"), ("complete", "b", 0)]
    events.clear()
    cams["a"].submit_frame(("a", 1))
    sched.run_turn()
    cams["a"].submit_frame(("a", 2))  # a's next frame: never launched while its previous step is in flight
    drain(sched)
    assert events == [("launch", "a", 1), ("complete", "a", 1), ("launch", "a", 2), ("complete", "a", 2)]
    for c in cams:  # every launched step completed exactly once, in its camera's order
        frames = [e[2] for e in events if e[1] == c]
        assert frames == sorted(frames)


def test_pipelined_one_camera_never_overlaps_itself_and_held_or_refused_frames_are_not_launched():
    cams, events = pipe_engines("a", "b")
    sched = CameraScheduler(cams, pipeline=True)
    for i in range(3):
        cams["a"].submit_frame(("a", i))
        sched.run_turn()
    drain(sched)
    assert events == [(kind, "a", i) for i in range(3) for kind in ("launch", "complete")]
    assert sched.overlapped == 0
    events.clear()
    cams["a"].held = True  # a keep/drop decision held: a's frame is not taken
    cams["a"].submit_frame(("a", 3))
    cams["b"].submit_frame(("b", "bad"))  # refused by b's engine: nothing launched
    drain(sched)
    assert events == [] and cams["a"].queue.pending_frame() and cams["b"].completed == []
    assert sched.served["b"] == 1  # taken and dropped, as without pipelining


def test_pipelined_batches_run_alone_and_stop_completes_the_step_in_flight():
    cams, events = pipe_engines("a", "b")
    calls = []
    sched = CameraScheduler(cams, pipeline=True, batch=lambda images: calls.append(sorted(images))
                            or {c: "batched" for c in images})
    cams["a"].submit_frame(("a", 0))
    sched.run_turn()  # a alone: launched, in flight
    cams["a"].submit_frame(("a", 1))
    cams["b"].submit_frame(("b", 1))
    sched.run_turn()  # two waiting: a batch, after a's step in flight completed
    assert events[:2] == [("launch", "a", 0), ("complete", "a", 0)]
    assert sorted(events[2:]) == [("complete", "a", 1), ("complete", "b", 1)] and calls == [["a", "b"]]
    events.clear()
    sched2 = CameraScheduler({"a": cams["a"]}, pipeline=True, idle_wait=0.01)
    sched2.start()
    cams["a"].submit_frame(("a", 2))
    deadline = time.monotonic() + 5
    while ("complete", "a", 2) not in events and time.monotonic() < deadline:
        time.sleep(0.01)
    sched2.stop()
    assert events == [("launch", "a", 2), ("complete", "a", 2)]
