"""The occupancy grid over ROS: ~/grid, its /diagnostics entry and its map_server files.

``GridOutput`` serves the node's one grid (``runtime.grid.GridMap``) in ``map_frame``, the first
camera's map: every camera's sequence feeds it (``attach_grid``: a ``SequenceGrid`` each, fed on
the camera's output thread) with the camera extrinsic read from the node's TF buffer
(``tf_tools.SharedTf``: ``<camera optical frame> -> base_frame``, the URDF's static transforms);
a listed camera's frames are placed through its map alignment (``runtime.multi_map.MapAligner``)
and wait in its history until its map has joined ``map_frame``.

- ~/grid (nav_msgs/OccupancyGrid, latched: transient local, depth 1) in the camera's map frame,
  published by the node's timer (``grid_publish_rate``) when the grid changed and someone
  listens; ``info.origin`` is the lower-left corner of cell (0, 0) on the floor with the map's
  heading (``GroundReference.aligned_with_map``), ``data`` row-major from it (100 occupied,
  0 free, -1 unknown). Nothing is published while the grid is off (~/status says why).
- ~/save_map: ``save_beside`` writes ``map.yaml`` + ``map-<save id>.pgm`` (``io.map_server``,
  crash-safe, the yaml last) next to the saved PLY, or says why not.
"""
from __future__ import annotations

import array
from pathlib import Path
from typing import Any

import numpy as np
from diagnostic_msgs.msg import DiagnosticStatus
from geometry_msgs.msg import Point, Pose, Quaternion
from nav_msgs.msg import MapMetaData, OccupancyGrid
from rclpy.node import Node
from std_msgs.msg import Header

from ..io.map_server import MapFilesError, save_map_files
from ..robot.occupancy import GridSnapshot
from ..runtime.grid import GridMap, GroundFromBase, Place, SequenceGrid, grid_config
from ..runtime.multi_map import MapAligner
from ..runtime.params import NodeSettings
from .camera_channel import CameraChannel
from .common import diag, qos_profile
from .tf_tools import SharedTf


def occupancy_grid_msg(snap: GridSnapshot, header: Header) -> OccupancyGrid:
    """``snap`` as an OccupancyGrid in ``header``'s frame (the grid's map frame), stamped with it."""
    x, y, z = (float(v) for v in snap.origin_position)
    qx, qy, qz, qw = (float(v) for v in snap.origin_orientation)
    info = MapMetaData(map_load_time=header.stamp, resolution=float(snap.resolution), width=int(snap.width),
                       height=int(snap.height),
                       origin=Pose(position=Point(x=x, y=y, z=z), orientation=Quaternion(x=qx, y=qy, z=qz, w=qw)))
    msg = OccupancyGrid(header=header, info=info)
    msg.data = array.array("b", np.ascontiguousarray(snap.data, np.int8).tobytes())
    return msg


def camera_extrinsic(tf: SharedTf, base_frame: str):
    """camera optical frame -> ``T_cam_base`` [4, 4] from ``tf`` (latest; None while it lacks it)."""
    return lambda camera_frame: tf.matrix(camera_frame, base_frame)


def joined_to(aligner: MapAligner, camera: str, map_frame: str) -> Place:
    """How ``camera``'s published frames reach ``map_frame`` (``runtime.grid.Place``): the alignment's
    ``T_map_mapc`` once its map is joined to the first camera's, else why not."""
    def place(transform):
        placed = aligner.placement(camera, cam_output=transform)
        if placed.frame != map_frame:
            return None, aligner.describe(camera)
        return placed.transform, ""
    return place


class GridOutput:
    """~/grid on ``node``, fed by every camera of ``channels`` (``reference``: the first camera, whose
    map is ``map_frame``); see the module docstring."""

    def __init__(self, node: Node, channels: dict[str, CameraChannel], reference: str, settings: NodeSettings,
                 tf: SharedTf, aligner: MapAligner) -> None:
        s = settings
        self.channel, self.reference = channels[reference], reference
        if s.base_frame:
            tf.start()  # the listener fills the buffer with the URDF's transforms from now on
        self.grid = GridMap(grid_config(s))
        ground = GroundFromBase(s.base_frame, s.grid_base_height, camera_extrinsic(tf, s.base_frame))
        self.feeds: dict[str, SequenceGrid] = {}
        for name in [reference] + [c for c in channels if c != reference]:  # the first camera's feed first
            channel = channels[name]
            self.feeds[name] = self.grid.feed(ground, channel.settings.scale_source, camera=name,
                                              place=joined_to(aligner, name, s.map_frame))
            channel.engine.seq.attach_grid(self.feeds[name])
        self.publisher = node.create_publisher(OccupancyGrid, "~/grid", qos_profile(latched=True, depth=1))
        self._published: int | None = None  # the version last published
        self.published = 0  # messages sent

    def publish(self) -> None:
        """The node's grid timer: publish when the grid is on, changed, and someone listens."""
        snap = self.grid.snapshot()
        if not snap.ready or snap.width == 0 or snap.version == self._published:
            return
        if self.publisher.get_subscription_count() == 0:
            return
        outputs = self.channel.outputs
        header = Header(stamp=outputs.latest_stamp, frame_id=outputs.placement().frame)
        self.publisher.publish(occupancy_grid_msg(snap, header))
        self._published = snap.version
        self.published += 1

    def save_beside(self, folder: Path) -> str:
        """Write the grid as map_server files into ``folder`` (after the map and trajectory); the text
        the ~/save_map answer adds: what was written, or why not."""
        snap = self.grid.snapshot()
        if not snap.ready:
            return f"grid not saved: {self.feeds[self.reference].state.reason or snap.reason}"
        try:
            saved = save_map_files(folder, snap)
        except MapFilesError as exc:
            return f"grid not saved: {exc}"
        return f"grid: wrote {saved.yaml} and {saved.image.name}"

    def diag(self, label: str) -> DiagnosticStatus:
        """The "<label>: grid" entry: OK when on, WARN with the reason when off."""
        st = self.feeds[self.reference].state  # the grid's, with the first camera's reason when it adds nothing
        snap = self.grid.snapshot()
        values: dict[str, Any] = {"on": st.on, "reason": st.reason or "none", "version": snap.version,
                                  "cells (width x height)": f"{snap.width} x {snap.height}",
                                  "resolution (m)": snap.resolution, "frames added": st.frames,
                                  "rebuilds": st.rebuilds, "messages published": self.published}
        for name, fed in list(self.feeds.items())[1:]:  # each other camera's part: in the grid, or why not
            values[f"camera {name}"] = fed.state.reason or "in the grid"
        if st.on:
            side = f"{snap.width * snap.resolution:.1f} x {snap.height * snap.resolution:.1f} m"
            return diag(f"{label}: grid", DiagnosticStatus.OK, f"{snap.width} x {snap.height} cells ({side})", values)
        return diag(f"{label}: grid", DiagnosticStatus.WARN, st.reason, values)


__all__ = ["GridOutput", "occupancy_grid_msg", "camera_extrinsic", "joined_to"]
