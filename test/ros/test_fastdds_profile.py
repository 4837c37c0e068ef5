"""config/fastdds_large_messages.xml: Fast DDS loads it and maps 16 MB shared-memory
segments, and a raw 518x378 image (587 KB, over the default 512 KB segment) crosses
between two participants intact. Runs in a child process (the profile is read when
the first participant is created)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")

pytestmark = pytest.mark.ros
REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "config" / "fastdds_large_messages.xml"

CHILD = r'''
import glob, os, time
before = set(glob.glob("/dev/shm/fastdds_*"))
import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image
rclpy.init()
writer, reader = rclpy.create_node("profile_check_writer"), rclpy.create_node("profile_check_reader")
qos = QoSProfile(depth=5, reliability=ReliabilityPolicy.RELIABLE)
payload = bytes(range(256)) * (518 * 378 * 3 // 256) + bytes(range(518 * 378 * 3 % 256))
got = []
reader.create_subscription(Image, "profile_check", lambda m: got.append(bytes(m.data) == payload), qos)
pub = writer.create_publisher(Image, "profile_check", qos)
executor = SingleThreadedExecutor()
executor.add_node(writer)
executor.add_node(reader)
msg = Image(height=378, width=518, encoding="rgb8", step=518 * 3, data=payload)
deadline = time.monotonic() + 20
while pub.get_subscription_count() == 0 and time.monotonic() < deadline:
    executor.spin_once(timeout_sec=0.05)
for _ in range(40):  # bounded
    if len(got) >= 3 or time.monotonic() > deadline:
        break
    pub.publish(msg)
    executor.spin_once(timeout_sec=0.1)
segments = [os.path.getsize(p) for p in set(glob.glob("/dev/shm/fastdds_*")) - before
            if not p.endswith("_el")]
print("RESULT", len(got), all(got), max(segments or [0]))
'''


def run_child(profile: Path | None) -> tuple[int, bool, int, str]:
    env = {**os.environ, "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST",
           "ROS_DOMAIN_ID": str(100 + os.getpid() % 100)}
    env.pop("FASTDDS_DEFAULT_PROFILES_FILE", None)
    if profile is not None:
        env["FASTDDS_DEFAULT_PROFILES_FILE"] = str(profile)
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    _, received, intact, segment = line.split()
    return int(received), intact == "True", int(segment), proc.stderr


def test_profile_loads_and_large_images_cross_intact():
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm: Fast DDS cannot use shared memory here")
    received, intact, segment, stderr = run_child(PROFILE)
    assert "XMLPARSER" not in stderr and "Error" not in stderr, stderr[-2000:]
    assert received >= 3 and intact
    if segment == 0:
        pytest.skip("this RMW created no Fast DDS shared-memory segment (not rmw_fastrtps_cpp?)")
    assert segment >= 16 * 2**20  # the profile's segment, not the 512 KB default


def test_without_the_profile_segments_are_the_small_default():
    """The check above can fail: without the profile, Fast DDS maps its default segment."""
    received, intact, segment, _ = run_child(None)
    assert received >= 3 and intact
    if segment == 0:
        pytest.skip("this RMW created no Fast DDS shared-memory segment (not rmw_fastrtps_cpp?)")
    assert segment < 2 * 2**20


@pytest.mark.parametrize("env,expected", [
    ({}, True),
    ({"FASTDDS_DEFAULT_PROFILES_FILE": "/x.xml"}, False),
    ({"FASTRTPS_DEFAULT_PROFILES_FILE": "/x.xml"}, False),
    ({"RMW_IMPLEMENTATION": "rmw_cyclonedds_cpp"}, False),
    ({"RMW_IMPLEMENTATION": "rmw_fastrtps_cpp"}, True),
])
def test_the_node_knows_when_fast_dds_runs_without_a_profile(monkeypatch, env, expected):
    from lingbot_map_ros.ros.startup import fastdds_without_profile

    for name in ("FASTDDS_DEFAULT_PROFILES_FILE", "FASTRTPS_DEFAULT_PROFILES_FILE", "RMW_IMPLEMENTATION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert fastdds_without_profile() is expected
