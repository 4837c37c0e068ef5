"""~/grid and the map_server files of ~/save_map over a real ROS 2 graph (ros/grid_outputs.py).

The node runs in this process with a stand-in for its model (``room_scene.stand_in_sessions``: the
depth and poses of a box room seen from its centre, injected where ``startup.load_sessions`` would
load the checkpoint). With ``grid`` on, a fixed metric scale and ``base_frame`` whose transform to
the camera comes from /tf_static (as a URDF's would), it publishes a latched OccupancyGrid in
``map`` with the walls occupied, the inside free and the outside unknown within one cell, and
~/save_map writes map.yaml + image that a YAML reader and PIL parse, with map_server's fields, and
that map_server's reading turns back into the grid published. A node without ``base_frame``
publishes no grid and says why in ~/status, /diagnostics and the ~/save_map answer."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")
tf2_ros = pytest.importorskip("tf2_ros", reason="tf2_ros not importable (bash ../shared/ros_extras/install.sh)")
yaml = pytest.importorskip("yaml")

from geometry_msgs.msg import Quaternion, Transform, TransformStamped, Vector3  # noqa: E402
from nav_msgs.msg import OccupancyGrid  # noqa: E402
from rclpy.qos import DurabilityPolicy, QoSProfile  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from std_msgs.msg import Header  # noqa: E402

from lingbot_map_ros.io.map_server import load_map_files  # noqa: E402
from lingbot_map_ros.msg import Status  # noqa: E402
from lingbot_map_ros.srv import SaveMap  # noqa: E402

from graph_helpers import GraphClient, InProcessNode, generated_frames, image_msg, private_domain_id  # noqa: E402
from lingbot_map_ros.geometry import OPTICAL_TO_REP103  # noqa: E402
from lingbot_map_ros.ros.conversions import transform_stamped  # noqa: E402
from room_scene import CAMERA, RESOLUTION, ROOM_X, ROOM_Y, SCALE, RoomSession, classes, stand_in_sessions  # noqa: E402

pytestmark = [pytest.mark.ros]

DOMAIN_ID = private_domain_id(__name__, 1, 100, 7, 13 + 63)  # not the other graph modules' offsets
TIMEOUT = 60.0
BASE = {"image_width": 98, "device": "cpu", "grid": True, "scale_source": "fixed", "metric_scale": SCALE,
        "conf_threshold": 0.0, "point_stride": 1, "grid_resolution": RESOLUTION, "grid_publish_rate": 20.0,
        "publish_depth": False, "publish_points": False, "map_publish_rate": 0.0}
CAMERA_HEIGHT = CAMERA[2]  # m: the camera's optical centre above base_link (on the floor)


def static_camera_transform() -> TransformStamped:
    """base_link -> cam_optical: the camera 1 m up, looking along base_link's x (optical z forward,
    x right, y down)."""
    q = Quaternion(x=-0.5, y=0.5, z=-0.5, w=0.5)  # columns: optical x, y, z = base_link's -y, -z, x
    return TransformStamped(header=Header(frame_id="base_link"), child_frame_id="cam_optical",
                            transform=Transform(translation=Vector3(x=0.0, y=0.0, z=CAMERA_HEIGHT), rotation=q))


def feed(client: GraphClient, node: InProcessNode, images, frames: int) -> None:
    """``frames`` images, each waited for (its status, then the node's output thread: when it falls
    behind it skips a frame's clouds, and with them the frame's part of the grid)."""
    clip = generated_frames(frames)
    outputs = node.node.channels[""].engine.outputs
    for i in range(frames):
        client.send_for_status(images, image_msg(clip[i], i + 1), "status", first=i == 0)
        assert outputs.flush(TIMEOUT)


@pytest.fixture
def box_room(monkeypatch):
    """The node's model replaced by the box room (a fresh turn for every node)."""
    monkeypatch.setattr("lingbot_map_ros.ros.node.load_sessions", lambda *args: stand_in_sessions())


