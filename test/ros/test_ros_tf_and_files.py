"""TF maths and TF mode logic of the node (no graph: a fake node records what would be
sent, tf2's buffer is filled by hand), and the robot-side files (launch, config, RViz):
the launch file is parsed with ``ast`` and, where ``launch`` is importable, its set-up
function is run with a recording ``Node``."""
from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from lingbot_map_ros.geometry import quaternion_to_matrix
from lingbot_map_ros.ros.conversions import OPTICAL_TO_REP103, optical_pose_to_map, transform_stamped
from lingbot_map_ros.runtime.params import PARAMETER_NAMES, PARAMETERS, check_value, resolve_settings
from lingbot_map_ros.ros.tf_tools import (AUTO_ODOM_GRACE_S, TfOutput, camera_child_frame, choose_mode, compose,
                                          edge_for, invert_rigid, map_to_base, map_to_odom, parents_from_yaml,
                                          transform_to_matrix)

pytestmark = pytest.mark.ros
REPO = Path(__file__).resolve().parents[2]
LAUNCH_ARGUMENTS = {"params_file", "checkpoint", "image_topic", "camera_info_topic", "input_transport", "device",
                    "dtype", "namespace", "use_sim_time", "rviz", "keyframe_selector", "keyframe_decision_timeout",
                    "dds_profile", "cameras", "camera_batching", "state_directory", "session", "managed"}
EXTRAS_HINT = "install ../shared/ros_extras (bash ../shared/ros_extras/install.sh .venv)"
NO_TF2 = f"tf2_ros not importable: {EXTRAS_HINT}"
NO_LAUNCH = f"launch/launch_ros not importable: {EXTRAS_HINT}"


