"""``image_folder_publisher``: play a folder of images (or a video) as a camera.

    python -m lingbot_map_ros.ros.image_folder_publisher --ros-args \\
        -p images:=/data/loop -p rate:=5.0 -p frame_id:=camera_optical_frame

Publishes ``image`` (sensor_msgs/Image, rgb8) or, with ``transport:=compressed``,
``image/compressed`` (sensor_msgs/CompressedImage: the file's own bytes for JPEG/PNG,
re-encoded JPEG otherwise), stamped with the current time and ``frame_id``, at
``rate`` Hz, plus ``camera_info`` when ``publish_camera_info`` (pinhole from fx, fy,
cx, cy; 0 = a 60° horizontal field of view centred on the image). Images are the
folder's files sorted by name; a video file (any format OpenCV reads) needs OpenCV.
By default it waits for a subscriber (plus ``start_delay``, so that discovery has
completed on both sides) before the first frame, then exits after the last one
unless ``loop``. Exit status 0, or 1 with one error line when the input
cannot be read.
"""
from __future__ import annotations

import io
import math
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import rclpy
from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import CameraInfo, CompressedImage, Image
from std_msgs.msg import Header

from ..io.preprocess import IMAGE_EXTENSIONS, ImageLoadError, list_images, load_image
from .conversions import camera_info_msg, rgb_to_image_msg

NODE_NAME = "image_folder_publisher"
DEFAULT_HFOV_DEG = 60.0


class SourceError(RuntimeError):
    """The images or video cannot be read."""


def _desc(text: str, lo: float | None = None, hi: float | None = None, integer: bool = False) -> ParameterDescriptor:
    d = ParameterDescriptor(description=text, read_only=True)
    if lo is not None:
        if integer:
            d.integer_range = [IntegerRange(from_value=int(lo), to_value=int(hi), step=1)]
        else:
            d.floating_point_range = [FloatingPointRange(from_value=float(lo), to_value=float(hi), step=0.0)]
    return d


PARAMS = {
    "images": ("", _desc("Folder of images (jpg, jpeg, png, bmp, webp; sorted by name) or a video file")),
    "rate": (5.0, _desc("Frames per second", 0.01, 1000.0)),
    "frame_id": ("camera_optical_frame", _desc("header.frame_id of the images and camera_info")),
    "transport": ("raw", _desc("raw (sensor_msgs/Image rgb8 on `image`) or compressed "
                               "(sensor_msgs/CompressedImage on `image/compressed`)")),
    "qos": ("reliable", _desc("reliable or best_effort (sensor data) publisher")),
    "loop": (False, _desc("Start again after the last frame instead of exiting")),
    "max_frames": (0, _desc("Publish at most this many frames (0 = all)", 0, 10**9, integer=True)),
    "publish_camera_info": (False, _desc("Also publish `camera_info`")),
    "fx": (0.0, _desc("Focal length x in pixels (0 = from a 60 deg horizontal FOV)", 0.0, 1e6)),
    "fy": (0.0, _desc("Focal length y in pixels (0 = fx)", 0.0, 1e6)),
    "cx": (0.0, _desc("Principal point x (0 = image centre)", 0.0, 1e6)),
    "cy": (0.0, _desc("Principal point y (0 = image centre)", 0.0, 1e6)),
    "wait_for_subscriber": (True, _desc("Hold the first frame until something subscribes")),
    "wait_timeout": (60.0, _desc("Seconds to wait for a subscriber before publishing anyway (0 = forever)",
                                 0.0, 1e6)),
    "start_delay": (0.5, _desc("Seconds between the first subscriber matching and the first frame",
                               0.0, 60.0)),
}


def iter_folder(paths: list[Path], compressed: bool) -> Iterator[tuple]:
    """(rgb [H,W,3] uint8 or None, compressed bytes or None, format, (width, height)) per file."""
    for path in paths:
        suffix = path.suffix.lower()
        if compressed and suffix in (".jpg", ".jpeg", ".png"):
            data = path.read_bytes()
            from PIL import Image as PILImage

            with PILImage.open(io.BytesIO(data)) as img:
                size = img.size
            yield None, data, ("png" if suffix == ".png" else "jpeg"), size
            continue
        try:
            rgb = np.asarray(load_image(path), dtype=np.uint8)
        except ImageLoadError as exc:
            raise SourceError(str(exc)) from None
        yield rgb, None, "", (rgb.shape[1], rgb.shape[0])


def iter_video(path: Path) -> Iterator[tuple]:
    """Frames of a video file as iter_folder yields them (rgb, None, "", (width, height))."""
    try:
        import cv2
    except ImportError:
        raise SourceError(f"{path} is not a folder, and reading videos needs OpenCV (pip install "
                          "opencv-python-headless)") from None
    capture = cv2.VideoCapture(str(path))
    if not capture.isOpened():
        raise SourceError(f"cannot open video {path}")
    try:
        while True:
            ok, bgr = capture.read()
            if not ok:
                return
            rgb = np.ascontiguousarray(bgr[:, :, ::-1])
            yield rgb, None, "", (rgb.shape[1], rgb.shape[0])
    finally:
        capture.release()


def encode_jpeg(rgb: np.ndarray, quality: int = 90) -> bytes:
    from PIL import Image as PILImage

    buf = io.BytesIO()
    PILImage.fromarray(rgb).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def default_intrinsics(width: int, height: int, fx: float = 0.0, fy: float = 0.0, cx: float = 0.0,
                       cy: float = 0.0) -> np.ndarray:
    fx = fx or (width / 2) / math.tan(math.radians(DEFAULT_HFOV_DEG) / 2)
    return np.array([[fx, 0.0, cx or width / 2], [0.0, fy or fx, cy or height / 2], [0.0, 0.0, 1.0]])


