"""A camera's ~/status messages: ``StatusReporter`` (``publish``: the sequence's state, counters,
health and scale, the cache's statistics), ``status_fields`` (the message's fields), and the
device memory it reports. No ROS; torch only when the session runs
on a GPU (imported there, lazily)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .frames import Sink, StatusFields
from .worker import CounterValues

HEARTBEAT_PERIOD = 1.0  # longest silence of ~/status


@dataclass
class Latency:
    """A frame's time in each stage (ms)."""

    preprocess: float = 0.0
    model: float = 0.0
    postprocess: float = 0.0
    publish: float = 0.0


@dataclass(frozen=True)
class Tracking:
    """What the health and the scale add to a status."""

    state: str = "initializing"
    reasons: tuple[str, ...] = ()
    lost_resets: int = 0
    scale: float = 1.0
    scale_source: str = "none"
    scale_spread: float = 0.0
    scale_converged: bool = False


def status_fields(state: int, text: str, frame_index: int, session, counters: CounterValues,
                  decision_pending: bool, tracking: Tracking, is_keyframe: bool = False,
                  latency: Latency | None = None, total_ms: float | None = None) -> StatusFields:
    """The fields of one ~/status (``total_ms``: image stamp to now, with a frame's latency)."""
    c = counters
    st = StatusFields(state=state, state_text=text, frame_index=frame_index, window_index=session.window_index,
                      is_keyframe=is_keyframe, deferred_eviction=bool(session.deferred_eviction),
                      frames_received=c.frames_received, frames_processed=c.frames_processed,
                      frames_dropped_stale=c.frames_dropped_stale, frames_dropped_invalid=c.frames_dropped_invalid,
                      frames_dropped_error=c.frames_dropped_error, frames_dropped_stamp=c.frames_dropped_stamp,
                      frames_not_localized=c.frames_not_localized,
                      time_jumps=c.time_jumps, evictions_auto_committed=c.evictions_auto_committed,
                      decision_pending=decision_pending, decisions_kept=c.decisions_kept,
                      decisions_dropped=c.decisions_dropped, decisions_timed_out=c.decisions_timed_out,
                      decisions_refused=c.decisions_refused, tracking_state=tracking.state,
                      tracking_reasons=",".join(tracking.reasons), lost_resets=tracking.lost_resets,
                      scale=tracking.scale, scale_source=tracking.scale_source,
                      scale_spread=tracking.scale_spread, scale_converged=tracking.scale_converged)
    stats = session.stats()
    if stats is not None:
        st.pending_evictions, st.stored_frames = stats.pending_evictions, stats.resident_frames
        st.temporal_index, st.scale_pages = stats.temporal_index, stats.scale_pages
        st.window_pages, st.free_pages = stats.window_pages, stats.free_pages
        st.special_tokens = stats.special_tokens
    if latency is not None:
        st.latency_preprocess_ms, st.latency_model_ms = latency.preprocess, latency.model
        st.latency_postprocess_ms, st.latency_publish_ms = latency.postprocess, latency.publish
        if total_ms is not None:
            st.latency_total_ms = total_ms
    st.gpu_memory_allocated_mb, st.gpu_memory_reserved_mb = device_memory_mb(session)
    return st


def add_loop_fields(st: StatusFields, loop) -> StatusFields:
    """The loop closer's counts (``runtime.loop_closure.LoopCloser``; None: loop closure is off)."""
    if loop is not None:
        ls = loop.stats
        st.loop_closure, st.localization = True, loop.localization
        st.loop_keyframes, st.loop_candidates = ls.keyframes, ls.candidates
        st.loop_accepted, st.loop_rejected, st.loop_optimisation_ms = ls.accepted, ls.rejected, ls.last_optimisation_ms
    return st


class StatusReporter:
    """Sends ~/status: the sequence's state and text (``runtime.sequence.Sequence``), its counters,
    the cache statistics last taken (``last_stats``, replaced as a whole: the node's diagnostics
    read it), the health and the scale. ``now``: ROS time in seconds (a frame's total latency),
    ``monotonic``: the heartbeat's clock. Inference thread."""

    def __init__(self, sink: Sink, session: Any, seq: Any, now: Callable[[], float],
                 monotonic: Callable[[], float]) -> None:
        self.sink, self.session, self.seq = sink, session, seq
        self.now, self.monotonic = now, monotonic
        self.last_stats = session.stats()
        self.last_time = -float("inf")  # monotonic time of the last status

    def refresh_stats(self) -> Any:
        """Take the session's cache statistics now (``last_stats``) and return them."""
        self.last_stats = self.session.stats()
        return self.last_stats

    def due(self) -> bool:
        """No status went out for HEARTBEAT_PERIOD."""
        return self.monotonic() - self.last_time >= HEARTBEAT_PERIOD

    def publish(self, text: str, stamp: Any, frame_index: int | None = None, is_keyframe: bool = False,
                latency: Latency | None = None, stamp_s: float | None = None) -> None:
        """One ~/status with ``text`` (``frame_index`` None: the last processed frame's);
        ``latency`` and ``stamp_s`` for a processed frame's."""
        seq = self.seq
        grid = seq.grid
        if grid is not None and grid.state.reason and grid.state.reason not in text:  # why there is no grid
            text = f"{text}; {grid.state.reason}"
        total = None if latency is None or stamp_s is None else max(0.0, (self.now() - stamp_s) * 1e3)
        st = status_fields(int(seq.state), text, seq.last_index if frame_index is None else frame_index,
                           self.session, seq.counter_values(), seq.decisions.hold is not None,
                           seq.tracking.summary(seq.anchor, seq.anchor.source_name), is_keyframe, latency, total)
        self.sink.publish_status(add_loop_fields(st, seq.loop), stamp)
        self.last_time = self.monotonic()

    def say(self, stamp: Any = None) -> None:
        """One ~/status with the sequence's own text."""
        self.publish(self.seq.text, stamp)


def device_memory_mb(session) -> tuple[float, float]:
    """(allocated, reserved) MiB of the session's CUDA device; zeros elsewhere."""
    device = getattr(session, "device", None)
    if device is None or getattr(device, "type", "cpu") != "cuda":
        return 0.0, 0.0
    import torch

    return torch.cuda.memory_allocated(device) / 2**20, torch.cuda.memory_reserved(device) / 2**20


def release_device_memory(session) -> None:
    """Give the CUDA caching allocator's free blocks back (after an inference error)."""
    device = getattr(session, "device", None)
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        import torch

        torch.cuda.empty_cache()


__all__ = ["StatusReporter", "status_fields", "Latency", "Tracking", "HEARTBEAT_PERIOD", "device_memory_mb",
           "release_device_memory"]
