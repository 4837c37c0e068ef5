"""The node in a real ROS 2 graph (DDS on loopback, a private ROS_DOMAIN_ID).

Two node processes run with the tiny fixture weights on CPU: ``lingbot_map`` (raw
input on /cam_a/image, sensor-data QoS) and ``lingbot_map_c`` (compressed input on
/cam_c/image/compressed). This process publishes real frames (``../shared/data/loop``)
and generated ones, listens to every output and calls every service. Expected poses
come from an in-process StreamingSession fed the same frames through the same
preprocessing.
"""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus  # noqa: E402
from geometry_msgs.msg import PoseStamped  # noqa: E402
from nav_msgs.msg import Odometry, Path as PathMsg  # noqa: E402
from rclpy.executors import MultiThreadedExecutor  # noqa: E402
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import CameraInfo, CompressedImage, Image, PointCloud2, PointField  # noqa: E402
from std_msgs.msg import Header  # noqa: E402
from std_srvs.srv import SetBool, Trigger  # noqa: E402

from lingbot_map_ros.msg import Status  # noqa: E402
from lingbot_map_ros.srv import CommitEviction, RollbackFrame, SaveMap  # noqa: E402

from graph_helpers import pose_matrix  # noqa: E402  (test/ros is on sys.path)

pytestmark = [pytest.mark.ros, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
WIDTH = 98
CAMERA_FRAME = "cam_a_optical"
A, C = "/lingbot_map", "/lingbot_map_c"
START_TIMEOUT = 90.0
STEP_TIMEOUT = 30.0
DOMAIN_ID = 1 + (os.getpid() * 7 + 13) % 100  # this module's own domain, 1..100
NODE_PARAMS = {"image_width": WIDTH, "num_scale_frames": 2, "sliding_window": 3, "keyframe_interval": 1,
               "camera_iterations": 4, "device": "cpu", "map_publish_rate": 10.0, "input_timeout": 1.5,
               "conf_threshold": 1.0, "point_stride": 1, "map_voxel_size": 0.0, "service_timeout": 20.0,
               "path_publish_rate": 20.0}


# ------------------------------------------------------------------ frames
def generated_frames(n: int, seed: int = 0) -> list[np.ndarray]:
    """n RGB frames [294, 518, 3] uint8 of a sliding blocky texture."""
    rng = np.random.default_rng(seed)
    big = np.kron(rng.integers(0, 256, (40, 120, 3)).astype(np.float32), np.ones((8, 8, 1)))
    return [big[10 + i: 304 + i, 20 + 7 * i: 538 + 7 * i].astype(np.uint8) for i in range(n)]


def real_frames(n: int) -> list[np.ndarray]:
    from PIL import Image as PILImage

    folder = SHARED / "data" / "loop"
    if not folder.is_dir():
        pytest.skip(f"real frames not found at {folder}")
    return [np.asarray(PILImage.open(p).convert("RGB")) for p in sorted(folder.glob("*.jpg"))[:n]]


def empty_image(stamp) -> Image:
    """A zero-size rgb8 Image: the node drops it as invalid."""
    return Image(header=Header(stamp=stamp, frame_id=CAMERA_FRAME), height=0, width=0, encoding="rgb8", step=0)


def empty_compressed(stamp) -> CompressedImage:
    """A CompressedImage without data: the node drops it as invalid."""
    return CompressedImage(header=Header(stamp=stamp, frame_id=CAMERA_FRAME), format="jpeg")


def jpeg_bytes(rgb: np.ndarray) -> bytes:
    from PIL import Image as PILImage

    buf = io.BytesIO()
    PILImage.fromarray(rgb).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def image_msg(rgb: np.ndarray, stamp, encoding: str = "rgb8") -> Image:
    from lingbot_map_ros.ros.conversions import rgb_to_image_msg

    return rgb_to_image_msg(rgb, Header(stamp=stamp, frame_id=CAMERA_FRAME), encoding)


# ------------------------------------------------------------------ processes
def start_node(name: str, params: Path, log: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST", ROS_DOMAIN_ID=str(DOMAIN_ID))
    cmd = [sys.executable, "-m", "lingbot_map_ros.ros.main", "--ros-args", "--params-file", str(params),
           "-r", f"__node:={name}", *extra]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class GraphClient:
    """An in-process rclpy node in its own context, spun by a background executor; ``wait``
    blocks on a condition that subscription callbacks notify. Subclasses create their
    subscriptions and publishers, then call ``start``."""

    def __init__(self, name: str) -> None:
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node(name, context=self.context)
        self.executor = MultiThreadedExecutor(num_threads=2, context=self.context)
        self.executor.add_node(self.node)
        self._cond = threading.Condition()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.executor.spin, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=2.0)
        self._thread.join(timeout=5.0)  # not left in rclpy's C++ wait when the interpreter finalizes
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)

    def wait(self, predicate, timeout: float = STEP_TIMEOUT, what: str = "condition"):
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                value = predicate()
                if value:
                    return value
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
                self._cond.wait(min(remaining, 0.1))


