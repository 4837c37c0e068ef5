"""The keyframe place database and the global descriptors (lingbot_map_ros/slam/places.py,
descriptors.py)."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from lingbot_map_ros.slam import Sim3
from lingbot_map_ros.slam.descriptors import (
    area_resize,
    gradient_descriptor,
    thumbnail_descriptor,
    token_descriptor,
)
from lingbot_map_ros.slam.places import PlaceConfig, PlaceDatabase

DIM = 32


def unit(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def filled(n: int = 50, **config) -> tuple[PlaceDatabase, np.ndarray]:
    desc = unit(np.random.default_rng(0), n)
    db = PlaceDatabase(PlaceConfig(DIM, **config))
    for i, d in enumerate(desc):
        db.add(i, d)
    return db, desc


def test_places_query_ranks_by_cosine_similarity():
    db, desc = filled()
    query = desc[17] + 0.05 * desc[3]
    hits = db.query(query * 7.0, k=3)  # any length: normalised
    assert hits[0][0] == 17 and hits[0][1] > 0.99
    sims = desc @ (query / np.linalg.norm(query))
    assert [i for i, _ in hits] == list(np.argsort(-sims)[:3])
    assert [s for _, s in hits] == pytest.approx(sorted(sims, reverse=True)[:3], abs=1e-5)


def test_places_query_excludes_the_window_and_low_similarities():
    db, desc = filled()
    assert all(i not in range(10, 30) for i, _ in db.query(desc[17], k=50, exclude=range(10, 30)))
    assert db.query(desc[17], k=1, exclude=range(10, 30))[0][0] != 17
    assert 17 not in [i for i, _ in db.query(desc[17], k=50, exclude={17, 4})]
    assert db.query(desc[17], k=5, min_similarity=0.999) == [(17, pytest.approx(1.0, abs=1e-5))]
    assert len(db.query(desc[0], k=100)) == 50
    assert PlaceDatabase(PlaceConfig(DIM)).query(desc[0]) == []


def test_places_keep_poses_and_round_trip_through_arrays():
    db, desc = filled(5)
    pose = Sim3(np.eye(3), np.array([1.0, 2.0, 3.0]), 1.5)
    db.add(9, desc[0], pose)
    assert db.pose(0) is None
    assert np.allclose(db.pose(9).matrix(), pose.matrix())
    db.remove(2)
    rebuilt = PlaceDatabase.from_arrays({k: v.copy() for k, v in db.to_arrays().items()})
    assert list(rebuilt.indices()) == list(db.indices()) == [0, 1, 3, 4, 9]
    assert np.array_equal(rebuilt.descriptor(4), db.descriptor(4))
    assert np.allclose(rebuilt.pose(9).matrix(), pose.matrix()) and rebuilt.pose(1) is None
    assert rebuilt.query(desc[3], k=2) == db.query(desc[3], k=2)


def test_places_growth_is_bounded(caplog):
    with caplog.at_level(logging.WARNING):
        db, desc = filled(2000, capacity=1500)
    assert len(db) == 1500 and db.dropped == 500
    assert 499 not in db and 500 in db and 1999 in db
    assert db.query(desc[100], k=1)[0][0] != 100
    assert sum("place database full" in r.message for r in caplog.records) == 1  # logged once
    refusing, desc = filled(10, capacity=10, when_full="refuse")
    with pytest.raises(ValueError, match="full"):
        refusing.add(10, desc[0])


@pytest.mark.parametrize("vector, match", [
    (np.zeros(DIM), "all zeros"),
    (np.full(DIM, np.nan), "non-finite"),
    (np.ones(DIM + 1), f"database's dimension is {DIM}"),
])
def test_places_refuse_bad_descriptors(vector, match):
    db, _ = filled(3)
    with pytest.raises(ValueError, match=match):
        db.add(3, vector)
    with pytest.raises(ValueError, match=match.replace("of place 3", "")):
        db.query(vector)


def test_places_refuse_bad_indices_and_config():
    db, desc = filled(3)
    with pytest.raises(ValueError, match="duplicate place 1"):
        db.add(1, desc[0])
    with pytest.raises(ValueError, match="int >= 0"):
        db.add(-1, desc[0])
    with pytest.raises(ValueError, match="unknown place 8"):
        db.pose(8)
    with pytest.raises(ValueError, match="k must be"):
        db.query(desc[0], k=0)
    with pytest.raises(ValueError, match="when_full"):
        PlaceConfig(DIM, when_full="grow")
    with pytest.raises(ValueError, match="capacity"):
        PlaceConfig(DIM, capacity=0)


# ----------------------------------------------------------------------------- descriptors
def test_token_descriptor_pools_tokens():
    rng = np.random.default_rng(3)
    tokens = rng.standard_normal((500, 64)) + rng.standard_normal(64)  # a frame's tokens
    d = token_descriptor(tokens, dim=128)
    assert d.shape == (128,) and d.dtype == np.float32 and np.linalg.norm(d) == pytest.approx(1.0, abs=1e-5)
    assert np.array_equal(d, token_descriptor(tokens[rng.permutation(500)], dim=128))  # order-free
    near = token_descriptor(tokens + 0.05 * rng.standard_normal(tokens.shape), dim=128)
    other = token_descriptor(rng.standard_normal((500, 64)) + rng.standard_normal(64), dim=128)
    assert float(d @ near) > 0.99 > float(d @ other) + 0.3
    assert not np.allclose(d, token_descriptor(tokens, dim=128, seed=1))  # the seed is the projection
    assert token_descriptor(tokens, dim=256).shape == (256,)  # wider than 2C: still works
    with pytest.raises(ValueError, match=r"\[N, C\]"):
        token_descriptor(np.ones(5))
    with pytest.raises(ValueError, match="non-finite"):
        token_descriptor(np.full((3, 4), np.inf))


def texture(seed: int, h: int = 150, w: int = 260) -> np.ndarray:
    """A grey image in [0, 1]: patches of gratings at random places, orientations and periods."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.zeros((h, w))
    for _ in range(12):
        cy, cx, theta = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(0, np.pi)
        wave = np.sin(2 * np.pi * (x * np.cos(theta) + y * np.sin(theta)) / rng.uniform(6, 20))
        img += wave * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * 35.0 ** 2))
    return (img - img.min()) / (img.max() - img.min())


