"""The node's memory of the sequence: the accumulated point map and the trajectory.

Both are keyed by the session's 0-based frame index so that a rollback can remove
exactly the frames the session forgot (``remove_from(first_forgotten_index)``).
Free of rclpy and torch.

Map: each frame's selected points (already in the map frame) are voxel-downsampled
and kept as a separate chunk while they may still be rolled back (index at or after
``protect_from``); older chunks are merged into one consolidated cloud, which is
thinned uniformly when the map would exceed ``max_points``. The consolidated cloud
is kept sorted by voxel key, so a merge only looks up the new points' voxels
(a voxel already in the map keeps its point) instead of downsampling the whole map
again: its cost grows with the points merged, not with the map.
"""
from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..geometry import voxel_downsample

MERGE_EVERY = 16  # mergeable chunks collected before a consolidation pass
THIN_TO = 0.75  # fraction of the budget kept when the bound forces thinning


KEY_BITS = 21  # per axis: voxel coordinates within +-2^20 voxels of the origin fit one int64 key
_KEY_OFFSET = 1 << (KEY_BITS - 1)


def _empty() -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((0, 3), np.float32), np.zeros((0, 3), np.uint8)


def voxel_keys(points: np.ndarray, voxel_size: float) -> tuple[np.ndarray, np.ndarray]:
    """(keys [N] int64, valid [N] bool): one key per point's voxel, the same for every call;
    points further than 2^20 voxels from the origin (or not finite) are not valid."""
    with np.errstate(invalid="ignore", over="ignore"):
        cells = np.floor(np.asarray(points, np.float64) / voxel_size) + _KEY_OFFSET
    valid = np.isfinite(cells).all(axis=1) & (cells >= 0).all(axis=1) & (cells < (1 << KEY_BITS)).all(axis=1)
    c = np.where(valid[:, None], cells, 0).astype(np.int64)
    return (c[:, 0] << (2 * KEY_BITS)) | (c[:, 1] << KEY_BITS) | c[:, 2], valid