def test_grid_topic_and_map_server_files(box_room, tmp_path):
    params = {**BASE, "base_frame": "base_link", "output_directory": str(tmp_path)}
    node = InProcessNode("grid_map", params, DOMAIN_ID).start()
    client = GraphClient("grid_client", DOMAIN_ID, TIMEOUT)
    try:
        broadcaster = tf2_ros.StaticTransformBroadcaster(client.node)
        broadcaster.sendTransform(static_camera_transform())
        grids = client.msgs.setdefault("grid", [])
        client.node.create_subscription(OccupancyGrid, "/grid_map/grid", lambda m: _store(client, grids, m),
                                        QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL))
        client.record(Status, "/grid_map/status", "status", depth=500)
        images = client.node.create_publisher(Image, "/image", 10)
        feed(client, node, images, 12)  # a full turn
        grid = node.node.grid.grid
        assert grid.state.on, grid.state
        final = grid.snapshot()
        msg = client.wait(lambda: next((m for m in reversed(grids) if list(m.data) == final.data.tolist()), None),
                          "the grid of the last frame on ~/grid")
        info = msg.info
        assert msg.header.frame_id == "map" and math.isclose(info.resolution, 0.1, rel_tol=1e-6)
        assert (info.width, info.height) == (final.width, final.height) and len(msg.data) == info.width * info.height
        assert set(msg.data) <= {-1, 0, 100} and set(msg.data) & {0, 100}
        # the floor lies 1 m under the camera (base_link's z through TF): the map frame moved down, its axes
        p, q = info.origin.position, info.origin.orientation
        assert p.z == pytest.approx(-CAMERA_HEIGHT, abs=1e-6) and (q.x, q.y, q.z, q.w) == pytest.approx((0, 0, 0, 1))
        cells = np.array(msg.data, np.int8).reshape(info.height, info.width)
        wall, inside, outside = classes(SimpleNamespace(resolution=info.resolution, width=info.width,
                                                        height=info.height, origin_xy=(p.x, p.y)))
        assert np.all(cells[outside] == -1) and np.mean(cells[inside] == 0) > 0.99
        assert np.all(wall[cells == 100]) and (cells == 100).sum() > 100

        answer = client.call(SaveMap, "/grid_map/save_map", SaveMap.Request(directory="run1"))
        assert answer.success and "grid: wrote " in answer.message, answer.message
        folder = tmp_path / "run1"
        fields = yaml.safe_load((folder / "map.yaml").read_text())
        assert set(fields) == {"image", "mode", "resolution", "origin", "negate", "occupied_thresh", "free_thresh"}
        assert fields["mode"] == "trinary" and fields["negate"] == 0 and fields["resolution"] == pytest.approx(0.1)
        assert fields["origin"] == pytest.approx([info.origin.position.x, info.origin.position.y, 0.0], abs=1e-6)
        assert 0.0 < fields["free_thresh"] < fields["occupied_thresh"] < 1.0
        from PIL import Image as PilImage

        with PilImage.open(folder / fields["image"]) as picture:
            assert picture.mode == "L" and picture.size == (info.width, info.height)
        loaded = load_map_files(folder / "map.yaml")
        assert loaded.data.tolist() == list(msg.data)  # map_server reads back the grid published
        assert (folder / "map.ply").is_file() and (folder / "trajectory.tum").is_file()
    finally:
        client.close()
        node.close()


def test_without_a_ground_reference_there_is_no_grid_and_the_node_says_why(box_room, tmp_path):
    params = {**BASE, "output_directory": str(tmp_path)}  # base_frame empty
    node = InProcessNode("grid_off", params, DOMAIN_ID).start()
    client = GraphClient("grid_off_client", DOMAIN_ID, TIMEOUT)
    try:
        statuses = client.record(Status, "/grid_off/status", "status", depth=500)
        images = client.node.create_publisher(Image, "/image", 10)
        feed(client, node, images, 3)
        reason = "grid off: no ground reference (base_frame is empty"
        client.wait(lambda: any(reason in s.state_text for s in statuses), "the reason in ~/status")
        answer = client.call(SaveMap, "/grid_off/save_map", SaveMap.Request(directory="run"))
        assert answer.success and f"grid not saved: {reason}" in answer.message, answer.message
        assert not (tmp_path / "run" / "map.yaml").exists() and (tmp_path / "run" / "map.ply").is_file()
        grid = node.node.grid
        assert grid.published == 0 and grid.grid.snapshot().width == 0
        assert grid.diag("n").level == grid.diag("n").WARN and reason in grid.diag("n").message
    finally:
        client.close()
        node.close()


