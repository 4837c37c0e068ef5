"""The node's second thread: per-frame point clouds, depth images and the map.

Unprojecting a 518x378 depth map, selecting and voxel-downsampling its points and
merging them into the map costs milliseconds to (when the map consolidates) a second
of Python and NumPy time. Done on the inference thread it delays the next frame and
with it every pose; here it runs beside inference, so poses go out as soon as the
model has them.

Jobs run in submission order, on the worker's thread (started by ``start`` or by the first
job; it ends after ``IDLE_EXIT_S`` without a job, and the next job starts it again). Frame jobs (a frame's clouds) may be skipped when the worker falls behind: at most
``max_pending`` wait, and a new one pushes out the oldest (``on_skip`` counts it).
Operations (map clear, rollback removal, protection) are never skipped, so the map sees
adds and removals in the order the inference thread issued them. ``flush`` waits until
everything queued ran.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable

Job = Callable[[], None]
IDLE_EXIT_S = 2.0  # the thread ends after this long without a job (a camera that went quiet holds none)


class OutputWorker:
    def __init__(self, max_pending: int = 2, on_skip: Callable[[], None] | None = None,
                 on_error: Callable[[Exception], None] | None = None) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self.on_skip = on_skip  # called when a waiting frame job is dropped (the worker fell behind)
        self.on_error = on_error  # called with a job's exception (None: it propagates, ending the thread)
        self._cv = threading.Condition()
        self._jobs: deque[tuple[bool, Job]] = deque()  # (is a frame job, job)
        self._busy = False
        self._stop = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ producer side
    def frame_job(self, job: Job) -> None:
        """Queue a frame's outputs; the oldest waiting frame job is dropped when ``max_pending`` wait."""
        self.start()
        skipped = False
        with self._cv:
            waiting = [i for i, (is_frame, _) in enumerate(self._jobs) if is_frame]
            if len(waiting) >= self.max_pending:
                del self._jobs[waiting[0]]
                skipped = True
            self._jobs.append((True, job))
            self._cv.notify_all()
        if skipped and self.on_skip is not None:
            self.on_skip()

    def op(self, job: Job) -> None:
        """Queue an operation that must not be skipped (runs after every job queued before it)."""
        self.start()
        with self._cv:
            self._jobs.append((False, job))
            self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job ran; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def pending(self) -> int:
        with self._cv:
            return len(self._jobs) + int(self._busy)

    # ------------------------------------------------------------------ thread
    def start(self) -> None:
        """Start the worker's thread (nothing when it runs)."""
        with self._cv:
            if self._thread is not None:
                return
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="lingbot_map_outputs", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Run what is queued, then stop (a later job starts the thread again)."""
        thread = self._thread
        if thread is None:
            return
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        thread.join(timeout)
        with self._cv:
            if self._thread is thread:
                self._thread = None

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._stop, IDLE_EXIT_S)
                if not self._jobs:  # stopping and drained, or idle: the next job starts a thread again
                    if self._thread is threading.current_thread():
                        self._thread = None
                    return
                _, job = self._jobs.popleft()
                self._busy = True
            try:
                self._run(job)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _run(self, job: Job) -> None:
        try:
            job()
        except Exception as exc:  # never let a bad frame stop the outputs
            if self.on_error is None:
                raise
            self.on_error(exc)


__all__ = ["OutputWorker"]
