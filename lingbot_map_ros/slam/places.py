"""Keyframe place database: one global descriptor per keyframe, nearest keyframes by cosine
similarity (numpy only, brute force).

Each place is a keyframe index (int ≥ 0), a float32 descriptor of the database's fixed
dimension (L2-normalised on entry, so cosine similarity is a dot product) and optionally its
camera-to-world pose (``Sim3``; odom or map frame, as the owner keeps them).

Query cost is one [n, dim] × [dim] float32 product plus a partial sort: measured in
``benchmarks/slam/place_query.py`` (``benchmarks/results/cpu_2core_place_query_*.json``): about
0.1 ms at 1k × 256 up to ~15 ms at 50k × 1024 on the 2-core development CPU. An exact search
over tens of thousands of keyframes needs no index library; an approximate one (HNSW, IVF)
would only pay far beyond that.

Bounded growth: at most ``capacity`` places (memory ``capacity·dim·4`` bytes for the
descriptors plus 8·16 bytes a pose: 200 MB at 50,000 × 1024). When full, ``when_full`` says
what ``add`` does: ``drop_oldest`` (the place added first goes, logged once) or ``refuse``
(ValueError).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from .sim3 import Sim3

LOG = logging.getLogger(__name__)
WHEN_FULL = ("drop_oldest", "refuse")


@dataclass(frozen=True)
class PlaceConfig:
    """Attributes: dim (descriptor length), capacity (max places), when_full (``WHEN_FULL``)."""

    dim: int
    capacity: int = 50_000
    when_full: str = "drop_oldest"

    def __post_init__(self) -> None:
        for name in ("dim", "capacity"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"PlaceConfig.{name} must be an int >= 1, got {value!r}")
        if self.when_full not in WHEN_FULL:
            raise ValueError(f"PlaceConfig.when_full must be one of {WHEN_FULL}, got {self.when_full!r}")


def normalise(descriptor, dim: int, what: str = "descriptor") -> np.ndarray:
    """``descriptor`` [dim] as an L2-normalised float32 vector; non-finite, zero or wrong-size
    vectors are refused."""
    vec = np.asarray(descriptor, dtype=np.float32).reshape(-1)
    if vec.size != dim:
        raise ValueError(f"{what} has {vec.size} values; the database's dimension is {dim}")
    if not np.isfinite(vec).all():
        raise ValueError(f"{what} has non-finite values")
    norm = float(np.linalg.norm(vec.astype(np.float64)))
    if norm == 0.0:
        raise ValueError(f"{what} is all zeros (no direction to compare)")
    return vec / np.float32(norm)


class PlaceDatabase:
    """Descriptors of keyframes, queried by cosine similarity (module text). One owner calls it."""

    def __init__(self, config: PlaceConfig) -> None:
        self.config = config
        self._desc = np.zeros((min(config.capacity, 1024), config.dim), dtype=np.float32)  # grows ×2
        self._index = np.full(self._desc.shape[0], -1, dtype=np.int64)  # -1 = free slot
        self._poses = np.full((self._desc.shape[0], 4, 4), np.nan)
        self._slot: dict[int, int] = {}
        self._order: list[int] = []  # slots in insertion order (oldest first) once full
        self._dropped = 0

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, index: int) -> bool:
        return int(index) in self._slot

    @property
    def dropped(self) -> int:
        """Places dropped because the database was full."""
        return self._dropped

    def indices(self) -> np.ndarray:
        """[n] int64 keyframe indices held, in insertion order."""
        return self._index[np.array(self._order, dtype=np.int64)] if self._order else np.zeros(0, np.int64)

    def add(self, index: int, descriptor, pose: Sim3 | None = None) -> None:
        """Add keyframe ``index`` (new) with its ``descriptor`` [dim] and optional ``pose``."""
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or index < 0:
            raise ValueError(f"place index must be an int >= 0, got {index!r}")
        index = int(index)
        if index in self._slot:
            raise ValueError(f"duplicate place {index}: already in the database")
        if pose is not None and not isinstance(pose, Sim3):
            raise ValueError(f"place {index}: pose must be a Sim3 or None, got {type(pose).__name__}")
        vec = normalise(descriptor, self.config.dim, f"descriptor of place {index}")
        slot = self._free_slot()
        self._desc[slot], self._index[slot] = vec, index
        self._poses[slot] = np.nan if pose is None else pose.matrix()
        self._slot[index] = slot
        self._order.append(slot)

    def pose(self, index: int) -> Sim3 | None:
        """The pose stored with ``index`` (None when added without one)."""
        mat = self._poses[self._known(index)]
        return None if np.isnan(mat).any() else Sim3.from_matrix(mat)

    def descriptor(self, index: int) -> np.ndarray:
        """The stored (normalised) descriptor [dim] of ``index`` (a copy)."""
        return self._desc[self._known(index)].copy()

    def remove(self, index: int) -> None:
        slot = self._known(index)
        del self._slot[int(index)]
        self._order.remove(slot)
        self._index[slot] = -1

    def query(self, descriptor, k: int = 5, exclude=None, min_similarity: float = -1.0) -> list[tuple[int, float]]:
        """The ``k`` most similar places as (index, cosine similarity), best first.

        Args:
            descriptor: [dim] query (normalised here).
            k: how many at most (≥ 1).
            exclude: indices never returned (e.g. the current window): a ``range``, or any
                iterable of ints, or None.
            min_similarity: places below it are not returned.
        """
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        vec = normalise(descriptor, self.config.dim, "query descriptor")
        if not self._slot:
            return []
        # every allocated slot (free ones are zeros), no copy of the table; einsum rather than a BLAS
        # gemv: BLAS wakes its thread pool, which stalls 10–20 ms on a busy 2-core CPU
        sims = np.einsum("ij,j->i", self._desc, vec)
        keep = (self._index >= 0) & (sims >= min_similarity) & ~self._excluded(self._index, exclude)
        cand = np.flatnonzero(keep)
        if cand.size > k:
            cand = cand[np.argpartition(-sims[cand], k - 1)[:k]]
        cand = cand[np.argsort(-sims[cand], kind="stable")]
        return [(int(self._index[c]), float(sims[c])) for c in cand]

    # ------------------------------------------------------------------ serialisation
    def to_arrays(self) -> dict[str, np.ndarray]:
        """``index`` [n] int64, ``descriptor`` [n, dim] float32, ``pose`` [n, 4, 4] (NaN = none),
        ``capacity`` and ``when_full`` (0-d), in insertion order."""
        order = np.array(self._order, dtype=np.int64)
        return {"index": self._index[order].copy(), "descriptor": self._desc[order].copy(),
                "pose": self._poses[order].copy(), "capacity": np.array(self.config.capacity),
                "when_full": np.array(self.config.when_full)}

    @classmethod
    def from_arrays(cls, arrays) -> "PlaceDatabase":
        desc = np.asarray(arrays["descriptor"], dtype=np.float32)
        if desc.ndim != 2:
            raise ValueError(f"place arrays: descriptor must be [n, dim], got {desc.shape}")
        db = cls(PlaceConfig(int(desc.shape[1]), int(np.asarray(arrays["capacity"])), str(np.asarray(arrays["when_full"]))))
        for index, vec, mat in zip(np.asarray(arrays["index"]), desc, np.asarray(arrays["pose"], dtype=np.float64)):
            db.add(int(index), vec, None if np.isnan(mat).any() else Sim3.from_matrix(mat))
        return db

    # ------------------------------------------------------------------ internals
    def _known(self, index) -> int:
        try:
            return self._slot[int(index)]
        except KeyError:
            raise ValueError(f"unknown place {index!r} (the database has {len(self)} places)") from None

    def _free_slot(self) -> int:
        if len(self._slot) >= self.config.capacity:
            if self.config.when_full == "refuse":
                raise ValueError(f"place database full ({self.config.capacity} places; when_full=refuse)")
            oldest = self._order.pop(0)
            if self._dropped == 0:
                LOG.warning("place database full (%d places): dropping the oldest places from now on",
                            self.config.capacity)
            del self._slot[int(self._index[oldest])]
            self._index[oldest] = -1
            self._dropped += 1
            return oldest
        free = np.flatnonzero(self._index < 0)
        if free.size == 0:
            self._grow()
            free = np.flatnonzero(self._index < 0)
        return int(free[0])

    def _grow(self) -> None:
        old = self._desc.shape[0]
        new = min(self.config.capacity, 2 * old)
        self._desc = np.concatenate([self._desc, np.zeros((new - old, self.config.dim), np.float32)])
        self._index = np.concatenate([self._index, np.full(new - old, -1, np.int64)])
        self._poses = np.concatenate([self._poses, np.full((new - old, 4, 4), np.nan)])

    @staticmethod
    def _excluded(indices: np.ndarray, exclude) -> np.ndarray:
        if exclude is None:
            return np.zeros(indices.shape, dtype=bool)
        if isinstance(exclude, range) and exclude.step == 1:
            return (indices >= exclude.start) & (indices < exclude.stop)
        return np.isin(indices, np.fromiter((int(e) for e in exclude), dtype=np.int64))
