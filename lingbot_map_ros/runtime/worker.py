"""Thread plumbing of the node, free of rclpy and torch (unit-tested without a graph).

- ``WorkQueue``: what the inference thread consumes: a depth-1 latest-frame slot
  (a new frame replaces a waiting one, counted as stale) plus a FIFO of commands. Items
  leave in arrival order, so a command sent after a frame runs after that frame and
  before the next. Several queues may wake one consumer: ``add_listener`` registers a
  ``threading.Event`` that every put and close sets (the multi-camera scheduler waits on
  one event for all cameras). The queue counts what arrives (``Intake``: images received,
  replaced while waiting, refused before they could be queued); it is the one writer of
  those counts, the producer's thread.
- ``Command``: a function to run on the inference thread; the caller waits on it with
  a timeout and may cancel it while it has not started.
- ``Throttle``: at most one message per kind per period, with a count of the
  suppressed ones.
- ``RateMeter``: events per second over a sliding window.
- ``Counters``: the cumulative frame counters of ``Status`` that the inference thread
  writes (``runtime.sequence.Sequence.count`` is their one writer); readable from any thread.
"""
from __future__ import annotations

import re
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class Command(Generic[T]):
    """A function to run once on the inference thread.

    States: pending -> running -> done, or pending -> cancelled. ``result`` /
    ``error`` hold the outcome once done.
    """

    PENDING, RUNNING, DONE, CANCELLED = "pending", "running", "done", "cancelled"

    def __init__(self, name: str, fn: Callable[[], T]) -> None:
        self.name = name
        self._fn = fn
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.state = self.PENDING
        self.result: T | None = None
        self.error: BaseException | None = None
        self.seq = 0

    def run(self) -> None:
        with self._lock:
            if self.state != self.PENDING:
                return
            self.state = self.RUNNING
        try:
            self.result = self._fn()
        except Exception as exc:  # handed to the waiter
            self.error = exc
        finally:
            with self._lock:
                self.state = self.DONE
            self._done.set()

    def wait(self, timeout: float) -> bool:
        """True when the command ran (successfully or not) within ``timeout`` seconds."""
        return self._done.wait(timeout)

    def cancel(self) -> bool:
        """Prevent a pending command from running; False if it already started."""
        with self._lock:
            if self.state == self.PENDING:
                self.state = self.CANCELLED
                self._done.set()
                return True
            return self.state == self.CANCELLED


@dataclass(frozen=True)
class Intake:
    """What a ``WorkQueue`` counted of the images offered to it since its last ``clear_intake``."""

    received: int = 0  # images offered (queued, or refused before: ``reject``)
    replaced: int = 0  # queued frames replaced by a newer one before the consumer took them (stale)
    rejected: int = 0  # images that could not be converted (``reject``)


class WorkQueue:
    """Latest-frame slot + command FIFO, consumed by one thread in arrival order."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._intake = Intake()
        self._frame: Any = None
        self._frame_seq = 0
        self._commands: deque[Command] = deque()
        self._seq = 0
        self._closed = False
        self._listeners: list[threading.Event] = []

    def add_listener(self, event: threading.Event) -> None:
        """Also set ``event`` whenever an item is put or the queue closes (another thread may wait
        on it for several queues at once, then poll each with ``get(0)``)."""
        with self._cond:
            self._listeners.append(event)

    def _wake(self) -> None:
        """Under ``_cond``: wake the consumer blocked in ``get`` and every listener."""
        self._cond.notify()
        for event in self._listeners:
            event.set()

    def put_frame(self, frame: Any) -> Any:
        """Offer a frame; returns the frame it replaced (now stale, counted) or None."""
        with self._cond:
            old = self._frame
            self._seq += 1
            self._frame, self._frame_seq = frame, self._seq
            i = self._intake
            self._intake = Intake(i.received + 1, i.replaced + (old is not None), i.rejected)
            self._wake()
            return old

    def reject(self) -> None:
        """Count an image that arrived but could not become a frame (it is received and rejected)."""
        with self._cond:
            i = self._intake
            self._intake = Intake(i.received + 1, i.replaced, i.rejected + 1)

    def intake(self) -> Intake:
        with self._cond:
            return self._intake

    def clear_intake(self) -> Intake:
        """Start counting again; returns the counts until now (the consumer folds them into its own)."""
        with self._cond:
            counted, self._intake = self._intake, Intake()
            return counted

    def put_command(self, command: Command) -> Command:
        with self._cond:
            self._seq += 1
            command.seq = self._seq
            self._commands.append(command)
            self._wake()
        return command

    def get(self, timeout: float, frames: bool = True) -> Any:
        """The oldest waiting item (a frame or a Command), or None after ``timeout`` s or when closed.

        ``frames=False`` takes commands only (a waiting frame stays in its slot, still replaceable)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._frame is None or not frames) and not self._commands and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            if self._closed:
                return None
            if self._commands and (not frames or self._frame is None or self._commands[0].seq < self._frame_seq):
                return self._commands.popleft()
            frame, self._frame = self._frame, None
            return frame

    def close(self) -> list[Command]:
        """Wake the consumer for good; returns the commands that will never run (cancelled)."""
        with self._cond:
            self._closed = True
            left = list(self._commands)
            self._commands.clear()
            self._frame = None
            self._cond.notify_all()
            for event in self._listeners:
                event.set()
        for c in left:
            c.cancel()
        return left

    def discard_frame(self) -> Any:
        """Empty the latest-frame slot (commands stay queued); the frame it held, or None."""
        with self._cond:
            frame, self._frame = self._frame, None
            return frame

    def take_frame(self) -> Any:
        """The waiting frame when no command is queued (commands keep their turn before frames),
        taken from the slot; None otherwise (nothing taken) or when closed."""
        with self._cond:
            if self._closed or self._frame is None or self._commands:
                return None
            frame, self._frame = self._frame, None
            return frame

    def pending_frame(self) -> bool:
        with self._cond:
            return self._frame is not None


