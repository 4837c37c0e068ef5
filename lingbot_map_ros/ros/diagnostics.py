"""The node's /diagnostics: the clock (``ClockWatch``), the shared pool and each camera's entries
(input, output, tracking, scale, cache, intrinsics, journal, loop closure, grid), built on the
node's timer thread from values the inference thread replaces as a whole (``node_diagnostics``)."""
from __future__ import annotations

import statistics
from typing import Any

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rclpy.clock import Clock
from std_msgs.msg import Header

from lingbot_map_ros.msg import Status

from .camera_channel import ARRIVAL_WINDOW, CameraChannel
from .common import diag
from .sessions import journal_diag


def input_diag(channel: CameraChannel, label: str) -> DiagnosticStatus:
    """"<label>: input": WARN while no image came within input_timeout."""
    s, e = channel.settings, channel.engine
    c = e.seq.counter_values()
    quiet = e.seconds_since_input()
    topic = channel.image_sub.topic_name
    if quiet is None or quiet > s.input_timeout:
        level = DiagnosticStatus.WARN
        message = f"no image on {topic} " + ("yet" if quiet is None else f"for {quiet:.1f} s")
    else:
        level, message = DiagnosticStatus.OK, f"receiving images on {topic}"
    ages = channel.arrival_age_s
    values = {"topic": topic, "input rate (Hz)": f"{e.input_rate.rate():.2f}",
              "seconds since last image": "never" if quiet is None else f"{quiet:.1f}",
              "frames received": c.frames_received, "frames dropped (invalid)": c.frames_dropped_invalid,
              "frames undistorted": e.inputs.frames_undistorted,
              f"image age on arrival, median of the last {ARRIVAL_WINDOW} (ms)":
                  f"{1e3 * statistics.median(ages):.1f}" if ages else "n/a"}
    info, intrinsics = channel.camera_info, e.assembler.last_intrinsics
    if info is not None and info.k[0] > 0 and intrinsics is not None:
        K, width, _ = intrinsics
        values["camera_info fx (input px)"] = f"{info.k[0]:.1f}"
        values["estimated fx (input px)"] = f"{K[0, 0] * info.width / width:.1f}" if info.width else "n/a"
    return diag(f"{label}: input", level, message, values)


def state_diags(channel: CameraChannel, label: str) -> list[DiagnosticStatus]:
    """"<label>: output", "tracking", "scale", "cache" and "intrinsics"."""
    e = channel.engine
    seq = e.seq
    c = seq.counter_values()
    out_level = DiagnosticStatus.ERROR if int(seq.state) == Status.STATE_ERROR else DiagnosticStatus.OK
    statuses = [diag(f"{label}: output", out_level, seq.text, {
        "state": seq.state.name, "output rate (Hz)": f"{e.output_rate.rate():.2f}",
        "frames processed": c.frames_processed, "frames dropped (stale)": c.frames_dropped_stale,
        "frames dropped (error)": c.frames_dropped_error, "clouds skipped (output thread behind)": e.clouds.skipped,
        "output thread queue": e.outputs.pending()})]
    statuses.append(tracking_diag(channel, label))
    statuses.append(scale_diag(channel, label))
    if channel.engine.loop is not None:
        statuses.append(loop_diag(channel, label))
    stats = e.reporter.last_stats
    if stats is None:
        statuses.append(diag(f"{label}: cache", DiagnosticStatus.OK, "not allocated yet (no frame)", {}))
    else:
        used = stats.scale_pages + stats.window_pages
        total = used + stats.free_pages
        cache_level = DiagnosticStatus.WARN if stats.free_pages == 0 and stats.deferred else DiagnosticStatus.OK
        statuses.append(diag(f"{label}: cache", cache_level, f"{used}/{total} pages in use", {
            "occupancy (%)": f"{100.0 * used / max(total, 1):.1f}", "stored frames": stats.resident_frames,
            "scale pages": stats.scale_pages, "window pages": stats.window_pages, "free pages": stats.free_pages,
            "pending evictions": stats.pending_evictions, "deferred eviction": stats.deferred}))
    statuses.append(intrinsics_diag(channel, label))
    return statuses


def intrinsics_diag(channel: CameraChannel, label: str) -> DiagnosticStatus:
    """"<label>: intrinsics": the model's median focal lengths vs camera_info's K (input pixels), WARN
    beyond ``robot.intrinsics.WARN_FRACTION``."""
    info, focal = channel.camera_info, channel.engine.seq.focal
    if info is None:
        return diag(f"{label}: intrinsics", DiagnosticStatus.OK, "no camera_info received: nothing to compare", {})
    if len(focal) == 0:
        return diag(f"{label}: intrinsics", DiagnosticStatus.OK, "no frame processed yet", {})
    comparison = focal.compare(info.k, (info.width, info.height))
    return diag(f"{label}: intrinsics", DiagnosticStatus.WARN if comparison.warn else DiagnosticStatus.OK,
                comparison.message(), comparison.values())


