"""The node's cameras as one set: one map and one pool (``CameraSet``).

Every node has a camera set: the one camera of a node without the parameter ``cameras`` (named
"", today's names) is a set of one; with ``cameras`` each listed camera is a member.

- One map: ``runtime.multi_map.MapAligner`` joins every camera's map to the first camera's
  ``map_frame`` through the TF extrinsics ``base_frame -> <camera frame>`` (read from the node's
  ``tf_tools.SharedTf``, and the odometry ``odom_frame -> base_frame`` between two cameras'
  stamps when ``odom_frame`` is set); a camera that cannot join (no ``base_frame``, an
  extrinsic missing) publishes in ``<map_frame>_<camera>``. The other cameras' TF goes under
  the first camera's map. A set of one has nothing to join: its camera is ``map_frame``.
- One pool: the shared K/V storage's status (``stream.multi.CameraSessions.pool_status``; none
  for one camera, whose pool is its own), read on the inference thread at most every
  ``POOL_REFRESH_S`` for ~/<c>/status and shown in /diagnostics with the scheduler's pipelining
  and batching counters.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from diagnostic_msgs.msg import DiagnosticStatus

from ..runtime.multi_map import MapAligner, base_motion_from_odometry, own_map_frame
from ..runtime.params import NodeSettings
from ..runtime.scheduler import CameraScheduler
from ..stream.multi import CameraSessions, PoolStatus
from .common import diag
from .tf_tools import SharedTf

POOL_REFRESH_S = 0.5  # s; the shared pool's status is read at most this often


def make_aligner(settings: NodeSettings, names: list[str], tf: SharedTf, log) -> MapAligner:
    """The cameras' ``MapAligner``: extrinsics (and odometry) from ``tf``, started at once when
    ``base_frame`` is set and there are cameras to join (the URDF's static transforms arrive while
    the model loads)."""
    s = settings
    lookup = tf if s.base_frame and len(names) > 1 else None
    if lookup is not None:
        lookup.start()
    base_motion = None
    if lookup is not None and s.odom_frame:
        def base_motion(t_ref: float, t_cam: float):
            a = lookup.matrix(s.odom_frame, s.base_frame, t_ref)
            b = lookup.matrix(s.odom_frame, s.base_frame, t_cam)
            return None if a is None or b is None else base_motion_from_odometry(a, b)
    extrinsic = (lambda frame: lookup.matrix(s.base_frame, frame)) if lookup is not None else (lambda frame: None)
    return MapAligner(names, s.map_frame, s.base_frame, extrinsic, base_motion,
                      scale_frames=s.stream.num_scale_frames, warn=log.warning, info=log.info)


class PoolMonitor:
    """The shared pool's status: read on the inference thread (``status``, at most every
    ``POOL_REFRESH_S`` once the storage exists), shown in /diagnostics (``diag``)."""

    def __init__(self, warn: Callable[[str], None]) -> None:
        self._warn = warn
        self._sessions: CameraSessions | None = None
        self._status: PoolStatus | None = None  # written by the inference thread, read by /diagnostics
        self._at = -float("inf")

    def attach(self, sessions: CameraSessions) -> None:
        """The storage is built (the model is loaded): from now on ``status`` reads it."""
        self._sessions = sessions

    def status(self) -> PoolStatus | None:
        """The pool's status, cached (inference thread): it may show the pool as it was up to
        ``POOL_REFRESH_S`` ago; None before the storage exists, and for one camera (no shared pool)."""
        now = time.monotonic()
        cached = self._status
        stale = cached is None or cached.capacity_tokens == 0 or now - self._at >= POOL_REFRESH_S
        if self._sessions is not None and stale:
            self._at = now
            try:
                self._status = self._sessions.pool_status()
            except Exception as exc:  # a status read must never cost a frame
                self._warn(f"cannot read the pool status: {type(exc).__name__}: {exc}")
        return self._status

    def diag(self, name: str, scheduler: CameraScheduler, pipelining: bool, batching: bool) -> DiagnosticStatus:
        """The "<name>: pool" entry of /diagnostics (the last status read, the scheduler's counters)."""
        pool = self._status
        if pool is None:
            return diag(f"{name}: pool", DiagnosticStatus.OK, "not read yet (no frame)", {})
        values = {"capacity (tokens)": pool.capacity_tokens, "leased (tokens)": pool.leased_tokens,
                  "size (MiB)": f"{pool.nbytes / 2**20:.1f}"}
        for camera, cp in pool.cameras.items():
            values[f"{camera}: pages / used / tokens per page"] = f"{cp.pages} / {cp.used_pages} / {cp.page_tokens}"
        if pipelining:  # written by the inference thread
            values["steps overlapped with the next camera's"] = scheduler.overlapped
        if batching and self._sessions is not None:  # counters written by the inference thread (plain ints)
            values["batched turns"] = scheduler.batches
            for camera, inner in self._sessions.inner.items():
                values[f"{camera}: steps in a batched trunk"] = inner.batched_steps
        used = 100.0 * pool.leased_tokens / pool.capacity_tokens if pool.capacity_tokens else 0.0
        return diag(f"{name}: pool", DiagnosticStatus.OK,
                    f"{pool.leased_tokens}/{pool.capacity_tokens} tokens leased ({used:.0f} %), "
                    f"{pool.nbytes / 2**20:.1f} MiB", values)


class CameraSet:
    """The node's cameras (``names``: [""] for the node's one camera) as one map and one pool (see
    the module docstring)."""

    def __init__(self, settings: NodeSettings, names: list[str], tf: SharedTf, log) -> None:
        self.settings = settings  # the start-up values it uses (cameras, frames, scale_source) are read-only
        self.names = list(names)
        self._tf = tf
        self._log = log
        self.reference = self.names[0]  # defines map_frame
        self.aligner = make_aligner(settings, self.names, tf, log)
        self.pool = PoolMonitor(log.warning)

    def tf_settings(self, camera: str, settings: NodeSettings) -> NodeSettings:
        """The settings ``camera`` publishes TF with: the reference camera's own; the others' camera
        frame under the map (one map -> odom transform is the reference camera's)."""
        return settings if camera == self.reference else replace(settings, tf_mode="map_to_camera")

    def announce(self) -> None:
        """Start-up lines: how the scheduler runs the cameras, how their maps are joined."""
        s, log = self.settings, self._log
        if self.reference == "":  # the node's one camera
            if s.camera_batching:
                log.warning("camera_batching is true but cameras is empty: with one camera there is nothing to "
                            "batch (the parameter has no effect)")
            return
        if s.camera_batching:
            log.info("camera_batching: the waiting frames of several cameras run in one batched "
                     "step where their CUDA graphs allow (bf16, FlashInfer), else in turn")
        log.info(f"camera_pipelining: {'on' if s.camera_pipelining else 'off'} (a camera's step "
                 f"{'is launched before' if s.camera_pipelining else 'waits for'} the previous "
                 "camera's results)")
        own = ", ".join(own_map_frame(s.map_frame, c) for c in s.cameras)
        if not s.base_frame:
            log.warning(f"cameras {', '.join(s.cameras)}: base_frame is empty, so their extrinsics are unknown: each "
                        f"camera publishes in its own map frame ({own}); set base_frame (and the URDF's camera "
                        f"transforms in TF) for one map {s.map_frame}")
            return
        if self._tf.buffer is None:
            log.warning(f"tf2_ros is not importable: the camera extrinsics cannot be read, each camera keeps its "
                        f"own map frame ({own})")
        if s.scale_source == "none":
            log.warning("scale_source none: the cameras' maps are joined through the extrinsics in metres while "
                        "each camera's poses are in its own model units (metre-like, not metric): the cameras' "
                        "maps agree only as far as those units are metres; a metric scale source joins them better")
        log.info(f"one map: camera {s.cameras[0]} defines {s.map_frame}; the other cameras join it through TF "
                 f"{s.base_frame} -> <camera frame> once both cameras have poses (until then: their own "
                 f"{s.map_frame}_<camera>)")

    def pool_diag(self, name: str, scheduler: CameraScheduler) -> DiagnosticStatus:
        return self.pool.diag(name, scheduler, self.settings.camera_pipelining, self.settings.camera_batching)

    def map_frame_diag(self, label: str, camera: str, frame: str, served: int) -> DiagnosticStatus:
        """The "<label>: map frame" entry: WARN while ``camera`` waits to join the one map."""
        waiting = self.aligner.enabled and not self.aligner.aligned(camera)  # own frames by configuration: OK
        return diag(f"{label}: map frame", DiagnosticStatus.WARN if waiting else DiagnosticStatus.OK,
                    self.aligner.describe(camera), {"frame": frame, "items run by the scheduler": served})