PRIME_PERIOD = 1.5  # s between the copies of a priming message
MAP_SETTLE_S = 2.0  # s: 20 periods of map_publish_rate (10 Hz)


def prime_input(client: GraphClient, publisher, msg, received: Callable[[], bool], what: str,
                timeout: float = START_TIMEOUT) -> None:
    """Publish ``msg`` and again every PRIME_PERIOD s until ``received()`` holds (``timeout`` s at most).

    ``publisher.get_subscription_count() >= 1`` says only that the writer has matched the node's
    reader; until the reader has matched the writer too (DDS discovery runs on each side), a sample
    is lost, reliable QoS or not, and a test waiting for its answer waits in vain. Once one arrived,
    the later samples of the same writer do (reliable, in order). Prime with a message the node
    drops as invalid: it counts in frames_received and frames_dropped_invalid only (the tests take
    those relative to a status, or after ~/reset), so a second copy changes nothing they assert."""
    deadline = time.monotonic() + timeout
    while True:
        publisher.publish(msg)
        try:
            client.wait(received, min(PRIME_PERIOD, max(0.0, deadline - time.monotonic())), what)
            return
        except AssertionError:
            if time.monotonic() >= deadline:
                raise


class Client(GraphClient):
    """In-process test node: publishers of images, recorders of every output, service calls."""

    def __init__(self) -> None:
        super().__init__("lingbot_map_test_client")
        self.msgs: dict[str, list] = {}
        reliable = QoSProfile(depth=200)
        latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
        for topic, kind, qos in [
            (f"{A}/pose", PoseStamped, reliable), (f"{A}/odometry", Odometry, reliable),
            (f"{A}/path", PathMsg, latched), (f"{A}/points", PointCloud2, reliable),
            (f"{A}/map_points", PointCloud2, latched), (f"{A}/depth", Image, reliable),
            (f"{A}/depth/camera_info", CameraInfo, reliable), (f"{A}/status", Status, reliable),
            ("/diagnostics", DiagnosticArray, reliable), (f"{C}/status", Status, reliable),
        ]:
            self.msgs[topic] = []
            self.node.create_subscription(kind, topic, self._recorder(topic), qos)
        self.pub_reliable = self.node.create_publisher(Image, "/cam_a/image", QoSProfile(depth=10))
        self.pub_best_effort = self.node.create_publisher(Image, "/cam_a/image", qos_profile_sensor_data)
        self.pub_compressed = self.node.create_publisher(CompressedImage, "/cam_c/image/compressed",
                                                         QoSProfile(depth=10))
        self._stamp = 1000
        self.start()

    def _recorder(self, topic: str):
        def store(msg) -> None:
            with self._cond:
                self.msgs[topic].append(msg)
                self._cond.notify_all()
        return store

    def latest(self, topic: str):
        with self._cond:
            return self.msgs[topic][-1] if self.msgs[topic] else None

    def clear(self) -> None:
        with self._cond:
            for v in self.msgs.values():
                v.clear()

    def next_stamp(self):
        from builtin_interfaces.msg import Time

        self._stamp += 1
        return Time(sec=self._stamp, nanosec=123_456)

    def status_for(self, stamp, topic: str = f"{A}/status") -> Status:
        """Wait for the status the node publishes for the input frame stamped ``stamp``."""
        return self.wait(lambda: next((s for s in self.msgs[topic] if s.header.stamp == stamp
                                       and not s.state_text.startswith("ready")), None),
                         what=f"a status for stamp {stamp.sec} on {topic}")

    def send(self, msg, publisher=None, topic: str = f"{A}/status") -> Status:
        (publisher or self.pub_reliable).publish(msg)
        return self.status_for(msg.header.stamp, topic)

    def send_rgb(self, rgb: np.ndarray, publisher=None):
        stamp = self.next_stamp()
        status = self.send(image_msg(rgb, stamp), publisher)
        return stamp, status

    def call(self, srv_type, name: str, request, timeout: float = STEP_TIMEOUT):
        client = self.node.create_client(srv_type, name)
        try:
            assert client.wait_for_service(timeout_sec=timeout), f"service {name} not available"
            future = client.call_async(request)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and not future.done():
                time.sleep(0.01)
            assert future.done(), f"service {name} did not answer within {timeout} s"
            return future.result()
        finally:
            self.node.destroy_client(client)

    def poses(self) -> dict[int, PoseStamped]:
        with self._cond:
            return {p.header.stamp.sec: p for p in self.msgs[f"{A}/pose"]}

    def reset(self) -> None:
        response = self.call(Trigger, f"{A}/reset", Trigger.Request())
        assert response.success, response.message
        self.wait(lambda: (s := self.latest(f"{A}/status")) is not None and s.frames_received == 0
                  and s.state == Status.STATE_WAITING_FOR_IMAGES, what="the status after reset")
        self.clear()