def rigid(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    q = rng.normal(size=4)
    T = np.eye(4)
    T[:3, :3] = quaternion_to_matrix(q / np.linalg.norm(q))
    T[:3, 3] = rng.normal(size=3)
    return T


def test_transform_message_round_trip_and_inverse():
    from std_msgs.msg import Header

    T = rigid(0)
    msg = transform_stamped(T, Header(frame_id="map"), "cam")
    np.testing.assert_allclose(transform_to_matrix(msg), T, atol=1e-12)
    np.testing.assert_allclose(invert_rigid(T) @ T, np.eye(4), atol=1e-12)


def test_map_to_base_and_map_to_odom_compose_to_the_model_pose():
    T_map_cam, T_cam_base, T_odom_base = rigid(1), rigid(2), rigid(3)
    T_map_base = map_to_base(T_map_cam, T_cam_base)
    np.testing.assert_allclose(T_map_base, T_map_cam @ T_cam_base)
    np.testing.assert_allclose(map_to_base(T_map_cam), T_map_cam)
    # map -> odom -> base must land the base where the model puts it
    T_map_odom = map_to_odom(T_map_cam, T_odom_base, T_cam_base)
    np.testing.assert_allclose(T_map_odom @ T_odom_base, T_map_base, atol=1e-12)


def test_first_camera_looking_forward_is_the_map_x_axis():
    """Identity c2w (the first camera) -> the optical z axis (forward) is map +x, optical y (down) is map -z."""
    T = optical_pose_to_map(np.eye(4))
    np.testing.assert_allclose(T[:3, :3] @ [0, 0, 1], [1, 0, 0])
    np.testing.assert_allclose(T[:3, :3] @ [0, 1, 0], [0, 0, -1])
    np.testing.assert_allclose(T[:3, :3] @ [1, 0, 0], [0, -1, 0])
    assert np.isclose(np.linalg.det(OPTICAL_TO_REP103[:3, :3]), 1.0)


# Hand-computed example. The first camera (T_map_cam = the REP-103 rotation of its optical axes)
# sits 0.2 m ahead of and 0.5 m above the robot base, level, looking forward: T_base_cam =
# [R_opt | (0.2, 0, 0.5)]. So the base is 0.2 m behind and 0.5 m below the map origin, unrotated.
R_OPT = np.array([[0.0, 0.0, 1.0], [-1.0, 0.0, 0.0], [0.0, -1.0, 0.0]])
R_Z90 = np.array([[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])  # yaw +90 degrees (left)


def rigid_rt(R, t) -> np.ndarray:
    T = np.eye(4)
    T[:3, :3], T[:3, 3] = R, t
    return T


T_MAP_CAM0 = rigid_rt(R_OPT, [0, 0, 0])
T_BASE_CAM = rigid_rt(R_OPT, [0.2, 0.0, 0.5])
T_ODOM_BASE = rigid_rt(R_Z90, [3.0, 1.0, 0.0])  # the robot's odometry: 3 m forward, 1 m left, facing left


def test_compose_per_mode_matches_hand_computed_transforms():
    T_cam_base = invert_rigid(T_BASE_CAM)
    np.testing.assert_allclose(R_OPT, OPTICAL_TO_REP103[:3, :3])
    # map_to_base: T_map_base = T_map_cam . T_cam_base = [I | (-0.2, 0, -0.5)]
    np.testing.assert_allclose(compose("map_to_base", T_MAP_CAM0, T_cam_base), rigid_rt(np.eye(3), [-0.2, 0, -0.5]),
                               atol=1e-12)
    # map_to_odom: T_map_odom = T_map_base . inv(T_odom_base); inv(T_odom_base) = [Rz90^T | (-1, 3, 0)]
    # -> [Rz90^T | (-1.2, 3, -0.5)]
    np.testing.assert_allclose(compose("map_to_odom", T_MAP_CAM0, T_cam_base, T_ODOM_BASE),
                               rigid_rt(R_Z90.T, [-1.2, 3.0, -0.5]), atol=1e-12)
    # map_to_camera: the camera pose itself (published under <camera>_lingbot)
    np.testing.assert_allclose(compose("map_to_camera", T_MAP_CAM0), T_MAP_CAM0)
    # the camera later: 1 m along map x, turned 90 degrees left -> base at (1, 0, 0) + Rz90 (-0.2, 0, -0.5)
    T_map_cam1 = rigid_rt(R_Z90 @ R_OPT, [1.0, 0.0, 0.0])
    np.testing.assert_allclose(compose("map_to_base", T_map_cam1, T_cam_base), rigid_rt(R_Z90, [1.0, -0.2, -0.5]),
                               atol=1e-12)
    # the camera is the base (no extrinsic): map_to_base publishes the camera pose
    np.testing.assert_allclose(compose("map_to_base", T_map_cam1), T_map_cam1)


def test_compose_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="needs T_odom_base"):
        compose("map_to_odom", T_MAP_CAM0, None, None)
    with pytest.raises(ValueError, match="unknown TF mode 'auto'"):
        compose("auto", T_MAP_CAM0)


@pytest.mark.parametrize("tf_mode, base, odom, current, waited, expected", [
    ("map_to_odom", "base_link", False, None, 0.0, "map_to_odom"),  # explicit modes are taken as they are
    ("map_to_base", "base_link", True, None, 0.0, "map_to_base"),
    ("map_to_camera", "base_link", True, None, 0.0, "map_to_camera"),
    ("auto", "", True, None, 0.0, "map_to_camera"),  # no robot
    ("auto", "base_link", True, None, 0.0, "map_to_odom"),  # odometry is there
    ("auto", "base_link", False, None, 0.5, None),  # waiting for odometry (grace)
    ("auto", "base_link", False, None, AUTO_ODOM_GRACE_S, "map_to_base"),  # grace over
    ("auto", "base_link", False, "map_to_base", 0.0, "map_to_base"),
    ("auto", "base_link", True, "map_to_base", 0.0, "map_to_odom"),  # odometry appeared: switch up
    ("auto", "base_link", False, "map_to_odom", 99.0, "map_to_odom"),  # odometry gone: never flips back
])
def test_auto_mode_choice(tf_mode, base, odom, current, waited, expected):
    assert choose_mode(tf_mode, base, odom, current, waited) == expected


SETTINGS = resolve_settings({"tf_mode": "auto"}, cuda_available=lambda: False)


def test_edges_name_parent_child_and_lookups():
    s = replace(SETTINGS, map_frame="map", odom_frame="odom", base_frame="base_link", camera_tf_frame="")
    assert camera_child_frame("", "cam_optical") == "cam_optical_lingbot"
    assert camera_child_frame("lingbot_cam", "cam_optical") == "lingbot_cam"
    e = edge_for("map_to_camera", s, "cam_optical")
    assert (e.parent, e.child, e.needs_extrinsic, e.needs_odom) == ("map", "cam_optical_lingbot", False, False)
    e = edge_for("map_to_base", s, "cam_optical")
    assert (e.parent, e.child, e.needs_extrinsic, e.needs_odom) == ("map", "base_link", True, False)
    e = edge_for("map_to_odom", s, "cam_optical")
    assert (e.parent, e.child, e.needs_extrinsic, e.needs_odom) == ("map", "odom", True, True)
    assert not edge_for("map_to_base", s, "base_link").needs_extrinsic  # the camera is the base


YAML_SAMPLE = """cam: \n  parent: 'base_link'\n  broadcaster: 'x'\n  rate: 10000.000\nbase_link: \n  parent: 'odom'
  broadcaster: 'y'\n  most_recent_transform: 5.000000\n"""


def test_parents_from_tf2_yaml():
    assert parents_from_yaml(YAML_SAMPLE) == {"cam": "base_link", "base_link": "odom"}
    assert parents_from_yaml("") == {}


# ------------------------------------------------------------------ TfOutput, no graph
class FakeNode:
    """Enough of an rclpy node for tf2_ros' broadcaster and listener: records publishers,
    subscriptions, what is published and the info lines."""

    def __init__(self) -> None:
        self.sent: list = []
        self.publishers: list[str] = []
        self.subscriptions: list[str] = []
        self.infos: list[str] = []

    def create_publisher(self, msg_type, topic, qos, **kwargs):
        self.publishers.append(topic)
        node = self

        class Pub:
            def publish(self, msg) -> None:
                node.sent.extend(msg.transforms)
        return Pub()

    def create_subscription(self, msg_type, topic, callback, qos, **kwargs):
        self.subscriptions.append(topic)
        return topic

    def destroy_subscription(self, sub) -> None:
        pass

    def get_logger(self):
        return self

    def info(self, text: str) -> None:
        self.infos.append(text)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def tf_output(**frames):
    pytest.importorskip("tf2_ros", reason=NO_TF2)
    node, warnings, clock = FakeNode(), [], Clock()
    settings = replace(SETTINGS, **{"map_frame": "map", "odom_frame": "odom", "base_frame": "", "camera_tf_frame": "",
                                    **frames})
    out = TfOutput(node, settings, warnings.append, clock=clock)
    return out, node, warnings, clock


def stamp(sec: int):
    from builtin_interfaces.msg import Time

    return Time(sec=sec, nanosec=0)


def put(out: TfOutput, T: np.ndarray, parent: str, child: str, sec: int | None = None) -> None:
    """A transform as the listener would store it (static when ``sec`` is None)."""
    from std_msgs.msg import Header

    msg = transform_stamped(T, Header(stamp=stamp(sec or 0), frame_id=parent), child)
    if sec is None:
        out._buffer.set_transform_static(msg, "test")
    else:
        out._buffer.set_transform(msg, "test")


def sent(node: FakeNode, index: int = -1) -> tuple[str, str, np.ndarray]:
    t = node.sent[index]
    return t.header.frame_id, t.child_frame_id, transform_to_matrix(t)


def test_tf_output_map_to_camera_uses_its_own_child_frame():
    out, node, warnings, _ = tf_output(tf_mode="map_to_camera")
    put(out, T_BASE_CAM, "base_link", "cam_optical")  # the URDF parents the camera frame
    assert out.publish(T_MAP_CAM0, stamp(5), "cam_optical")
    parent, child, T = sent(node)
    assert (parent, child) == ("map", "cam_optical_lingbot")
    np.testing.assert_allclose(T, T_MAP_CAM0, atol=1e-9)
    assert node.sent[-1].header.stamp == stamp(5) and not warnings


def test_tf_output_never_gives_a_parented_frame_a_second_parent():
    out, node, warnings, _ = tf_output(tf_mode="map_to_camera", camera_tf_frame="cam_optical")
    put(out, T_BASE_CAM, "base_link", "cam_optical")
    assert not out.publish(T_MAP_CAM0, stamp(5), "cam_optical")
    assert node.sent == []
    assert len(warnings) == 1 and "cam_optical already has the parent base_link" in warnings[0]
    assert "camera_tf_frame" in warnings[0]


def test_tf_output_waits_for_the_camera_extrinsic_then_publishes_map_to_base():
    out, node, warnings, clock = tf_output(tf_mode="map_to_base", base_frame="base_link")
    assert not out.publish(T_MAP_CAM0, stamp(5), "cam_optical")
    assert node.sent == [] and len(warnings) == 1
    assert warnings[0].startswith("waiting for TF cam_optical -> base_link (the camera extrinsic")
    assert not out.publish(T_MAP_CAM0, stamp(6), "cam_optical")
    assert len(warnings) == 1  # throttled
    put(out, T_BASE_CAM, "base_link", "cam_optical")
    assert out.publish(T_MAP_CAM0, stamp(7), "cam_optical")
    parent, child, T = sent(node)
    assert (parent, child) == ("map", "base_link")
    np.testing.assert_allclose(T, rigid_rt(np.eye(3), [-0.2, 0, -0.5]), atol=1e-9)
    # a robot whose odometry parents base_link: map_to_base refuses (base_link would get two parents)
    put(out, T_ODOM_BASE, "odom", "base_link", sec=8)
    clock.t += 10.0  # past the parent check period and the warning throttle
    assert not out.publish(T_MAP_CAM0, stamp(8), "cam_optical")
    assert "base_link already has the parent odom" in warnings[-1] and "map_to_odom" in warnings[-1]


def test_tf_output_map_to_odom_at_the_image_stamp():
    out, node, warnings, clock = tf_output(tf_mode="map_to_odom", base_frame="base_link")
    put(out, T_BASE_CAM, "base_link", "cam_optical")
    put(out, rigid_rt(np.eye(3), [0.0, 0.0, 0.0]), "odom", "base_link", sec=4)
    put(out, T_ODOM_BASE, "odom", "base_link", sec=5)
    assert out.publish(T_MAP_CAM0, stamp(5), "cam_optical")
    parent, child, T = sent(node)
    assert (parent, child) == ("map", "odom")
    np.testing.assert_allclose(T, rigid_rt(R_Z90.T, [-1.2, 3.0, -0.5]), atol=1e-9)
    # no odometry at a later image stamp: nothing, and a warning naming the transform
    assert not out.publish(T_MAP_CAM0, stamp(9), "cam_optical")
    assert len(node.sent) == 1
    assert warnings[-1].startswith("no TF odom -> base_link (odometry) at the image stamp 9.000000000")


def test_tf_output_clears_its_buffer_when_the_stamps_jump_back():
    """A bag played in a loop: tf2 drops odometry older than its newest by over 10 s, so the
    new pass would never get in; the buffer is cleared on the jump (the URDF stays)."""
    out, node, warnings, _ = tf_output(tf_mode="map_to_odom", base_frame="base_link")
    put(out, T_BASE_CAM, "base_link", "cam_optical")
    put(out, T_ODOM_BASE, "odom", "base_link", sec=500)
    assert out.publish(T_MAP_CAM0, stamp(500), "cam_optical")
    put(out, T_ODOM_BASE, "odom", "base_link", sec=480)  # the loop starts again: ignored by tf2 (old data)
    assert not out.publish(T_MAP_CAM0, stamp(480), "cam_optical")
    assert any("went back 20.0 s" in line for line in node.infos)
    put(out, T_ODOM_BASE, "odom", "base_link", sec=481)
    assert out.publish(T_MAP_CAM0, stamp(481), "cam_optical")
    assert (node.sent[-1].header.stamp.sec, out.mode) == (481, "map_to_odom")
    np.testing.assert_allclose(sent(node)[2], rigid_rt(R_Z90.T, [-1.2, 3.0, -0.5]), atol=1e-9)


def test_tf_output_auto_mode_choices_and_announcements():
    out, node, warnings, _ = tf_output(tf_mode="auto")  # no base frame: no robot
    assert out.publish(T_MAP_CAM0, stamp(1), "cam")
    assert sent(node)[:2] == ("map", "cam_lingbot") and out.mode == "map_to_camera"
    assert node.infos == ["TF: publishing map -> cam_lingbot, tf_mode map_to_camera (auto: base_frame is empty)"]

    out, node, warnings, clock = tf_output(tf_mode="auto", base_frame="base_link")
    put(out, T_BASE_CAM, "base_link", "cam_optical")
    assert not out.publish(T_MAP_CAM0, stamp(1), "cam_optical")  # waiting for odometry (grace)
    clock.t += AUTO_ODOM_GRACE_S
    assert out.publish(T_MAP_CAM0, stamp(2), "cam_optical")
    assert sent(node)[:2] == ("map", "base_link") and out.mode == "map_to_base"
    put(out, T_ODOM_BASE, "odom", "base_link", sec=3)  # odometry starts
    clock.t += 10.0
    assert out.publish(T_MAP_CAM0, stamp(3), "cam_optical")
    parent, child, T = sent(node)
    assert (parent, child, out.mode) == ("map", "odom", "map_to_odom")
    np.testing.assert_allclose(T, rigid_rt(R_Z90.T, [-1.2, 3.0, -0.5]), atol=1e-9)
    assert [line.split(", tf_mode ")[1].split(" ")[0] for line in node.infos] == ["map_to_base", "map_to_odom"]
    # odometry missing later: a warning, and no flip back to map_to_base
    clock.t += 10.0
    assert not out.publish(T_MAP_CAM0, stamp(30), "cam_optical")
    assert out.mode == "map_to_odom" and "stays in map_to_odom" in warnings[-1]


def test_tf_output_is_idle_until_publish_tf_and_reads_replaced_settings():
    out, node, warnings, _ = tf_output(tf_mode="map_to_camera", publish_tf=False)
    assert node.publishers == [] and node.subscriptions == []  # construction: no side effects
    assert not out.publish(T_MAP_CAM0, stamp(1), "cam")
    assert node.publishers == [] and node.sent == []
    out.settings = replace(out.settings, publish_tf=True)  # as the node does on `ros2 param set`
    assert out.publish(T_MAP_CAM0, stamp(2), "cam")
    assert node.publishers == ["/tf"] and set(node.subscriptions) == {"/tf", "/tf_static"}
    out.settings = replace(out.settings, publish_tf=False)
    assert not out.publish(T_MAP_CAM0, stamp(3), "cam") and len(node.sent) == 1
    # created with publish_tf on: the listener starts at once (it fills while the model loads)
    _, node2, _, _ = tf_output(tf_mode="map_to_camera")
    assert set(node2.subscriptions) == {"/tf", "/tf_static"}


def test_parents_from_a_real_tf2_buffer():
    out, _, _, _ = tf_output()
    put(out, T_BASE_CAM, "base_link", "cam_optical")
    put(out, T_ODOM_BASE, "odom", "base_link", sec=3)
    assert parents_from_yaml(out._buffer.all_frames_as_yaml()) == {"cam_optical": "base_link", "base_link": "odom"}


# ------------------------------------------------------------------ launch / config / rviz
def _launch_arguments() -> dict[str, str]:
    tree = ast.parse((REPO / "launch" / "lingbot_map.launch.py").read_text())
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert "generate_launch_description" in functions
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "ARGUMENTS" for t in node.targets):
            return {name: default for name, default, _ in ast.literal_eval(node.value)}
    raise AssertionError("launch file has no ARGUMENTS table")


