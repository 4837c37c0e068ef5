"""The replay's outputs: the results bag (topics, types, stamps, REP-103 frames, the node's cloud
layout), the incremental TUM/PLY writers and the chunked prediction store."""
from __future__ import annotations

import numpy as np
import pytest

from lingbot_map_ros.cli.replay import main
from lingbot_map_ros.io.export import read_ply, read_tum
from lingbot_map_ros.io.results import (DepthPolicy, PlyStreamWriter, PredictionStore, TumStreamWriter, iter_depth,
                                        load_predictions)
from lingbot_map_ros.io.results_bag import OPTICAL_TO_REP103
from replay_fixtures import bag_types, read_bag, write_image_bag

TOPIC = "/camera/image"


@pytest.fixture(scope="module")
def bag_run(loop_frames, tiny, tmp_path_factory):
    """One replay of a bag into every output; the results bag written with depth every 2nd frame."""
    root = tmp_path_factory.mktemp("run")
    stamps = write_image_bag(root / "in", loop_frames, "mcap", "compressed", TOPIC)
    paths = {"out": root / "p.npz", "trajectory": root / "t.tum", "ply": root / "c.ply", "out_bag": root / "res"}
    argv = ["--bag", str(root / "in"), "--topic", TOPIC, *tiny, "--save-depth", "every-2"]
    for flag, path in paths.items():
        argv += [f"--{flag.replace('_', '-')}", str(path)]
    assert main(argv) == 0
    return paths, stamps


def test_results_bag_topics_types_and_stamps(bag_run):
    paths, stamps = bag_run
    assert bag_types(paths["out_bag"]) == {
        "/tf": "tf2_msgs/msg/TFMessage", "/lingbot_map/odometry": "nav_msgs/msg/Odometry",
        "/lingbot_map/path": "nav_msgs/msg/Path", "/lingbot_map/points": "sensor_msgs/msg/PointCloud2",
        "/lingbot_map/depth": "sensor_msgs/msg/Image", "/lingbot_map/depth/camera_info": "sensor_msgs/msg/CameraInfo"}
    msgs = read_bag(paths["out_bag"])
    for topic in ("/tf", "/lingbot_map/odometry", "/lingbot_map/points"):
        assert [t for t, _ in msgs[topic]] == stamps, topic
    for topic in ("/lingbot_map/depth", "/lingbot_map/depth/camera_info"):
        assert [t for t, _ in msgs[topic]] == stamps[::2], topic  # --save-depth every-2
    for topic, items in msgs.items():
        for log_time, msg in items:
            header = msg.transforms[0].header if topic == "/tf" else msg.header
            assert header.stamp.sec * 10**9 + header.stamp.nanosec == log_time
    path = msgs["/lingbot_map/path"]
    assert path[0][0] == stamps[0] and path[-1][0] == stamps[-1]  # 10 Hz input, path at 2 Hz and at the end
    assert len(path[-1][1].poses) == len(stamps)
    assert all(p.header.frame_id == "map" for p in path[-1][1].poses)


def test_results_bag_poses_points_depth_in_the_map_frame(bag_run):
    paths, stamps = bag_run
    pred = load_predictions(paths["out"])
    msgs = read_bag(paths["out_bag"])
    R = OPTICAL_TO_REP103[:3, :3]
    for i, ((_, tf), (_, odom)) in enumerate(zip(msgs["/tf"], msgs["/lingbot_map/odometry"])):
        t = tf.transforms[0]
        assert t.header.frame_id == "map" and t.child_frame_id == "cam_optical"  # the images' frame_id
        v = t.transform.translation
        np.testing.assert_allclose([v.x, v.y, v.z], R @ pred["pose_c2w"][i, :3, 3], atol=1e-5)
        p = odom.pose.pose.position
        assert (p.x, p.y, p.z) == (v.x, v.y, v.z) and odom.child_frame_id == "cam_optical"
    # the first camera looks along the map's x axis: its optical z (forward) is map x
    q = msgs["/tf"][0][1].transforms[0].transform.rotation
    from lingbot_map_ros.geometry import quaternion_to_matrix

    rot = quaternion_to_matrix(np.array([q.x, q.y, q.z, q.w]))
    np.testing.assert_allclose(rot @ [0, 0, 1], R @ pred["pose_c2w"][0, :3, :3] @ [0, 0, 1], atol=1e-5)

    cloud = msgs["/lingbot_map/points"][0][1]
    assert [(f.name, f.offset, f.datatype, f.count) for f in cloud.fields] == [
        ("x", 0, 7, 1), ("y", 4, 7, 1), ("z", 8, 7, 1), ("rgb", 12, 7, 1), ("confidence", 16, 7, 1)]
    assert cloud.point_step == 20 and cloud.height == 1 and cloud.header.frame_id == "map"
    rows = np.frombuffer(cloud.data.tobytes(), np.dtype({"names": ["x", "y", "z", "rgb", "c"], "formats":
                         ["<f4", "<f4", "<f4", "<u4", "<f4"], "offsets": [0, 4, 8, 12, 16], "itemsize": 20}))
    assert rows.size == cloud.width > 0 and (rows["c"] > 1.5).all() and (rows["rgb"] >> 24 == 0).all()
    # the PLY holds the same points in the OpenCV world: frame 0's are its first rows
    ply_points, ply_colors = read_ply(paths["ply"])
    map_points = np.stack([rows["x"], rows["y"], rows["z"]], -1)
    np.testing.assert_allclose(map_points, ply_points[:rows.size] @ R.T.astype(np.float32), atol=1e-5)
    packed = rows["rgb"]
    np.testing.assert_array_equal(np.stack([packed >> 16 & 255, packed >> 8 & 255, packed & 255], -1),
                                  ply_colors[:rows.size])

    depth_msg = msgs["/lingbot_map/depth"][1][1]  # frame 2
    assert depth_msg.encoding == "32FC1" and depth_msg.header.frame_id == "cam_optical"
    depth = np.frombuffer(depth_msg.data.tobytes(), "<f4").reshape(depth_msg.height, depth_msg.width)
    expected = pred["depth"][list(pred["depth_frames"]).index(2)]
    np.testing.assert_array_equal(depth, np.where(expected > 0, expected, np.nan))
    info = msgs["/lingbot_map/depth/camera_info"][1][1]
    np.testing.assert_allclose(np.asarray(info.k).reshape(3, 3), pred["intrinsics"][2], rtol=1e-6)
    assert (info.width, info.height) == (depth_msg.width, depth_msg.height)


