"""Frame sources for offline replay: a folder of images, a rosbag2 (or ROS 1) bag topic,
a video file. Frames come one at a time, never all in memory; ``Prefetcher`` decodes
and preprocesses a few ahead on a thread.

Every source yields ``SourceFrame``s in recording order: a decoded uint8 RGB frame
[H, W, 3] with its stamp (nanoseconds), or, for a frame that cannot be decoded (a
truncated message, a corrupt image, a broken video packet), the reason in ``error``
and no pixels: the caller counts and skips it, or stops. A source that cannot be read
at all raises ``SourceError`` with a one-line message, when it is made (missing file,
corrupt bag, no such topic, wrong message type, unreadable video) or while iterating
(a bag or video that breaks part-way).

Time line and selection (``Selection``): ``start`` and ``duration`` are seconds of the
recording's own time line — a bag's receive (log) time from the bag's first message,
a video's presentation time, an image folder's frame number (frame i is at i s) —
and ``stride`` keeps every n-th frame of that range (counted before decoding, so a
skipped frame still takes its turn). Stamps: a bag frame has its header stamp (the
receive time when the stamp is zero), a video frame its presentation time, a folder
frame i seconds.

Bags are read with ``rosbags`` (pure Python, no ROS install): rosbag2 directories
in the sqlite3 or MCAP storage, or ROS 1 ``.bag`` files; the message definitions come
from the bag, or from the ROS 2 standard types when the bag has none (older sqlite3
bags). Videos are decoded by PyAV (FFmpeg in its wheels) with timestamps from the
container.
"""
from __future__ import annotations

import math
import queue
import threading
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from .image_msgs import ImageDecodeError, is_image_type, message_to_rgb, stamp_ns
from .preprocess import ImageLoadError, list_images, load_image

NS = 1_000_000_000
DEFAULT_CAMERA_FRAME = "camera_optical_frame"


class SourceError(ValueError):
    """The input cannot be read (one line, naming the file and the problem)."""


@dataclass(frozen=True)
class Selection:
    """Which part of the recording to replay (see the module docstring)."""

    start: float = 0.0  # seconds from the recording's start
    duration: float | None = None  # seconds; None = to the end
    stride: int = 1  # keep every stride-th frame of the range

    def __post_init__(self) -> None:
        if not (math.isfinite(self.start) and self.start >= 0):
            raise ValueError(f"start must be a finite number of seconds >= 0, got {self.start}")
        if self.duration is not None and not (math.isfinite(self.duration) and self.duration > 0):
            raise ValueError(f"duration must be a positive number of seconds, got {self.duration}")
        if self.stride < 1:
            raise ValueError(f"stride must be >= 1, got {self.stride}")

    def contains(self, t: float) -> bool:
        """``t`` (seconds from the recording's start) lies in [start, start + duration)."""
        return t >= self.start and (self.duration is None or t < self.start + self.duration)

    def ended(self, t: float) -> bool:
        return self.duration is not None and t >= self.start + self.duration

    def fraction(self, total_s: float) -> float:
        """Share of a recording of ``total_s`` seconds inside the range (for progress estimates)."""
        if total_s <= 0:
            return 1.0
        end = total_s if self.duration is None else min(total_s, self.start + self.duration)
        return max(0.0, end - self.start) / total_s


@dataclass
class SourceFrame:
    """One frame of the input: pixels, or why there are none."""

    stamp_ns: int  # header stamp (bag), presentation time (video), index seconds (folder)
    name: str  # where it came from, for messages: file name, "message N", "frame at T s"
    rgb: np.ndarray | None  # [H, W, 3] uint8 RGB; None when ``error`` is set (or after preparation)
    error: str | None = None  # why the frame cannot be used
    camera_frame: str = DEFAULT_CAMERA_FRAME  # the image's frame_id (bags), else the default


