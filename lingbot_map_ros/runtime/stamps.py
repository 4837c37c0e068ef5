"""Which frames may enter a camera's sequence by their age and stamp: ``StampGate``.

The trajectory stays monotonic: a zero stamp is let through once (with a warning: the
driver does not stamp images), a repeated or slightly older stamp is dropped, and a
stamp more than ``time_jump_threshold`` before the last one is a time jump (a bag
played again, a clock reset): ``on_time_jump=reset`` starts a new sequence with it,
``on_time_jump=drop`` drops frames until the stamps pass the last one again (or a reset).
A frame older than ``max_frame_age`` (ROS time) is dropped as stale first.

The gate only decides; the engine counts, warns and resets (``StampVerdict`` says what).
Inference thread only; no ROS, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StampVerdict:
    """What to do with one frame. ``accept`` False: drop it, count it in ``counter`` and warn with
    ``reason`` (throttled by ``kind``); ``status`` whether the reason also goes out in a status.
    ``new_sequence``: accept it as the first frame of a new sequence (``reason`` is the warning)."""

    accept: bool
    reason: str = ""
    kind: str = ""
    counter: str = ""
    status: bool = False
    new_sequence: bool = False
    time_jump: bool = False  # a time jump starts here (count it in time_jumps)
    zero_stamp: bool = False  # the image has a zero stamp (warn, throttled)


ACCEPT = StampVerdict(True)
ZERO_STAMP_WARNING = ("image with a zero stamp: its driver does not stamp images (TF, latency and the trajectory "
                      "need the capture time; repeats are dropped)")


class StampGate:
    """The stamp of the last frame taken for inference and whether the stamps are behind it."""

    def __init__(self) -> None:
        self.last_stamp = None  # builtin_interfaces/Time of the last frame taken for inference
        self.last_stamp_s: float | None = None  # the same, in seconds
        self.behind = False  # on_time_jump=drop: stamps are behind the last frame's

    def check(self, stamp_s: float, now_s: float, max_frame_age: float, time_jump_threshold: float,
              on_time_jump: str) -> StampVerdict:
        """The verdict about a frame stamped ``stamp_s`` at ROS time ``now_s`` (seconds)."""
        if max_frame_age > 0 and now_s - stamp_s > max_frame_age:
            return StampVerdict(False, f"dropped a frame older than max_frame_age={max_frame_age} s "
                                       f"(age {now_s - stamp_s:.2f} s)", "too old", "frames_dropped_stale")
        zero, last = stamp_s == 0.0, self.last_stamp_s
        if last is None or stamp_s > last:
            self.behind = False
            return StampVerdict(True, zero_stamp=zero) if zero else ACCEPT
        if stamp_s == last:
            return self._drop(f"dropped an image with the same stamp as the previous frame ({stamp_s:.9f} s): a "
                              "duplicate", "repeated stamp", zero)
        back = last - stamp_s
        if back <= time_jump_threshold:
            return self._drop(f"dropped an image {1e3 * back:.1f} ms older than the previous frame (out of order; "
                              "the trajectory stays monotonic)", "older stamp", zero)
        jump = not self.behind
        if on_time_jump == "drop":
            self.behind = True
            return StampVerdict(False, f"time jump: image stamp {stamp_s:.3f} s is {back:.3f} s before the previous "
                                       f"frame's; on_time_jump=drop: dropping frames until the stamps pass "
                                       f"{last:.3f} s (or call ~/reset)", "time jump drop", "frames_dropped_stamp",
                                status=True, time_jump=jump, zero_stamp=zero)
        self.behind = False
        return StampVerdict(True, f"time jump: image stamp {stamp_s:.3f} s is {back:.3f} s before the previous "
                                  f"frame's (more than time_jump_threshold={time_jump_threshold} s): on_time_jump="
                                  "reset, starting a new sequence", new_sequence=True, time_jump=jump,
                            zero_stamp=zero)

    @staticmethod
    def _drop(reason: str, kind: str, zero: bool) -> StampVerdict:
        return StampVerdict(False, reason, kind, "frames_dropped_stamp", status=True, zero_stamp=zero)

    def taken(self, stamp, stamp_s: float) -> None:
        """A frame with this stamp was taken for inference."""
        self.last_stamp, self.last_stamp_s = stamp, stamp_s

    def clear(self) -> None:
        """~/reset: any stamp is the first one again."""
        self.last_stamp = self.last_stamp_s = None
        self.behind = False


__all__ = ["StampGate", "StampVerdict", "ZERO_STAMP_WARNING"]
