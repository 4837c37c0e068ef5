"""An input's final outputs from the outputs of its segments.

A fleet task replays its input in segments (``fleet_task``); each segment is one complete
``lingbot-map-replay`` run that resumes the model's state from the previous segment's
journal and writes its own outputs, for its own frames. Put end to end they hold what one
uninterrupted replay writes (the resumed state is the same, frame for frame), and here
they become one file each, under the names ``OUTPUTS`` gives:

- one segment: its files are renamed into place;
- several: the TUM lines and the PLY vertices are concatenated (the vertex count summed),
  the npz rows are fed in order to the replay's own ``PredictionStore`` (same layout,
  same depth chunks), and the results bag's messages are copied, except its paths
  (``nav_msgs/Path``: the last poses of the whole run), which are made again from the
  odometry poses at the rate and length the replay used.

Every file is written under a temporary name and renamed when complete (``io.atomic``,
``io.results.replace_folder``), so a kill leaves the old file or the new one.
"""
from __future__ import annotations

import os
import re
import shutil
from collections import deque
from pathlib import Path

from ..io.atomic import atomic_write, fsync_directory
from ..io.results import DepthPolicy, PredictionStore, iter_depth, load_predictions, replace_folder

# output -> (replay flag, name in the input's folder)
OUTPUTS = {
    "trajectory": ("--trajectory", "trajectory.tum"),
    "ply": ("--ply", "map.ply"),
    "npz": ("--out", "predictions.npz"),
    "bag": ("--out-bag", "results"),
}
DEFAULT_OUTPUTS = ("trajectory", "ply", "bag")
_PATH_TYPE, _ODOMETRY_TYPE = "nav_msgs/msg/Path", "nav_msgs/msg/Odometry"


def finish(output: str, parts: list[Path], folder: Path, chunk_frames: int, path_rate: float,
           path_length: int) -> list[Path]:
    """Write ``output`` of the segments' folders ``parts`` (in order) into ``folder``; returns the paths written.

    ``chunk_frames``: depth frames per npz chunk (--chunk-frames); ``path_rate`` (messages a second of
    input time, 0 = one at the end) and ``path_length`` (poses): the results bag's path messages.
    """
    name = OUTPUTS[output][1]
    final = folder / name
    if len(parts) == 1:
        return _move(parts[0] / name, final)
    sources = [part / name for part in parts]
    if output == "trajectory":
        atomic_write(final, lambda f: _concatenate_tum(sources, f))
    elif output == "ply":
        atomic_write(final, lambda f: _concatenate_ply(sources, f))
    elif output == "npz":
        return _merge_npz(sources, final, chunk_frames)
    else:
        _merge_bag(sources, final, path_rate, path_length)
    return [final]


def _move(source: Path, final: Path) -> list[Path]:
    """Rename one segment's output into place (with the npz, its depth chunks' folder first)."""
    chunks, final_chunks = (p.with_name(p.stem + ".chunks") for p in (source, final))
    with_chunks = source.suffix == ".npz"
    if not os.path.lexists(source) and os.path.lexists(final):  # moved by an attempt killed before it said so
        return [final] + ([final_chunks] if with_chunks and final_chunks.is_dir() else [])
    written = [final]
    if with_chunks and chunks.is_dir():
        _replace_folder(chunks, final_chunks)
        written.append(final_chunks)
    if source.is_dir():
        _replace_folder(source, final)
    else:
        os.replace(source, final)
    fsync_directory(final.parent)
    return written


def _replace_folder(source: Path, final: Path) -> None:
    aside = replace_folder(source, final, overwrite=True)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _concatenate_tum(sources: list[Path], out) -> None:
    """One header line, then every segment's poses."""
    header_written = False
    for source in sources:
        with open(source, "rb") as f:
            for line in f:
                if line.startswith(b"#"):
                    if not header_written:
                        out.write(line)
                        header_written = True
                    continue
                out.write(line)


def _ply_header(f, source: Path) -> tuple[bytes, re.Match]:
    """The header of the binary PLY open in ``f`` (read up to its end) and the match of its vertex count."""
    header = b""
    while not header.endswith(b"end_header\n"):
        line = f.readline()
        if not line or len(header) > 4096:
            raise ValueError(f"{source}: not a PLY file (no end_header)")
        header += line
    count = re.search(rb"element vertex (\d+)\n", header)
    if count is None:
        raise ValueError(f"{source}: its PLY header has no vertex count")
    return header, count


def _concatenate_ply(sources: list[Path], out) -> None:
    """The first segment's header with the summed vertex count, then every segment's vertices."""
    total, first = 0, None
    for source in sources:
        with open(source, "rb") as f:
            header, count = _ply_header(f, source)
        total += int(count.group(1))
        first = first or (header, count)
    header, count = first
    digits = max(len(count.group(1)), len(str(total)))
    out.write(header[:count.start(1)] + f"{total:0{digits}d}".encode() + header[count.end(1):])
    for source in sources:
        with open(source, "rb") as f:
            _ply_header(f, source)
            shutil.copyfileobj(f, out, 1 << 20)


