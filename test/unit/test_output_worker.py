"""OutputWorker: order, bounded backlog (frame jobs skipped oldest first, operations never),
flush, the thread starting with the first job (and again after a stop), errors contained. Bounded
waits throughout."""
from __future__ import annotations

import threading
import time

import pytest

from lingbot_map_ros.runtime.output_worker import OutputWorker


def test_the_first_job_starts_the_thread_and_a_job_after_stop_starts_it_again():
    done, threads = [], []
    w = OutputWorker()
    assert w.flush(0) and w.pending() == 0  # nothing queued: nothing to wait for
    w.frame_job(lambda: (done.append("f1"), threads.append(threading.current_thread().name)))
    w.op(lambda: done.append("op"))
    assert w.flush(5.0) and done == ["f1", "op"] and w.pending() == 0
    assert threads == ["lingbot_map_outputs"]  # not the caller's thread
    w.stop()
    w.frame_job(lambda: (done.append("f2"), threads.append(threading.current_thread().name)))
    assert w.flush(5.0) and done[-1] == "f2" and threads[-1] == "lingbot_map_outputs"
    w.stop()


def test_order_skips_and_operations_kept():
    gate = threading.Event()
    done, skipped = [], []
    w = OutputWorker(max_pending=2, on_skip=lambda: skipped.append(1))
    w.start()
    try:
        w.frame_job(lambda: gate.wait(5) and done.append("blocker"))
        deadline = time.monotonic() + 5
        while w.pending() != 1 or not w._busy:  # the blocker is running
            assert time.monotonic() < deadline
            time.sleep(0.001)
        w.frame_job(lambda: done.append("f1"))
        w.op(lambda: done.append("op1"))
        w.frame_job(lambda: done.append("f2"))
        w.frame_job(lambda: done.append("f3"))  # 2 frame jobs wait already: f1 is dropped
        w.op(lambda: done.append("op2"))
        w.frame_job(lambda: done.append("f4"))  # f2 dropped
        assert len(skipped) == 2
        gate.set()
        assert w.flush(5)
    finally:
        w.stop()
    assert done == ["blocker", "op1", "f3", "op2", "f4"]


def test_errors_are_reported_and_the_thread_survives():
    errors, done = [], []
    w = OutputWorker(on_error=errors.append)
    w.start()
    try:
        w.frame_job(lambda: 1 / 0)
        w.op(lambda: done.append("after"))
        assert w.flush(5)
    finally:
        w.stop()
    assert len(errors) == 1 and isinstance(errors[0], ZeroDivisionError) and done == ["after"]


def test_stop_runs_what_is_queued():
    done = []
    w = OutputWorker(max_pending=100)
    w.start()
    for i in range(50):
        w.frame_job(lambda i=i: (time.sleep(0.001), done.append(i)))
    w.stop(10)
    assert done == list(range(50))


def test_bad_configuration():
    with pytest.raises(ValueError, match="max_pending"):
        OutputWorker(max_pending=0)