@pytest.fixture(scope="module")
def graph(tmp_path_factory, fixtures):
    root = fixtures  # skips with a message when the tiny fixture set is absent
    from lingbot_map_ros.runtime.params import write_params_file

    tmp = tmp_path_factory.mktemp("graph")
    # deferred_eviction_timeout 0: test_deferred_eviction_and_commit's pending evictions wait for its
    # commit however slow the machine (the default 5 s would commit them on a heartbeat)
    params = {**NODE_PARAMS, "deferred_eviction_timeout": 0.0, "checkpoint": str(root / "weights.safetensors"),
              "model_config": str(root / "config.json"), "output_directory": str(tmp / "default_out")}
    raw = write_params_file(tmp / "raw.yaml", params)
    # camera_batching on a one-camera node: a warning at start that it has no effect
    compressed = write_params_file(tmp / "compressed.yaml", {**params, "input_transport": "compressed",
                                                             "camera_batching": True})
    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    os.environ["ROS_DOMAIN_ID"] = str(DOMAIN_ID)
    procs = {A: start_node("lingbot_map", raw, tmp / "a.log", "-r", "image:=/cam_a/image",
                           "-r", "camera_info:=/cam_a/camera_info"),
             C: start_node("lingbot_map_c", compressed, tmp / "c.log", "-r",
                           "image/compressed:=/cam_c/image/compressed")}
    client = Client()
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and not (client.pub_reliable.get_subscription_count() >= 1
                                                   and client.pub_compressed.get_subscription_count() >= 1):
            for name, proc in procs.items():
                if proc.poll() is not None:
                    log = (tmp / ("a.log" if name == A else "c.log")).read_text()
                    pytest.fail(f"node {name} exited with {proc.returncode}:\n{log[-3000:]}")
            time.sleep(0.1)
        assert client.pub_reliable.get_subscription_count() >= 1, "node did not subscribe in time"
        assert client.pub_compressed.get_subscription_count() >= 1, "compressed node did not subscribe in time"
        for node, publisher, msg in ((A, client.pub_reliable, empty_image(client.next_stamp())),
                                     (C, client.pub_compressed, empty_compressed(client.next_stamp()))):
            prime_input(client, publisher, msg, lambda node=node: (s := client.latest(f"{node}/status")) is not None
                        and s.frames_received >= 1, f"{node} to receive its first (invalid) input")
        yield client, procs, tmp
    finally:
        client.close()
        for proc in procs.values():
            stop_process(proc)


