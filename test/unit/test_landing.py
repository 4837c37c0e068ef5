"""The output landing ring: results are views of a buffer that is reused only when free."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from lingbot_map_ros.stream.landing import LandingRing


def land(ring: LandingRing, values: np.ndarray) -> np.ndarray:
    buf = ring.acquire(values.size)
    buf[:values.size] = __import__("torch").from_numpy(values)
    return ring.array(values.size)


def test_held_results_are_never_overwritten_and_free_buffers_are_reused():
    ring = LandingRing(size=2, pin=False)
    a = land(ring, np.full(6, 1.0, np.float32)).reshape(2, 3)[0]  # a view of a view, as results are
    b = land(ring, np.full(6, 2.0, np.float32))[2:4]
    # both buffers are held: the third step goes through the staging buffer and is copied
    c = land(ring, np.full(6, 3.0, np.float32))
    d = land(ring, np.full(6, 4.0, np.float32))
    assert ring.copies == 2
    np.testing.assert_array_equal(a, 1.0)
    np.testing.assert_array_equal(b, 2.0)
    np.testing.assert_array_equal(c, 3.0)  # a copy: the staging buffer's later use did not touch it
    np.testing.assert_array_equal(d, 4.0)
    first_base = id(a.base)
    del a
    gc.collect()
    e = land(ring, np.full(6, 5.0, np.float32))  # the first buffer is free again: no copy
    assert ring.copies == 2 and id(e.base) == first_base
    np.testing.assert_array_equal(b, 2.0)
    np.testing.assert_array_equal(e, 5.0)


def test_a_free_buffer_too_small_for_a_new_resolution_is_replaced():
    ring = LandingRing(size=1, pin=False)
    small = land(ring, np.arange(4, dtype=np.float32))
    del small
    big = land(ring, np.arange(10, dtype=np.float32))
    np.testing.assert_array_equal(big, np.arange(10))
    assert ring.copies == 0


def test_size_must_be_positive():
    with pytest.raises(ValueError, match="size"):
        LandingRing(size=0)
