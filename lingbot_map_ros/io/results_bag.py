"""The replay's results as a rosbag2 (MCAP storage) that RViz (``ros2 bag play``) or
Foxglove plays back: the node's outputs, without ROS, through ``rosbags``' writer and
its ROS 2 type store.

Topics (``namespace`` = the node's, ``/lingbot_map``), every message stamped with its
input frame's stamp (and logged at that time):

- ``/tf`` (tf2_msgs/TFMessage): ``map_frame`` -> the camera's optical frame;
- ``<ns>/odometry`` (nav_msgs/Odometry): the same pose, child = the optical frame;
- ``<ns>/path`` (nav_msgs/Path): the last ``path_max_length`` poses, written at most
  ``path_rate`` times a second of input time and once at the end;
- ``<ns>/points`` (sensor_msgs/PointCloud2): the frame's points in the map frame,
  fields x, y, z (float32), rgb (float32 holding 0x00RRGGBB), confidence (float32):
  20 bytes a point, the node's layout;
- ``<ns>/depth`` (sensor_msgs/Image, 32FC1, model units, NaN where not > 0) and
  ``<ns>/depth/camera_info`` (pinhole, no distortion), in the optical frame.

Frames: the model's world ``W`` (the first camera, OpenCV axes x right, y down, z
forward) is published as the REP-103 map frame ``M`` (x forward, y left, z up, same
origin) as the node does: ``T_M_C = OPTICAL_TO_REP103 @ c2w`` and points
``p_M = R(OPTICAL_TO_REP103) p_W``. Units are the model's.

The bag is written into a hidden folder next to ``path`` and renamed to ``path`` when
complete (``close``); ``abort`` closes it as a valid bag named ``<path>.partial`` (when the
MCAP cannot be finished, e.g. on a full disk, it is still moved there, incomplete:
``mcap recover`` reads what it holds, and ``abort`` raises). An existing ``path`` is refused
unless ``overwrite``; then it is replaced only once the new bag is complete.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from ..geometry import matrix_to_quaternion, rotate
from .atomic import fsync_directory
from .results import partial_path, replace_folder, restore_folder

OPTICAL_TO_REP103 = np.array([[0.0, 0.0, 1.0, 0.0],  # map x (forward) = optical z
                              [-1.0, 0.0, 0.0, 0.0],  # map y (left) = -optical x
                              [0.0, -1.0, 0.0, 0.0],  # map z (up) = -optical y
                              [0.0, 0.0, 0.0, 1.0]])
"""``T_M_W``: points of the model's world (optical axes) expressed in the REP-103 map frame."""
OPTICAL_TO_REP103.setflags(write=False)

CLOUD_DTYPE = np.dtype({"names": ["x", "y", "z", "rgb", "confidence"],
                        "formats": ["<f4", "<f4", "<f4", "<u4", "<f4"],  # rgb: a bit pattern declared FLOAT32
                        "offsets": [0, 4, 8, 12, 16], "itemsize": 20})
_FLOAT32 = 7  # sensor_msgs/PointField.FLOAT32

TOPIC_TYPES = {  # suffix (after the namespace; "/tf" is absolute) -> message type
    "/tf": "tf2_msgs/msg/TFMessage",
    "odometry": "nav_msgs/msg/Odometry",
    "path": "nav_msgs/msg/Path",
    "points": "sensor_msgs/msg/PointCloud2",
    "depth": "sensor_msgs/msg/Image",
    "depth/camera_info": "sensor_msgs/msg/CameraInfo",
}


def pose_in_map(c2w: np.ndarray) -> np.ndarray:
    """[4, 4] ``T_M_C`` (float64) of the camera's optical frame from the model's ``c2w``."""
    return OPTICAL_TO_REP103 @ np.asarray(c2w, dtype=np.float64)


def points_in_map(points: np.ndarray) -> np.ndarray:
    """[N, 3] points of the model's world -> the REP-103 map frame (float32)."""
    return rotate(np.asarray(points, dtype=np.float32), OPTICAL_TO_REP103[:3, :3].astype(np.float32))