@pytest.fixture(scope="module")
def replay(tiny_model, fixture_config):
    """Expected map-frame poses for a list of RGB frames, from an in-process session."""
    from lingbot_map_ros.config import StreamConfig
    from lingbot_map_ros.io.preprocess import preprocess_array
    from lingbot_map_ros.ros.conversions import optical_pose_to_map
    from lingbot_map_ros.stream.session import StreamingSession

    def run(frames: list[np.ndarray]) -> list[np.ndarray]:
        cfg = StreamConfig(num_scale_frames=2, sliding_window=3, keyframe_interval=1, camera_iterations=4,
                           backend="sdpa")
        session = StreamingSession(tiny_model, cfg)
        results = []
        for rgb in frames:
            results += session.push(preprocess_array(rgb, WIDTH))
        return [optical_pose_to_map(r.c2w) for r in results]

    return run


def assert_alive(procs) -> None:
    for name, proc in procs.items():
        assert proc.poll() is None, f"node {name} died (exit {proc.returncode})"


# ------------------------------------------------------------------ tests
def test_outputs_types_frames_stamps_and_parity(graph, replay):
    client, procs, _ = graph
    client.reset()
    frames = real_frames(5)
    stamps = [client.send_rgb(rgb)[0] for rgb in frames]
    poses = client.wait(lambda: len(client.msgs[f"{A}/pose"]) >= 5 and client.msgs[f"{A}/pose"], what="5 poses")
    assert [p.header.stamp for p in poses] == stamps
    assert all(p.header.frame_id == "map" for p in poses)
    for got, expected in zip(poses, replay(frames)):  # same frames, same preprocessing, same weights
        np.testing.assert_allclose(pose_matrix(got), expected, atol=1e-4)

    odometry = client.wait(lambda: len(client.msgs[f"{A}/odometry"]) >= 5 and client.msgs[f"{A}/odometry"])
    assert [o.header.stamp for o in odometry] == stamps
    assert {(o.header.frame_id, o.child_frame_id) for o in odometry} == {("map", CAMERA_FRAME)}

    clouds = client.wait(lambda: len(client.msgs[f"{A}/points"]) >= 5 and client.msgs[f"{A}/points"])
    assert [c.header.stamp for c in clouds] == stamps
    cloud = clouds[-1]
    assert cloud.header.frame_id == "map" and cloud.width > 0 and cloud.height == 1
    assert [(f.name, f.datatype, f.count) for f in cloud.fields] == [
        (name, PointField.FLOAT32, 1) for name in ("x", "y", "z", "rgb", "confidence")]
    from lingbot_map_ros.ros.conversions import read_pointcloud2

    decoded = read_pointcloud2(cloud)
    assert np.isfinite(decoded["points"]).all() and (decoded["confidence"] > NODE_PARAMS["conf_threshold"]).all()

    depths = client.wait(lambda: len(client.msgs[f"{A}/depth"]) >= 5 and client.msgs[f"{A}/depth"])
    infos = client.wait(lambda: len(client.msgs[f"{A}/depth/camera_info"]) >= 5
                        and client.msgs[f"{A}/depth/camera_info"])
    depth, info = depths[-1], infos[-1]
    assert (depth.encoding, depth.header.frame_id, depth.width, depth.height) == ("32FC1", CAMERA_FRAME, WIDTH, 56)
    assert (info.width, info.height, info.header.frame_id) == (WIDTH, 56, CAMERA_FRAME) and info.k[0] > 0
    assert [d.header.stamp for d in depths] == stamps == [i.header.stamp for i in infos]

    path = client.wait(lambda: (p := client.latest(f"{A}/path")) is not None and len(p.poses) == 5 and p)
    assert path.header.frame_id == "map" and [p.header.stamp for p in path.poses] == stamps
    status = client.status_for(stamps[-1])  # the status of the last frame itself
    assert (status.state, status.frame_index, status.frames_processed, status.frames_received) == (
        Status.STATE_TRACKING, 5, 5, 5)
    assert status.stored_frames > 0 and status.latency_model_ms > 0 and status.latency_total_ms > 0
    assert status.header.frame_id == "map"
    map_cloud = client.wait(lambda: (m := client.latest(f"{A}/map_points")) is not None and m.width > 0 and m,
                            what="map points")
    assert map_cloud.header.frame_id == "map"
    diag = client.wait(lambda: next((d for d in client.msgs["/diagnostics"] for s in d.status
                                     if s.name.endswith("lingbot_map: cache") and "pages" in s.message), None),
                       what="cache diagnostics")
    assert diag.status
    key = "image age on arrival, median of the last 64 (ms)"
    values = client.wait(lambda: next(({kv.key: kv.value for kv in s.values} for d in client.msgs["/diagnostics"]
                                       for s in d.status if s.name.endswith("lingbot_map: input")
                                       and any(kv.key == key and kv.value != "n/a" for kv in s.values)), None),
                         what="image age on /diagnostics")
    # this client stamps its images 1 s, 2 s, ... after the epoch: the age is the wall clock minus that
    assert abs(float(values[key]) - (time.time() - client._stamp) * 1e3) < 120_000.0
    assert_alive(procs)