def _merge_npz(sources: list[Path], final: Path, chunk_frames: int) -> list[Path]:
    """The segments' rows, in order, through ``PredictionStore`` (depth where a segment kept it)."""
    store = PredictionStore(final, DepthPolicy(1), chunk_frames, overwrite=True)
    for source in sources:
        arrays = load_predictions(source, depth=False)
        for row, depth, confidence in _rows_with_depth(source, len(arrays["pose_enc"])):
            store.add(arrays["pose_enc"][row], arrays["pose_c2w"][row], arrays["intrinsics"][row],
                      bool(arrays["is_keyframe"][row]), int(arrays["stamp_ns"][row]), int(arrays["window"][row]),
                      depth, confidence)
    return store.close()


def _rows_with_depth(source: Path, rows: int):
    """(row, depth or None, confidence or None) of each of a segment npz's ``rows``, one depth chunk in memory."""
    blocks = iter_depth(source)
    block, i = next(blocks, None), 0
    for row in range(rows):
        if block is not None and i < len(block[0]) and int(block[0][i]) == row:
            yield row, block[1][i], block[2][i]
            i += 1
            if i == len(block[0]):
                block, i = next(blocks, None), 0
        else:
            yield row, None, None


class _PathMessages:
    """The results bag's ``nav_msgs/Path`` messages made again from the odometry poses, as
    ``io.results_bag.ResultsBagWriter`` writes them: the last ``length`` poses, at most
    ``rate`` messages a second of input time (0: none during the run), and one at the end."""

    def __init__(self, store, rate: float, length: int) -> None:
        self.store, self.types = store, store.types
        self.period = int(1e9 / rate) if rate > 0 else None
        self.poses: deque = deque(maxlen=length)
        self.last_path: int | None = None
        self.last_stamp: int | None = None
        self.frame = "map"

    def add(self, stamp: int, odometry) -> bytes | None:
        """Take one frame's odometry (deserialized); the path message due at ``stamp``, serialized, or None."""
        self.frame = odometry.header.frame_id
        self.poses.append((stamp, odometry.pose.pose))
        self.last_stamp = stamp
        if self.period is not None and (self.last_path is None or stamp - self.last_path >= self.period):
            self.last_path = stamp
            return self.message(stamp)
        return None

    def final(self) -> bytes | None:
        """The whole path at the last frame, unless it went out with that frame."""
        if self.last_stamp is None or self.last_path == self.last_stamp:
            return None
        return self.message(self.last_stamp)

    def _header(self, stamp: int):
        sec, nanosec = divmod(int(stamp), 1_000_000_000)
        return self.types["std_msgs/msg/Header"](stamp=self.types["builtin_interfaces/msg/Time"](
            sec=sec, nanosec=nanosec), frame_id=self.frame)

    def message(self, stamp: int) -> bytes:
        stamped = self.types["geometry_msgs/msg/PoseStamped"]
        poses = [stamped(header=self._header(s), pose=pose) for s, pose in self.poses]
        path = self.types[_PATH_TYPE](header=self._header(stamp), poses=poses)
        return bytes(self.store.serialize_cdr(path, _PATH_TYPE))


def _merge_bag(sources: list[Path], final: Path, rate: float, length: int) -> None:
    """The segments' results bags as one (MCAP), written beside ``final`` and renamed into place."""
    from rosbags.rosbag2 import Reader, StoragePlugin, Writer
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS2_KILTED)  # the replay's results bags are written with it
    work = final.parent / f".{final.name}.merging"
    if work.exists():
        shutil.rmtree(work)  # left by a merge that was killed
    work.mkdir(parents=True)
    paths = _PathMessages(store, rate, length)
    writer = Writer(work / final.name, version=9, storage_plugin=StoragePlugin.MCAP)
    writer.open()
    connections: dict[str, object] = {}
    path_topic = None
    for source in sources:
        with Reader(source) as reader:
            for c in sorted(reader.connections, key=lambda c: c.id):
                if c.topic not in connections:
                    connections[c.topic] = writer.add_connection(c.topic, c.msgtype, typestore=store)
                path_topic = c.topic if c.msgtype == _PATH_TYPE else path_topic
            for c, stamp, raw in reader.messages():
                if c.msgtype == _PATH_TYPE:
                    continue
                writer.write(connections[c.topic], stamp, raw)
                if c.msgtype == _ODOMETRY_TYPE and path_topic is not None:
                    due = paths.add(stamp, store.deserialize_cdr(raw, _ODOMETRY_TYPE))
                    if due is not None:
                        writer.write(connections[path_topic], stamp, due)
    last = paths.final()
    if last is not None and path_topic is not None:
        writer.write(connections[path_topic], paths.last_stamp, last)
    writer.close()
    for f in (work / final.name).iterdir():
        with open(f, "rb") as handle:
            os.fsync(handle.fileno())
    _replace_folder(work / final.name, final)
    fsync_directory(final.parent)
    work.rmdir()


__all__ = ["OUTPUTS", "DEFAULT_OUTPUTS", "finish"]
