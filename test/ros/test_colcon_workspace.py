"""The README's robot path, from a clean copy of the tracked files: a colcon workspace.

One ``colcon build`` of ``src/lingbot_map_ros`` (``git ls-files`` copied into a temporary
workspace), then, in bash after ``source install/setup.bash``: ``ros2 pkg prefix`` names the
workspace's install space; ``python3`` imports ``lingbot_map_ros`` (and its generated messages)
from the install space, not from the checkout; ``ros2 run lingbot_map_ros keyframe_selector
--help`` answers; and one ``ros2 launch lingbot_map_ros lingbot_map.launch.py`` with the tiny
fixture weights publishes poses for frames sent to the remapped image topic, its node process
running the install space's executable.

ROS comes from the venv this test runs in (rclpy, messages and the rosidl/ament build tools as
wheels; ``AMENT_PREFIX_PATH`` = the venv, as scripts/bootstrap.sh uses it), colcon from
colcon-common-extensions in that venv, ``ros2 launch`` and the ``ros2`` CLI from
``../shared/ros_extras`` (built into the venv by scripts/bootstrap.sh where it exists).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

rclpy = pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")

from geometry_msgs.msg import PoseStamped  # noqa: E402
from rclpy.qos import QoSProfile  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402

from graph_helpers import (GraphClient, generated_frames, image_msg, log_tail, private_domain_id,  # noqa: E402
                           write_node_params)

pytestmark = [pytest.mark.ros, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)  # the venv running the tests (.venv in CI)
EXTRAS = REPO.parent / "shared" / "ros_extras"
DOMAIN_ID = private_domain_id(__name__, 1, 100, 7, 13 + 93)  # not the other graph modules' offsets
NODE = "/lingbot_map"
IMAGE_TOPIC = "/ws_cam/image"
BUILD_TIMEOUT = 600.0  # a hang guard: about 45 s on 2 idle cores
CLI_TIMEOUT = 60.0
START_TIMEOUT = 90.0
POSE_TIMEOUT = 60.0


def require_tools() -> None:
    missing = [name for name in ("launch", "launch_ros", "ros2launch", "ros2pkg")
               if importlib.util.find_spec(name) is None]
    if missing or not (VENV / "bin" / "ros2").is_file():
        pytest.skip(f"ros2 launch / the ros2 CLI are not in {VENV} ({', '.join(missing) or 'no bin/ros2'}): "
                    f"install {EXTRAS} (bash {EXTRAS}/install.sh .venv, or scripts/bootstrap.sh)")
    if not (VENV / "bin" / "colcon").is_file():
        pytest.skip(f"colcon is not in {VENV}: pip install colcon-common-extensions (scripts/bootstrap.sh does)")
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip(f"{REPO} is not a git checkout (the workspace copies `git ls-files`)")


def base_env() -> dict[str, str]:
    """The shell a robot user starts from: ROS on PATH and AMENT_PREFIX_PATH (here: the venv), no
    PYTHONPATH pointing at the checkout, loopback-only DDS on this module's domain."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "COLCON_PREFIX_PATH", "CMAKE_PREFIX_PATH", "AMENT_PREFIX_PATH")}
    env.update(PATH=f"{VENV / 'bin'}:{os.environ.get('PATH', '')}", VIRTUAL_ENV=str(VENV),
               AMENT_PREFIX_PATH=str(VENV), ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST",
               ROS_DOMAIN_ID=str(DOMAIN_ID), PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def in_workspace(ws: Path, script: str, timeout: float) -> subprocess.CompletedProcess:
    """``script`` in bash, in ``ws``, after ``source install/setup.bash``."""
    return subprocess.run(["bash", "-c", f"set -e; source install/setup.bash; {script}"], cwd=ws, env=base_env(),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    require_tools()
    ws = tmp_path_factory.mktemp("colcon_ws")
    src = ws / "src" / "lingbot_map_ros"
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for rel in filter(None, listed.decode().split("\0")):
        source = REPO / rel
        if source.is_file():  # a tracked file deleted in the working tree is not copied
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, src / rel)
    # the README's command (CMake finds the venv's python3 first on PATH, as a robot's ROS python)
    build = subprocess.run(["colcon", "build", "--packages-select", "lingbot_map_ros"],
                           cwd=ws, env=base_env(), capture_output=True, text=True, timeout=BUILD_TIMEOUT,
                           stdin=subprocess.DEVNULL)
    assert build.returncode == 0, f"colcon build failed:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}\n" + \
        "".join(f"\n{p}:\n{p.read_text(errors='replace')[-3000:]}" for p in (ws / "log" / "latest_build").rglob("stderr.log"))
    assert (ws / "install" / "setup.bash").is_file(), build.stdout[-2000:]
    return ws


def test_installed_package_is_found_imported_and_runs(workspace):
    install = workspace / "install" / "lingbot_map_ros"
    out = in_workspace(workspace, "ros2 pkg prefix lingbot_map_ros; "
                       "cd /; python3 -c 'import lingbot_map_ros, lingbot_map_ros.msg as m, lingbot_map_ros.runtime.params;"
                       " print(lingbot_map_ros.__file__); print(m.__file__)'", CLI_TIMEOUT)
    assert out.returncode == 0, out.stdout + out.stderr
    prefix, package_file, msg_file = out.stdout.split()[:3]
    assert Path(prefix) == install, out.stdout
    for path in (package_file, msg_file):  # the install space's copy, not the checkout's (editable) one
        assert Path(path).resolve().is_relative_to(install.resolve()), (path, install)
        assert not Path(path).resolve().is_relative_to(REPO.resolve()), path

    help_ = in_workspace(workspace, "ros2 run lingbot_map_ros keyframe_selector --help", CLI_TIMEOUT)
    assert help_.returncode == 0, help_.stdout + help_.stderr
    assert help_.stdout.startswith("usage: ros2 run lingbot_map_ros keyframe_selector"), help_.stdout
    assert "target_node (default '/lingbot_map')" in help_.stdout, help_.stdout


def _children(pid: int) -> list[int]:
    """Every descendant process id of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(text.rsplit(")", 1)[1].split()[1])
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, parent in parents.items() if parent == p]
        found += kids
        todo += kids
    return found


def test_launch_from_the_install_space_publishes_poses(workspace, fixtures, tmp_path):
    install = workspace / "install" / "lingbot_map_ros"
    params = write_node_params(tmp_path / "params.yaml", fixtures, {
        "image_width": 98, "num_scale_frames": 2, "sliding_window": 3, "publish_points": False,
        "publish_depth": False, "output_directory": str(tmp_path / "out")})
    log = tmp_path / "launch.log"
    # SIGINT at its default in the launch (a background child of a non-interactive shell inherits it ignored)
    shim = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])"
    command = (f"exec {VENV / 'bin' / 'python'} -c '{shim}' ros2 launch lingbot_map_ros lingbot_map.launch.py "
               f"params_file:={params} image_topic:={IMAGE_TOPIC} device:=cpu")
    with open(log, "w") as out:
        launch = subprocess.Popen(["bash", "-c", f"source install/setup.bash; {command}"], cwd=workspace,
                                  env=base_env(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    client = GraphClient("ws_test_client", DOMAIN_ID, POSE_TIMEOUT)
    client.watch(launch, log)
    try:
        poses = client.record(PoseStamped, f"{NODE}/pose", "pose")
        pub = client.node.create_publisher(Image, IMAGE_TOPIC, QoSProfile(depth=10))
        client.wait(lambda: pub.get_subscription_count() >= 1, f"the node's subscription to {IMAGE_TOPIC}",
                    timeout=START_TIMEOUT)
        # the node process runs the install space's executable
        cmdlines = [Path(f"/proc/{c}/cmdline").read_bytes().split(b"\0") for c in _children(launch.pid)
                    if Path(f"/proc/{c}/cmdline").exists()]
        node_cmd = [c for c in cmdlines if any(arg.endswith(b"/lingbot_map_node") for arg in c)]
        assert node_cmd, f"no lingbot_map_node process under the launch: {cmdlines}"
        exe = next(arg for arg in node_cmd[0] if arg.endswith(b"/lingbot_map_node")).decode()
        assert Path(exe).resolve() == (install / "lib" / "lingbot_map_ros" / "lingbot_map_node").resolve(), exe
        # a frame every 0.3 s until 3 poses came: the first may be lost (the node's reader had not
        # matched this writer yet) and a frame may replace one still waiting (the first steps are slow)
        frames, sent, deadline = generated_frames(4), 0, time.monotonic() + POSE_TIMEOUT
        while client.count("pose") < 3 and time.monotonic() < deadline:
            pub.publish(image_msg(frames[sent % len(frames)], 4000 + sent, frame_id="ws_cam"))
            sent += 1
            time.sleep(0.3)
        client.wait(lambda: len(poses) >= 3, "3 poses on /lingbot_map/pose")
        assert all(p.header.frame_id == "map" for p in poses)
        assert {p.header.stamp.sec for p in poses} <= set(range(4000, 4000 + sent))
    finally:
        client.close()
        if launch.poll() is None:
            launch.send_signal(signal.SIGINT)
            try:
                launch.wait(30)
            except subprocess.TimeoutExpired:
                launch.kill()
                launch.wait(10)
    text = log.read_text(errors="replace")
    assert launch.returncode == 0, f"ros2 launch exit status {launch.returncode}:\n{log_tail(log)}"
    assert "Traceback" not in text, log_tail(log)