def message_kind(message: str) -> str:
    """A throttling key for a message: its text with numbers and quoted values blanked,
    so 'image of 640x0' and 'image of 320x0' are one kind (long hexadecimal numbers such as
    object addresses too)."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'?'", message)
    text = re.sub(r"\b0x[0-9a-fA-F]{6,}", "#", text)
    return re.sub(r"\d+(\.\d+)?", "#", text)[:120]


class Throttle:
    """Allow one message per kind every ``period`` seconds; count what was held back."""

    def __init__(self, period: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.period = period
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, kind: str) -> int | None:
        """None when a message of ``kind`` should be held back, else the number held back
        since the last one that went out."""
        now = self._clock()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.period:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return None
            self._last[kind] = now
            return self._suppressed.pop(kind, 0)

    def emit(self, log: Callable[[str], None], message: str, kind: str | None = None) -> bool:
        """Log ``message`` through ``log`` unless its kind was logged within the period."""
        held = self(kind if kind is not None else message_kind(message))
        if held is None:
            return False
        log(message + (f" ({held} similar message(s) suppressed)" if held else ""))
        return True


class RateMeter:
    """Events per second over the last ``window`` seconds."""

    def __init__(self, window: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self._clock = clock
        self._times: deque[float] = deque()
        self._lock = threading.Lock()

    def tick(self) -> None:
        with self._lock:
            self._times.append(self._clock())
            self._trim()

    def rate(self) -> float:
        with self._lock:
            self._trim()
            if len(self._times) < 2:
                return 0.0
            span = self._clock() - self._times[0]
            return (len(self._times) - 1) / span if span > 0 else 0.0

    def last(self) -> float | None:
        with self._lock:
            return self._times[-1] if self._times else None

    def clear(self) -> None:
        with self._lock:
            self._times.clear()

    def _trim(self) -> None:
        cutoff = self._clock() - self.window
        while self._times and self._times[0] < cutoff:
            self._times.popleft()


@dataclass
class CounterValues:
    frames_received: int = 0
    frames_processed: int = 0
    frames_dropped_stale: int = 0
    frames_dropped_invalid: int = 0
    frames_dropped_error: int = 0
    frames_dropped_stamp: int = 0  # repeated, zero or backwards stamps (see on_time_jump)
    frames_not_localized: int = 0  # looked for in the map while relocalizing, not posed
    time_jumps: int = 0
    evictions_auto_committed: int = 0  # deferred evictions committed by deferred_eviction_timeout
    decisions_kept: int = 0  # decision hold: frames kept by a client's ~/commit_eviction
    decisions_dropped: int = 0  # ... dropped by a client's ~/rollback_last_frame
    decisions_timed_out: int = 0  # ... decided by keyframe_decision_default
    decisions_refused: int = 0  # decisions naming another frame, or one already decided


class Counters:
    """Cumulative frame counters (names as in Status.msg): one writer, any reader (a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = CounterValues()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self._values, name, getattr(self._values, name) + n)

    def snapshot(self) -> CounterValues:
        with self._lock:
            return CounterValues(**{f.name: getattr(self._values, f.name) for f in fields(CounterValues)})

    def reset(self) -> None:
        with self._lock:
            self._values = CounterValues()

    def restore(self, values: dict) -> None:
        """Take ``values`` (a journaled snapshot: name -> count; unknown names ignored)."""
        known = {f.name for f in fields(CounterValues)}
        with self._lock:
            self._values = CounterValues(**{k: int(v) for k, v in values.items() if k in known})


__all__ = ["Command", "WorkQueue", "Intake", "Throttle", "RateMeter", "Counters", "CounterValues", "message_kind"]
