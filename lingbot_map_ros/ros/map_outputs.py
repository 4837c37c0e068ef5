"""Every camera's accumulated map over ROS: ~/[<c>/]map_points and ~/save_map.

- ``MapTopics``: on the node's map timer (``map_publish_rate``), each camera's own map on
  ~/[<c>/]map_points (in its frame, scaled as its engine publishes) and, with named cameras,
  every camera whose map is in ``map_frame`` now on ~/map_points; each only when someone
  listens and something changed (the map, the camera's output transform or its placement).
- ``MapSaving``: the ~/save_map service. Every camera's snapshot is taken on the inference
  thread, then the files are written on the service thread, so a slow disk holds up neither
  frames nor the other services. The unnamed camera writes map.ply and trajectory.tum; named
  cameras one map.ply for the cameras in ``map_frame`` (map_<c>.ply for a camera in its own
  frame) and trajectory_<c>.tum each (``runtime.multi_save``). With ``grid`` the occupancy grid
  follows as map.yaml + map-<id>.pgm in the same folder (``grid_outputs``), or the answer says why
  not.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
from rclpy.node import Node
from sensor_msgs.msg import PointCloud2
from std_msgs.msg import Header

from ..io.map_save import MAP_FILE, MapSaveError
from ..robot.map_offset import OutputTransform
from ..runtime.multi_map import transform_points, transform_poses
from ..runtime.multi_save import CameraMap, SavedMaps, save_camera_maps
from ..runtime.params import NodeSettings
from ..runtime.saving import SaveError, write_map_files
from .camera_channel import CameraChannel
from .common import qos_profile, stamp_seconds
from .conversions import make_pointcloud2


def camera_map(channel: CameraChannel) -> tuple[Any, Callable[[], tuple[np.ndarray, np.ndarray]]]:
    """(version, snapshot) of the map a camera publishes: with loop closure, its keyframes' points
    at their corrected poses (``LoopCloser.map``: rebuilt after every optimisation); else the
    accumulated map of its frames."""
    loop = channel.engine.loop
    if loop is not None:
        points, colors, version = loop.map
        return ("loop", version), lambda: (points, colors)
    seq_map = channel.engine.seq.map

    def snapshot():
        p, c, _ = seq_map.snapshot()
        return p, c
    return seq_map.version, snapshot


class MapTopics:
    """~/[<c>/]map_points of every camera and (named cameras with ``publish_map`` and
    ``accumulate_map``) the combined ~/map_points of ``node``; ``publish`` runs on its timer."""

    def __init__(self, node: Node, channels: dict[str, CameraChannel], settings: NodeSettings) -> None:
        self._channels = channels
        self._map_frame = settings.map_frame
        self.combined = None  # named cameras: every camera's map in map_frame
        if settings.cameras and settings.publish_map and settings.accumulate_map:
            self.combined = node.create_publisher(PointCloud2, "~/map_points", qos_profile(latched=True, depth=1))
        self._version: dict[str, Any] = {}  # camera ("" = the combined map) -> what it last published

    def any_published(self) -> bool:
        """Whether any camera publishes its map (else the node needs no map timer)."""
        return any(c.outputs.map_points is not None for c in self._channels.values())

    def publish(self) -> None:
        """~/[<c>/]map_points (each camera's own map, in its frame) and, with named cameras,
        ~/map_points (every camera whose map is in map_frame now), each when someone listens and
        something changed."""
        combined = self.combined is not None and self.combined.get_subscription_count() > 0
        parts, key = [], []
        for name, channel in self._channels.items():
            own = channel.outputs.map_points
            seq = channel.engine.seq
            if own is None or seq.map is None:
                continue
            wanted = own.get_subscription_count() > 0
            if channel.engine.loop is not None:  # its keyframes' map is rendered only while someone looks
                channel.engine.loop.map_wanted = wanted or combined
            if not (wanted or combined):
                continue
            output = seq.anchor.output  # how the camera publishes now (replaced as a whole)
            placed = channel.outputs.placement(output)
            version, snapshot = camera_map(channel)
            state = (version, output, (placed.version, placed.frame))
            if wanted and self._version.get(name) != state:
                points, colors = snapshot()
                channel.outputs.publish_map(points, colors, output)  # the map is kept in model units
                self._version[name] = state
            if combined and placed.frame == self._map_frame:
                parts.append(channel)
                key.append((name, state))
        if combined and parts and self._version.get("") != key:
            self._publish_combined(parts)
            self._version[""] = key

    def _publish_combined(self, channels: list[CameraChannel]) -> None:
        points, colors, stamp = [], [], None
        for channel in channels:
            seq = channel.engine.seq
            output = seq.anchor.output
            p, c = camera_map(channel)[1]()
            placed = channel.outputs.placement(output)
            points.append(transform_points(placed.transform, output.points(p)).astype(np.float32))
            colors.append(c)
            latest = channel.outputs.latest_stamp
            if stamp is None or stamp_seconds(latest) > stamp_seconds(stamp):
                stamp = latest
        header = Header(stamp=stamp, frame_id=self._map_frame)
        self.combined.publish(make_pointcloud2(np.concatenate(points), np.concatenate(colors), None, header))


class MapSaving:
    """The ~/save_map service body (``save``, on a service thread; one save writes at a time).

    ``settings`` returns the node's settings now (``service_timeout`` may change at run time)."""

    def __init__(self, channels: dict[str, CameraChannel], settings: Callable[[], NodeSettings], log,
                 grid: Any = None) -> None:
        self._channels = channels
        self._settings = settings
        self._log = log
        self._grid = grid  # ros.grid_outputs.GridOutput: its files go next to the map's (None: no grid)
        self._lock = threading.Lock()  # one save writes at a time

    def save(self, request, response):
        """Every camera's snapshot (on the inference thread), then the files (this thread)."""
        snapshots, error = {}, ""
        for name, channel in self._channels.items():
            ok, snapshot, error = channel.run("save_map", channel.engine.commands.save_snapshot)
            if not ok:
                error = f"camera {name}: {error}" if name else error
                break
            snapshots[name] = snapshot
        saved, grid_note = None, ""
        s = self._settings()
        timeout = s.service_timeout
        if error:  # a camera's snapshot failed: nothing written
            pass
        elif not self._lock.acquire(timeout=timeout):
            error = f"another ~/save_map is still writing after {timeout:.1f} s; not saved"
        else:
            try:
                saved = self._write(snapshots, request.directory, s)
                if self._grid is not None:  # the map_server files after the pair, in the same folder
                    grid_note = "; " + self._grid.save_beside(next(iter(saved.maps.values())).parent)
            except (SaveError, MapSaveError) as exc:
                error = str(exc)
            finally:
                self._lock.release()
        response.success = saved is not None
        if saved is None:
            response.message = error
        else:
            first = next(iter(self._channels))
            response.ply_path = str(saved.maps.get(MAP_FILE, next(iter(saved.maps.values()))))
            response.trajectory_path = str(saved.trajectories.get(first, next(iter(saved.trajectories.values()))))
            files = [str(p) for p in list(saved.maps.values()) + list(saved.trajectories.values())]
            notes = "; ".join(f"camera {c} not saved: {why}" for c, why in saved.skipped.items())
            listed = ", ".join(files) if s.cameras else " and ".join(files)
            response.message = f"wrote {listed}" + (f" ({notes})" if notes else "") + grid_note
        self._log.info(f"~/save_map: {response.message}")
        return response

    def _write(self, snapshots: dict, directory: str, s: NodeSettings) -> SavedMaps:
        """The cameras' snapshots -> files (service thread): scaled, placed in their map frames."""
        if "" in snapshots:  # the node's one camera: one crash-safe PLY + TUM pair
            ply, tum = write_map_files(snapshots[""], directory, s.output_directory, s.service_timeout)
            return SavedMaps("", {MAP_FILE: ply}, {"": tum}, {})
        maps = []
        for name, snap in snapshots.items():
            try:
                points, colors, poses = snap.output(s.service_timeout)
            except SaveError as exc:
                raise SaveError(f"camera {name}: {exc}") from None
            placed = self._channels[name].outputs.placement(OutputTransform(snap.scale, snap.offset))
            maps.append(CameraMap(name, placed.frame, snap.stamps, transform_poses(placed.transform, poses),
                                  transform_points(placed.transform, points).astype(np.float32), colors))
        return save_camera_maps(directory, s.output_directory, maps, s.map_frame)
