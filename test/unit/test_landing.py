"""The output landing ring: results are views of a buffer that is reused only when free."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from lingbot_map_ros.stream.landing import LandingRing


def land(ring: LandingRing, values: np.ndarray) -> np.ndarray:
    buf, array, staging = ring.acquire(values.size)
    buf[:values.size] = torch.from_numpy(values)
    return array.copy() if staging else array


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


def test_a_buffer_acquired_for_a_step_in_flight_is_not_handed_out_again():
    """A submitted step holds its array before its data lands: the next acquire must not
    hand the same buffer to the following step."""
    ring = LandingRing(size=2, pin=False)
    t1, a1, s1 = ring.acquire(4)
    t2, a2, s2 = ring.acquire(4)
    assert not s1 and not s2 and t1.data_ptr() != t2.data_ptr()
    t3, a3, s3 = ring.acquire(4)  # both in flight: staging
    assert s3 and t3.data_ptr() not in (t1.data_ptr(), t2.data_ptr())
    t1[:4] = 7.0
    np.testing.assert_array_equal(a1, 7.0)
    del a1
    gc.collect()
    t4, a4, s4 = ring.acquire(4)
    assert not s4 and t4.data_ptr() == t1.data_ptr()


def test_size_must_be_positive():
    with pytest.raises(ValueError, match="size"):
        LandingRing(size=0)