class ImageFolderPublisher(Node):
    def __init__(self, **kwargs) -> None:
        super().__init__(NODE_NAME, **kwargs)
        for name, (default, desc) in PARAMS.items():
            self.declare_parameter(name, default, desc)
        p = {name: self.get_parameter(name).value for name in PARAMS}
        self.p = p
        if p["transport"] not in ("raw", "compressed"):
            raise SourceError(f"transport must be raw or compressed, got {p['transport']!r}")
        if p["qos"] not in ("reliable", "best_effort"):
            raise SourceError(f"qos must be reliable or best_effort, got {p['qos']!r}")
        source = Path(p["images"]).expanduser()
        if not p["images"]:
            raise SourceError("parameter images is empty: give a folder of images or a video file")
        self.compressed = p["transport"] == "compressed"
        if source.is_dir():
            try:
                self.paths = list_images(source)
            except (OSError, ValueError) as exc:
                raise SourceError(str(exc)) from None
            if p["max_frames"]:
                self.paths = self.paths[:p["max_frames"]]
            self.total = len(self.paths)
        elif source.is_file() and source.suffix.lower() not in IMAGE_EXTENSIONS:
            self.paths = None
            self.total = p["max_frames"] or None
        else:
            raise SourceError(f"images {source} is neither a folder of images nor a video file")
        self.source = source
        qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE) if p["qos"] == "reliable" \
            else qos_profile_sensor_data
        if self.compressed:
            self.pub = self.create_publisher(CompressedImage, "image/compressed", qos)
        else:
            self.pub = self.create_publisher(Image, "image", qos)
        self.info_pub = self.create_publisher(CameraInfo, "camera_info", qos) if p["publish_camera_info"] else None
        self.sent = 0
        self.done = False
        self._frames = self._open()
        self._wait_started = time.monotonic()
        self._matched_at: float | None = None
        self._timer = self.create_timer(1.0 / p["rate"], self._tick)
        self.get_logger().info(f"publishing {source} on {self.pub.topic_name} at {p['rate']} Hz"
                               + (f" ({self.total} frames)" if self.total else ""))

    def _open(self) -> Iterator:
        if self.paths is not None:
            return iter_folder(self.paths, self.compressed)
        return iter_video(self.source)

    def _tick(self) -> None:
        if self.done:
            return
        p = self.p
        if self.sent == 0 and p["wait_for_subscriber"] and not self._ready():
            return
        if p["max_frames"] and self.sent >= p["max_frames"]:
            return self._finish()
        item = next(self._frames, None)
        if item is None:
            if p["loop"] and self.sent > 0:
                self._frames = self._open()
                item = next(self._frames, None)
            if item is None:
                return self._finish()
        rgb, data, fmt, (width, height) = item
        header = Header(frame_id=p["frame_id"])
        if self.compressed:
            if data is None:
                data, fmt = encode_jpeg(rgb), "jpeg"
            msg = CompressedImage(header=header, format=fmt)
            msg.data = data
        else:
            msg = rgb_to_image_msg(rgb, header)
        # stamped once the message is built (as a driver stamps at capture): the stamp -> pose
        # latency a subscriber measures does not include this process's own conversion
        header.stamp = self.get_clock().now().to_msg()
        self.pub.publish(msg)
        if self.info_pub is not None:
            K = default_intrinsics(width, height, p["fx"], p["fy"], p["cx"], p["cy"])
            self.info_pub.publish(camera_info_msg(K, width, height, header))
        self.sent += 1
        self.get_logger().debug(f"published frame {self.sent}")

    def _ready(self) -> bool:
        """A subscriber matched at least ``start_delay`` s ago (so that it has matched us too: a
        best-effort reader drops what arrives before that), or ``wait_timeout`` ran out."""
        p, now = self.p, time.monotonic()
        if self.pub.get_subscription_count() > 0:
            if self._matched_at is None:
                self._matched_at = now
            return now - self._matched_at >= p["start_delay"]
        if p["wait_timeout"] and now - self._wait_started >= p["wait_timeout"]:
            self.get_logger().warning(f"no subscriber on {self.pub.topic_name} after {p['wait_timeout']} s; "
                                      "publishing anyway")
            return True
        return False

    def _finish(self) -> None:
        self.done = True
        self.get_logger().info(f"published {self.sent} frame(s); done")


def main(args: list[str] | None = None) -> int:
    rclpy.init(args=args if args is not None else sys.argv)
    try:
        node = ImageFolderPublisher()
    except (SourceError, rclpy.exceptions.ParameterException) as exc:
        rclpy.logging.get_logger(NODE_NAME).error(f"cannot start: {exc}")
        rclpy.try_shutdown()
        return 1
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    status = 0
    try:
        while rclpy.ok() and not node.done:
            executor.spin_once(timeout_sec=0.1)
        linger_until = time.monotonic() + 1.0  # let reliable readers take the last frames
        while rclpy.ok() and time.monotonic() < linger_until:
            executor.spin_once(timeout_sec=0.1)
    except SourceError as exc:
        node.get_logger().error(str(exc))
        status = 1
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        executor.shutdown(timeout_sec=1.0)
        node.destroy_node()
        rclpy.try_shutdown()
    return status


if __name__ == "__main__":
    sys.exit(main())
