"""TF output of the node: the transform maths (pure numpy, tested) and the broadcaster.

Conventions (REP 105): every ``T_a_b`` is a 4x4 rigid transform mapping points of frame
``b`` into frame ``a`` (the TF ``a -> b``, ``a`` the parent); translations are in the
model's units (metre-like, not guaranteed metric).

The map frame (``map_frame``) follows REP 103: x forward, y left, z up, with its origin
at the FIRST camera of the sequence (``conversions.OPTICAL_TO_REP103``: map x = the
first camera's optical z, y = -optical x, z = -optical y). A level first camera gives a
map with z up; a tilted one a map tilted the same way. The node estimates ``T_map_cam``,
the pose of the camera's OPTICAL frame (the image's frame_id, or ``camera_frame``).

Modes (parameter ``tf_mode``); exactly one transform is published per frame, stamped
with the image's stamp:

- ``map_to_odom`` (robot with odometry): ``map -> odom_frame`` with
  ``T_map_odom = T_map_cam · T_cam_base · inv(T_odom_base(stamp))``, so that the chain
  ``map -> odom -> base_frame`` puts the base where the model sees it. ``T_cam_base`` is
  the camera extrinsic read from TF (camera frame -> base_frame, the URDF's static
  transforms, latest value); ``T_odom_base`` is the robot's odometry at the image stamp
  (a frame whose stamp has no odometry yet is skipped, with a throttled warning).
- ``map_to_base`` (robot without odometry): ``map -> base_frame`` with
  ``T_map_base = T_map_cam · T_cam_base``.
- ``map_to_camera`` (no robot): ``map -> camera_tf_frame`` with ``T_map_cam`` itself.
  The child defaults to ``<camera optical frame>_lingbot``: the camera frame keeps its
  own parent (a URDF's), it is never given a second one. With ``loop_closure`` (REP 105),
  two transforms instead: ``odom_frame -> camera_tf_frame`` is the stream's own pose
  (continuous) and ``map -> odom_frame`` the correction (``T_map_cam · inv(T_odom_cam)``:
  the identity until the first loop or pose from outside, then it jumps with each).
- ``auto``: ``base_frame`` empty -> ``map_to_camera``. ``base_frame`` set ->
  ``map_to_odom`` as soon as ``odom_frame -> base_frame`` is in TF; until then (after a
  grace of ``AUTO_ODOM_GRACE_S`` from the first frame with the extrinsic known)
  ``map_to_base``. Once ``map_to_odom`` is chosen it stays: odometry that goes missing
  is warned about, the node never flips back silently (restart it to choose again).

Waiting and refusing (throttled warnings, nothing published):

- when a mode needs the extrinsic and ``<camera frame> -> <base_frame>`` is not in TF
  ("waiting for TF cam -> base (the camera extrinsic) ...");
- when the child frame already has a parent other than ``map_frame`` in TF (it would get
  two parents): e.g. ``map_to_base`` on a robot whose odometry publishes
  ``odom -> base_link`` (use ``map_to_odom``), or ``camera_tf_frame`` naming a URDF frame.

Image stamps that go back by more than ``time_jump_threshold`` (a bag played in a loop)
clear the tf2 buffer's dynamic transforms (tf2 ignores data older than its newest by more
than its 10 s cache, so odometry of the new pass would never get in); the static ones
(the URDF) stay, and so does the chosen mode.

``TfOutput`` reads ``self.settings`` on every publish (the node may replace it while
running, e.g. ``publish_tf`` set at run time) and creates its tf2_ros broadcaster and
listener only when it first needs them (at construction when ``publish_tf`` is on then,
so that the listener fills its buffer while the model loads). Without tf2_ros a plain
``/tf`` publisher (tf2_msgs) serves ``map_to_camera`` only, without the parent check.

The broadcaster, buffer and listener live in a ``SharedTf``: one per ``TfOutput`` by
default (one camera), or one for the whole node (several cameras: every camera's
``TfOutput`` and the alignment's extrinsic look-ups use it, so one listener parses
``/tf``). It is created lazily the same way: by its first user that needs it. With a
shared buffer a time jump clears it once for all cameras: a camera whose stamps go back
after another camera cleared the buffer since its own previous frame leaves it as it is.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..geometry import quaternion_to_matrix
from ..robot.map_offset import invert_rigid
from ..runtime.worker import Throttle

MODES = ("map_to_odom", "map_to_base", "map_to_camera")
CAMERA_CHILD_SUFFIX = "_lingbot"
AUTO_ODOM_GRACE_S = 2.0  # auto waits this long for odom -> base before it settles for map_to_base
PARENT_CHECK_PERIOD_S = 1.0  # the TF tree's parents are re-read at most this often
WARN_PERIOD_S = 5.0


# ------------------------------------------------------------------ maths
def transform_to_matrix(transform: Any) -> np.ndarray:
    """4x4 ``T_parent_child`` from a ``geometry_msgs/Transform`` (or ``TransformStamped``)."""
    t = getattr(transform, "transform", transform)
    T = np.eye(4)
    q = t.rotation
    T[:3, :3] = quaternion_to_matrix(np.array([q.x, q.y, q.z, q.w], dtype=np.float64))
    T[:3, 3] = (t.translation.x, t.translation.y, t.translation.z)
    return T


def map_to_base(T_map_cam: np.ndarray, T_cam_base: np.ndarray | None = None) -> np.ndarray:
    """``T_map_base = T_map_cam · T_cam_base`` (identity extrinsic when None)."""
    T_map_cam = np.asarray(T_map_cam, dtype=np.float64)
    return T_map_cam if T_cam_base is None else T_map_cam @ np.asarray(T_cam_base, dtype=np.float64)


def map_to_odom(T_map_cam: np.ndarray, T_odom_base: np.ndarray, T_cam_base: np.ndarray | None = None) -> np.ndarray:
    """``T_map_odom = T_map_base · inv(T_odom_base)``: the correction that makes the external
    odometry chain ``map -> odom -> base`` agree with the model's pose of the base."""
    return map_to_base(T_map_cam, T_cam_base) @ invert_rigid(T_odom_base)