def test_the_map_matrix_is_the_nodes():
    conversions = pytest.importorskip("lingbot_map_ros.ros.conversions", reason="ROS messages not installed")
    np.testing.assert_array_equal(OPTICAL_TO_REP103, conversions.OPTICAL_TO_REP103)


def test_outputs_agree_with_each_other(bag_run):
    paths, stamps = bag_run
    pred = load_predictions(paths["out"])
    t, c2w = read_tum(paths["trajectory"])
    np.testing.assert_allclose(t, np.array(stamps) / 1e9, rtol=0, atol=1e-6)
    np.testing.assert_allclose(c2w, pred["pose_c2w"], atol=1e-5)
    assert pred["depth_frames"].tolist() == [0, 2, 4, 6]
    assert pred["depth"].shape == (4, 56, 98)
    assert not list(paths["out"].parent.glob("*.partial")) and not list(paths["out"].parent.glob(".*"))


def test_ply_stream_writer_round_trip_and_abort(tmp_path):
    rng = np.random.default_rng(1)
    parts = [(rng.normal(size=(n, 3)).astype(np.float32), rng.integers(0, 256, (n, 3), dtype=np.uint8))
             for n in (5, 0, 17)]
    w = PlyStreamWriter(tmp_path / "a.ply")
    for p, c in parts:
        w.add(p, c)
    assert not (tmp_path / "a.ply").exists() and (tmp_path / "a.ply.partial").exists()
    assert w.close() == tmp_path / "a.ply"
    points, colors = read_ply(tmp_path / "a.ply")
    np.testing.assert_array_equal(points, np.concatenate([p for p, _ in parts]))
    np.testing.assert_array_equal(colors, np.concatenate([c for _, c in parts]))
    w = PlyStreamWriter(tmp_path / "b.ply")
    w.add(*parts[0])
    assert w.abort() == tmp_path / "b.ply.partial"
    assert read_ply(tmp_path / "b.ply.partial")[0].shape == (5, 3)  # a partial PLY is still valid
    with pytest.raises(ValueError, match="uint8 colors"):
        PlyStreamWriter(tmp_path / "c.ply").add(parts[0][0], parts[0][1].astype(np.float32))


def test_tum_stream_writer_and_refused_destination(tmp_path):
    c2w = np.tile(np.eye(4), (3, 1, 1))
    c2w[:, :3, 3] = np.arange(9).reshape(3, 3)
    w = TumStreamWriter(tmp_path / "t.tum")
    for i in range(3):
        w.add(1.5 * i, c2w[i])
    w.close()
    t, back = read_tum(tmp_path / "t.tum")
    np.testing.assert_allclose(t, [0, 1.5, 3.0])
    np.testing.assert_allclose(back, c2w)
    (tmp_path / "link.tum").symlink_to(tmp_path / "t.tum")
    from lingbot_map_ros.io.atomic import UnsafeDestinationError

    with pytest.raises(UnsafeDestinationError):
        TumStreamWriter(tmp_path / "link.tum")


