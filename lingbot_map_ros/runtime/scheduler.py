"""One inference thread for several cameras: ``CameraScheduler``.

Each camera has its own ``InferenceEngine`` (its session, trajectory, map, latest-frame
slot and command FIFO, ``engine.queue``); all of them share one model and one K/V
storage (``stream.multi.CameraSessions``), so they must be driven from ONE thread. The
scheduler is that thread:

- Round-robin, one item per turn: the cameras are visited in their configured order
  starting after the camera served last; the first one whose ``run_once(0)`` takes an
  item (a frame from its slot, or a command) has its turn, then the next camera comes
  first. A camera that floods frames therefore gets one step between any two of
  another camera's items: nobody starves, and a command of camera B (a service call)
  waits for at most one step of each other camera.
- No busy loop: every queue sets one shared ``threading.Event`` when an item arrives
  (``WorkQueue.add_listener``). When a full pass finds no work the thread first gives each
  engine its idle work (``run_idle``: a loop candidate's verification by the model, which
  waits until the stream leaves time), then waits on the event, at most ``idle_wait``
  seconds, so the engines' own deadlines (a keyframe decision hold, which ``run_once``
  checks) are still honoured without an item arriving.
- Stale frames: a camera's slot holds one frame; a newer one replaces it and the
  engine counts the old one in its own ``frames_dropped_stale``. The scheduler counts
  per camera the items it ran (``served``).

- Batched steps (``batch``, the node's ``camera_batching``): at the start of a turn, when
  two or more cameras have a frame waiting as their next item (no command queued, no
  decision held), their frames are taken together (``take_frame``), each admitted by its
  engine (``admit``: stamp and preprocessing), submitted in one call
  (``stream.multi.CameraSessions.submit_many``: one batched trunk where their steps can go
  together, else one after another) and each outcome handed back to its engine
  (``finish_step``). Every camera with a frame then gets its step in that turn; commands and
  held cameras go through the round-robin as before.

- Pipelined steps (``pipeline``, the node's ``camera_pipelining``): a camera's frame is
  started (``admit``, then ``start_step``: its step is submitted, its results not yet taken)
  and the step started before it, another camera's, is finished only then
  (``finish_step``: results taken and published), so the GPU runs one camera's step while the
  host finishes the previous one and prepares the next. At most one step is in flight, and
  a camera's own step is always completed before anything else of that camera runs (its
  next frame, a command such as a reset or a rollback, a keep/drop decision), so each
  camera sees exactly the order of events it sees without pipelining. When a pass finds
  no other work the step in flight is completed at once (its results do not wait for the
  next frame), and at stop. With one camera it is the same as no pipelining.

The engines are duck-typed (``Engine``): the node passes ``runtime.engine.InferenceEngine``s,
the unit tests small fakes.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Mapping, Protocol

from .worker import WorkQueue

IDLE_WAIT_S = 0.05  # longest sleep without work: bounds the lateness of a decision hold's deadline
_log = logging.getLogger(__name__)


class OutputThread(Protocol):
    def start(self) -> None: ...


class Engine(Protocol):
    queue: WorkQueue
    outputs: OutputThread

    def run_once(self, timeout: float = 0.0) -> bool: ...
    def run_idle(self) -> bool: ...  # work that waits until nothing else is queued; True when some ran
    def stop(self, timeout: float = 5.0) -> None: ...
    # batched and pipelined steps only
    def take_frame(self) -> Any | None: ...
    def admit(self, frame: Any) -> Any | None: ...  # an admitted frame (``.image``: what the session takes)
    def finish_step(self, admitted: Any, outcome: Any) -> None: ...
    # pipelined steps only
    def start_step(self, admitted: Any) -> Any: ...


# images by camera -> per camera the pending results or the exception of its submit
BatchSubmit = Callable[[Mapping[str, Any]], Mapping[str, Any]]


class CameraScheduler:
    """Drives ``engines`` (name -> engine, in turn order) from one thread; see the module docstring."""

    def __init__(self, engines: Mapping[str, Engine], idle_wait: float = IDLE_WAIT_S,
                 name: str = "lingbot_map_inference", batch: BatchSubmit | None = None,
                 pipeline: bool = False) -> None:
        if not engines:
            raise ValueError("CameraScheduler needs at least one camera")
        if not idle_wait > 0:
            raise ValueError(f"idle_wait must be > 0 s, got {idle_wait}")
        self.engines = dict(engines)
        self.order = list(self.engines)
        self.idle_wait = idle_wait
        self.served = {name: 0 for name in self.order}  # items run per camera (inference thread writes)
        self.idle_waits = 0  # passes that found no work and waited on the event
        self.batch = batch
        self.batches = 0  # batched submits (two or more cameras' frames in one call)
        self.pipeline = bool(pipeline)
        self.overlapped = 0  # steps completed after the next camera's step was launched
        self._in_flight: tuple[str, Any, Any] | None = None  # (camera, frame, outcome) launched, not completed
        self._name = name
        self._next = 0  # index in ``order`` of the camera looked at first in the next pass
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for engine in self.engines.values():
            engine.queue.add_listener(self._wake)

    # ------------------------------------------------------------------ one pass
    def run_turn(self) -> str | None:
        """One pass over the cameras from the one after the last served: with ``batch``, first the
        waiting frames of two or more cameras together; else run the first item found (one
        engine ``run_once(0)``). Returns a camera served, or None when nobody had work."""
        if self.batch is not None:
            served = self._run_batch()
            if served:
                return served[0]
        n = len(self.order)
        for k in range(n):
            i = (self._next + k) % n
            name = self.order[i]
            # pipelined: a camera's own step in flight is completed first, before its frame,
            # its command or its held decision
            if self.pipeline and self._start_pipelined(name):
                self._next = (i + 1) % n
                return name
            if self.engines[name].run_once(0.0):
                self.served[name] += 1
                self._next = (i + 1) % n
                return name
        self.finish_in_flight()  # nobody else has work: its results should not wait
        return None

    def _start_pipelined(self, name: str) -> bool:
        """Start camera ``name``'s waiting frame (when its next item is a frame it may run now),
        then finish the step started before it. False when it has no such frame."""
        engine = self.engines[name]
        if self._in_flight is not None and self._in_flight[0] == name:
            self.finish_in_flight()  # a camera's own steps never overlap
        frame = engine.take_frame()
        if frame is None:
            return False
        self.served[name] += 1
        admitted = engine.admit(frame)
        if admitted is None:  # dropped (too old, a stamp out of order, not preprocessable): counted by its engine
            return True
        outcome = engine.start_step(admitted)
        previous, self._in_flight = self._in_flight, (name, admitted, outcome)
        if previous is not None:
            self.overlapped += 1
            self.engines[previous[0]].finish_step(*previous[1:])
        return True

    def finish_in_flight(self) -> None:
        """Finish the step in flight, if any (its results taken and handled by its engine)."""
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self.engines[previous[0]].finish_step(*previous[1:])

    def _run_batch(self) -> list[str]:
        """Take the waiting frames of every camera that has one as its next item; with two or
        more, submit them in one call. Returns the cameras whose frames were taken (served)."""
        n = len(self.order)
        ready = [self.order[(self._next + k) % n] for k in range(n)]
        ready = [c for c in ready if self.engines[c].queue.pending_frame()]
        if len(ready) < 2:
            return []
        self.finish_in_flight()  # a batch runs alone (a camera in it may have its step in flight)
        frames = {}
        for c in ready:
            frame = self.engines[c].take_frame()
            if frame is not None:
                frames[c] = frame
        admitted = {}
        for c, frame in frames.items():
            self.served[c] += 1
            a = self.engines[c].admit(frame)
            if a is not None:
                admitted[c] = a
        outcomes: dict[str, Any] = {}
        if admitted:  # one left: its step alone, through the same call (nothing to batch with)
            self.batches += len(admitted) >= 2
            try:
                outcomes = dict(self.batch({c: a.image for c, a in admitted.items()}))
            except Exception as exc:  # the whole call failed: every camera reports it
                outcomes = {c: exc for c in admitted}
        for c, outcome in outcomes.items():
            self.engines[c].finish_step(admitted[c], outcome)
        if frames:
            self._next = (self.order.index(list(frames)[-1]) + 1) % n
        return list(frames)

    # ------------------------------------------------------------------ thread
    def start(self) -> None:
        """Start every engine's output thread, then the inference thread."""
        if self._thread is not None:
            return
        for engine in self.engines.values():
            engine.outputs.start()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the inference thread (after the step it is in), then every engine (its queue is
        closed, pending commands cancelled, its output thread drained and stopped)."""
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                _log.warning(f"the inference thread did not stop within {timeout:.1f} s")
        for engine in self.engines.values():
            engine.stop(timeout)

    def _loop(self) -> None:
        try:
            self._serve()
        finally:
            try:
                self.finish_in_flight()  # at stop: the last launched step is completed, not lost
            except Exception as exc:
                _log.error(f"scheduler: unexpected error at stop: {type(exc).__name__}: {exc}")

    def _serve(self) -> None:
        while not self._stop.is_set():
            # cleared BEFORE the pass: an item put during the pass sets it again, so it is never missed
            self._wake.clear()
            try:
                served = self.run_turn()
            except Exception as exc:  # run_once guards frames; a failure here must not end the thread
                _log.error(f"scheduler: unexpected error: {type(exc).__name__}: {exc}")
                served = None
            if served is None and not self._stop.is_set() and not self._run_idle():
                self.idle_waits += 1
                self._wake.wait(self.idle_wait)

    def _run_idle(self) -> bool:
        """One engine's idle work (the first that has some, in turn order); True when some ran."""
        for name in self.order:
            try:
                if self.engines[name].run_idle():
                    return True
            except Exception as exc:  # idle work must not end the thread either
                _log.error(f"scheduler: idle work of camera {name!r} failed: {type(exc).__name__}: {exc}")
        return False


__all__ = ["CameraScheduler", "IDLE_WAIT_S"]