class ImageFolderSource:
    """The images directly inside a folder, sorted by file name (see ``preprocess.list_images``)."""

    def __init__(self, directory: str | Path, selection: Selection = Selection()) -> None:
        self.path = Path(directory)
        try:
            paths = list_images(self.path)
        except (OSError, ValueError) as exc:
            raise SourceError(str(exc)) from None
        first = math.ceil(selection.start)
        self._selected = [(i, p) for i, p in enumerate(paths)
                          if selection.contains(i) and (i - first) % selection.stride == 0]
        if not self._selected:
            raise SourceError(f"no image of {self.path} lies in the selected range "
                              f"(--start {selection.start:g}, {len(paths)} images)")
        self.description = f"{len(self._selected)} images from {self.path}"

    def expected_frames(self) -> int:
        return len(self._selected)

    def frames(self) -> Iterator[SourceFrame]:
        for i, path in self._selected:
            try:
                rgb = np.asarray(load_image(path))
            except ImageLoadError as exc:
                yield SourceFrame(i * NS, path.name, None, str(exc))
                continue
            yield SourceFrame(i * NS, path.name, rgb)


class BagSource:
    """The image messages of one topic of a bag (``sensor_msgs/Image`` or ``CompressedImage``)."""

    def __init__(self, path: str | Path, topic: str, selection: Selection = Selection(),
                 msgtype: str | None = None) -> None:
        """``msgtype``: the connections of ``topic`` to read when it carries both image types
        (``Image`` or ``CompressedImage``, short or full name); None = the topic's only type."""
        self.path = _bag_path(Path(path))
        self.topic, self.selection = topic, selection
        with closing(self._open()) as reader:
            types = _topic_types(reader.connections)  # topic -> {message type: messages}
            found = types.get(topic)
            if found is None:
                raise SourceError(f"bag {self.path} has no topic {topic}; {_image_topics(types)}")
            images = {t: n for t, n in found.items() if is_image_type(t)}
            if msgtype is not None:
                images = {t: n for t, n in images.items() if t.rsplit("/", 1)[-1] == msgtype.rsplit("/", 1)[-1]}
                if not images:
                    raise SourceError(f"topic {topic} of bag {self.path} has no {msgtype} messages; it carries "
                                      f"{_counted(found)}")
            if not images:
                raise SourceError(f"topic {topic} of bag {self.path} carries {_counted(found)}, not "
                                  f"sensor_msgs/Image or sensor_msgs/CompressedImage; {_image_topics(types)}")
            if len(images) > 1:
                raise SourceError(f"topic {topic} of bag {self.path} carries both {_counted(images, ' and ')} (two "
                                  "publishers of different types); pass --topic-type Image or --topic-type "
                                  "CompressedImage to replay one of them")
            (self.msgtype, self._count), = images.items()
            self._start, self._total_s = reader.start_time, max(0, reader.duration) / NS
        self.description = f"{topic} ({self.msgtype.rsplit('/', 1)[-1]}, {self._count} messages) of {self.path}"

    def expected_frames(self) -> int:
        return math.ceil(self._count * self.selection.fraction(self._total_s) / self.selection.stride)

    def _open(self):
        from rosbags.highlevel import AnyReader
        from rosbags.typesys import Stores, get_typestore

        try:
            reader = AnyReader([self.path], default_typestore=get_typestore(Stores.LATEST))
            reader.open()
        except Exception as exc:  # rosbags raises its own errors, YAML, sqlite3, struct errors for corrupt files
            raise SourceError(f"cannot read bag {self.path}: {_reason(exc)}{_mcap_hint(self.path)}") from None
        return reader

    def frames(self) -> Iterator[SourceFrame]:
        """Opens the bag itself: call it on the thread that iterates (sqlite3 handles stay on theirs)."""
        sel = self.selection
        start = self._start + round(sel.start * NS)
        stop = None if sel.duration is None else start + round(sel.duration * NS)
        with closing(self._open()) as reader:
            connections = [c for c in reader.connections if c.topic == self.topic and c.msgtype == self.msgtype]
            messages = reader.messages(connections, start=start, stop=stop)
            for n, (connection, log_time, raw) in enumerate(_guarded(messages, self)):
                if n % sel.stride:
                    continue
                yield self._frame(reader, connection.msgtype, n, log_time, raw)

    def _frame(self, reader, msgtype: str, n: int, log_time: int, raw) -> SourceFrame:
        name = f"message {n} of {self.topic}"
        try:
            msg = reader.deserialize(raw, msgtype)
        except Exception as exc:  # truncated or corrupt CDR data
            return SourceFrame(log_time, name, None, f"{name}: cannot deserialize {msgtype}: {_reason(exc)}")
        stamp = stamp_ns(msg.header) or log_time
        frame_id = msg.header.frame_id or DEFAULT_CAMERA_FRAME
        try:
            rgb = message_to_rgb(msg, msgtype)
        except ImageDecodeError as exc:
            return SourceFrame(stamp, name, None, f"{name}: {exc}", frame_id)
        return SourceFrame(stamp, name, rgb, None, frame_id)