def compose(mode: str, T_map_cam: np.ndarray, T_cam_base: np.ndarray | None = None,
            T_odom_base: np.ndarray | None = None) -> np.ndarray:
    """The transform published in ``mode`` (one of ``MODES``): ``T_map_odom``, ``T_map_base``
    or ``T_map_cam``. ``T_cam_base`` None = the camera is the base; ``T_odom_base`` is
    required for ``map_to_odom``."""
    if mode == "map_to_odom":
        if T_odom_base is None:
            raise ValueError("map_to_odom needs T_odom_base")
        return map_to_odom(T_map_cam, T_odom_base, T_cam_base)
    if mode == "map_to_base":
        return map_to_base(T_map_cam, T_cam_base)
    if mode == "map_to_camera":
        return np.asarray(T_map_cam, dtype=np.float64)
    raise ValueError(f"unknown TF mode {mode!r} (one of {', '.join(MODES)})")


# ------------------------------------------------------------------ choices
@dataclass(frozen=True)
class TfEdge:
    """What a mode publishes: ``parent -> child``, and which look-ups it needs."""

    mode: str
    parent: str
    child: str
    needs_extrinsic: bool  # camera frame -> base_frame
    needs_odom: bool  # odom_frame -> base_frame at the image stamp


def camera_child_frame(camera_tf_frame: str, camera_frame: str) -> str:
    """Child of ``map_to_camera``: ``camera_tf_frame``, or ``<camera_frame>_lingbot`` when empty."""
    return camera_tf_frame or f"{camera_frame}{CAMERA_CHILD_SUFFIX}"


def edge_for(mode: str, settings: Any, camera_frame: str) -> TfEdge:
    """The ``TfEdge`` of a resolved ``mode`` given the frame parameters in ``settings``."""
    s = settings
    if mode == "map_to_camera":
        return TfEdge(mode, s.map_frame, camera_child_frame(s.camera_tf_frame, camera_frame), False, False)
    needs_extrinsic = s.base_frame != camera_frame
    if mode == "map_to_base":
        return TfEdge(mode, s.map_frame, s.base_frame, needs_extrinsic, False)
    if mode == "map_to_odom":
        return TfEdge(mode, s.map_frame, s.odom_frame, needs_extrinsic, True)
    raise ValueError(f"unknown TF mode {mode!r}")


