"""Pre-flight check of a ROS 2 environment: imports, and a two-process round trip.

    python3 benchmarks/node/ros_roundtrip.py            # exit 0 and one line when it works

Imports rclpy, the message packages the node uses and this package's generated
interfaces, then starts a second python process that publishes a sensor_msgs/Image
and a lingbot_map_ros/Status on a private topic until this process has received one
of each (30 s at most). Uses the caller's ROS_DOMAIN_ID and forces
ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST (loopback only).
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
TIMEOUT_S = 30.0


def _imports():
    import rclpy
    from diagnostic_msgs.msg import DiagnosticArray  # noqa: F401
    from geometry_msgs.msg import PoseStamped  # noqa: F401
    from nav_msgs.msg import Odometry, Path  # noqa: F401
    from sensor_msgs.msg import CameraInfo, CompressedImage, Image, PointCloud2  # noqa: F401
    from std_srvs.srv import SetBool, Trigger  # noqa: F401

    from lingbot_map_ros.msg import Status
    from lingbot_map_ros.srv import CommitEviction, RollbackFrame, SaveMap  # noqa: F401

    return rclpy, Image, Status


def publish() -> int:
    rclpy, Image, Status = _imports()
    from rclpy.executors import ExternalShutdownException
    from rclpy.qos import QoSProfile

    rclpy.init()
    node = rclpy.create_node("roundtrip_pub")
    image_pub = node.create_publisher(Image, "/roundtrip/image", QoSProfile(depth=10))
    status_pub = node.create_publisher(Status, "/roundtrip/status", QoSProfile(depth=10))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            image = Image(height=2, width=3, encoding="rgb8", step=9)
            image.data = bytes(range(18))
            image.header.stamp = node.get_clock().now().to_msg()
            image_pub.publish(image)
            status_pub.publish(Status(state=Status.STATE_TRACKING, frame_index=7, latency_model_ms=1.5))
            rclpy.spin_once(node, timeout_sec=0.05)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        node.destroy_node()
        rclpy.try_shutdown()
    return 0


def main() -> int:
    if sys.argv[1:] == ["--publish"]:
        return publish()
    rclpy, Image, Status = _imports()
    from rclpy.qos import QoSProfile

    rclpy.init()
    node = rclpy.create_node("roundtrip_sub")
    got: dict[str, object] = {}
    done = threading.Event()

    def keep(kind):
        def cb(msg):
            got.setdefault(kind, msg)
            if len(got) == 2:
                done.set()
        return cb

    node.create_subscription(Image, "/roundtrip/image", keep("image"), QoSProfile(depth=10))
    node.create_subscription(Status, "/roundtrip/status", keep("status"), QoSProfile(depth=10))
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--publish"], env=dict(os.environ))
    t0 = time.monotonic()
    try:
        while not done.is_set() and time.monotonic() - t0 < TIMEOUT_S and proc.poll() is None:
            rclpy.spin_once(node, timeout_sec=0.1)
    finally:
        proc.terminate()
        proc.wait(10)
        node.destroy_node()
        rclpy.try_shutdown()
    image, status = got.get("image"), got.get("status")
    ok = (image is not None and bytes(image.data) == bytes(range(18)) and status is not None
          and status.frame_index == 7 and abs(status.latency_model_ms - 1.5) < 1e-6)
    import lingbot_map_ros

    where = ", ".join(lingbot_map_ros.__path__)
    if not ok:
        print(f"ros_roundtrip: FAILED after {time.monotonic() - t0:.1f} s: got {sorted(got)}", file=sys.stderr)
        return 1
    print(f"ros_roundtrip: OK in {time.monotonic() - t0:.1f} s (Image + Status across two processes, "
          f"ROS_DOMAIN_ID={os.environ.get('ROS_DOMAIN_ID', '0')}, localhost only); lingbot_map_ros from {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