def _guarded(messages: Iterator, source: BagSource) -> Iterator:
    """The reader's messages; a failure of the reader itself (a corrupt chunk, a broken database)
    becomes a SourceError naming how far it got."""
    n = 0
    while True:
        try:
            item = next(messages)
        except StopIteration:
            return
        except Exception as exc:
            raise SourceError(f"bag {source.path} is unreadable after {n} messages of {source.topic}: "
                              f"{_reason(exc)}{_mcap_hint(source.path)}") from None
        n += 1
        yield item


def _bag_path(path: Path) -> Path:
    """The path rosbags opens: a rosbag2 directory (a storage file inside one is taken to mean its
    directory) or a ROS 1 .bag file."""
    if not path.exists():
        raise SourceError(f"bag not found: {path}")
    if path.is_file() and path.suffix != ".bag":
        if (path.parent / "metadata.yaml").is_file():
            return path.parent
        raise SourceError(f"{path}: a rosbag2 is read as its directory, with metadata.yaml; none next to this "
                          "file (reindex it with `ros2 bag reindex` or give the directory)")
    if path.is_dir() and not (path / "metadata.yaml").is_file():
        raise SourceError(f"{path} is not a rosbag2 directory: it has no metadata.yaml")
    return path


def _topic_types(connections) -> dict[str, dict[str, int]]:
    """topic -> {message type: messages} over a bag's connections (a topic may have several types)."""
    types: dict[str, dict[str, int]] = {}
    for c in connections:
        counts = types.setdefault(c.topic, {})
        counts[c.msgtype] = counts.get(c.msgtype, 0) + c.msgcount
    return types


def _counted(types: dict[str, int], sep: str = ", ") -> str:
    return sep.join(f"{t} ({n} message{'s' if n != 1 else ''})" for t, n in sorted(types.items()))


def _image_topics(types: dict[str, dict[str, int]]) -> str:
    """The image topics of a bag for a message (or, when it has none, every topic it has)."""
    found = [f"{name} ({', '.join(f'{t}, {n} messages' for t, n in sorted(counts.items()) if is_image_type(t))})"
             for name, counts in sorted(types.items()) if any(is_image_type(t) for t in counts)]
    if found:
        return "image topics in it: " + ", ".join(found)
    present = [f"{name} ({', '.join(sorted(counts))})" for name, counts in sorted(types.items())]
    return ("it has no image topics (sensor_msgs/Image or sensor_msgs/CompressedImage); its topics: "
            + (", ".join(present) if present else "none") + ". Replay a bag that recorded the camera's image topic "
            "(e.g. ros2 bag record /camera/image_raw), or --images / --video")