def choose_mode(tf_mode: str, base_frame: str, odom_available: bool, current: str | None,
                waited_s: float, grace_s: float = AUTO_ODOM_GRACE_S) -> str | None:
    """The mode to publish in: ``tf_mode`` itself unless it is ``auto`` (see the module
    docstring). ``current`` is the mode chosen before (None at first); ``waited_s`` how long
    auto has waited for odometry. None = auto is still waiting (publish nothing yet)."""
    if tf_mode != "auto":
        return tf_mode
    if not base_frame:
        return "map_to_camera"
    if current == "map_to_odom" or odom_available:
        return "map_to_odom"
    if current == "map_to_base" or waited_s >= grace_s:
        return "map_to_base"
    return None


def parents_from_yaml(text: str) -> dict[str, str]:
    """``{child: parent}`` from tf2's ``all_frames_as_yaml()`` (``<frame>: `` lines followed by
    indented ``parent: '<frame>'`` lines); no YAML library needed."""
    parents: dict[str, str] = {}
    frame = None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith(":"):
            frame = line.rstrip()[:-1].strip()
        elif frame is not None and line.strip().startswith("parent:"):
            parents[frame] = line.split(":", 1)[1].strip().strip("'\"")
    return parents


# ------------------------------------------------------------------ output
class LookupFailed(RuntimeError):
    """A transform is not in TF (yet); ``kind`` groups the throttled warnings."""

    def __init__(self, message: str, kind: str = "lookup") -> None:
        super().__init__(message)
        self.kind = kind


class SharedTf:
    """A node's TF machinery: one broadcaster and one tf2_ros buffer with its listener, made on
    the first ``start`` (any thread; once) and shared by every ``TfOutput`` given it and by
    ``matrix`` look-ups. Without tf2_ros a plain ``/tf`` publisher (tf2_msgs) and no buffer.

    ``clears`` counts ``clear`` calls: a user compares it with the value it saw at its previous
    frame to know whether another user cleared the buffer in between."""

    def __init__(self, node) -> None:
        self._node = node
        self._lock = threading.Lock()
        self.started = False
        self.backend = "none"  # tf2_ros | tf2_msgs | none, once started
        self.send: Callable[[Any], Any] | None = None  # publishes one TransformStamped
        self.buffer = None  # tf2_ros.Buffer
        self.listener = None  # tf2_ros.TransformListener (subscribes to /tf and /tf_static)
        self.broadcaster = None
        self.clears = 0

    def start(self) -> None:
        """Create the broadcaster and the listener, once (the listener's subscriptions are made on
        the calling thread: call it from the executor thread where it matters)."""
        if self.started:
            return
        with self._lock:
            if self.started:
                return
            self._create()
            self.started = True

    def _create(self) -> None:
        try:
            import tf2_ros

            self.broadcaster = tf2_ros.TransformBroadcaster(self._node)
            self.send = self.broadcaster.sendTransform
            self.buffer = tf2_ros.Buffer()
            self.listener = tf2_ros.TransformListener(self.buffer, self._node)
            self.backend = "tf2_ros"
        except ImportError:
            try:
                from rclpy.qos import QoSProfile
                from tf2_msgs.msg import TFMessage

                pub = self._node.create_publisher(TFMessage, "/tf", QoSProfile(depth=100))
                self.send = lambda transform: pub.publish(TFMessage(transforms=[transform]))
                self.backend = "tf2_msgs"
            except ImportError:
                pass

    def clear(self) -> None:
        """Forget the buffer's dynamic transforms (the static ones stay) and count the clear."""
        if self.buffer is not None:
            self.buffer.clear()
        self.clears += 1

    def matrix(self, target: str, source: str, stamp_s: float | None = None) -> np.ndarray | None:
        """``T_target_source`` [4, 4] (latest, or at ``stamp_s`` seconds), None when not in the buffer
        (or there is none: not started, no tf2_ros). Never waits."""
        if self.buffer is None:
            return None
        from rclpy.time import Time

        try:
            when = Time() if stamp_s is None else Time(nanoseconds=int(round(stamp_s * 1e9)))
            return transform_to_matrix(self.buffer.lookup_transform(target, source, when))
        except Exception:  # tf2 raises several lookup/extrapolation exception types
            return None


