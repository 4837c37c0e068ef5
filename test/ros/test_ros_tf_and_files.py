"""TF maths of the node, and the robot-side files (launch, config, RViz) checked without
importing ``launch`` (not installable here): the launch file is parsed with ``ast``."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from lingbot_map_ros.geometry import quaternion_to_matrix
from lingbot_map_ros.ros.conversions import OPTICAL_TO_REP103, optical_pose_to_map, transform_stamped
from lingbot_map_ros.ros.params import PARAMETER_NAMES, PARAMETERS, check_value, resolve_settings
from lingbot_map_ros.ros.tf_tools import invert_rigid, map_to_base, map_to_odom, transform_to_matrix

pytestmark = pytest.mark.ros
REPO = Path(__file__).resolve().parents[2]
LAUNCH_ARGUMENTS = {"params_file", "checkpoint", "image_topic", "camera_info_topic", "input_transport", "namespace",
                    "use_sim_time", "rviz", "dds_profile"}


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
    assert '"large_messages": "fastdds_large_messages.xml"' in src and (REPO / "config" / "fastdds_large_messages.xml").is_file()


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


def test_rviz_config_uses_the_map_frame_and_node_topics():
    yaml = pytest.importorskip("yaml")
    data = yaml.safe_load((REPO / "rviz" / "lingbot_map.rviz").read_text())
    manager = data["Visualization Manager"]
    assert manager["Global Options"]["Fixed Frame"] == "map"
    displays = {d["Class"]: d for d in manager["Displays"]}
    topics = {d["Topic"]["Value"] for d in manager["Displays"] if "Topic" in d}
    assert {"/lingbot_map/map_points", "/lingbot_map/points", "/lingbot_map/path", "/lingbot_map/odometry"} <= topics
    assert {"rviz_default_plugins/PointCloud2", "rviz_default_plugins/Path", "rviz_default_plugins/Odometry",
            "rviz_default_plugins/TF"} <= set(displays)
    latched = [d for d in manager["Displays"] if d.get("Topic", {}).get("Value") in ("/lingbot_map/map_points",
                                                                                     "/lingbot_map/path")]
    assert all(d["Topic"]["Durability Policy"] == "Transient Local" for d in latched)