class _PoseRing:
    """The last ``capacity`` poses of the path as numpy rows (72 bytes a pose, allocated once)."""

    def __init__(self, capacity: int) -> None:
        self._stamps = np.zeros(capacity, np.int64)
        self._rows = np.zeros((capacity, 7))  # x, y, z, qx, qy, qz, qw in the map frame
        self._next = self.size = 0

    def append(self, stamp_ns: int, row: np.ndarray) -> None:
        self._stamps[self._next], self._rows[self._next] = stamp_ns, row
        self._next = (self._next + 1) % len(self._stamps)
        self.size = min(self.size + 1, len(self._stamps))

    def items(self):
        """(stamp ns, row) oldest first."""
        order = np.arange(self._next - self.size, self._next) % len(self._stamps)
        return zip(self._stamps[order], self._rows[order])


class ResultsBagWriter:
    """Writes one frame's results at a time (see the module docstring)."""

    def __init__(self, path: str | Path, namespace: str = "/lingbot_map", map_frame: str = "map",
                 path_rate: float = 2.0, path_max_length: int = 5000, overwrite: bool = False) -> None:
        from rosbags.rosbag2 import StoragePlugin, Writer
        from rosbags.typesys import Stores, get_typestore

        self.path, self.overwrite = Path(path), overwrite
        if os.path.lexists(self.path) and not overwrite:
            raise FileExistsError(f"{self.path} exists already (a bag is not overwritten without overwrite)")
        self._work = self.path.parent / f".{self.path.name}.writing"
        if self._work.exists():
            shutil.rmtree(self._work)  # left by a run that was killed
        self._work.mkdir(parents=True)
        self._store = get_typestore(Stores.ROS2_KILTED)
        self._t = self._store.types
        self._writer = Writer(self._work / self.path.name, version=9, storage_plugin=StoragePlugin.MCAP)
        self._writer.open()
        ns = "/" + namespace.strip("/") if namespace.strip("/") else ""
        self.topics = {suffix: suffix if suffix.startswith("/") else f"{ns}/{suffix}" for suffix in TOPIC_TYPES}
        self._connections = {suffix: self._writer.add_connection(self.topics[suffix], msgtype, typestore=self._store)
                             for suffix, msgtype in TOPIC_TYPES.items()}
        self.map_frame = map_frame
        self._path_period = int(1e9 / path_rate) if path_rate > 0 else None
        self._path = _PoseRing(path_max_length)
        self._last_path: int | None = None
        self._last_stamp: int | None = None
        self._closed: bool | BaseException | None = None  # True, or the error of the failed close
        self.count = 0

    # ------------------------------------------------------------------ messages
    def _header(self, stamp_ns: int, frame_id: str):
        t = self._t
        sec, nanosec = divmod(int(stamp_ns), 1_000_000_000)
        return t["std_msgs/msg/Header"](stamp=t["builtin_interfaces/msg/Time"](sec=sec, nanosec=nanosec),
                                         frame_id=frame_id)

    def _pose(self, T: np.ndarray):
        return self._pose_msg(np.concatenate([T[:3, 3], matrix_to_quaternion(T[:3, :3])]))

    def _pose_msg(self, row: np.ndarray):
        """geometry_msgs/Pose of ``row`` = (x, y, z, qx, qy, qz, qw)."""
        t = self._t
        x, y, z, qx, qy, qz, qw = (float(v) for v in row)
        return t["geometry_msgs/msg/Pose"](position=t["geometry_msgs/msg/Point"](x=x, y=y, z=z),
                                           orientation=t["geometry_msgs/msg/Quaternion"](x=qx, y=qy, z=qz, w=qw))

    def _write(self, suffix: str, stamp_ns: int, msg) -> None:
        data = self._store.serialize_cdr(msg, TOPIC_TYPES[suffix])
        self._writer.write(self._connections[suffix], int(stamp_ns), data)

    def _transform(self, T: np.ndarray, stamp_ns: int, child: str):
        t = self._t
        pose = self._pose(T)
        p = pose.position
        return t["geometry_msgs/msg/TransformStamped"](
            header=self._header(stamp_ns, self.map_frame), child_frame_id=child,
            transform=t["geometry_msgs/msg/Transform"](
                translation=t["geometry_msgs/msg/Vector3"](x=p.x, y=p.y, z=p.z), rotation=pose.orientation))

    def _odometry(self, T: np.ndarray, stamp_ns: int, child: str):
        t = self._t
        zero = np.zeros(36)
        twist = t["geometry_msgs/msg/Twist"](linear=t["geometry_msgs/msg/Vector3"](x=0.0, y=0.0, z=0.0),
                                             angular=t["geometry_msgs/msg/Vector3"](x=0.0, y=0.0, z=0.0))
        return t["nav_msgs/msg/Odometry"](
            header=self._header(stamp_ns, self.map_frame), child_frame_id=child,
            pose=t["geometry_msgs/msg/PoseWithCovariance"](pose=self._pose(T), covariance=zero),
            twist=t["geometry_msgs/msg/TwistWithCovariance"](twist=twist, covariance=zero.copy()))

    def _cloud(self, points: np.ndarray, colors: np.ndarray, confidence: np.ndarray, stamp_ns: int):
        t = self._t
        n = points.shape[0]
        cloud = np.empty(n, CLOUD_DTYPE)
        cloud["x"], cloud["y"], cloud["z"] = points[:, 0], points[:, 1], points[:, 2]
        rgb = colors.astype(np.uint32)
        cloud["rgb"] = (rgb[:, 0] << 16) | (rgb[:, 1] << 8) | rgb[:, 2]
        cloud["confidence"] = confidence
        fields = [t["sensor_msgs/msg/PointField"](name=name, offset=CLOUD_DTYPE.fields[name][1], datatype=_FLOAT32,
                                                  count=1) for name in CLOUD_DTYPE.names]
        return t["sensor_msgs/msg/PointCloud2"](
            header=self._header(stamp_ns, self.map_frame), height=1, width=n, fields=fields, is_bigendian=False,
            point_step=CLOUD_DTYPE.itemsize, row_step=CLOUD_DTYPE.itemsize * n,
            data=cloud.view(np.uint8).reshape(-1), is_dense=bool(np.isfinite(points).all()))

    def _depth(self, depth: np.ndarray, stamp_ns: int, frame: str):
        arr = np.where(depth > 0, depth, np.nan).astype("<f4")
        h, w = arr.shape
        return self._t["sensor_msgs/msg/Image"](
            header=self._header(stamp_ns, frame), height=h, width=w, encoding="32FC1", is_bigendian=0, step=w * 4,
            data=arr.view(np.uint8).reshape(-1))

    def _camera_info(self, K: np.ndarray, width: int, height: int, stamp_ns: int, frame: str):
        t = self._t
        k = np.asarray(K, dtype=np.float64)
        p = np.zeros((3, 4))
        p[:, :3] = k
        roi = t["sensor_msgs/msg/RegionOfInterest"](x_offset=0, y_offset=0, height=0, width=0, do_rectify=False)
        return t["sensor_msgs/msg/CameraInfo"](
            header=self._header(stamp_ns, frame), height=int(height), width=int(width), distortion_model="plumb_bob",
            d=np.zeros(5), k=k.reshape(-1), r=np.eye(3).reshape(-1), p=p.reshape(-1), binning_x=0, binning_y=0,
            roi=roi)

    def _path_msg(self, stamp_ns: int):
        stamped = self._t["geometry_msgs/msg/PoseStamped"]
        poses = [stamped(header=self._header(int(s), self.map_frame), pose=self._pose_msg(row))
                 for s, row in self._path.items()]
        return self._t["nav_msgs/msg/Path"](header=self._header(stamp_ns, self.map_frame), poses=poses)

    # ------------------------------------------------------------------ frames
    def add(self, stamp_ns: int, camera_frame: str, c2w: np.ndarray, intrinsics: np.ndarray,
            size: tuple[int, int], points: np.ndarray | None = None, colors: np.ndarray | None = None,
            confidence: np.ndarray | None = None, depth: np.ndarray | None = None) -> None:
        """One frame's results.

        Args:
            stamp_ns: the input frame's stamp (ns since the epoch, or since the video's start).
            camera_frame: the camera's optical frame id.
            c2w: [4, 4] camera-to-world in the model's world (OpenCV axes).
            intrinsics: [3, 3] pixels at the model resolution ``size`` = (H, W).
            points: [N, 3] selected points in the model's world (converted to the map frame here),
                with ``colors`` [N, 3] uint8 RGB and ``confidence`` [N]; None = no cloud message.
            depth: [H, W] z-depth (model units); None = no depth and camera_info messages.
        """
        T = pose_in_map(c2w)
        if not np.isfinite(T).all():
            return  # a non-finite pose has no message (the node drops it too)
        stamp_ns = max(0, int(stamp_ns))
        self._write("/tf", stamp_ns, self._t["tf2_msgs/msg/TFMessage"](
            transforms=[self._transform(T, stamp_ns, camera_frame)]))
        self._write("odometry", stamp_ns, self._odometry(T, stamp_ns, camera_frame))
        self._path.append(stamp_ns, np.concatenate([T[:3, 3], matrix_to_quaternion(T[:3, :3])]))
        if self._path_period is not None and (self._last_path is None
                                              or stamp_ns - self._last_path >= self._path_period):
            self._write("path", stamp_ns, self._path_msg(stamp_ns))
            self._last_path = stamp_ns
        if points is not None:
            self._write("points", stamp_ns, self._cloud(points_in_map(points), colors, confidence, stamp_ns))
        if depth is not None:
            height, width = size
            self._write("depth", stamp_ns, self._depth(depth, stamp_ns, camera_frame))
            self._write("depth/camera_info", stamp_ns,
                        self._camera_info(intrinsics, width, height, stamp_ns, camera_frame))
        self._last_stamp = stamp_ns
        self.count += 1

    def _close_writer(self) -> None:
        """Write the last path message, close the MCAP and fsync it (once; a failure is remembered)."""
        if self._closed is not None:
            if isinstance(self._closed, BaseException):
                raise self._closed
            return
        try:
            if self._last_stamp is not None and self._last_path != self._last_stamp:
                self._write("path", self._last_stamp, self._path_msg(self._last_stamp))  # the whole path at the end
            self._writer.close()
            for f in (self._work / self.path.name).iterdir():
                with open(f, "rb") as handle:
                    os.fsync(handle.fileno())
        except BaseException as exc:
            self._closed = exc
            raise
        self._closed = True

    def close(self) -> Path:
        """Finish the bag and give it its name (an existing bag is replaced only with ``overwrite``,
        and only now); returns it. On an error the bag stays in the hidden folder for ``abort``."""
        self._close_writer()
        inner = self._work / self.path.name
        aside = replace_folder(inner, self.path, self.overwrite)
        try:
            fsync_directory(self.path.parent)
        except BaseException:
            restore_folder(self.path, inner, aside)
            raise
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)  # the bag this one replaced
        self._work.rmdir()
        return self.path

    def abort(self) -> Path:
        """Finish what there is as ``<path>.partial`` (a valid bag); returns that path. When the bag
        cannot be finished it is moved there all the same, incomplete, and the error is raised."""
        final = partial_path(self.path)
        inner = self._work / self.path.name
        error = None
        try:
            self._close_writer()
        except Exception as exc:  # a full disk: what was written stays readable by `mcap recover`
            error = exc
        if inner.exists():
            if final.exists():
                shutil.rmtree(final)  # an earlier run's partial bag
            os.replace(inner, final)
            _remove_folder(self._work)
            fsync_directory(final.parent)
        if error is not None:
            raise error
        return final

    def leftovers(self) -> list[Path]:
        """What this writer may have left on disk when ``abort`` failed."""
        return [partial_path(self.path), self._work]


def _remove_folder(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass


__all__ = ["ResultsBagWriter", "OPTICAL_TO_REP103", "CLOUD_DTYPE", "TOPIC_TYPES", "pose_in_map", "points_in_map"]
