"""The launch file as an operator uses it: ``ros2 launch lingbot_map_ros lingbot_map.launch.py``.

One real launch (tiny fixture weights, ``device:=cpu`` given as a launch argument) serves
every test of this module: poses come out for frames published to the remapped image
topic; ``ros2 param list|get|describe|set`` answer (read-only and out-of-range values
refused); SIGINT while frames stream ends the launch with exit status 0 and no error
line. Needs ``ros2``/``launch_ros`` in .venv (``bash ../shared/ros_extras/install.sh .venv``,
which scripts/bootstrap.sh runs when ../shared/ros_extras exists) and the package
installed into .venv (bootstrap step 3).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")

from geometry_msgs.msg import PoseStamped  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.qos import QoSProfile  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from std_msgs.msg import Header  # noqa: E402

from lingbot_map_ros.runtime.params import PARAMETER_NAMES, write_params_file  # noqa: E402

pytestmark = [pytest.mark.ros, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv"
EXTRAS = REPO.parent / "shared" / "ros_extras"
NODE = "/lingbot_map"
IMAGE_TOPIC = "/launch_cam/image"
START_TIMEOUT = 90.0
STEP_TIMEOUT = 30.0
CLI_TIMEOUT = 30.0
DOMAIN_ID = 1 + (os.getpid() * 7 + 13 + 66) % 100  # not test_node_graph's (+0) nor test_tf_graph's (+33)
NODE_WAIT = 10  # s: `ros2 param get|describe|set --timeout` (they wait for the node that long, no longer)
LIST_SPIN = 2.0  # s: `ros2 param list` has no --timeout: it looks for the node after spinning this long


def cli_options(verb: str) -> list[str]:
    """The options of ``ros2 param <verb>``: no daemon (none outliving the test); the verbs with a
    --timeout wait for the node to be discovered and spin the least (0.5 s: each spins twice)."""
    if verb == "list":
        return ["--no-daemon", "--spin-time", str(LIST_SPIN)]
    return ["--no-daemon", "--spin-time", "0.5", "--timeout", str(NODE_WAIT)]


def ros_env() -> dict[str, str]:
    return dict(os.environ, PATH=f"{VENV / 'bin'}:{os.environ.get('PATH', '')}", AMENT_PREFIX_PATH=str(VENV),
                ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST", ROS_DOMAIN_ID=str(DOMAIN_ID), PYTHONUNBUFFERED="1")


def require_launch_tools() -> None:
    missing = [name for name in ("launch", "launch_ros", "ros2launch", "ros2param")
               if __import__("importlib").util.find_spec(name) is None]
    if missing or not (VENV / "bin" / "ros2").is_file():
        pytest.skip(f"ros2 launch/param not in .venv ({', '.join(missing) or 'no .venv/bin/ros2'}): install "
                    f"{EXTRAS} (bash {EXTRAS}/install.sh .venv, or scripts/bootstrap.sh)")


def require_installed_package() -> None:
    """The package's share and executables in .venv, as current as the repository's."""
    share = VENV / "share" / "lingbot_map_ros"
    for rel in ("launch/lingbot_map.launch.py", "config/lingbot_map.yaml"):
        installed, source = share / rel, REPO / rel
        assert installed.is_file() and installed.read_bytes() == source.read_bytes(), (
            f"{installed} is missing or differs from {source}: run scripts/bootstrap.sh (it reinstalls them)")


def generated_frames(n: int, seed: int = 0) -> list[np.ndarray]:
    """n RGB frames [294, 518, 3] uint8 of a sliding blocky texture."""
    rng = np.random.default_rng(seed)
    big = np.kron(rng.integers(0, 256, (40, 120, 3)).astype(np.float32), np.ones((8, 8, 1)))
    return [big[10 + i: 304 + i, 20 + 7 * i: 538 + 7 * i].astype(np.uint8) for i in range(n)]


def ros2(*args: str) -> subprocess.Popen:
    """Start ``ros2 <args>`` (text output on .stdout)."""
    return subprocess.Popen(["ros2", *args], env=ros_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True)


def param_verbs(commands: dict[str, tuple[str, ...]], attempts: int = 3) -> dict[str, str]:
    """Run ``ros2 param <args>`` for every entry at once; the output by key. A command that
    answers "Node not found" (discovery slower than its wait on a loaded machine) or does
    not finish within CLI_TIMEOUT is run again, at most ``attempts`` times in all. (The CLI
    waits for a service response without a time limit; a request sent before DDS matched the
    server's reply writer to the CLI's reader is answered into the void, and the CLI hangs.
    Sets here are idempotent, so running one again is harmless.)"""
    result: dict[str, str] = {}
    hung: dict[str, str] = {}
    pending = dict(commands)
    for _ in range(attempts):
        procs = {key: ros2("param", *args, *cli_options(args[0])) for key, args in pending.items()}
        for key, proc in procs.items():
            try:
                out, _ = proc.communicate(timeout=CLI_TIMEOUT)
                hung.pop(key, None)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                hung[key] = out
            result[key] = out
        pending = {key: args for key, args in pending.items() if key in hung or "Node not found" in result[key]}
        if not pending:
            break
    for key, out in hung.items():
        raise AssertionError(f"`ros2 param {' '.join(commands[key])}` did not finish within {CLI_TIMEOUT} s, "
                             f"{attempts} times: {out[-2000:]}")
    return result


class Client:
    """Publishes frames on the image topic and records the node's poses."""

    def __init__(self) -> None:
        os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"  # read by rcl: loopback only
        self.context = rclpy.Context()
        rclpy.init(context=self.context, domain_id=DOMAIN_ID)
        self.node = rclpy.create_node("launch_test_client", context=self.context)
        self.poses: list[PoseStamped] = []
        self._cond = threading.Condition()
        self.node.create_subscription(PoseStamped, f"{NODE}/pose", self._on_pose, QoSProfile(depth=100))
        self.pub = self.node.create_publisher(Image, IMAGE_TOPIC, QoSProfile(depth=10))
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self._thread = threading.Thread(target=self.executor.spin, daemon=True)
        self._thread.start()
        self.frames = generated_frames(12)
        self.sent = 0

    def _on_pose(self, msg: PoseStamped) -> None:
        with self._cond:
            self.poses.append(msg)
            self._cond.notify_all()

    def publish_next(self) -> None:
        from builtin_interfaces.msg import Time

        from lingbot_map_ros.ros.conversions import rgb_to_image_msg

        rgb = self.frames[self.sent % len(self.frames)]
        self.sent += 1
        self.pub.publish(rgb_to_image_msg(rgb, Header(stamp=Time(sec=3000 + self.sent), frame_id="launch_cam"),
                                          "rgb8"))

    def wait_poses(self, count: int, timeout: float = STEP_TIMEOUT) -> list[PoseStamped]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.poses) < count:
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"{len(self.poses)} pose(s) on {NODE}/pose after {timeout} s, {count} expected"
                self._cond.wait(min(remaining, 0.1))
            return list(self.poses)

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=2.0)
        self._thread.join(timeout=5.0)  # not left in rclpy's C++ wait when the interpreter finalizes
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)