class MapAccumulator:
    """Bounded, voxel-downsampled point map with per-frame removal of recent frames.

    Thread-safe: the inference thread adds and removes, a timer reads snapshots.
    """

    def __init__(self, voxel_size: float, max_points: int) -> None:
        if voxel_size < 0 or max_points < 1:
            raise ValueError(f"need voxel_size >= 0 and max_points >= 1, got {voxel_size}, {max_points}")
        self.voxel_size = float(voxel_size)
        self.max_points = int(max_points)
        self._lock = threading.Lock()
        self._base = _empty()
        self._base_keys = np.zeros(0, np.int64)  # sorted voxel keys of the base (voxel_size > 0)
        self._chunks: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._floor = 0
        self._version = 0
        self._snapshot: tuple[int, np.ndarray, np.ndarray] | None = None
        self.thinned = False  # set once the bound forced uniform thinning
        # told every change, under the lock, after it is applied (``map_journal.MapJournal``): None = nobody
        self.listener: Any = None

    @property
    def lock(self) -> threading.Lock:
        """Held while the map changes (a listener that must see the map still takes it first)."""
        return self._lock

    @property
    def version(self) -> int:
        """Increases on every change (readers republish when it moved)."""
        return self._version

    def add(self, frame_index: int, points: np.ndarray, colors: np.ndarray, downsampled: bool = False) -> None:
        """Add frame ``frame_index``'s points [N, 3] float32 (map frame) and colours [N, 3] uint8.
        ``downsampled``: they are a chunk as this map keeps it already (a journal's replay)."""
        pts, cols = np.asarray(points, np.float32), np.asarray(colors, np.uint8)
        if not downsampled:
            pts, cols = self._downsample(pts, cols)
        with self._lock:
            self._chunks[frame_index] = (pts, cols)
            self._chunks.move_to_end(frame_index)
            self._consolidate()
            self._version += 1
            if self.listener is not None:
                self.listener.map_added(self, frame_index, pts, cols)

    def protect_from(self, frame_index: int) -> None:
        """Frames with index >= ``frame_index`` may still be rolled back: keep them separate."""
        with self._lock:
            self._floor = frame_index
            if self.listener is not None:
                self.listener.map_op(self, "protect", frame_index)

    def remove_from(self, frame_index: int) -> int:
        """Forget the frames with index >= ``frame_index``; returns the points removed."""
        with self._lock:
            gone = [i for i in self._chunks if i >= frame_index]
            removed = sum(self._chunks.pop(i)[0].shape[0] for i in gone)
            if gone:
                self._version += 1
            if self.listener is not None:
                self.listener.map_op(self, "remove", frame_index)
            return removed

    def clear(self) -> None:
        with self._lock:
            self._base = _empty()
            self._base_keys = np.zeros(0, np.int64)
            self._chunks.clear()
            self._floor = 0
            self._version += 1
            if self.listener is not None:
                self.listener.map_op(self, "clear", 0)

    def state(self) -> dict[str, Any]:
        """Everything that decides this map's future (its points, the chunks still held apart,
        the floor, whether it was thinned) as arrays and numbers; ``load_state`` takes it back.
        The arrays are the map's own (never modified in place: every change replaces them)."""
        with self._lock:
            return self.state_locked()

    def state_locked(self) -> dict[str, Any]:
        """``state`` for a caller that holds the lock already (a listener)."""
        return {"base": self._base, "chunks": list(self._chunks.items()), "floor": self._floor,
                "thinned": self.thinned}

    def load_state(self, state: dict[str, Any]) -> None:
        """Become the map ``state`` describes (``state``); the base's voxel keys are recomputed
        (a point's key is a function of its coordinates)."""
        pts, cols = (np.ascontiguousarray(state["base"][0], np.float32),
                     np.ascontiguousarray(state["base"][1], np.uint8))
        with self._lock:
            self._base = (pts, cols)
            self._base_keys = voxel_keys(pts, self.voxel_size)[0] if self.voxel_size > 0 else np.zeros(0, np.int64)
            self._chunks = OrderedDict((int(i), (np.asarray(p, np.float32), np.asarray(c, np.uint8)))
                                       for i, (p, c) in state["chunks"])
            self._floor = int(state["floor"])
            self.thinned = bool(state["thinned"])
            self._version += 1

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(points [M, 3] float32, colours [M, 3] uint8, version) of the whole map."""
        with self._lock:
            if self._snapshot is None or self._snapshot[0] != self._version:
                parts = [self._base] + list(self._chunks.values())
                self._snapshot = (self._version, np.concatenate([p for p, _ in parts]),
                                  np.concatenate([c for _, c in parts]))
            version, pts, cols = self._snapshot
            return pts, cols, version

    def __len__(self) -> int:
        with self._lock:
            return self._base[0].shape[0] + sum(p.shape[0] for p, _ in self._chunks.values())

    def frames(self) -> list[int]:
        """Indices of the frames still held separately (may be rolled back)."""
        with self._lock:
            return list(self._chunks)

    # ------------------------------------------------------------------ internals
    def _downsample(self, pts: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.voxel_size > 0 and pts.shape[0]:
            return voxel_downsample(pts, cols, self.voxel_size)
        keep = np.isfinite(pts).all(axis=1)
        return pts[keep], cols[keep]

    def _consolidate(self) -> None:
        """Merge chunks below the floor into the base once enough piled up or the bound is hit."""
        mergeable = [i for i in self._chunks if i < self._floor]
        recent = sum(p.shape[0] for i, (p, _) in self._chunks.items() if i >= self._floor)
        total = self._base[0].shape[0] + sum(self._chunks[i][0].shape[0] for i in mergeable) + recent
        if len(mergeable) < MERGE_EVERY and total <= self.max_points:
            return
        parts = [self._chunks.pop(i) for i in mergeable]
        if self.voxel_size > 0:
            pts, cols, keys = self._merge(parts)
        else:
            pts = np.concatenate([self._base[0]] + [p for p, _ in parts])
            cols = np.concatenate([self._base[1]] + [c for _, c in parts])
            keys = None
        budget = max(self.max_points - recent, self.max_points // 2)
        if pts.shape[0] > budget:  # thin to 3/4 of the budget so that this does not recur every frame
            keep = np.linspace(0, pts.shape[0] - 1, int(budget * THIN_TO)).astype(np.int64)
            pts, cols = pts[keep], cols[keep]
            keys = None if keys is None else keys[keep]
            self.thinned = True
        self._base = (np.ascontiguousarray(pts), np.ascontiguousarray(cols))
        if keys is not None:
            self._base_keys = keys

    def _merge(self, parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Base + chunks (oldest first), one point per voxel, sorted by voxel key: voxels new to
        the base take the first point that fell into them; the base's own points stay."""
        pts = np.concatenate([p for p, _ in parts]) if parts else self._base[0][:0]
        cols = np.concatenate([c for _, c in parts]) if parts else self._base[1][:0]
        keys, valid = voxel_keys(pts, self.voxel_size)
        keys, first = np.unique(keys[valid], return_index=True)
        index = np.flatnonzero(valid)[first]
        base_keys = self._base_keys
        pos = np.searchsorted(base_keys, keys)
        known = (pos < base_keys.size) & (base_keys[np.minimum(pos, max(base_keys.size - 1, 0))] == keys) \
            if base_keys.size else np.zeros(keys.shape, bool)
        new = ~known
        at = pos[new]
        return (np.insert(self._base[0], at, pts[index[new]], axis=0),
                np.insert(self._base[1], at, cols[index[new]], axis=0),
                np.insert(base_keys, at, keys[new]))


@dataclass
class PoseEntry:
    """One trajectory sample: the camera's optical frame in the map frame (``T_map_cam``,
    4x4, REP-103 map axes, model units) at the image stamp."""

    frame_index: int  # session index, 0-based
    stamp: Any  # the image's builtin_interfaces/Time (opaque here)
    stamp_s: float  # the same in seconds
    T_map_cam: np.ndarray
    message: Any = None  # cache for the node's PoseStamped


class Trajectory:
    """Bounded list of poses in frame order (touched by the inference thread only)."""

    def __init__(self, max_length: int) -> None:
        self._entries: deque[PoseEntry] = deque(maxlen=max_length)
        self.listener: Any = None  # told every change after it is applied (``map_journal.MapJournal``)

    @property
    def max_length(self) -> int:
        return self._entries.maxlen

    def append(self, entry: PoseEntry) -> None:
        self._entries.append(entry)
        if self.listener is not None:
            self.listener.path_appended(entry)

    def remove_from(self, frame_index: int) -> int:
        n = 0
        while self._entries and self._entries[-1].frame_index >= frame_index:
            self._entries.pop()
            n += 1
        if n and self.listener is not None:
            self.listener.path_op("remove", frame_index)
        return n

    def clear(self) -> None:
        self._entries.clear()
        if self.listener is not None:
            self.listener.path_op("clear", 0)

    def entries(self) -> list[PoseEntry]:
        return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def stamps(self) -> np.ndarray:
        return np.array([e.stamp_s for e in self._entries], dtype=np.float64)

    def poses(self) -> np.ndarray:
        """[N, 4, 4] ``T_map_cam``."""
        if not self._entries:
            return np.zeros((0, 4, 4))
        return np.stack([e.T_map_cam for e in self._entries])


__all__ = ["MapAccumulator", "Trajectory", "PoseEntry"]