def test_gradient_descriptor_ignores_brightness_and_tells_places_apart():
    img = texture(0)
    d = gradient_descriptor(img)
    assert d.shape == (4 * 8 * 8,) and np.linalg.norm(d) == pytest.approx(1.0, abs=1e-5)
    assert float(d @ gradient_descriptor(0.5 * img + 0.2)) == pytest.approx(1.0, abs=1e-5)  # gain, offset
    shifted = float(d @ gradient_descriptor(np.roll(img, (2, 3), axis=(0, 1))))
    assert shifted > float(d @ gradient_descriptor(texture(1))) + 0.3
    rgb = (np.stack([img] * 3, axis=-1) * 255).astype(np.uint8)
    assert float(d @ gradient_descriptor(rgb)) > 0.99  # uint8 RGB reads as the same grey
    with pytest.raises(ValueError, match="multiple of the grid"):
        gradient_descriptor(img, grid=(5, 8))


def test_thumbnail_descriptor_and_area_resize():
    img = texture(2)
    assert thumbnail_descriptor(img).shape == (192,)
    assert float(thumbnail_descriptor(img) @ thumbnail_descriptor(img * 0.7 + 0.1)) == pytest.approx(1.0, abs=1e-5)
    ramp = np.tile(np.arange(8.0), (4, 1))
    assert np.allclose(area_resize(ramp, 2, 4), np.tile([0.5, 2.5, 4.5, 6.5], (2, 1)))