def tracking_diag(channel: CameraChannel, label: str) -> DiagnosticStatus:
    """"<label>: tracking": OK tracking/initializing, WARN degraded, ERROR lost."""
    e = channel.engine
    tracking, anchor = e.seq.tracking, e.seq.anchor
    state = tracking.health.state.value
    level = {"degraded": DiagnosticStatus.WARN, "lost": DiagnosticStatus.ERROR}.get(state, DiagnosticStatus.OK)
    reasons = ", ".join(tracking.reasons)
    return diag(f"{label}: tracking", level, state + (f" ({reasons})" if reasons else ""), {
        "state": state, "reasons": reasons or "none", "on_lost": e.settings.on_lost,
        "lost resets": tracking.lost_resets, "map frame anchored to": anchor.map_alignment})


def scale_diag(channel: CameraChannel, label: str) -> DiagnosticStatus:
    """"<label>: scale": OK when none/fixed/converged, WARN while an estimate has not converged."""
    e = channel.engine
    anchor = e.seq.anchor
    kind, src = e.settings.scale_source, anchor.scale_source
    if src is None:
        return diag(f"{label}: scale", DiagnosticStatus.OK, "model units (scale_source none)", {"source": kind})
    level = DiagnosticStatus.OK if src.converged else DiagnosticStatus.WARN
    message = f"{anchor.applied_scale:.4f} m per model unit" if src.converged else "not converged: model units"
    return diag(f"{label}: scale", level, message, dict(src.as_status()))


def loop_diag(channel: CameraChannel, label: str) -> DiagnosticStatus:
    """"<label>: loop closure": the place database, candidates, verified loops, the last reason;
    WARN while relocalizing (no pose is published until the camera is found in the map)."""
    loop = channel.engine.loop
    st = loop.stats
    if loop.relocalizing:
        level, message = DiagnosticStatus.WARN, f"relocalizing: {st.last_reason or 'looking for the camera'}"
    else:
        level = DiagnosticStatus.OK
        message = f"{st.accepted} loop(s) closed of {st.candidates} candidate(s)" + \
            (f"; {loop.localization}" if loop.localization else "")
    values = {"keyframes": st.keyframes, "candidates": st.candidates, "accepted": st.accepted,
              "rejected": st.rejected, "last decision": st.last_reason or "none yet",
              "last optimisation (ms)": f"{st.last_optimisation_ms:.1f}", "localization": loop.localization or "n/a",
              "corrections": len(loop.corrections)}
    return diag(f"{label}: loop closure", level, message, values)


class ClockWatch:
    """Whether ROS time moves: with use_sim_time, /clock may never come or stall (``problem``)."""

    def __init__(self, node, steady: Clock) -> None:
        self.node, self.steady = node, steady
        self._seen: tuple[int, float] | None = None  # (ROS time ns, steady s) when it last moved

    def problem(self) -> str:
        """'no clock: ...' when use_sim_time is on and ROS time has not moved for 2 s, else ''."""
        if not self.node.get_parameter("use_sim_time").value:
            self._seen = None
            return ""
        now_ns, steady = self.node.get_clock().now().nanoseconds, self.steady.now().nanoseconds * 1e-9
        if self._seen is None or now_ns != self._seen[0]:
            self._seen = (now_ns, steady)
        stalled = steady - self._seen[1]
        if now_ns == 0 or stalled >= 2.0:
            return ("no clock: use_sim_time is true and /clock " +
                    ("was never received" if now_ns == 0 else f"has not advanced for {stalled:.0f} s"))
        return ""


def node_diagnostics(node: Any, clock: str) -> DiagnosticArray:
    """/diagnostics of a configured ``node`` (``LingBotMapNode``): the clock (``clock``: its problem or
    ""), the shared pool (several cameras) and every camera's entries (the node's one camera under the
    node's name, a listed camera's under "<node>: <camera>")."""
    name = node.get_fully_qualified_name()
    statuses = [diag(f"{name}: clock", DiagnosticStatus.WARN if clock else DiagnosticStatus.OK,
                     clock or "ok", {"use_sim_time": node.get_parameter("use_sim_time").value})]
    if node.sessions.storage is not None:  # a K/V storage several cameras share
        statuses.append(node.cameras.pool_diag(name, node.scheduler))
    for camera, channel in node.channels.items():
        label = f"{name}: {camera}" if camera else name
        statuses.append(input_diag(channel, label))
        statuses += state_diags(channel, label)
        journal = journal_diag(label, channel.engine)
        if journal is not None:
            statuses.append(journal)
        statuses.append(node.cameras.map_frame_diag(label, camera, channel.outputs.placement().frame,
                                                    node.scheduler.served.get(camera, 0)))
        if node.grid is not None and node.grid.channel is channel:
            statuses.append(node.grid.diag(label))
    return DiagnosticArray(header=Header(stamp=node.get_clock().now().to_msg()), status=statuses)


__all__ = ["ClockWatch", "node_diagnostics", "input_diag", "state_diags", "intrinsics_diag", "tracking_diag", "scale_diag", "loop_diag"]
