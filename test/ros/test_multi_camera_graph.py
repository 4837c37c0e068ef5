"""Two cameras on one node in a real ROS 2 graph (DDS on loopback, a private ROS_DOMAIN_ID).

One node process (tiny fixture weights, CPU) serves ``cameras: [front, rear]`` with one
model and one K/V pool; ``rear`` has its own image width (``camera.rear.image_width``) and
optical frame (``camera.rear.camera_frame``). This process publishes the robot's URDF
(base_link -> front_optical, base_link -> rear_optical on /tf_static), different real
frames to /front/image and /rear/image, listens to the per-camera outputs and calls the
per-camera services. Expected poses come from separate in-process single-camera sessions
fed the same frames: front (the reference camera) defines ``map``; rear's poses are
expected in ``map`` through the extrinsics. Two more node processes check that a bad
``camera.<c>.*`` parameter stops the node at start with one clear line.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")
tf2_ros = pytest.importorskip("tf2_ros", reason="tf2_ros not importable: install ../shared/ros_extras "
                                                "(bash ../shared/ros_extras/install.sh .venv)")

from builtin_interfaces.msg import Time as TimeMsg  # noqa: E402
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus  # noqa: E402
from geometry_msgs.msg import PoseStamped  # noqa: E402
from nav_msgs.msg import Odometry  # noqa: E402
from rcl_interfaces.msg import Parameter as ParameterMsg, ParameterType, ParameterValue  # noqa: E402
from rcl_interfaces.srv import GetParameters, SetParameters  # noqa: E402
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy  # noqa: E402
from sensor_msgs.msg import CameraInfo, Image, PointCloud2  # noqa: E402
from std_msgs.msg import Header  # noqa: E402
from std_srvs.srv import SetBool, Trigger  # noqa: E402
from tf2_msgs.msg import TFMessage  # noqa: E402

from graph_helpers import (GraphClient, image_msg, pose_matrix, private_domain_id, start_node,  # noqa: E402
                           stop_processes, write_node_params)
from lingbot_map_ros.geometry import OPTICAL_TO_REP103  # noqa: E402
from lingbot_map_ros.msg import Status  # noqa: E402
from lingbot_map_ros.ros.conversions import transform_stamped  # noqa: E402
from lingbot_map_ros.runtime.params import write_params_file  # noqa: E402
from lingbot_map_ros.srv import CommitEviction, RollbackFrame, SaveMap  # noqa: E402

pytestmark = [pytest.mark.ros, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
DOMAIN_ID = private_domain_id(__name__, 101, 100, 11, 55)  # 101..200: apart from the other graph modules
NODE = "/lingbot_map"
CAMERAS = ("front", "rear")
WIDTH = {"front": 98, "rear": 112}
START_TIMEOUT = 90.0
STEP_TIMEOUT = 30.0
FRAMES = 4
NODE_PARAMS = {"num_scale_frames": 2, "sliding_window": 3, "keyframe_interval": 1, "camera_iterations": 4,
               # reliable input: a best-effort reader may miss a frame sent right after discovery
               "input_qos": "reliable",
               "device": "cpu", "image_width": WIDTH["front"], "map_publish_rate": 10.0, "input_timeout": 30.0,
               "conf_threshold": 1.0, "point_stride": 1, "map_voxel_size": 0.0, "service_timeout": 20.0,
               "path_publish_rate": 20.0, "publish_depth": False, "cameras": list(CAMERAS),
               "base_frame": "base_link", "camera.rear.image_width": WIDTH["rear"],
               "camera.rear.camera_frame": "rear_optical"}


def rigid(R: np.ndarray, t) -> np.ndarray:
    """The [4, 4] transform of rotation ``R`` [3, 3] and translation ``t`` (m)."""
    T = np.eye(4)
    T[:3, :3], T[:3, 3] = R, t
    return T


M = np.asarray(OPTICAL_TO_REP103)[:3, :3]  # optical axes in a REP-103 body: a camera looking forward
RZ180 = np.diag([-1.0, -1.0, 1.0])
EXTRINSICS = {"front_optical": rigid(M, (0.2, 0.0, 0.5)),  # T_base_cam: 0.2 m ahead, looking forward
              "rear_optical": rigid(RZ180 @ M, (-0.3, 0.05, 0.5))}  # 0.3 m behind, looking back


def real_frames(first: int, n: int) -> list[np.ndarray]:
    from PIL import Image as PILImage

    folder = SHARED / "data" / "loop"
    if not folder.is_dir():
        pytest.skip(f"real frames not found at {folder}")
    return [np.asarray(PILImage.open(p).convert("RGB")) for p in sorted(folder.glob("*.jpg"))[first:first + n]]


FRONT_FIRST, REAR_FIRST = 0, 60  # the two cameras see different parts of the loop


class Client(GraphClient):
    """The test's side: URDF on /tf_static, image publishers, recorders of every output (``msgs``
    keyed by topic), services."""

    def __init__(self) -> None:
        super().__init__("multi_camera_test_client", DOMAIN_ID, STEP_TIMEOUT)
        self.record(DiagnosticArray, "/diagnostics", "/diagnostics")
        self.record(TFMessage, "/tf", "/tf")
        for c in CAMERAS:
            for topic, kind in ((f"{NODE}/{c}/pose", PoseStamped), (f"{NODE}/{c}/odometry", Odometry),
                                (f"{NODE}/{c}/status", Status)):
                self.record(kind, topic, topic)
        self._record_latched(PointCloud2, f"{NODE}/map_points")
        self.images = {c: self.node.create_publisher(Image, f"/{c}/image", QoSProfile(depth=10)) for c in CAMERAS}
        self.infos = {c: self.node.create_publisher(CameraInfo, f"/{c}/camera_info", QoSProfile(depth=10))
                      for c in CAMERAS}
        self.urdf = tf2_ros.StaticTransformBroadcaster(self.node)
        self.urdf.sendTransform([transform_stamped(T, Header(frame_id="base_link"), child)
                                 for child, T in EXTRINSICS.items()])
        for c in CAMERAS:  # the camera_batching node's (test_camera_batching_takes_frames_that_arrive_together)
            self.record(PoseStamped, f"/{BATCH}/{c}/pose", f"batch {c} pose")
            self.record(Status, f"/{BATCH}/{c}/status", f"batch {c} status")

    def _record_latched(self, msg_type: type, topic: str) -> None:
        """Every message on latched ``topic`` (reliable, transient local, depth 1) in ``msgs[topic]``."""
        store = self.msgs.setdefault(topic, [])

        def callback(msg) -> None:
            with self.cond:
                store.append(msg)
                self.cond.notify_all()
        latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self.node.create_subscription(msg_type, topic, callback, latched)

    def latest(self, topic: str):
        with self.cond:
            return self.msgs[topic][-1] if self.msgs[topic] else None

    def send(self, camera: str, rgb: np.ndarray, stamp: TimeMsg, first: bool = False) -> Status:
        """Publish a frame to ``camera`` and wait for the node's status about it; ``first``: the
        camera's first frame, published again every 1.5 s until that status came (a copy is a
        repeated stamp: the node drops it)."""
        frame_id = "front_optical" if camera == "front" else ""  # rear: camera.rear.camera_frame
        msg = image_msg(rgb, stamp, frame_id)
        return self.send_for_status(self.images[camera], msg, f"{NODE}/{camera}/status", first)

    def pose(self, camera: str, stamp: TimeMsg) -> PoseStamped:
        topic = f"{NODE}/{camera}/pose"
        return self.wait(lambda: next((p for p in self.msgs[topic] if p.header.stamp == stamp), None),
                         what=f"the pose of {camera} at {stamp.sec}")


def node_subscriptions(node, topic: str, name: str = "lingbot_map") -> int:
    """How many subscriptions the node ``name`` (namespace /) has on ``topic``, as the graph sees them."""
    return sum(1 for info in node.get_subscriptions_info_by_topic(topic)
               if info.node_name == name and info.node_namespace == "/")


def stamp_of(k: int) -> TimeMsg:
    return TimeMsg(sec=7000 + k, nanosec=500_000_000)


BATCH = "lingbot_batch"  # the camera_batching node (test_camera_batching_takes_frames_that_arrive_together)
BAD = {  # node name -> a bad camera.<c>.* parameter and the start-up error it gets
    "lingbot_map_bad0": ({"camera.side.image_width": 98}, "unknown parameter camera.side.image_width: 'side' is not "
                                                          "in cameras"),
    "lingbot_map_bad1": ({"camera.rear.image_width": 100}, "parameter camera.rear.image_width must be in [14, 4088] "
                                                           "in steps of 14"),
}


@pytest.fixture(scope="module")
def graph(tmp_path_factory, fixtures):
    """The two-camera node, fed its first frames; started at the same time (their start-ups
    overlap): the camera_batching node and the nodes with a bad parameter (see the tests that use
    ``others``)."""
    tmp = tmp_path_factory.mktemp("multi_camera")
    frames = {"front": real_frames(FRONT_FIRST, FRAMES + 2), "rear": real_frames(REAR_FIRST, FRAMES + 2)}
    params = write_node_params(tmp / "multi.yaml", fixtures, {**NODE_PARAMS, "output_directory": str(tmp / "out")})
    proc = start_node("lingbot_map", params, tmp / "node.log", DOMAIN_ID)
    others = {BATCH: start_node(BATCH, write_node_params(tmp / "batch.yaml", fixtures, {
        **NODE_PARAMS, "camera_batching": True, "base_frame": "", "output_directory": str(tmp / "batch_out")}),
        tmp / f"{BATCH}.log", DOMAIN_ID, {f"{c}/image": f"/batch/{c}/image" for c in CAMERAS})}
    for name, (bad, _) in BAD.items():
        others[name] = start_node(name, write_params_file(tmp / f"{name}.yaml", {**NODE_PARAMS, **bad}),
                                  tmp / f"{name}.log", DOMAIN_ID)
    client = Client()
    try:
        client.watch(proc, tmp / "node.log")
        client.wait(lambda: all(p.get_subscription_count() >= 1 for p in client.images.values()),
                    timeout=START_TIMEOUT, what="the node to subscribe to both cameras")
        # the node's TF listener (one for every camera's TF output and the extrinsics) has the URDF
        client.wait(lambda: node_subscriptions(client.node, "/tf_static") >= 1, what="the node's /tf_static listener")
        # frames in pairs of equal stamps; each waits for its status, so front's first poses (after its two
        # scale frames) come before rear's: rear joins map at its first pose
        for k in range(FRAMES):
            for camera in CAMERAS:
                client.send(camera, frames[camera][k], stamp_of(k), first=k == 0)
        yield client, proc, frames, tmp, others
    finally:
        client.close()
        stop_processes(proc, *others.values())


@pytest.fixture(scope="module")
def others(graph):
    """The processes the ``graph`` fixture started besides the two-camera node: name -> (process, log)."""
    tmp = graph[3]
    return {name: (proc, tmp / f"{name}.log") for name, proc in graph[4].items()}


@pytest.fixture(scope="module")
def replay(tiny_model):
    """Poses (map frame of a single-camera sequence) for a list of RGB frames at ``width``."""
    from lingbot_map_ros.config import StreamConfig
    from lingbot_map_ros.io.preprocess import preprocess_array
    from lingbot_map_ros.ros.conversions import optical_pose_to_map
    from lingbot_map_ros.stream.session import StreamingSession

    def run(frames: list[np.ndarray], width: int) -> list[np.ndarray]:
        cfg = StreamConfig(num_scale_frames=2, sliding_window=3, keyframe_interval=1, camera_iterations=4,
                           backend="sdpa")
        session = StreamingSession(tiny_model, cfg)
        results = []
        for rgb in frames:
            results += session.push(preprocess_array(rgb, width))
        return [optical_pose_to_map(r.c2w) for r in results]

    return run


# ------------------------------------------------------------------ tests
def test_both_cameras_get_their_own_sequence_in_one_map(graph, replay):
    client, proc, frames, _, _ = graph
    stamps = [stamp_of(k) for k in range(FRAMES)]
    front = [client.pose("front", s) for s in stamps]
    rear = [client.pose("rear", s) for s in stamps]
    assert {p.header.frame_id for p in front + rear} == {"map"}
    # front is the reference: exactly a single-camera replay of its frames
    for got, expected in zip(front, replay(frames["front"][:FRAMES], WIDTH["front"])):
        np.testing.assert_allclose(pose_matrix(got), expected, atol=1e-4)
    # rear: its own sequence (at its own width), placed in map through the extrinsics at the first pair
    own = replay(frames["rear"][:FRAMES], WIDTH["rear"])
    A = pose_matrix(front[0]) @ np.linalg.inv(EXTRINSICS["front_optical"]) @ EXTRINSICS["rear_optical"] \
        @ np.linalg.inv(own[0])
    for got, expected in zip(rear, own):
        np.testing.assert_allclose(pose_matrix(got), A @ expected, atol=1e-4)
    odometry = {c: client.wait(lambda c=c: client.latest(f"{NODE}/{c}/odometry")) for c in CAMERAS}
    assert odometry["front"].child_frame_id == "front_optical" and odometry["rear"].child_frame_id == "rear_optical"

    status = {c: client.latest(f"{NODE}/{c}/status") for c in CAMERAS}
    for c in CAMERAS:
        assert (status[c].camera, status[c].frame_index, status[c].frames_processed) == (c, FRAMES, FRAMES)
        assert status[c].header.frame_id == "map"
    pool = status["rear"]
    assert pool.pool_bytes > 0 and 0 < pool.pool_leased_tokens <= pool.pool_capacity_tokens
    assert proc.poll() is None


def test_diagnostics_tf_and_the_map_cover_both_cameras(graph):
    client, proc, frames, _, _ = graph
    h, w = frames["front"][0].shape[:2]
    info = CameraInfo(header=Header(frame_id="front_optical"), width=w, height=h,
                      k=[321.0, 0.0, w / 2, 0.0, 321.0, h / 2, 0.0, 0.0, 1.0])
    client.wait(lambda: client.infos["front"].get_subscription_count() >= 1, what="the front camera_info subscription")
    client.infos["front"].publish(info)
    def aligned_diagnostics():
        # the newest array with the pool read and rear's map-frame entry OK (an array published
        # before rear was aligned says WARN, "waits for ..."): rear must get there
        for d in reversed(client.msgs["/diagnostics"]):
            by_name = {s.name: s for s in d.status}
            rear = by_name.get(f"{NODE}: rear: map frame")
            if any(s.name.endswith("pool") and "leased" in s.message for s in d.status) and rear is not None:
                return by_name if rear.level == DiagnosticStatus.OK else None
        return None

    names = client.wait(aligned_diagnostics, what="/diagnostics with the pool and rear aligned to map")
    for c in CAMERAS:
        for part in ("input", "output", "tracking", "scale", "cache", "map frame"):
            assert f"{NODE}: {c}: {part}" in names, (c, part, sorted(names))
    assert "aligned to map" in names[f"{NODE}: rear: map frame"].message
    assert f"{NODE}: input" not in names  # the single-camera entry
    intrinsics = client.wait(lambda: next((s for d in client.msgs["/diagnostics"] for s in d.status
                                           if s.name == f"{NODE}: front: intrinsics"
                                           and any(kv.key == "camera_info fx (px)" for kv in s.values)), None),
                             what="front's intrinsics entry with its camera_info")
    assert {kv.key: kv.value for kv in intrinsics.values}["camera_info fx (px)"] == "321.0"
    assert "focal length" in intrinsics.message
    # TF: the rear camera's own child under map (the reference publishes map -> base_link)
    client.wait(lambda: any(t.header.frame_id == "map" and t.child_frame_id == "rear_optical_lingbot"
                            for m in client.msgs["/tf"] for t in m.transforms), what="TF map -> rear_optical_lingbot")
    cloud = client.wait(lambda: (m := client.latest(f"{NODE}/map_points")) is not None and m.width > 0 and m,
                        what="~/map_points")
    assert cloud.header.frame_id == "map"


def test_one_tf_listener_serves_every_camera(graph):
    """Every camera's TF output and the alignment's extrinsic look-ups share one tf2 buffer: the
    node parses /tf and /tf_static once (it was once per camera plus once for the alignment)."""
    client, proc, _, _, _ = graph
    client.wait(lambda: any(t.child_frame_id == "rear_optical_lingbot" for m in client.msgs["/tf"]
                            for t in m.transforms), what="TF from the rear camera")  # both cameras publish TF
    assert node_subscriptions(client.node, "/tf") == 1
    assert node_subscriptions(client.node, "/tf_static") == 1
    assert sum(1 for info in client.node.get_publishers_info_by_topic("/tf")
               if info.node_name == "lingbot_map") == 1  # one broadcaster
    assert proc.poll() is None


def test_single_camera_names_are_absent(graph):
    client, _, _, _, _ = graph
    topics = dict(client.node.get_topic_names_and_types())
    for c in CAMERAS:
        assert f"{NODE}/{c}/pose" in topics and f"{NODE}/{c}/status" in topics
    for name in ("pose", "odometry", "status", "path", "points", "frame"):
        assert f"{NODE}/{name}" not in topics, name
    subscribed = {t for t, _ in client.node.get_subscriber_names_and_types_by_node("lingbot_map", "/")}
    assert {"/front/image", "/rear/image", "/front/camera_info", "/rear/camera_info"} <= subscribed
    assert "/image" not in subscribed and "/camera_info" not in subscribed
    services = {s for s, _ in client.node.get_service_names_and_types_by_node("lingbot_map_services", "/")}
    for c in CAMERAS:
        for srv in ("reset", "set_deferred_eviction", "commit_eviction", "rollback_last_frame"):
            assert f"{NODE}/{c}/{srv}" in services
    assert f"{NODE}/save_map" in services and f"{NODE}/reset" not in services


def test_services_of_one_camera_leave_the_other_alone(graph):
    client, proc, frames, _, _ = graph
    ok = client.call(SetBool, f"{NODE}/rear/set_deferred_eviction", SetBool.Request(data=True))
    assert ok.success, ok.message
    front = client.send("front", frames["front"][FRAMES], stamp_of(FRAMES))
    assert front.frame_index == FRAMES + 1 and not front.deferred_eviction
    client.wait(lambda: client.latest(f"{NODE}/rear/status").deferred_eviction, what="rear's deferred status")

    rear_before = client.latest(f"{NODE}/rear/status")
    rolled = client.call(RollbackFrame, f"{NODE}/front/rollback_last_frame",
                         RollbackFrame.Request(expected_frame_index=FRAMES + 1))
    assert rolled.success and rolled.frame_index == FRAMES + 1, rolled.message
    committed = client.call(CommitEviction, f"{NODE}/rear/commit_eviction", CommitEviction.Request())
    assert committed.success, committed.message

    reset = client.call(Trigger, f"{NODE}/rear/reset", Trigger.Request())
    assert reset.success, reset.message
    client.wait(lambda: (s := client.latest(f"{NODE}/rear/status")).frames_received == 0 and s.frame_index == 0,
                what="rear's status after its reset")
    assert rear_before.frames_processed == FRAMES
    # front goes on from where it was (frame 5 was rolled back: the next one is 5 again), rear starts anew
    front = client.send("front", frames["front"][FRAMES + 1], stamp_of(FRAMES + 1))
    assert (front.frame_index, front.frames_processed) == (FRAMES + 1, FRAMES + 2)
    rear = client.send("rear", frames["rear"][0], stamp_of(FRAMES + 1))
    assert rear.frame_index == 1 and rear.frames_received == 1 and rear.state == Status.STATE_INITIALIZING
    client.call(SetBool, f"{NODE}/rear/set_deferred_eviction", SetBool.Request(data=False))
    assert proc.poll() is None


def test_save_map_writes_every_camera(graph, tmp_path):
    from lingbot_map_ros.io.export import read_ply, read_tum
    from lingbot_map_ros.runtime.multi_save import check_camera_maps

    client, _, frames, _, _ = graph
    client.send("rear", frames["rear"][1], stamp_of(FRAMES + 2))  # rear has poses again (2 scale frames)
    response = client.call(SaveMap, f"{NODE}/save_map", SaveMap.Request(directory=str(tmp_path)))
    assert response.success, response.message
    ply = tmp_path / "map.ply"
    tums = {c: tmp_path / f"trajectory_{c}.tum" for c in CAMERAS}
    assert Path(response.ply_path) == ply and Path(response.trajectory_path) == tums["front"]
    assert check_camera_maps(ply, list(tums.values()))
    assert read_ply(ply)[0].shape[0] > 0
    for c in CAMERAS:
        times, poses = read_tum(tums[c])
        assert len(times) > 0
        topic = f"{NODE}/{c}/pose"  # ~/status came for every saved frame; its ~/pose may still be on the way
        client.wait(lambda: {int(t) for t in times} <= {p.header.stamp.sec for p in client.msgs[topic]},
                    what=f"the poses of {c}'s saved frames")
        recorded = {p.header.stamp.sec: p for p in client.msgs[topic]}
        for t, T in zip(times, poses):
            np.testing.assert_allclose(T, pose_matrix(recorded[int(t)]), atol=1e-5)


def test_per_camera_parameters_at_run_time(graph):
    client, _, _, _, _ = graph
    got = client.call(GetParameters, f"{NODE}/get_parameters",
                      GetParameters.Request(names=["camera.rear.image_width", "camera.front.image_width"]))
    assert [v.integer_value for v in got.values] == [WIDTH["rear"], WIDTH["front"]]
    got = client.call(GetParameters, f"{NODE}/get_parameters", GetParameters.Request(names=["cameras"]))
    assert list(got.values[0].string_array_value) == list(CAMERAS)
    refused = client.call(SetParameters, f"{NODE}/set_parameters", SetParameters.Request(parameters=[ParameterMsg(
        name="cameras", value=ParameterValue(type=ParameterType.PARAMETER_STRING_ARRAY, string_array_value=["x"]))]))
    assert not refused.results[0].successful  # read-only
    refused = client.set_parameter(NODE, "camera.rear.keyframe_decision_default", "maybe")
    assert not refused.successful and "camera.rear.keyframe_decision_default" in refused.reason
    refused = client.set_parameter(NODE, "deferred_eviction", True)
    assert not refused.successful and "camera.front.deferred_eviction" in refused.reason
    refused = client.set_parameter(NODE, "camera.front.image_width", 112)
    assert not refused.successful and refused.reason
    refused = client.set_parameter(NODE, "camera.side.image_width", 98)
    assert not refused.successful
    ok = client.set_parameter(NODE, "camera.rear.deferred_eviction", True)
    assert ok.successful, ok.reason
    client.wait(lambda: client.latest(f"{NODE}/rear/status").deferred_eviction, what="rear deferred by parameter")
    assert client.set_parameter(NODE, "camera.rear.deferred_eviction", False).successful


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_camera_parameter_stops_the_node_at_start(others, name):
    proc, log = others[name]  # started by the graph fixture with BAD[name]'s parameter
    try:
        proc.wait(START_TIMEOUT)
    finally:
        stop_processes(proc)
    text = log.read_text()
    assert proc.returncode == 1, text
    assert "cannot start" in text and BAD[name][1] in text, text
    assert "Traceback" not in text


def test_camera_batching_takes_frames_that_arrive_together(graph, others, replay):
    """A node with ``camera_batching`` (its own process and topics) serves both cameras through
    the scheduler's batched turn: pairs of frames published at once, each camera's poses equal
    its own replay, /diagnostics reports the batching counters. Whether a pair is waiting
    together at a turn depends on timing here, and on the CPU the sessions run a batch's frames
    one after another (no CUDA graphs); the batched turn itself is checked deterministically
    in test/core/test_multi_camera_engines.py."""
    client, _, frames, _, _ = graph
    name = BATCH
    proc, log = others[name]  # started by the graph fixture (its own topics: /batch/<camera>/image)
    pubs = {c: client.node.create_publisher(Image, f"/batch/{c}/image", QoSProfile(depth=10)) for c in CAMERAS}
    poses = {c: client.msgs[f"batch {c} pose"] for c in CAMERAS}  # recorded from the start (Client)
    statuses = {c: client.msgs[f"batch {c} status"] for c in CAMERAS}
    try:
        client.wait(lambda: proc.poll() is not None or all(p.get_subscription_count() >= 1 for p in pubs.values()),
                    timeout=START_TIMEOUT, what="the batching node to subscribe to both cameras")
        assert proc.poll() is None, log.read_text()[-3000:]
        for k in range(FRAMES):
            stamp = stamp_of(100 + k)

            def publish_pair(k=k, stamp=stamp) -> None:
                for c in CAMERAS:  # together: the second arrives while the first still waits or runs
                    pubs[c].publish(image_msg(frames[c][k], stamp, "front_optical" if c == "front" else ""))

            def both_statuses(stamp=stamp) -> bool:
                return all(any(s.header.stamp == stamp and not s.state_text.startswith("ready") for s in statuses[c])
                           for c in CAMERAS)

            # the first pair again every 1.5 s until both statuses came (a copy is a repeated stamp: dropped)
            if k > 0:
                publish_pair()
            client.wait(both_statuses, what=f"both cameras' statuses for frame {k + 1}",
                        repeat=publish_pair if k == 0 else None)
        for c in CAMERAS:
            got = client.wait(lambda c=c: len(poses[c]) >= FRAMES and poses[c], what=f"{c}'s poses")
            assert {p.header.frame_id for p in got} == {f"map_{c}"}  # no base_frame: each its own map
            for p, expected in zip(got, replay(frames[c][:FRAMES], WIDTH[c])):
                np.testing.assert_allclose(pose_matrix(p), expected, atol=1e-4)
            assert statuses[c][-1].frames_processed == FRAMES
        pool = client.wait(lambda: next((s for d in reversed(client.msgs["/diagnostics"]) for s in d.status
                                         if s.name == f"/{name}: pool" and s.values), None),
                           what="the batching node's pool diagnostics")
        keys = {kv.key: kv.value for kv in pool.values}
        assert int(keys["batched turns"]) >= 0 and "front: steps in a batched trunk" in keys
        assert int(keys["steps overlapped with the next camera's"]) >= 0  # camera_pipelining on by default
        text = log.read_text()
        assert "camera_batching:" in text and "[ERROR]" not in text and "Traceback" not in text
        assert "camera_pipelining: on" in text
    finally:
        stop_processes(proc)