def _mcap_hint(path: Path) -> str:
    """How to recover an MCAP storage file cut short (a recording killed, a copy that stopped)."""
    files = sorted(path.glob("*.mcap")) if path.is_dir() else []
    if not files:
        return ""
    f = files[0]
    return (f"; an MCAP file cut short can be recovered with the mcap CLI: mcap recover {f} -o "
            f"{f.with_name(f.stem + '-recovered.mcap')}, then put the recovered file in place of {f.name} "
            "(metadata.yaml names it)")


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class VideoSource:
    """The first video stream of a file, decoded by PyAV."""

    def __init__(self, path: str | Path, selection: Selection = Selection()) -> None:
        self.path, self.selection = Path(path), selection
        if not self.path.is_file():
            raise SourceError(f"video file not found: {self.path}")
        with self._open() as container:
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            self._rate = float(rate) if rate else None
            seconds = float(stream.duration * stream.time_base) if stream.duration and stream.time_base else (
                container.duration / 1e6 if container.duration else 0.0)
            count = stream.frames or (round(seconds * self._rate) if self._rate else 0)
            self._count, self._seconds = count, seconds
            codec = stream.codec_context
            self.description = f"{self.path} ({codec.name} {codec.width}x{codec.height}, {count or '?'} frames)"

    def expected_frames(self) -> int | None:
        if not self._count:
            return None
        return math.ceil(self._count * self.selection.fraction(self._seconds) / self.selection.stride)

    def _open(self):
        import av

        try:
            container = av.open(str(self.path), mode="r")
        except (av.FFmpegError, OSError, ValueError) as exc:
            raise SourceError(f"cannot read video {self.path}: {_reason(exc)}") from None
        if not container.streams.video:
            container.close()
            raise SourceError(f"{self.path} has no video stream")
        return container

    def frames(self) -> Iterator[SourceFrame]:
        import av

        sel = self.selection
        with self._open() as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            if sel.start > 0 and stream.time_base:
                container.seek(int(sel.start / stream.time_base), stream=stream)  # the keyframe before start
            seen, last_t = 0, None
            for packet in _packets(container, stream, self.path):
                try:
                    decoded = packet.decode()
                except av.FFmpegError as exc:
                    t = float(packet.pts * stream.time_base) if packet.pts is not None else (last_t or 0.0)
                    yield SourceFrame(round(max(t, 0.0) * NS), f"packet at {t:.3f} s", None,
                                      f"{self.path}: undecodable packet at {t:.3f} s: {_reason(exc)}")
                    continue
                for frame in decoded:
                    t = frame.time if frame.time is not None else (
                        (last_t or 0.0) + (1.0 / self._rate if self._rate else 0.0))
                    last_t = t
                    if sel.ended(t):
                        return
                    if not sel.contains(t):
                        continue
                    seen += 1
                    if (seen - 1) % sel.stride:
                        continue
                    rgb = frame.to_ndarray(format="rgb24")
                    yield SourceFrame(round(max(t, 0.0) * NS), f"frame at {t:.3f} s", rgb)


def _packets(container, stream, path: Path) -> Iterator:
    """Demuxed packets; a failure to read the file itself is a SourceError."""
    import av

    packets = container.demux(stream)
    while True:
        try:
            packet = next(packets)
        except StopIteration:
            return
        except (av.FFmpegError, OSError) as exc:
            raise SourceError(f"video {path} is unreadable part-way: {_reason(exc)}") from None
        yield packet


# ----------------------------------------------------------------------------- prefetching

@dataclass
class _Failure:
    exc: BaseException


_END = object()


class Prefetcher:
    """Runs a source's ``frames()`` and a preparation step (e.g. resizing to model input) on a
    thread, at most ``depth`` frames ahead of the consumer.

    Iterating yields ``(SourceFrame, prepared)``; ``prepared`` is None for a frame with an
    error. A ``ValueError`` of ``prepare`` becomes that frame's error. The frame's
    ``rgb`` is dropped once prepared (only the model input stays queued). An exception
    of the source re-raises in the consumer. Use as a context manager: leaving it early
    stops the thread, which closes the source there.
    """

    def __init__(self, source_frames: Callable[[], Iterator[SourceFrame]], prepare: Callable[[np.ndarray], Any],
                 depth: int = 4) -> None:
        self._frames, self._prepare = source_frames, prepare
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="replay-prefetch", daemon=True)

    def __enter__(self) -> "Prefetcher":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():
            try:  # make room so that a producer blocked on put sees the stop
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass
        self._thread.join()

    def __iter__(self) -> Iterator[tuple[SourceFrame, Any]]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield item

    def _produce(self) -> None:
        frames = self._frames()
        try:
            for frame in frames:
                if self._stop.is_set():
                    return
                if not self._put((frame, self._prepared(frame))):
                    return
            self._put(_END)
        except BaseException as exc:  # handed to the consumer
            self._put(_Failure(exc))
        finally:
            frames.close()

    def _prepared(self, frame: SourceFrame) -> Any:
        if frame.rgb is None:
            return None
        try:
            return self._prepare(frame.rgb)
        except ValueError as exc:
            frame.error = f"{frame.name}: {exc}"
            return None
        finally:
            frame.rgb = None

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False


__all__ = ["SourceError", "Selection", "SourceFrame", "ImageFolderSource", "BagSource", "VideoSource", "Prefetcher",
           "DEFAULT_CAMERA_FRAME"]