class Launch:
    """``ros2 launch lingbot_map_ros lingbot_map.launch.py ...`` with its output in a file."""

    def __init__(self, log: Path, *arguments: str) -> None:
        self.log = log
        # exec through a shim that sets SIGINT to its default: a process started from a
        # non-interactive shell's background job inherits SIGINT ignored, and `ros2 launch`
        # then ignores the Ctrl-C this test sends
        shim = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                "os.execvp(sys.argv[1], sys.argv[1:])")
        cmd = [sys.executable, "-c", shim, "ros2", "launch", "lingbot_map_ros", "lingbot_map.launch.py", *arguments]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, env=ros_env(), stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=log.parent, start_new_session=False)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def interrupt(self, timeout: float = 30.0) -> int:
        """SIGINT (Ctrl-C) and wait; kills the process group's leftovers only if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise AssertionError(f"ros2 launch did not stop within {timeout} s of SIGINT:\n{self.text()[-3000:]}")
        return self.proc.returncode


@pytest.fixture(scope="module")
def launched(tmp_path_factory, fixtures):
    require_launch_tools()
    require_installed_package()
    root = fixtures  # skips with a message when the tiny fixture set is absent
    tmp = tmp_path_factory.mktemp("launch")
    params = write_params_file(tmp / "params.yaml", {
        "checkpoint": str(root / "weights.safetensors"), "model_config": str(root / "config.json"),
        "image_width": 98, "num_scale_frames": 2, "sliding_window": 3, "publish_points": False,
        "publish_depth": False, "output_directory": str(tmp / "out")})
    launch = Launch(tmp / "launch.log", f"params_file:={params}", f"image_topic:={IMAGE_TOPIC}", "device:=cpu",
                    f"state_directory:={tmp / 'state'}")
    launch.state = tmp / "state"
    client = Client()
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while client.pub.get_subscription_count() < 1:
            assert launch.proc.poll() is None, f"ros2 launch ended early:\n{launch.text()[-4000:]}"
            assert time.monotonic() < deadline, f"the node did not subscribe to {IMAGE_TOPIC} within " \
                                                f"{START_TIMEOUT} s:\n{launch.text()[-4000:]}"
            time.sleep(0.2)
        yield launch, client
    finally:
        try:
            launch.interrupt()
        finally:
            client.close()


def test_ros2_finds_the_installed_package_and_its_executable():
    require_launch_tools()
    prefix = subprocess.run(["ros2", "pkg", "prefix", "lingbot_map_ros"], env=ros_env(), capture_output=True,
                            text=True, timeout=CLI_TIMEOUT)
    assert prefix.returncode == 0 and prefix.stdout.strip() == str(VENV), prefix.stdout + prefix.stderr
    exe = VENV / "lib" / "lingbot_map_ros" / "lingbot_map_node"
    assert os.access(exe, os.X_OK), f"{exe} is not installed (run scripts/bootstrap.sh)"
    assert exe.read_text().startswith("#!/usr/bin/env python3\n")
    # with .venv/bin first on PATH, env's python3 is the venv's (the one with rclpy and the package)
    found = shutil.which("python3", path=ros_env()["PATH"])
    assert found is not None and Path(found).parent == VENV / "bin", found


def test_poses_come_out_for_frames_on_the_remapped_topic(launched):
    launch, client = launched
    # a frame every 0.3 s until 3 poses came: the first may be lost (the node's reader had not matched
    # this writer yet) and a frame may replace one still waiting (the first steps are slow)
    deadline = time.monotonic() + STEP_TIMEOUT
    while len(client.poses) < 3 and time.monotonic() < deadline:
        client.publish_next()
        time.sleep(0.3)
    poses = client.wait_poses(3)
    assert all(p.header.frame_id == "map" for p in poses)
    stamps = [p.header.stamp.sec for p in poses]
    assert stamps == sorted(stamps) and set(stamps) <= set(range(3001, 3001 + client.sent))
    assert "device cpu" in launch.text()  # the launch argument reached the node (params file says auto)
    assert (launch.state / "journal.lbj").is_file()  # state_directory:= too (the node journals there)


def test_ros2_param_list_get_describe(launched):
    out = param_verbs({"list": ("list", NODE), "get image_width": ("get", NODE, "image_width"),
                       "get device": ("get", NODE, "device"), "describe": ("describe", NODE, "conf_threshold")})
    listed = {line.strip() for line in out["list"].splitlines()}
    missing = sorted(set(PARAMETER_NAMES) - listed)
    assert not missing, f"ros2 param list lacks {missing}:\n{out['list']}"
    assert "Integer value is: 98" in out["get image_width"], out["get image_width"]
    assert "String value is: cpu" in out["get device"], out["get device"]
    d = out["describe"]
    assert "Type: double" in d and "Description: Points (per-frame cloud and map) need depth confidence" in d, d
    assert "Min value: 0.0" in d and "Max value: 1000.0" in d, d
    assert "Read only: true" not in d, d  # conf_threshold may be set at run time


def test_ros2_param_set_takes_run_time_values_and_refuses_the_rest(launched):
    out = param_verbs({"set conf_threshold": ("set", NODE, "conf_threshold", "2.0"),
                       "set device": ("set", NODE, "device", "cuda"),
                       "set point_stride": ("set", NODE, "point_stride", "0")})
    assert "Set parameter successful" in out["set conf_threshold"], out["set conf_threshold"]
    assert "Setting parameter failed" in out["set device"] and "read-only" in out["set device"].lower(), \
        out["set device"]
    assert "Setting parameter failed" in out["set point_stride"], out["set point_stride"]
    after = param_verbs({"get conf_threshold": ("get", NODE, "conf_threshold"), "get device": ("get", NODE, "device"),
                         "get point_stride": ("get", NODE, "point_stride")})
    assert "Double value is: 2.0" in after["get conf_threshold"], after["get conf_threshold"]
    assert "String value is: cpu" in after["get device"], after["get device"]  # refused values are not kept
    assert "Integer value is: 10" in after["get point_stride"], after["get point_stride"]


def test_sigint_mid_stream_exits_cleanly(launched):
    """Last test of the module: it ends the launch."""
    launch, client = launched
    before = len(client.poses)
    stop = threading.Event()

    def stream() -> None:
        while not stop.is_set():
            client.publish_next()
            time.sleep(0.1)

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    try:
        client.wait_poses(before + 2)  # frames are in flight
        rc = launch.interrupt()
    finally:
        stop.set()
        streamer.join(5)
    text = launch.text()
    assert rc == 0, f"ros2 launch exit status {rc}:\n{text[-4000:]}"
    bad = [line for line in text.splitlines() if "ERROR" in line or "Traceback" in line]
    assert not bad, "error lines in the launch output:\n" + "\n".join(bad[:20])
    assert "process has finished cleanly" in text, text[-3000:]