def test_generated_frames_best_effort_and_reliable_publishers_both_deliver(graph):
    client, procs, _ = graph
    client.reset()
    stamps = []
    for i, rgb in enumerate(generated_frames(4, seed=1)):
        publisher = client.pub_best_effort if i % 2 == 0 else client.pub_reliable
        stamp, status = client.send_rgb(rgb, publisher)
        stamps.append(stamp)
    client.wait(lambda: len(client.msgs[f"{A}/pose"]) >= 4, what="4 poses")
    assert [p.header.stamp for p in client.msgs[f"{A}/pose"]] == stamps
    assert client.latest(f"{A}/status").frames_processed == 4
    assert_alive(procs)


def _bad_messages(stamp_fn) -> list[tuple[str, Image]]:
    good = generated_frames(1, seed=5)[0]
    bad = []
    msg = image_msg(good, stamp_fn())
    msg.encoding = "bayer_rggb12"
    bad.append(("unsupported encoding", msg))
    msg = image_msg(good, stamp_fn())
    msg.step = msg.width  # rgb8 needs 3 bytes a pixel
    bad.append(("wrong step", msg))
    msg = image_msg(good, stamp_fn())
    msg.data = bytes(msg.data)[: len(msg.data) // 2]
    bad.append(("truncated data", msg))
    msg = Image(header=Header(stamp=stamp_fn(), frame_id=CAMERA_FRAME), height=0, width=0, encoding="rgb8", step=0)
    bad.append(("zero size", msg))
    msg = image_msg(good[:4, :4].copy(), stamp_fn())
    bad.append(("another size", msg))
    return bad


def test_bad_raw_input_is_dropped_counted_and_survived(graph):
    client, procs, _ = graph
    client.reset()
    frames = generated_frames(3, seed=2)
    for rgb in frames[:2]:
        client.send_rgb(rgb)
    path_before = len(client.wait(lambda: (p := client.latest(f"{A}/path")) is not None and len(p.poses) == 2
                                  and p, what="path of the scale frames").poses)
    invalid = 0
    for what, msg in _bad_messages(client.next_stamp):
        status = client.send(msg)
        invalid += 1
        assert status.frames_dropped_invalid == invalid, what
        assert "invalid" in status.state_text, (what, status.state_text)
        assert_alive(procs)
    stamp, status = client.send_rgb(frames[2])
    assert status.frames_processed == 3 and status.frame_index == 3  # nothing was lost
    client.wait(lambda: stamp in [p.header.stamp for p in client.msgs[f"{A}/pose"]], what="the good frame's pose")
    client.wait(lambda: len(client.latest(f"{A}/path").poses) == path_before + 1, what="path growth")
    assert client.latest(f"{A}/status").frames_dropped_invalid == invalid


def test_bad_compressed_input_is_dropped_and_survived(graph):
    client, procs, _ = graph
    frames = generated_frames(3, seed=3)
    topic = f"{C}/status"

    def compressed(data: bytes, fmt: str = "jpeg") -> CompressedImage:
        msg = CompressedImage(header=Header(stamp=client.next_stamp(), frame_id=CAMERA_FRAME), format=fmt)
        msg.data = data
        return msg

    first = client.send(compressed(jpeg_bytes(frames[0])), client.pub_compressed, topic)
    base_invalid, base_processed = first.frames_dropped_invalid, first.frames_processed
    client.send(compressed(jpeg_bytes(frames[1])), client.pub_compressed, topic)
    good = jpeg_bytes(frames[2])
    for i, msg in enumerate([compressed(good[: len(good) // 2]), compressed(b"\x00garbage" * 50),
                             compressed(b""), compressed(jpeg_bytes(frames[2]), "16UC1; compressedDepth png")]):
        status = client.send(msg, client.pub_compressed, topic)
        assert status.frames_dropped_invalid == base_invalid + i + 1
        assert_alive(procs)
    status = client.send(compressed(good), client.pub_compressed, topic)
    assert status.frames_processed >= base_processed + 3 and status.state == Status.STATE_TRACKING


def test_rollback_restores_the_previous_state(graph, replay):
    client, procs, _ = graph
    client.reset()
    frames = generated_frames(6, seed=4)
    stamps = [client.send_rgb(rgb)[0] for rgb in frames[:4]]
    client.wait(lambda: (p := client.latest(f"{A}/path")) is not None and len(p.poses) == 4, what="path of 4")
    before = client.latest(f"{A}/status")
    # A map is stamped with the latest pose, which goes out before the output thread adds that
    # frame's points: the first map stamped with frame 4 may lack them (CI saw it). Frame 4's ~/points
    # leave after its points joined the map; the widest map stamped frame 4 once one more map came
    # after them (or none came within a few map periods: it came before) holds them.
    client.wait(lambda: any(m.header.stamp == stamps[-1] for m in client.msgs[f"{A}/points"]), what="frame 4's points")
    maps_seen = len(client.msgs[f"{A}/map_points"])
    try:
        client.wait(lambda: len(client.msgs[f"{A}/map_points"]) > maps_seen, timeout=MAP_SETTLE_S,
                    what="a map after frame 4's points")
    except AssertionError:
        pass  # the map with them was published before its ~/points arrived: it is among those seen
    width_before = max(m.width for m in client.msgs[f"{A}/map_points"] if m.header.stamp == stamps[-1])

    response = client.call(RollbackFrame, f"{A}/rollback_last_frame", RollbackFrame.Request(expected_frame_index=9))
    assert not response.success and "not" in response.message
    assert client.latest(f"{A}/status").stored_frames == before.stored_frames

    response = client.call(RollbackFrame, f"{A}/rollback_last_frame", RollbackFrame.Request(expected_frame_index=4))
    assert response.success and response.frame_index == 4, response.message
    path = client.wait(lambda: (p := client.latest(f"{A}/path")) is not None and len(p.poses) == 3 and p,
                       what="path without the rolled-back pose")
    assert [p.header.stamp for p in path.poses] == stamps[:3]
    status = client.wait(lambda: (s := client.latest(f"{A}/status")).temporal_index == before.temporal_index - 1
                         and s, what="cache stats after rollback")
    assert status.stored_frames == before.stored_frames - 1 and status.free_pages > before.free_pages
    client.wait(lambda: client.latest(f"{A}/map_points").width < width_before, what="map shrink")

    again = client.call(RollbackFrame, f"{A}/rollback_last_frame", RollbackFrame.Request(expected_frame_index=0))
    assert not again.success and "nothing to roll back" in again.message

    stamp, status = client.send_rgb(frames[4])
    assert status.frame_index == 4
    pose = client.wait(lambda: client.poses().get(stamp.sec), what="the pose after rollback")
    expected = replay(frames[:3] + frames[4:5])[-1]
    np.testing.assert_allclose(pose_matrix(pose), expected, atol=1e-4)
    assert_alive(procs)


def test_deferred_eviction_and_commit(graph):
    client, procs, _ = graph
    client.reset()
    response = client.call(SetBool, f"{A}/set_deferred_eviction", SetBool.Request(data=True))
    assert response.success, response.message
    for rgb in generated_frames(7, seed=6):  # 2 scale frames + a window of 3 + 2 beyond it
        client.send_rgb(rgb)
    status = client.latest(f"{A}/status")
    assert status.deferred_eviction and status.pending_evictions == 2
    response = client.call(CommitEviction, f"{A}/commit_eviction", CommitEviction.Request())
    assert response.success and response.pages_freed > 0, response.message
    after = client.wait(lambda: (s := client.latest(f"{A}/status")).pending_evictions == 0 and s,
                        what="status after commit")
    assert after.free_pages == status.free_pages + response.pages_freed
    assert after.window_pages == status.window_pages - response.pages_freed
    response = client.call(CommitEviction, f"{A}/commit_eviction", CommitEviction.Request())
    assert response.success and response.pages_freed == 0
    response = client.call(SetBool, f"{A}/set_deferred_eviction", SetBool.Request(data=False))
    assert response.success
    client.wait(lambda: not client.latest(f"{A}/status").deferred_eviction, what="deferred flag off")
    assert_alive(procs)


def test_save_map_then_reset(graph, tmp_path):
    from lingbot_map_ros.io.export import read_ply, read_tum

    client, procs, _ = graph
    client.reset()
    stamps = [client.send_rgb(rgb)[0] for rgb in generated_frames(4, seed=7)]
    response = client.call(SaveMap, f"{A}/save_map", SaveMap.Request(directory=str(tmp_path)))
    assert response.success, response.message
    points, colors = read_ply(response.ply_path)
    assert points.shape[0] > 0 and colors is not None
    times, poses = read_tum(response.trajectory_path)
    np.testing.assert_allclose(times, [s.sec + s.nanosec * 1e-9 for s in stamps], atol=1e-6)
    # ~/status came for every frame; a ~/pose may still be in flight on its own topic
    recorded = client.wait(lambda: {int(t) for t in times} <= set(p := client.poses()) and p,
                           what="the poses of the saved frames")
    for t, T in zip(times, poses):
        np.testing.assert_allclose(T, pose_matrix(recorded[int(t)]), atol=1e-5)

    response = client.call(Trigger, f"{A}/reset", Trigger.Request())
    assert response.success
    status = client.wait(lambda: (s := client.latest(f"{A}/status")).frames_received == 0 and s)
    assert (status.frames_processed, status.frames_dropped_invalid, status.frame_index, status.stored_frames) == (
        0, 0, 0, 0)
    client.wait(lambda: (p := client.latest(f"{A}/path")) is not None and len(p.poses) == 0, what="empty path")
    stamp, status = client.send_rgb(generated_frames(1, seed=8)[0])
    assert status.frame_index == 1 and status.state == Status.STATE_INITIALIZING  # a new sequence


def test_waiting_for_images_is_reported(graph):
    client, procs, _ = graph
    client.clear()
    client.send_rgb(generated_frames(1, seed=9)[0])
    diag = client.wait(lambda: next((s for d in client.msgs["/diagnostics"] for s in d.status
                                     if s.name.endswith("lingbot_map: input") and s.level == DiagnosticStatus.WARN),
                                    None), what="an input warning on /diagnostics")
    assert "/cam_a/image" in diag.message
    client.wait(lambda: client.latest(f"{A}/status").state == Status.STATE_WAITING_FOR_IMAGES,
                what="WAITING_FOR_IMAGES")


def test_a_checkpoint_that_does_not_load_fails_at_start(graph, tmp_path):
    from lingbot_map_ros.runtime.params import write_params_file

    params = write_params_file(tmp_path / "bad.yaml", {**NODE_PARAMS, "checkpoint": str(tmp_path / "missing.pt")})
    proc = start_node("lingbot_map_bad", params, tmp_path / "bad.log")
    try:
        proc.wait(START_TIMEOUT)
    finally:
        stop_process(proc)
    log = (tmp_path / "bad.log").read_text()
    assert proc.returncode == 1, log
    assert "cannot start" in log and "checkpoint file not found" in log and "missing.pt" in log
    assert "Traceback" not in log


@pytest.mark.parametrize("transport", ["compressed", "raw"])
def test_image_folder_publisher_feeds_the_node(graph, tmp_path, transport):
    """The demo/test publisher as a process: file bytes as CompressedImage, or rgb8 Images, with
    CameraInfo; it exits by itself after max_frames."""
    from lingbot_map_ros.cli.demo import synthetic_sequence

    client, procs, _ = graph
    folder = synthetic_sequence(tmp_path / "frames", 5, size=(196, 112))
    topic = f"{C}/status" if transport == "compressed" else f"{A}/status"
    target = "image/compressed:=/cam_c/image/compressed" if transport == "compressed" else "image:=/cam_a/image"
    before = client.wait(lambda: client.latest(topic), what=f"a status on {topic}")
    if transport == "raw":
        client.reset()
        before = None
    env = dict(os.environ, ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST", ROS_DOMAIN_ID=str(DOMAIN_ID))
    cmd = [sys.executable, "-m", "lingbot_map_ros.ros.image_folder_publisher", "--ros-args",
           "-p", f"images:={folder}", "-p", "rate:=5.0", "-p", "max_frames:=4", "-p", f"transport:={transport}",
           "-p", "publish_camera_info:=true", "-p", "frame_id:=folder_cam", "-r", target,
           "-r", "camera_info:=/cam_a/camera_info"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=START_TIMEOUT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "published 4 frame(s)" in result.stdout + result.stderr
    received = (before.frames_received if before else 0) + 4
    status = client.wait(lambda: (s := client.latest(topic)).frames_received >= received and s,
                         what="4 frames received")
    assert status.frames_dropped_invalid == (before.frames_dropped_invalid if before else 0)
    if transport == "raw":
        client.wait(lambda: len(client.msgs[f"{A}/odometry"]) > 0, what="odometry")
        assert client.msgs[f"{A}/odometry"][-1].child_frame_id == "folder_cam"
    assert_alive(procs)


def test_services_are_served_by_the_helper_node_under_the_nodes_names(graph):
    """The services run on '<node>_services' (its own executor thread, so a call that waits for
    the inference thread does not hold up image intake) under the node's own names."""
    client, procs, _ = graph
    expected = {"reset", "set_deferred_eviction", "commit_eviction", "rollback_last_frame", "save_map"}
    for node in (A, C):
        name = node.strip("/")
        served = client.wait(lambda: {s for s, _ in client.node.get_service_names_and_types_by_node(
            f"{name}_services", "/")} >= {f"{node}/{e}" for e in expected} and True,
            what=f"services of {name}_services")
        assert served
        main = {s for s, _ in client.node.get_service_names_and_types_by_node(name, "/")}
        assert not main & {f"{node}/{e}" for e in expected}  # not on the main node
    response = client.call(CommitEviction, f"{A}/commit_eviction", CommitEviction.Request())
    assert response.success
    assert_alive(procs)


def test_a_raw_input_node_without_a_fastdds_profile_says_how_to_avoid_fragment_loss(graph):
    client, procs, tmp = graph
    if os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE") or os.environ.get("RMW_IMPLEMENTATION", "rmw_fastrtps_cpp") \
            not in ("", "rmw_fastrtps_cpp"):
        pytest.skip("a Fast DDS profile (or another RMW) is configured in this environment")
    raw, compressed = (tmp / "a.log").read_text(), (tmp / "c.log").read_text()
    assert "FASTDDS_DEFAULT_PROFILES_FILE is not set" in raw and "fastdds_large_messages.xml" in raw
    assert "FASTDDS_DEFAULT_PROFILES_FILE is not set" not in compressed  # compressed frames are small


def test_camera_batching_without_cameras_is_said_to_have_no_effect(graph):
    _, _, tmp = graph
    raw, compressed = (tmp / "a.log").read_text(), (tmp / "c.log").read_text()
    assert "camera_batching is true but cameras is empty" in compressed
    assert "camera_batching is true" not in raw