class TfOutput:
    """Publishes the node's TF according to ``tf_mode`` (see the module docstring).

    ``publish`` runs on the inference thread; ``settings`` may be replaced by another
    thread at any time (it is read once per call). ``shared``: the node's ``SharedTf``
    (several cameras); None = one of its own."""

    def __init__(self, node, settings, warn: Callable[[str], Any], info: Callable[[str], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic, shared: SharedTf | None = None) -> None:
        self.settings = settings
        self.mode: str | None = None  # the resolved mode, once chosen
        self.shared = shared if shared is not None else SharedTf(node)
        self._node = node
        self._warn = warn
        self._info = info if info is not None else node.get_logger().info
        self._clock = clock
        self._throttle = Throttle(WARN_PERIOD_S, clock)
        self._warned: set[str] = set()
        self._auto_since: float | None = None
        self._parents: dict[str, str] = {}
        self._parents_at = -float("inf")
        self._parents_clears = 0  # shared.clears when the parents were read
        self._last_stamp_s: float | None = None
        self._clears_seen = 0  # shared.clears at the previous frame
        if settings.publish_tf:
            self.start()

    @property
    def backend(self) -> str:
        """tf2_ros | tf2_msgs | none (not started, or neither importable)."""
        return self.shared.backend

    @property
    def _buffer(self):
        return self.shared.buffer

    @property
    def _send(self) -> Callable[[Any], Any] | None:
        return self.shared.send

    # -------------------------------------------------------------- public
    def publish(self, T_map_cam: np.ndarray, stamp: Any, camera_frame: str, T_front: np.ndarray | None = None) -> bool:
        """Publish the TF of one frame (``T_map_cam`` [4, 4], the image's stamp and optical
        frame; ``T_front``: the stream's own pose when loop closure corrects it, see the module
        docstring). Returns whether a transform was sent."""
        s = self.settings
        if not s.publish_tf:
            return False
        self.start()
        self._check_time_jump(stamp, getattr(s, "time_jump_threshold", 1.0))
        if self._send is None:
            self._warn_once("tf-none", "publish_tf is on but neither tf2_ros nor tf2_msgs is importable: "
                                       "no TF is published (poses still go to ~/pose and ~/odometry)")
            return False
        base_needed = s.tf_mode in ("map_to_odom", "map_to_base") or (s.tf_mode == "auto" and s.base_frame)
        if self._buffer is None and base_needed:
            self._warn_once("tf-lookup", f"tf_mode {s.tf_mode} with base_frame {s.base_frame!r} needs transforms "
                                         "from TF (tf2_ros), which is not importable here: no TF is published")
            return False
        try:
            T_cam_base = self._extrinsic(s.base_frame, camera_frame) if base_needed else None
            mode = self._resolve_mode(s, camera_frame)
            if mode is None:
                return False
            edge = edge_for(mode, s, camera_frame)
            loop_edges = mode == "map_to_camera" and s.loop_closure
            if loop_edges and T_front is None:  # no correction yet: map -> odom is the identity
                T_front = T_map_cam
            if loop_edges:  # map -> odom (the correction) -> camera (the stream's pose)
                edge = TfEdge(mode, s.odom_frame, edge.child, False, False)
                if not self._child_free(TfEdge(mode, s.map_frame, s.odom_frame, False, False)):
                    return False
            if not self._child_free(edge):
                return False
            T_odom_base = self._odometry(s, stamp) if edge.needs_odom else None
        except LookupFailed as exc:
            self._throttle.emit(self._warn, str(exc), kind=exc.kind)
            return False
        from std_msgs.msg import Header

        from .conversions import transform_stamped

        if loop_edges:
            T_map_odom = np.asarray(T_map_cam, np.float64) @ invert_rigid(np.asarray(T_front, np.float64))
            self._send(transform_stamped(T_map_odom, Header(stamp=stamp, frame_id=s.map_frame), s.odom_frame))
            self._send(transform_stamped(T_front, Header(stamp=stamp, frame_id=edge.parent), edge.child))
            return True
        T = compose(mode, T_map_cam, T_cam_base, T_odom_base)
        self._send(transform_stamped(T, Header(stamp=stamp, frame_id=edge.parent), edge.child))
        return True

    def clear(self) -> None:
        """Forget the buffered transforms (e.g. after the clock jumped back); the mode stays. With a
        shared buffer every user's dynamic transforms go."""
        self.shared.clear()
        self._clears_seen = self.shared.clears
        self._parents, self._parents_at = {}, -float("inf")

    def start(self) -> None:
        """Create the broadcaster and the listener (once per ``SharedTf``; ``publish`` calls it). Call
        it from the executor thread when ``publish_tf`` is switched on at run time, so that the
        listener's subscriptions are not created on the inference thread."""
        self.shared.start()

    # -------------------------------------------------------------- steps
    def _check_time_jump(self, stamp: Any, threshold_s: float) -> None:
        stamp_s = stamp.sec + stamp.nanosec * 1e-9
        last, self._last_stamp_s = self._last_stamp_s, stamp_s
        seen, self._clears_seen = self._clears_seen, self.shared.clears
        if last is not None and stamp_s < last - threshold_s and self._buffer is not None:
            if self.shared.clears != seen:  # another camera cleared the shared buffer after our previous frame
                return
            self.clear()
            self._info(f"TF: the image stamps went back {last - stamp_s:.1f} s (a bag played in a loop?): cleared "
                       "the TF buffer's dynamic transforms (static ones stay)")

    def _extrinsic(self, base_frame: str, camera_frame: str) -> np.ndarray | None:
        """``T_cam_base`` (latest; None when the camera frame is the base)."""
        if base_frame == camera_frame:
            return None
        try:
            return self._lookup(camera_frame, base_frame, None)
        except LookupFailed as exc:
            raise LookupFailed(f"waiting for TF {camera_frame} -> {base_frame} (the camera extrinsic, normally a "
                               f"static transform of the robot's URDF): no TF is published until it is available "
                               f"({exc})", kind="extrinsic") from None

    def _odometry(self, s: Any, stamp: Any) -> np.ndarray:
        """``T_odom_base`` at the image stamp."""
        try:
            return self._lookup(s.odom_frame, s.base_frame, stamp)
        except LookupFailed as exc:
            stay = " (tf_mode auto stays in map_to_odom once chosen)" if s.tf_mode == "auto" else ""
            raise LookupFailed(f"no TF {s.odom_frame} -> {s.base_frame} (odometry) at the image stamp "
                               f"{stamp.sec}.{stamp.nanosec:09d}: {s.map_frame} -> {s.odom_frame} is not updated "
                               f"for this frame{stay} ({exc})", kind="odometry") from None

    def _resolve_mode(self, s: Any, camera_frame: str) -> str | None:
        odom_available = False
        waited = 0.0
        if s.tf_mode == "auto" and s.base_frame and self.mode != "map_to_odom":
            odom_available = self._odom_available(s.odom_frame, s.base_frame)
            now = self._clock()
            if self._auto_since is None:
                self._auto_since = now
            waited = now - self._auto_since
        mode = choose_mode(s.tf_mode, s.base_frame, odom_available, self.mode, waited)
        if mode is not None and mode != self.mode:
            self._announce(s, mode, camera_frame)
            self.mode = mode
        return mode

    def _announce(self, s: Any, mode: str, camera_frame: str) -> None:
        edge = edge_for(mode, s, camera_frame)
        why = ""
        if s.tf_mode == "auto":
            why = {"map_to_camera": " (auto: base_frame is empty)",
                   "map_to_odom": f" (auto: {s.odom_frame} -> {s.base_frame} is in TF; stays in this mode)",
                   "map_to_base": f" (auto: no {s.odom_frame} -> {s.base_frame} in TF after {AUTO_ODOM_GRACE_S:.0f} s;"
                                  f" switches to map_to_odom when it appears)"}[mode]
        self._info(f"TF: publishing {edge.parent} -> {edge.child}, tf_mode {mode}{why}")

    def _odom_available(self, odom_frame: str, base_frame: str) -> bool:
        from rclpy.time import Time

        if self._parent_of(base_frame) == odom_frame:
            return True
        try:
            return bool(self._buffer.can_transform(odom_frame, base_frame, Time()))
        except Exception:  # tf2 raises several types for unknown frames
            return False

    def _child_free(self, edge: TfEdge) -> bool:
        """False (with a throttled warning) when ``edge.child`` has a parent other than ours in TF."""
        parent = self._parent_of(edge.child)
        if self._buffer is None and edge.mode == "map_to_camera":
            self._warn_once("tf-parents", "tf2_ros is not importable: cannot check that "
                                          f"{edge.child} has no other parent in TF")
        if parent is None or parent == edge.parent:
            return True
        hint = {"map_to_camera": "set camera_tf_frame to a frame of its own (empty = <camera frame>_lingbot)",
                "map_to_base": "on a robot with odometry use tf_mode map_to_odom (or auto)",
                "map_to_odom": "another node publishes the odom frame's parent (a second localiser?)"}[edge.mode]
        self._throttle.emit(self._warn, f"not publishing {edge.parent} -> {edge.child}: {edge.child} already has "
                                        f"the parent {parent} in TF and a frame can have only one; {hint}",
                            kind=f"parent:{edge.child}")
        return False

    def _parent_of(self, frame: str) -> str | None:
        if self._buffer is None:
            return None
        now = self._clock()
        if now - self._parents_at >= PARENT_CHECK_PERIOD_S or self._parents_clears != self.shared.clears:
            self._parents = parents_from_yaml(self._buffer.all_frames_as_yaml())
            self._parents_at, self._parents_clears = now, self.shared.clears
        return self._parents.get(frame)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self._warn(message)

    def camera_pose(self, stamp: Any, camera_frame: str) -> np.ndarray | None:
        """``T_odom_cam`` [4, 4] (metres): the pose of ``camera_frame`` in ``odom_frame`` at the image
        ``stamp`` (odometry chain plus the URDF's extrinsic), for the odometry scale source and the
        alignment of a sequence started by on_lost=reset; None while the buffer lacks it (or there
        is no tf2_ros buffer). Never waits (any thread: the tf2 buffer is thread-safe)."""
        if self._buffer is None:
            return None
        try:
            return self._lookup(self.settings.odom_frame, camera_frame, stamp)
        except LookupFailed:
            return None

    def camera_position(self, stamp: Any, camera_frame: str) -> np.ndarray | None:
        """The optical centre of ``camera_frame`` in ``odom_frame`` [3] (metres) at the image
        ``stamp`` (``camera_pose``'s translation); None while the buffer lacks it."""
        pose = self.camera_pose(stamp, camera_frame)
        return None if pose is None else pose[:3, 3].copy()

    def _lookup(self, target: str, source: str, stamp: Any) -> np.ndarray:
        """``T_target_source`` from the buffer (latest when ``stamp`` is None), no waiting."""
        from rclpy.time import Time

        try:
            when = Time() if stamp is None else Time.from_msg(stamp)
            return transform_to_matrix(self._buffer.lookup_transform(target, source, when))
        except Exception as exc:  # tf2 raises several lookup/extrapolation exception types
            raise LookupFailed(f"{type(exc).__name__}: {exc}") from None


__all__ = ["TfOutput", "SharedTf", "TfEdge", "MODES", "transform_to_matrix", "invert_rigid", "map_to_base", "map_to_odom",
           "compose", "choose_mode", "edge_for", "camera_child_frame", "parents_from_yaml", "LookupFailed"]