def test_launch_file_declares_the_listed_arguments():
    args = _launch_arguments()
    assert set(args) == LAUNCH_ARGUMENTS
    src = (REPO / "launch" / "lingbot_map.launch.py").read_text()
    tree = ast.parse(src)
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert {"DeclareLaunchArgument", "Node", "OpaqueFunction", "LaunchDescription"} <= calls
    assert "lingbot_map_node" in src and "rviz2" in src and "image/compressed" in src
    assert args["use_sim_time"] == "false" and args["rviz"] == "false"
    assert args["dds_profile"] == "large_messages" and "FASTDDS_DEFAULT_PROFILES_FILE" in src
    assert '"large_messages": "fastdds_large_messages.xml"' in src
    assert (REPO / "config" / "fastdds_large_messages.xml").is_file()
    assert args["device"] == args["dtype"] == ""  # empty = as in the params file (auto there)
    assert args["keyframe_selector"] == "false" and args["keyframe_decision_timeout"] == "0.5"


def _launch_module(monkeypatch):
    """The launch file as a module, with ``Node`` recording its keyword arguments and the
    package share faked (no ament index needed)."""
    pytest.importorskip("launch", reason=NO_LAUNCH)
    pytest.importorskip("launch_ros", reason=NO_LAUNCH)
    spec = importlib.util.spec_from_file_location("lingbot_map_launch", REPO / "launch" / "lingbot_map.launch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "Node", lambda **kwargs: kwargs)
    monkeypatch.setattr(module, "FindPackageShare", lambda _pkg: type("S", (), {"perform": lambda self, c: "/share"})())
    return module


def _run_setup(module, **arguments) -> list[dict]:
    from launch import LaunchContext

    context = LaunchContext()
    defaults = {name: default for name, default, _ in module.ARGUMENTS}
    context.launch_configurations.update({**defaults, **arguments})
    return module._setup(context)


def test_launch_setup_builds_the_node_and_the_optional_selector(monkeypatch):
    module = _launch_module(monkeypatch)
    assert module.fully_qualified_name("", "lingbot_map") == "/lingbot_map"
    assert module.fully_qualified_name("/robot1/", "lingbot_map") == "/robot1/lingbot_map"
    (node,) = _run_setup(module)
    params_file, overrides = node["parameters"]
    assert params_file == "/share/config/lingbot_map.yaml"
    assert overrides == {"use_sim_time": False}  # empty arguments leave the params file's values
    assert ("image", "/camera/image_raw") in node["remappings"]
    assert node["additional_env"] == {"FASTDDS_DEFAULT_PROFILES_FILE": "/share/config/fastdds_large_messages.xml"}

    node, selector = _run_setup(module, device="cpu", dtype="fp32", namespace="robot1", keyframe_selector="true",
                                keyframe_decision_timeout="0.25", params_file="/tmp/p.yaml")
    assert node["parameters"] == ["/tmp/p.yaml", {"use_sim_time": False, "device": "cpu", "dtype": "fp32",
                                                 "keyframe_decision_timeout": 0.25}]
    assert (selector["package"], selector["executable"], selector["namespace"]) == (
        "lingbot_map_ros", "keyframe_selector", "robot1")
    assert selector["parameters"] == [{"target_node": "/robot1/lingbot_map", "use_sim_time": False}]
    with pytest.raises(ValueError, match="keyframe_decision_timeout must be a number of seconds >= 0, got 'soon'"):
        _run_setup(module, keyframe_selector="true", keyframe_decision_timeout="soon")


def test_launch_cameras_argument_lists_the_cameras_and_remaps_each(monkeypatch):
    module = _launch_module(monkeypatch)
    assert module.camera_names(" front, rear,,") == ["front", "rear"]
    (node,) = _run_setup(module, cameras="front,rear", image_topic="/{camera}/color/image_raw",
                         camera_info_topic="/{camera}/color/camera_info")
    assert node["parameters"][1] == {"use_sim_time": False, "cameras": ["front", "rear"]}
    assert node["remappings"] == [
        ("front/image", "/front/color/image_raw"), ("front/image/compressed", "/front/color/image_raw/compressed"),
        ("front/camera_info", "/front/color/camera_info"),
        ("rear/image", "/rear/color/image_raw"), ("rear/image/compressed", "/rear/color/image_raw/compressed"),
        ("rear/camera_info", "/rear/color/camera_info")]
    (node,) = _run_setup(module, cameras="front,rear")  # default topics name no camera: no remapping
    assert node["remappings"] == [] and node["parameters"][1]["cameras"] == ["front", "rear"]
    (node,) = _run_setup(module, cameras="front,rear", camera_batching="True")
    assert node["parameters"][1]["camera_batching"] is True
    (node,) = _run_setup(module, camera_batching="off")
    assert node["parameters"][1] == {"use_sim_time": False, "camera_batching": False}
    with pytest.raises(ValueError, match="camera_batching must be true or false, got 'sometimes'"):
        _run_setup(module, camera_batching="sometimes")


def test_launch_managed_argument_makes_a_lifecycle_node(monkeypatch):
    module = _launch_module(monkeypatch)
    (node,) = _run_setup(module, managed="true")
    assert node["parameters"][1] == {"use_sim_time": False, "managed": True}
    (node,) = _run_setup(module)
    assert "managed" not in node["parameters"][1]  # empty: as in the params file
    with pytest.raises(ValueError, match="managed must be true or false, got 'maybe'"):
        _run_setup(module, managed="maybe")


def test_config_lists_every_parameter_with_a_valid_value_and_a_comment():
    yaml = pytest.importorskip("yaml")
    path = REPO / "config" / "lingbot_map.yaml"
    data = yaml.safe_load(path.read_text())
    values = data["/**"]["ros__parameters"]
    assert set(values) == set(PARAMETER_NAMES)
    by_name = {p.name: p for p in PARAMETERS}
    for name, value in values.items():
        check_value(by_name[name], value)
        assert type(value) is type(by_name[name].default), name  # ROS parameters are strictly typed
    resolve_settings(values)
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip().split(":")[0] in by_name and not line.strip().startswith("#"):
            assert lines[i - 1].strip().startswith("#"), f"no comment above {line.strip()}"


def _yaml_values(text: str) -> dict[str, str]:
    """``name: value`` lines under ``ros__parameters`` (values as written); no YAML library."""
    values = {}
    for line in text.splitlines():
        m = re.fullmatch(r"    ([a-z_0-9]+): (.+)", line)
        if m:
            values[m.group(1)] = m.group(2).strip()
    return values


def _yaml_text(value) -> str:
    import json

    return json.dumps(value)  # the file writes scalars as JSON (valid YAML): true, 0.5, "auto"


def test_config_has_every_parameter_with_its_default_range_and_run_time_mark():
    text = (REPO / "config" / "lingbot_map.yaml").read_text()
    values = _yaml_values(text)
    assert set(values) == set(PARAMETER_NAMES)
    assert list(values) == list(PARAMETER_NAMES)  # same order as the table
    lines = text.splitlines()
    for p in PARAMETERS:
        assert values[p.name] == _yaml_text(p.default), f"{p.name}: {values[p.name]} != default {p.default!r}"
        i = lines.index(f"    {p.name}: {values[p.name]}")
        comment = []
        while lines[i - 1].startswith("    # ") and not lines[i - 1].startswith("    # ----"):
            i -= 1
            comment.insert(0, lines[i][6:])
        comment = " ".join(comment)
        assert comment, f"no comment above {p.name}"
        assert ("(settable at run time)" in comment) == p.dynamic, p.name
        if p.choices is not None:
            assert "One of: " + ", ".join(p.choices) + "." in comment, p.name
        if p.limits is not None and not isinstance(p.default, bool):
            assert re.search(r"Range \[[-0-9.e+]+, [-0-9.e+]+\]", comment), p.name
            lo, hi, _ = p.limits
            numbers = [float(x) for x in re.search(r"Range \[([^,]+), ([^\]]+)\]", comment).groups()]
            assert numbers == [lo, hi], p.name
    yaml = pytest.importorskip("yaml")  # the same through a real YAML parser, where installed
    parsed = yaml.safe_load(text)["/**"]["ros__parameters"]
    assert parsed == {p.name: p.default for p in PARAMETERS}


def test_rviz_config_uses_the_map_frame_and_node_topics():
    yaml = pytest.importorskip("yaml")
    data = yaml.safe_load((REPO / "rviz" / "lingbot_map.rviz").read_text())
    manager = data["Visualization Manager"]
    assert manager["Global Options"]["Fixed Frame"] == "map"
    displays = {d["Class"]: d for d in manager["Displays"]}
    topics = {d["Topic"]["Value"] for d in manager["Displays"] if "Topic" in d}
    assert {"/lingbot_map/map_points", "/lingbot_map/points", "/lingbot_map/path", "/lingbot_map/odometry"} <= topics
    assert {"rviz_default_plugins/PointCloud2", "rviz_default_plugins/Path", "rviz_default_plugins/Odometry",
            "rviz_default_plugins/TF", "rviz_default_plugins/Map"} <= set(displays)
    assert displays["rviz_default_plugins/Map"]["Topic"]["Value"] == "/lingbot_map/grid"
    latched = [d for d in manager["Displays"] if d.get("Topic", {}).get("Value") in ("/lingbot_map/map_points",
                                                                                     "/lingbot_map/path",
                                                                                     "/lingbot_map/grid")]
    assert all(d["Topic"]["Durability Policy"] == "Transient Local" for d in latched)
