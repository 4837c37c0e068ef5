"""The node's ROS interface as a table: every topic it publishes or subscribes and every service it
serves, with type, QoS, the parameters that turn it on, and what it carries.

One source for ``docs/reference.md`` (``scripts/gen_reference.py``) and for the test that starts the
real node and compares its publishers, subscriptions and services, names, types and QoS, with this
table (``test/ros/test_interface_graph.py``). Nothing here imports rclpy.

Names: ``~/x`` is node-private (``/<namespace>/<node>/x``); a relative ``x`` resolves in the node's
namespace (remap it, e.g. ``image:=/camera/color/image_raw``); ``/x`` is absolute. Entries of scope
``camera`` exist once per camera: as written with one camera (``cameras`` empty), under ``~/<c>/``
and ``<c>/`` for each listed camera ``c`` otherwise. ``when`` is a Python expression over the
parameters (NodeSettings fields, plus ``several`` = cameras are listed); the entry exists when it
is true.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class Qos:
    reliable: bool = True
    transient_local: bool = False
    depth: int = 10

    def text(self) -> str:
        return (f"{'reliable' if self.reliable else 'best effort'}, "
                f"{'transient local' if self.transient_local else 'volatile'}, depth {self.depth}")


RELIABLE = Qos()
LATCHED = Qos(transient_local=True, depth=1)
SENSOR_DATA = Qos(reliable=False, depth=5)  # rclpy's qos_profile_sensor_data
TF = Qos(depth=100)
TF_STATIC = Qos(transient_local=True, depth=100)

# The image subscription's QoS follows the parameter input_qos.
INPUT_QOS: dict[str, Qos] = {"sensor_data": SENSOR_DATA, "reliable": Qos(depth=5)}


@dataclass(frozen=True)
class Endpoint:
    """One topic (kind ``publisher`` or ``subscription``) or service (kind ``service``)."""

    kind: str
    name: str
    type: str  # ROS type name, e.g. sensor_msgs/msg/Image
    description: str
    qos: Qos | str | None = None  # a profile, "input_qos" (by that parameter), None for services
    when: str = "True"  # Python expression over the parameters (see the module docstring)
    scope: str = "camera"  # camera: once per camera; node: once

    def qos_for(self, settings: Any) -> Qos | None:
        if self.qos == "input_qos":
            return INPUT_QOS[settings.input_qos]
        return self.qos  # type: ignore[return-value]

    def qos_text(self) -> str:
        if self.qos is None:
            return ""
        if self.qos == "input_qos":
            return " / ".join(f"{k}: {q.text()}" for k, q in INPUT_QOS.items()) + " (parameter input_qos)"
        return self.qos.text()  # type: ignore[union-attr]

    def present(self, settings: Any, several: bool) -> bool:
        names = dict(vars(settings), several=several)
        return bool(eval(self.when, {"__builtins__": {}}, names))  # noqa: S307 - constant expressions of this table


P, S, V = "publisher", "subscription", "service"
_TF_ON = "publish_tf or scale_source == 'odometry' or on_lost != 'continue' or (several and base_frame != '')"

ENDPOINTS: tuple[Endpoint, ...] = (
    # -- inputs
    Endpoint(S, "image", "sensor_msgs/msg/Image", "Camera images (rgb8, bgr8, mono8, Bayer, 16-bit, ...); "
             "the newest waiting frame is processed, older ones count as stale", "input_qos",
             when="input_transport == 'raw'"),
    Endpoint(S, "image/compressed", "sensor_msgs/msg/CompressedImage", "JPEG/PNG camera images", "input_qos",
             when="input_transport == 'compressed'"),
    Endpoint(S, "camera_info", "sensor_msgs/msg/CameraInfo", "Latest intrinsics and distortion (undistortion, "
             "diagnostics); never synchronised with the images", SENSOR_DATA),
    Endpoint(S, "depth", "sensor_msgs/msg/Image", "Registered depth (16UC1 mm or 32FC1 m) for the metric scale",
             SENSOR_DATA, when="scale_source == 'depth'"),
    Endpoint(S, "~/pose_prior", "geometry_msgs/msg/PoseWithCovarianceStamped", "A pose of the camera in the map "
             "frame from outside (GNSS, fiducials) at the stamp of a frame: a prior of the pose graph; refused "
             "with its reason (log, ~/status) when it does not hold", Qos(depth=10), when="loop_closure"),
    Endpoint(S, "/tf", "tf2_msgs/msg/TFMessage", "Robot transforms (camera extrinsics, odometry) via tf2_ros",
             TF, when=_TF_ON, scope="node"),
    Endpoint(S, "/tf_static", "tf2_msgs/msg/TFMessage", "Static robot transforms (the URDF) via tf2_ros",
             TF_STATIC, when=_TF_ON, scope="node"),
    # -- outputs (stamped with the input image's stamp)
    Endpoint(P, "~/status", "lingbot_map_ros/msg/Status", "One per input frame (processed or dropped) plus a "
             "1 Hz heartbeat: state, cache occupancy, latencies, counters, tracking health, scale",
             Qos(depth=20)),
    Endpoint(P, "~/frame", "lingbot_map_ros/msg/FrameInfo", "One per processed frame, after its pose: what a "
             "keyframe client needs to keep or drop it", RELIABLE),
    Endpoint(P, "~/pose", "geometry_msgs/msg/PoseStamped", "Camera optical frame in map_frame", RELIABLE,
             when="publish_pose"),
    Endpoint(P, "~/odometry", "nav_msgs/msg/Odometry", "The pose with a covariance that follows tracking health",
             RELIABLE, when="publish_odometry"),
    Endpoint(P, "~/path", "nav_msgs/msg/Path", "Trajectory (path_max_length poses, at most path_publish_rate Hz)",
             LATCHED, when="publish_path"),
    Endpoint(P, "~/points", "sensor_msgs/msg/PointCloud2", "Per-frame cloud in map_frame (x, y, z, rgb, "
             "confidence), confident points only, every point_stride-th", Qos(depth=2), when="publish_points"),
    Endpoint(P, "~/map_points", "sensor_msgs/msg/PointCloud2", "Accumulated voxel-downsampled map (at most "
             "map_publish_rate Hz, map_max_points points); with loop_closure the keyframes' points at their "
             "corrected poses", LATCHED, when="publish_map and accumulate_map"),
    Endpoint(P, "~/map_points", "sensor_msgs/msg/PointCloud2", "Several cameras: every camera's map joined in "
             "map_frame", LATCHED, when="several and publish_map and accumulate_map", scope="node"),
    Endpoint(P, "~/loop_closures", "visualization_msgs/msg/MarkerArray", "Loop closures tried: accepted "
             "(green) and refused (red) lines between the two keyframes, in the map", LATCHED, when="loop_closure"),
    Endpoint(P, "~/depth", "sensor_msgs/msg/Image", "Depth, 32FC1 in the optical frame (NaN where unknown)",
             Qos(depth=2), when="publish_depth"),
    Endpoint(P, "~/depth/camera_info", "sensor_msgs/msg/CameraInfo", "Estimated intrinsics at the depth "
             "resolution", Qos(depth=2), when="publish_depth"),
    Endpoint(P, "/diagnostics", "diagnostic_msgs/msg/DiagnosticArray", "1 Hz: state, input rate and age, "
             "cache, scale, health, pool (several cameras)", RELIABLE, scope="node"),
    Endpoint(P, "/tf", "tf2_msgs/msg/TFMessage", "The pose as TF (see tf_mode); also made when publish_tf is "
             "first set true at run time", TF, when=_TF_ON, scope="node"),
    # -- services (served between frames, in arrival order, on the helper node <node>_services)
    Endpoint(V, "~/reset", "std_srvs/srv/Trigger", "Clear the session and the cache; the next frame starts a "
             "new map"),
    Endpoint(V, "~/set_deferred_eviction", "std_srvs/srv/SetBool", "Turn deferred eviction on or off (as the "
             "parameter deferred_eviction)"),
    Endpoint(V, "~/commit_eviction", "lingbot_map_ros/srv/CommitEviction", "Keep the latest stored frame: apply "
             "its deferred evictions, release the decision hold"),
    Endpoint(V, "~/rollback_last_frame", "lingbot_map_ros/srv/RollbackFrame", "Drop the latest frame: its tokens "
             "leave the cache, its pose is forgotten"),
    Endpoint(V, "~/set_pose", "lingbot_map_ros/srv/SetPose", "The frame at the stamp (zero: the latest) is at "
             "this pose in the map: the map frame moves so that it is, the pose graph keeps it as a prior",
             when="loop_closure"),
    Endpoint(V, "~/save_map", "lingbot_map_ros/srv/SaveMap", "Write the map (PLY) and trajectory (TUM; with "
             "loop_closure the corrected one, and the front end's as trajectory_raw.tum); several cameras: every "
             "camera's", scope="node"),
    Endpoint(V, "~/save_session", "lingbot_map_ros/srv/SaveSession", "Save the keyframe journal as a session "
             "folder (needs state_directory); several cameras: every camera's", scope="node"),
    Endpoint(V, "~/load_session", "lingbot_map_ros/srv/LoadSession", "Replace the state by a saved session: "
             "later frames are posed in its map; several cameras: every camera's", scope="node"),
    # -- Nav2: occupancy grid and the managed node (docs/nav2.md); the lifecycle entries are rclpy's own,
    # served by the node itself (not the helper) from construction on
    Endpoint(P, "~/grid", "nav_msgs/msg/OccupancyGrid", "Occupancy grid of the first camera in its map frame "
             "(100 occupied, 0 free, -1 unknown; at most grid_publish_rate Hz while it changes); none while "
             "the grid is off (~/status says why)", LATCHED, when="grid", scope="node"),
    Endpoint(P, "~/transition_event", "lifecycle_msgs/msg/TransitionEvent", "Each lifecycle transition "
             "(rclpy's)", RELIABLE, when="managed", scope="node"),
    Endpoint(V, "~/change_state", "lifecycle_msgs/srv/ChangeState", "Request a lifecycle transition (configure, "
             "activate, deactivate, cleanup, shutdown); success false when refused or failed (the node logs why)",
             when="managed", scope="node"),
    Endpoint(V, "~/get_state", "lifecycle_msgs/srv/GetState", "The current lifecycle state", when="managed",
             scope="node"),
    Endpoint(V, "~/get_available_states", "lifecycle_msgs/srv/GetAvailableStates", "Every lifecycle state",
             when="managed", scope="node"),
    Endpoint(V, "~/get_available_transitions", "lifecycle_msgs/srv/GetAvailableTransitions", "The transitions "
             "allowed from the current state", when="managed", scope="node"),
    Endpoint(V, "~/get_transition_graph", "lifecycle_msgs/srv/GetAvailableTransitions", "Every transition of "
             "the state machine", when="managed", scope="node"),
)

# -- Nav2: the managed node's states (managed:=true; ros/lifecycle.py): (state, what holds in it)
LIFECYCLE_STATES: tuple[tuple[str, str], ...] = (
    ("unconfigured", "at start and after cleanup: parameters declared (and writable), nothing loaded, no topic "
     "but ~/transition_event, no service but the lifecycle's and the parameters'"),
    ("inactive", "after configure: model loaded, journals open, publishers made (silent), services answer, the TF "
     "listener fills its buffer; no image, camera_info or depth subscribed"),
    ("active", "after activate: inputs subscribed, everything published; deactivate returns to inactive keeping "
     "the map and the model's state"),
    ("finalized", "after shutdown (from any state): threads stopped, journals and files complete; the process "
     "waits for SIGINT/SIGTERM"),
)


def resolve_name(name: str, camera: str = "") -> str:
    """``name`` of a camera-scoped entry for camera ``camera`` ("" = the single camera)."""
    if not camera:
        return name
    if name.startswith("~/"):
        return f"~/{camera}/{name[2:]}"
    return f"{camera}/{name}"


def expected(settings: Mapping[str, Any], cameras: tuple[str, ...] = ()) -> list[tuple[Endpoint, str, Any]]:
    """(entry, name, camera settings) of every endpoint a node with these settings creates.

    ``settings``: {camera: NodeSettings} ("" = the single camera); a node-scoped entry exists when
    any camera's settings make it."""
    several = bool(cameras)
    out = []
    for e in ENDPOINTS:
        if e.scope == "node":
            hits = [s for s in settings.values() if e.present(s, several)]
            if hits:
                out.append((e, e.name, hits[0]))
            continue
        for camera in cameras or ("",):
            s = settings[camera]
            if e.present(s, several):
                out.append((e, resolve_name(e.name, camera), s))
    return out


__all__ = ["Qos", "Endpoint", "ENDPOINTS", "INPUT_QOS", "LIFECYCLE_STATES", "expected", "resolve_name"]
