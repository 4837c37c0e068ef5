"""Inputs for the replay tests, written here with ``rosbags`` and PyAV: image bags in
both rosbag2 storages (raw and compressed images, other topics, broken messages) and
short video clips."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

NS = 1_000_000_000
T0 = 1_700_000_000 * NS  # header stamps of the written bags start here
PERIOD = NS // 10  # 10 Hz


def typestore():
    from rosbags.typesys import Stores, get_typestore

    return get_typestore(Stores.ROS2_HUMBLE)


def _header(t, stamp_ns: int, frame_id: str = "cam_optical"):
    sec, nanosec = divmod(stamp_ns, NS)
    return t["std_msgs/msg/Header"](stamp=t["builtin_interfaces/msg/Time"](sec=sec, nanosec=nanosec),
                                    frame_id=frame_id)


def raw_image(t, rgb: np.ndarray, stamp_ns: int, encoding: str = "rgb8"):
    """A sensor_msgs/Image of ``rgb`` [H, W, 3] uint8 as rgb8 or bgr8, rows padded by 2 bytes."""
    pixels = rgb if encoding == "rgb8" else rgb[:, :, ::-1]
    h, w, _ = pixels.shape
    padded = np.zeros((h, w * 3 + 2), np.uint8)
    padded[:, :w * 3] = pixels.reshape(h, w * 3)
    return t["sensor_msgs/msg/Image"](header=_header(t, stamp_ns), height=h, width=w, encoding=encoding,
                                      is_bigendian=0, step=w * 3 + 2, data=padded.reshape(-1))


def compressed_image(t, data: bytes, stamp_ns: int, fmt: str = "jpeg"):
    return t["sensor_msgs/msg/CompressedImage"](header=_header(t, stamp_ns), format=fmt,
                                                data=np.frombuffer(data, np.uint8).copy())


def write_image_bag(path: Path, images: Sequence[Path] | Sequence[np.ndarray], storage: str = "mcap",
                    kind: str = "raw", topic: str = "/camera/image", broken: dict[int, str] | None = None,
                    encoding: str = "rgb8") -> list[int]:
    """Write ``images`` (files, or uint8 RGB arrays for kind raw) as one message each, 10 Hz from T0,
    receive time = header stamp, plus a std_msgs/String topic ``/chatter`` and a second image topic.

    broken: index -> "cdr" (the serialized message cut in half), "jpeg" (compressed data cut
    in half), "short" (raw data shorter than step x height).

    Returns:
        The header stamps (ns) of the messages written on ``topic``.
    """
    from PIL import Image
    from rosbags.rosbag2 import StoragePlugin, Writer

    t = typestore().types
    store = typestore()
    broken = broken or {}
    msgtype = "sensor_msgs/msg/Image" if kind == "raw" else "sensor_msgs/msg/CompressedImage"
    plugin = StoragePlugin.MCAP if storage == "mcap" else StoragePlugin.SQLITE3
    stamps = []
    with Writer(path, version=9, storage_plugin=plugin) as writer:
        conn = writer.add_connection(topic, msgtype, typestore=store)
        chatter = writer.add_connection("/chatter", "std_msgs/msg/String", typestore=store)
        other = writer.add_connection("/other/image/compressed", "sensor_msgs/msg/CompressedImage",
                                      typestore=store)
        for i, image in enumerate(images):
            stamp = T0 + i * PERIOD
            stamps.append(stamp)
            if kind == "raw":
                rgb = image if isinstance(image, np.ndarray) else np.asarray(Image.open(image).convert("RGB"))
                msg = raw_image(t, rgb, stamp, encoding)
                if broken.get(i) == "short":
                    msg.data = msg.data[: msg.data.size // 2]
            else:
                data = Path(image).read_bytes()
                if broken.get(i) == "jpeg":
                    data = data[: len(data) // 2]
                msg = compressed_image(t, data, stamp)
            raw = store.serialize_cdr(msg, msgtype)
            if broken.get(i) == "cdr":
                raw = bytes(raw)[: len(raw) // 2]
            writer.write(conn, stamp, raw)
            writer.write(chatter, stamp + 1, store.serialize_cdr(t["std_msgs/msg/String"](data=f"{i}"),
                                                                 "std_msgs/msg/String"))
        writer.write(other, T0, store.serialize_cdr(compressed_image(t, b"x", T0),
                                                    "sensor_msgs/msg/CompressedImage"))
    return stamps


def write_ros1_bag(path: Path, images: Sequence[Path], topic: str = "/camera/image") -> list[int]:
    """A ROS 1 bag of rgb8 sensor_msgs/Image messages of ``images``, 10 Hz from T0; returns the stamps."""
    from PIL import Image
    from rosbags.rosbag1 import Writer
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS1_NOETIC)
    t = store.types
    stamps = []
    with Writer(path) as writer:
        conn = writer.add_connection(topic, "sensor_msgs/msg/Image", typestore=store)
        for i, image in enumerate(images):
            stamp = T0 + i * PERIOD
            rgb = np.asarray(Image.open(image).convert("RGB"))
            sec, nanosec = divmod(stamp, NS)
            header = t["std_msgs/msg/Header"](seq=i, stamp=t["builtin_interfaces/msg/Time"](sec=sec, nanosec=nanosec),
                                              frame_id="cam_optical")
            msg = t["sensor_msgs/msg/Image"](header=header, height=rgb.shape[0], width=rgb.shape[1], encoding="rgb8",
                                             is_bigendian=0, step=rgb.shape[1] * 3, data=rgb.reshape(-1))
            writer.write(conn, stamp, store.serialize_ros1(msg, "sensor_msgs/msg/Image"))
            stamps.append(stamp)
    return stamps


def write_video(path: Path, frames: Sequence[np.ndarray], codec: str = "ffv1", rate: int = 10) -> None:
    """Encode uint8 RGB frames [H, W, 3] (even H and W for yuv codecs) at ``rate`` fps with PyAV.
    ffv1 (mkv) and libx264rgb are lossless in RGB; libx264 (yuv420p) is lossy."""
    import av

    h, w, _ = frames[0].shape
    pix_fmt = {"ffv1": "bgr0", "libx264rgb": "rgb24"}.get(codec, "yuv420p")
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = w, h, pix_fmt
        if codec == "libx264rgb":
            stream.options = {"qp": "0"}
        for rgb in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def read_bag(path: Path) -> dict[str, list[tuple[int, object]]]:
    """Every message of a bag, deserialized: topic -> [(log time ns, message)]."""
    from rosbags.highlevel import AnyReader

    out: dict[str, list] = {}
    with AnyReader([path]) as reader:
        for conn, log_time, raw in reader.messages():
            out.setdefault(conn.topic, []).append((log_time, reader.deserialize(raw, conn.msgtype)))
    return out


def bag_types(path: Path) -> dict[str, str]:
    from rosbags.highlevel import AnyReader

    with AnyReader([path]) as reader:
        return {name: info.msgtype for name, info in reader.topics.items()}


PROG = "lingbot-map-replay"


def replay(capsys, *argv, observer=None) -> tuple[int, str]:
    """Run the replay CLI in this process: (exit code, what it printed on stderr)."""
    from lingbot_map_ros.cli.replay import main

    code = main([str(a) for a in argv], observer)
    return code, capsys.readouterr().err


def error_line(err: str) -> str:
    """The one error line that ends ``err`` (and no traceback before it)."""
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{PROG}: error:"), err
    assert sum(line.startswith(f"{PROG}: error:") for line in err.splitlines()) == 1, err
    return last