@pytest.mark.parametrize("frames,chunk,policy,kept", [(25, 10, "all", 25), (25, 10, "every-3", 9),
                                                      (7, 10, "all", 7), (12, 10, "none", 0)])
def test_prediction_store_chunks(tmp_path, frames, chunk, policy, kept):
    rng = np.random.default_rng(2)
    depth = rng.random((frames, 4, 6), dtype=np.float32)
    store = PredictionStore(tmp_path / "p.npz", DepthPolicy.parse(policy), chunk_frames=chunk)
    for i in range(frames):
        store.add(np.full(9, i, np.float32), np.eye(4) * i, np.eye(3), i % 2 == 0, 1000 + i, i // 10, depth[i],
                  depth[i] + 1)
    written = store.close()
    arrays = load_predictions(tmp_path / "p.npz")
    assert arrays["pose_enc"][:, 0].tolist() == list(range(frames))
    assert arrays["stamp_ns"].tolist() == [1000 + i for i in range(frames)]
    assert arrays["window"].tolist() == [i // 10 for i in range(frames)]
    rows = [i for i in range(frames) if DepthPolicy.parse(policy).keeps(i)]
    assert arrays["depth_frames"].tolist() == rows and len(rows) == kept
    chunked = kept > chunk
    assert ("depth_chunks" in arrays) == chunked and ((tmp_path / "p.chunks") in written) == chunked
    if kept:
        np.testing.assert_array_equal(arrays["depth"], depth[rows])
        np.testing.assert_array_equal(arrays["depth_conf"], depth[rows] + 1)
        blocks = list(iter_depth(tmp_path / "p.npz"))
        assert [len(b[0]) for b in blocks] == ([chunk] * (kept // chunk) + [kept % chunk] * bool(kept % chunk)
                                               if chunked else [kept])
    else:
        assert "depth" not in arrays
    assert not list(tmp_path.glob("*.partial"))


def test_prediction_store_abort_marks_partial(tmp_path):
    store = PredictionStore(tmp_path / "p.npz", DepthPolicy(1), chunk_frames=2)
    for i in range(5):
        store.add(np.zeros(9), np.eye(4), np.eye(3), True, i, 0, np.ones((2, 2)), np.ones((2, 2)))
    kept = store.abort()
    assert kept == [tmp_path / "p.npz.partial", tmp_path / "p.chunks.partial"]
    assert not (tmp_path / "p.npz").exists() and not (tmp_path / "p.chunks").exists()
    arrays = load_predictions(tmp_path / "p.npz.partial")
    assert arrays["depth"].shape == (5, 2, 2) and arrays["pose_enc"].shape == (5, 9)


@pytest.mark.parametrize("text", ["every-0", "every-", "some", "every-x"])
def test_depth_policy_rejects(text):
    with pytest.raises(ValueError, match="none, all or every-K"):
        DepthPolicy.parse(text)


def test_results_bag_messages_deserialize_with_rclpy(bag_run):
    """The bytes in the results bag are what a ROS 2 graph carries: rclpy reads them into its own
    message classes, and the node's cloud reader finds the same points."""
    serialization = pytest.importorskip("rclpy.serialization", reason="rclpy not installed")
    conversions = pytest.importorskip("lingbot_map_ros.ros.conversions", reason="ROS messages not installed")
    from nav_msgs.msg import Odometry, Path
    from rosbags.highlevel import AnyReader
    from sensor_msgs.msg import CameraInfo, Image, PointCloud2
    from tf2_msgs.msg import TFMessage

    classes = {"/tf": TFMessage, "/lingbot_map/odometry": Odometry, "/lingbot_map/path": Path,
               "/lingbot_map/points": PointCloud2, "/lingbot_map/depth": Image,
               "/lingbot_map/depth/camera_info": CameraInfo}
    paths, stamps = bag_run
    ours = read_bag(paths["out_bag"])
    seen = set()
    with AnyReader([paths["out_bag"]]) as reader:
        for conn, log_time, raw in reader.messages():
            msg = serialization.deserialize_message(bytes(raw), classes[conn.topic])
            seen.add(conn.topic)
            if conn.topic == "/lingbot_map/points" and log_time == stamps[0]:
                cloud = conversions.read_pointcloud2(msg)
                rows = ours["/lingbot_map/points"][0][1]
                assert cloud["points"].shape == (rows.width, 3)
                np.testing.assert_array_equal(cloud["points"].reshape(-1).view(np.uint8),
                                              np.frombuffer(rows.data.tobytes(), np.uint8).reshape(-1, 20)[:, :12]
                                              .reshape(-1))
            if conn.topic == "/lingbot_map/depth":
                depth = conversions.image_to_depth(msg)
                assert depth.shape == (56, 98) and msg.header.frame_id == "cam_optical"
    assert seen == set(classes)