def test_two_cameras_back_to_back_feed_one_grid(monkeypatch, tmp_path):
    """cameras [front, back] on one base, back to back, 1 m up; both turn through half a turn (6 frames
    of 30 degrees). The back camera's transform reaches TF only after two frames: until then its frames
    wait (its ~/back/status says why) and the grid holds the front camera's; then its map joins the
    front one's through the URDF's extrinsics and all its frames reach the one ~/grid in ``map``: the
    wall the front camera never faces (-y) is occupied along its length, the inside free, the outside
    unknown; /diagnostics names both cameras' part."""
    sessions = {"front": RoomSession(6, 0.0, math.pi), "back": RoomSession(6, math.pi, math.pi)}
    monkeypatch.setattr("lingbot_map_ros.ros.node.load_sessions", lambda *args: stand_in_sessions(cameras=sessions))
    params = {**BASE, "base_frame": "base_link", "output_directory": str(tmp_path), "cameras": ["front", "back"],
              "camera.front.camera_frame": "front_optical", "camera.back.camera_frame": "back_optical",
              "input_timeout": 30.0}
    node = InProcessNode("grid_two", params, DOMAIN_ID).start()
    client = GraphClient("grid_two_client", DOMAIN_ID, TIMEOUT)
    try:
        forward = np.asarray(OPTICAL_TO_REP103)[:3, :3]  # optical axes of a camera looking along base_link's x

        def urdf(child: str, R: np.ndarray) -> None:
            T = np.eye(4)
            T[:3, :3], T[2, 3] = R, CAMERA_HEIGHT
            tf2_ros.StaticTransformBroadcaster(client.node).sendTransform(
                transform_stamped(T, Header(frame_id="base_link"), child))

        urdf("front_optical", forward)  # the back camera's transform comes late (its driver starts later)
        client.wait(lambda: node.node.tf_shared.matrix("base_link", "front_optical") is not None,
                    "the front camera's transform in the node's TF buffer")
        for c in sessions:
            client.record(Status, f"/grid_two/{c}/status", c, depth=500)
        images = {c: client.node.create_publisher(Image, f"/{c}/image", 10) for c in sessions}
        clip = generated_frames(6)
        grid = node.node.grid
        for i in range(6):  # the same stamp for both cameras: the alignment's pair
            if i == 2:
                waiting = grid.feeds["back"].state.reason
                assert "camera back's frames wait to join the map" in waiting and "back_optical" in waiting, waiting
                assert grid.grid.state.on and grid.grid.state.frames == 2  # the front camera's frames only
                urdf("back_optical", np.diag([-1.0, -1.0, 1.0]) @ forward)
                client.wait(lambda: node.node.tf_shared.matrix("base_link", "back_optical") is not None,
                            "the back camera's transform in the node's TF buffer")
            for c in sessions:
                status = client.send_for_status(images[c], image_msg(clip[i], i + 1, f"{c}_optical"), c,
                                                first=i == 0)
                assert node.node.channels[c].engine.outputs.flush(TIMEOUT)
            if i == 1:  # the reason reached the back camera's ~/back/status
                assert "frames wait to join the map" in status.state_text, status.state_text
        feeds = grid.feeds
        assert grid.grid.state.on and feeds["back"].state.reason == "" and grid.grid.state.frames >= 11, \
            (grid.grid.state, feeds["back"].state)
        snap = grid.grid.snapshot()
        cells, res = snap.cells(), snap.resolution
        wall, inside, outside = classes(snap)
        assert np.all(cells[outside] == -1) and np.mean(cells[inside] == 0) > 0.99 and np.all(wall[cells == 100])
        x = snap.origin_xy[0] + (np.arange(snap.width) + 0.5) * res + CAMERA[0]
        y = snap.origin_xy[1] + (np.arange(snap.height) + 0.5) * res + CAMERA[1]
        band = np.abs(y + ROOM_Y) <= res  # the rows of the wall at -y, which only the back camera faces
        columns = np.abs(x) <= ROOM_X - 2 * res
        assert np.mean((cells[band][:, columns] == 100).any(axis=0)) > 0.95
        entry = grid.diag("n")
        values = {v.key: v.value for v in entry.values}
        assert entry.level == entry.OK and values["camera back"] == "in the grid", values
    finally:
        client.close()
        node.close()


def _store(client: GraphClient, store: list, msg) -> None:
    with client.cond:
        store.append(msg)
        client.cond.notify_all()


def test_static_camera_transform_puts_the_optical_axes_in_base_link():
    from lingbot_map_ros.ros.tf_tools import transform_to_matrix

    T = transform_to_matrix(static_camera_transform())
    assert np.allclose(T[:3, :3] @ [0, 0, 1], [1, 0, 0]) and np.allclose(T[:3, :3] @ [1, 0, 0], [0, -1, 0])
    assert np.allclose(T[:3, :3] @ [0, 1, 0], [0, 0, -1]) and np.allclose(T[:3, 3], [0, 0, CAMERA_HEIGHT])
