"""Several cameras on one model and one shared K/V storage (``stream.multi``, issue 20).

Per camera, the outputs must be exactly those of a separate single-camera session fed the
same frames, whatever the interleaving of the cameras' arrivals; transitions on one camera
(reset, rollback, deferral, commit) must leave every other camera's cache bit-identical;
no step may address another camera's pages.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lingbot_map_ros.cache.pool import CrossedExtentError, PoolFullError, SharedKVStorage
from lingbot_map_ros.config import LongStreamConfig
from lingbot_map_ros.stream.errors import CacheFullError, SessionError
from lingbot_map_ros.stream.multi import CameraSessions
from lingbot_map_ros.stream.session import StreamingSession

from multi_camera_helpers import TOL, assert_same, cfg, replay, sequences  # test/ is on sys.path


@pytest.fixture(scope="module")
def images(fixtures):
    return torch.from_numpy(np.load(fixtures / "reference_kf1.npz")["images"])


def extent_bytes(cams: CameraSessions, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    lease = cams.storage.lease_of(name)
    return (cams.storage.k[:, lease.start:lease.end].clone(), cams.storage.v[:, lease.start:lease.end].clone())


def camera_cache(cams: CameraSessions, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    cam = cams.inner[name]._runner.camera
    return cam.k.clone(), cam.v.clone()


# ------------------------------------------------------------------ the storage alone
def storage(**kw) -> SharedKVStorage:
    return SharedKVStorage(2, 1, 4, torch.float32, torch.device("cpu"), **kw)


def test_leases_are_disjoint_views_first_fit_and_merged_on_release():
    st = storage(capacity_tokens=100, growable=False)
    a = st.lease("a", 3, 10)
    b = st.lease("b", 2, 20)
    assert a.k.shape == (2, 3, 10, 1, 4) and b.k.shape == (2, 2, 20, 1, 4)
    assert [(l.owner, l.start, l.end) for l in st.leases()] == [("a", 0, 30), ("b", 30, 70)]
    a.k.fill_(1.0)
    b.k.fill_(2.0)
    assert float(st.k[:, :30].min()) == 1.0 and float(st.k[:, 30:70].min()) == 2.0 and float(st.k[:, 70:].abs().max()) == 0
    assert st.owner_of(29) == "a" and st.owner_of(30) == "b" and st.owner_of(70) is None
    st.release("a")
    assert st.free_extents() == [(0, 30), (70, 100)]
    c = st.lease("c", 1, 25)  # first fit: the hole at the start
    assert st.lease_of("c").start == 0 and c.k.data_ptr() == st.k.data_ptr()
    st.release("b")
    st.release("c")
    assert st.free_extents() == [(0, 100)]  # neighbours merged back into one extent
    st.release("nobody")  # releasing nothing is a no-op


def test_a_lease_that_does_not_fit_changes_nothing_when_the_storage_may_not_grow():
    st = storage(capacity_tokens=50, growable=False)
    st.lease("a", 2, 20)
    before = (st.leases(), st.free_extents(), st.generation)
    with pytest.raises(PoolFullError, match="no free extent of 20 tokens for 'b'"):
        st.lease("b", 1, 20)
    assert (st.leases(), st.free_extents(), st.generation) == before
    with pytest.raises(ValueError, match="already holds"):
        st.lease("a", 1, 1)
    with pytest.raises(ValueError, match="pages > 0"):
        st.lease("z", 0, 10)


def test_growth_keeps_every_extent_at_its_offset_and_bumps_the_generation():
    st = storage()  # capacity taken at the first lease (reserve 1)
    a = st.lease("a", 2, 10)
    assert st.capacity == 20 and st.generation == 0
    a.k.copy_(torch.randn_like(a.k))
    saved = a.k.clone()
    st.lease("b", 3, 10)
    assert st.capacity == 50 and st.generation == 1
    assert torch.equal(st.view("a").k, saved)  # copied to the same offsets of the new allocation
    st.release("a")
    st.lease("c", 1, 20)  # fits into a's old extent: no growth
    assert st.generation == 1 and st.lease_of("c").start == 0


def test_page_ids_outside_the_owners_extent_are_refused():
    st = storage(capacity_tokens=100)
    st.lease("a", 3, 10)
    st.lease("b", 3, 10)
    st.check_pages("a", (0, 1, 2), last_slot=29)
    with pytest.raises(CrossedExtentError, match="outside its 3 pages"):
        st.check_pages("a", (0, 3))  # page 3 of a's view would be b's page 0
    with pytest.raises(CrossedExtentError):
        st.check_pages("b", (1,), last_slot=30)
    with pytest.raises(CrossedExtentError, match="holds no extent"):
        st.check_pages("c", (0,))


# ------------------------------------------------------------------ sessions on one storage
def make_cameras(model, fixture_config, n: int, long_cfg=None, **kw) -> CameraSessions:
    names = ["front", "rear", "left", "right"][:n]
    return CameraSessions(model, {c: (cfg(fixture_config, **kw), long_cfg) for c in names})


def test_one_model_one_set_of_head_copies_one_storage(tiny_model, fixture_config, images):
    cams = make_cameras(tiny_model, fixture_config, 3)
    inner = list(cams.inner.values())
    assert all(s.model is tiny_model for s in inner)
    assert all(s.step_options is inner[0].step_options for s in inner)
    for name, seq in zip(cams.names, sequences(images, 3)):
        cams.sessions[name].push(seq[0])
        cams.sessions[name].push(seq[1])
    status = cams.pool_status()
    pages = inner[0]._runner.pages.num_pages
    # sized at the first camera's first frame for all three cameras: no growth
    assert status.capacity_tokens == 3 * pages * 28 == status.leased_tokens
    assert status.nbytes == cams.storage.k.numel() * 2 * 4 and cams.storage.generation == 0
    assert {c.pages for c in status.cameras.values()} == {pages}
    assert all(c.used_pages == 2 + 1 for c in status.cameras.values())  # 2 scale pages + 1 special page


@pytest.mark.parametrize("n,seed", [(2, 0), (2, 1), (3, 2), (3, 3)])
def test_each_camera_equals_its_own_single_camera_replay_in_any_interleaving(tiny_model, fixture_config, images,
                                                                            n, seed):
    config = cfg(fixture_config)
    cams = make_cameras(tiny_model, fixture_config, n)
    seqs = dict(zip(cams.names, sequences(images, n)))
    order = [c for c in cams.names for _ in range(len(images))]
    random.Random(seed).shuffle(order)
    fed = {c: 0 for c in cams.names}
    results = {c: [] for c in cams.names}
    for c in order:
        results[c] += cams.sessions[c].push(seqs[c][fed[c]])
        fed[c] += 1
    for c in cams.names:
        assert len(results[c]) == len(images)
        assert_same(results[c], replay(tiny_model, config, seqs[c]))


def test_transitions_on_one_camera_leave_the_others_bit_identical(tiny_model, fixture_config, images):
    cams = make_cameras(tiny_model, fixture_config, 3)
    seqs = dict(zip(cams.names, sequences(images, 3)))
    for i in range(6):
        for c in cams.names:
            cams.sessions[c].push(seqs[c][i])
    target = cams.sessions["rear"]
    others = ("front", "left")

    def snapshot():
        return {c: (extent_bytes(cams, c), camera_cache(cams, c), cams.inner[c]._runner.pages.state_signature())
                for c in others}

    def unchanged(before):
        after = snapshot()
        for c in others:
            (k0, v0), (ck0, cv0), sig0 = before[c]
            (k1, v1), (ck1, cv1), sig1 = after[c]
            assert torch.equal(k0, k1) and torch.equal(v0, v1), c
            assert torch.equal(ck0, ck1) and torch.equal(cv0, cv1), c
            assert sig0 == sig1, c

    before = snapshot()
    target.set_deferred_eviction(True)
    target.push(seqs["rear"][6])
    target.push(seqs["rear"][7])
    unchanged(before)
    target.rollback_last_frame()
    unchanged(before)
    assert target.commit_eviction() == 1
    unchanged(before)
    target.reset()
    target.push(seqs["rear"][0])
    target.push(seqs["rear"][1])
    unchanged(before)
    # and the others go on exactly as if nothing had happened to rear
    config = cfg(fixture_config)
    for c in others:
        rest = []
        for f in seqs[c][6:]:
            rest += cams.sessions[c].push(f)
        assert_same(rest, replay(tiny_model, config, seqs[c])[6:])


def test_random_service_sequences_never_cross_page_ownership(tiny_model, fixture_config, images):
    """Property test: random pushes (keyframe or not), resets, rollbacks, deferrals and commits
    over three cameras (a bounded 120 operations); after each, every camera's resident pages
    lie in its own extent, the extents are disjoint, and the cameras not operated on are
    bit-identical."""
    cams = make_cameras(tiny_model, fixture_config, 3, max_pending_evictions=2)
    seqs = dict(zip(cams.names, sequences(images, 3)))
    fed = {c: 0 for c in cams.names}
    rng = random.Random(7)
    refused = 0
    for _ in range(120):
        c = rng.choice(cams.names)
        session = cams.sessions[c]
        others = {o: (extent_bytes(cams, o), cams.inner[o]._runner.pages.state_signature()) for o in cams.names
                  if o != c and cams.storage.lease_of(o) is not None}
        op = rng.choices(["push", "reset", "rollback", "defer", "commit"], [8, 1, 2, 1, 1])[0]
        try:
            if op == "push":
                session.push(seqs[c][fed[c] % len(images)], rng.choice([None, True, False]))
                fed[c] += 1
            elif op == "reset":
                session.reset()
            elif op == "rollback":
                session.rollback_last_frame()
            elif op == "defer":
                session.set_deferred_eviction(not session.deferred_eviction)
            else:
                session.commit_eviction()
        except (SessionError, CacheFullError):
            refused += 1  # refused transitions change nothing (checked below like the others)
        leases = cams.storage.leases()
        for a, b in zip(leases, leases[1:]):
            assert a.end <= b.start
        for name, inner in cams.inner.items():
            if inner._runner.pages is None:
                continue
            lease = cams.storage.lease_of(name)
            assert lease.pages == inner._runner.pages.num_pages
            sig = inner._runner.pages.state_signature()
            resident = [p for _, p in sig[1]] + [p for _, p in sig[2]] + list(sig[3])
            assert all(0 <= p < lease.pages for p in resident)
        for o, ((k0, v0), sig0) in others.items():
            (k1, v1) = extent_bytes(cams, o)
            assert torch.equal(k0, k1) and torch.equal(v0, v1), (op, c, o)
            assert cams.inner[o]._runner.pages.state_signature() == sig0
    assert sum(fed.values()) > 60 and refused < 120


def test_a_camera_with_another_resolution_grows_the_storage_without_disturbing_the_first(
        tiny_model, fixture_config, images):
    config = cfg(fixture_config)
    cams = make_cameras(tiny_model, fixture_config, 2)
    front = list(images)
    rear = [torch.nn.functional.interpolate(f[None], size=(84, 98), mode="bilinear", align_corners=False)[0]
            for f in images]  # 6x7 patches: larger pages than front's 4x7
    out_front = []
    for f in front[:4]:
        out_front += cams.sessions["front"].push(f)
    capacity = cams.storage.capacity  # sized for two cameras at front's resolution
    out_rear = []
    for f in rear[:4]:
        out_rear += cams.sessions["rear"].push(f)
    assert cams.storage.generation == 1 and cams.storage.capacity > capacity
    for f in front[4:]:
        out_front += cams.sessions["front"].push(f)  # views the grown storage; its pages came along
    for f in rear[4:]:
        out_rear += cams.sessions["rear"].push(f)
    assert_same(out_front, replay(tiny_model, config, front))
    assert_same(out_rear, replay(tiny_model, config, rear))


def test_long_stream_cameras_restart_their_windows_independently(tiny_model, fixture_config, images):
    long_cfg = LongStreamConfig(window_frames=6, overlap_frames=2)
    config = cfg(fixture_config)
    cams = make_cameras(tiny_model, fixture_config, 2, long_cfg=long_cfg)
    seqs = dict(zip(cams.names, sequences(images, 2)))
    results = {c: [] for c in cams.names}
    for i in range(len(images)):
        for c in cams.names:
            results[c] += cams.sessions[c].push(seqs[c][i])
    from lingbot_map_ros.stream.long_stream import LongStreamSession

    for c in cams.names:
        single = LongStreamSession(StreamingSession(tiny_model, config), long_cfg)
        ref = []
        for f in seqs[c]:
            ref += single.push(f)
        assert cams.sessions[c].window_index == single.window_index >= 1
        for a, b in zip(results[c], ref):
            assert np.abs(a.c2w - b.c2w).max() <= TOL and a.frame_index == b.frame_index


def test_sessions_of_different_dtypes_are_refused(tiny_model, fixture_config):
    with pytest.raises(ValueError, match="same dtype"):
        CameraSessions(tiny_model, {"a": (cfg(fixture_config), None),
                                    "b": (cfg(fixture_config, dtype="bf16"), None)})
    with pytest.raises(ValueError, match="at least one camera"):
        CameraSessions(tiny_model, {})
