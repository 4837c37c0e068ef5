"""The camera head's cache: the static-shape attention of CUDA graphs (``attend_at``, one
query over every slot with a mask) against the plain one over the visible slots."""
from __future__ import annotations

import pytest
import torch

from lingbot_map_ros.cache.pool import CameraKVCache


@pytest.mark.parametrize("position", [0, 1, 5, 11])
def test_attend_at_equals_attend_over_the_visible_slots(position):
    torch.manual_seed(position)
    heads, dim, capacity = 4, 16, 12
    plain = CameraKVCache(2, 3, capacity, heads, dim, torch.float32, torch.device("cpu"))
    static = CameraKVCache(2, 3, capacity, heads, dim, torch.float32, torch.device("cpu"))
    # earlier frames in both; junk after the position in the static one (slots a graph never unmasks)
    history = torch.randn(2, 3, capacity, heads, dim) * 3
    plain.k.copy_(history)
    plain.v.copy_(-history)
    static.k.copy_(history)
    static.v.copy_(-history)
    static.k[:, :, position + 1:] = 1e4
    static.v[:, :, position + 1:] = -1e4
    q, k, v = (torch.randn(1, heads, dim) * 2 for _ in range(3))
    want = plain.attend(1, 2, q, k, v, start=position)
    slot = torch.tensor([position])
    got = static.attend_at(1, 2, q, k, v, slot, static.visible_bias(slot))
    assert got.shape == want.shape == (1, heads, dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(static.k[1, 2, position], k[0])  # the step's own token was stored
    torch.testing.assert_close(static.v[1, 2, position], v[0])
