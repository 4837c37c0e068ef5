"""LongStreamSession: windowed restarts, Sim(3) continuity, keyframe policies, the horizon,
service transitions against a replay, and failed steps."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lingbot_map_ros.cache.attention import SdpaBackend
from lingbot_map_ros.cache.pages import CacheFullError, PageTable
from lingbot_map_ros.config import ConfigError, ModelConfig, StreamConfig
from lingbot_map_ros.geometry import quaternion_to_matrix
from lingbot_map_ros.io.checkpoint import load_model
from lingbot_map_ros.stream.alignment import estimate_window_sim3
from lingbot_map_ros.stream.long_stream import LongStreamConfig, LongStreamSession
from lingbot_map_ros.stream.session import FrameResult, InvalidFrameError, SessionError, StreamingSession

HORIZON = 16


@pytest.fixture(scope="module")
def images(fixtures):
    return torch.from_numpy(np.load(fixtures / "reference_kf1.npz")["images"])


@pytest.fixture(scope="module")
def short_model(fixtures, fixture_config):
    """The fixture model with a temporal horizon of 16 frames (the RoPE table is not a weight)."""
    cfg = dataclasses.replace(ModelConfig.from_dict(fixture_config), max_frame_num=HORIZON)
    return load_model(cfg, fixtures / "weights.safetensors")


def stream_cfg(fixture_config, **kw):
    return StreamConfig.from_dict(fixture_config).with_overrides(backend="sdpa", **kw)


def make_long(model, fixture_config, backend=None, stream=None, **long_kw):
    inner = StreamingSession(model, stream or stream_cfg(fixture_config), backend=backend)
    return LongStreamSession(inner, LongStreamConfig(**{"window_frames": 6, **long_kw}))


def frame(images, i):
    """Frame i of an endless stream made from the 12 fixture images (mirrored on odd passes)."""
    image = images[i % len(images)]
    return image.flip(-1) if (i // len(images)) % 2 else image


def push_all(session, frames, **kw):
    out = []
    for f in frames:
        out += session.push(f, **kw)
    return out


# ----------------------------------------------------------------------------- config

@pytest.mark.parametrize("kw,needle", [
    (dict(window_frames=1), "window_frames"),
    (dict(overlap_frames=0), "overlap_frames"),
    (dict(window_frames=4, overlap_frames=4), "smaller than window_frames"),
    (dict(keyframe_policy="every"), "keyframe_policy"),
    (dict(motion_min_translation=float("nan")), "motion_min_translation"),
    (dict(motion_min_rotation_deg=-1.0), "motion_min_rotation_deg"),
    (dict(keyframe_policy="motion", motion_min_translation=0.0, motion_min_rotation_deg=0.0), "needs"),
])
def test_config_names_the_bad_value(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        LongStreamConfig(**kw)


def test_config_lives_in_config_and_the_stream_module_re_exports_it():
    """runtime/params.py and cli/replay_args.py import LongStreamConfig and KEYFRAME_POLICIES from
    stream.long_stream; they are the objects of lingbot_map_ros.config."""
    from lingbot_map_ros import config
    from lingbot_map_ros.stream import long_stream

    assert long_stream.LongStreamConfig is config.LongStreamConfig is LongStreamConfig
    assert long_stream.KEYFRAME_POLICIES is config.KEYFRAME_POLICIES == ("interval", "motion")
    assert config.LongStreamConfig(keyframe_policy="motion").keyframe_policy == "motion"


@pytest.mark.parametrize("kw,needle", [
    (dict(window_frames=HORIZON), "below the model's max_frame_num"),
    (dict(overlap_frames=1), "between num_scale_frames"),
    (dict(overlap_frames=6, window_frames=8), "between num_scale_frames"),  # 2 scale + 3 window = 5
])
def test_config_must_fit_the_stream_and_the_horizon(short_model, fixture_config, kw, needle):
    with pytest.raises(ConfigError, match=needle):
        make_long(short_model, fixture_config, **kw)


# ----------------------------------------------------------------------------- a pose oracle
class Settled:
    """A submit's results that are there at once (what PendingResults is on CPU)."""

    def __init__(self, results):
        self.done, self._results = True, results

    def result(self):
        return self._results


class PoseOracle:
    """Stands in for StreamingSession (same calls, real PageTable bookkeeping) and reports a known
    trajectory the way the model would: in each sequence's own world (its first camera), at a
    per-sequence scale. Each image carries its frame id in pixel [0, 0, 0]."""

    def __init__(self, c2w, depth, num_scale_frames=2, sliding_window=3, scales=(1.0, 0.5, 2.0, 1.25)):
        self.c2w, self.depth, self.scales = c2w, depth, scales
        self.cfg = StreamConfig(num_scale_frames=num_scale_frames, sliding_window=sliding_window)
        self.model = SimpleNamespace(cfg=SimpleNamespace(max_frame_num=HORIZON))
        self.pages = PageTable(8, num_scale_frames, sliding_window, HORIZON)
        self.pending, self.frames_pushed, self.anchor, self.last_stored = [], 0, None, None
        self.sequences = 0  # resets since construction

    def reset(self):
        self.pages.reset()
        self.pending, self.frames_pushed, self.anchor = [], 0, None
        self.sequences += 1

    def stats(self):
        return self.pages.stats()

    def is_keyframe_index(self, i):
        return i < self.cfg.num_scale_frames or (i - self.cfg.num_scale_frames) % self.cfg.keyframe_interval == 0

    def check_frame(self, image, resolution=None):
        return image

    def submit(self, image, keyframe=None):
        return Settled(self.push(image, keyframe))

    def step(self, image, keyframe=None):  # a checked frame (``check_frame`` passes every image)
        return self.submit(image, keyframe)

    @property
    def scale_frames_waiting(self):
        return len(self.pending)

    def push(self, image, keyframe=None):
        image = np.asarray(image)
        if self.pages.in_phase1:
            self.pending.append(image)
            if len(self.pending) < self.cfg.num_scale_frames:
                return []
            batch, self.pending = self.pending, []
            self.anchor = self.c2w[self._id(batch[0])]
            plan = self.pages.plan_step(len(batch), True)
        else:
            batch = [image]
            store = self.is_keyframe_index(self.frames_pushed) if keyframe is None else keyframe
            plan = self.pages.plan_step(1, store)
        self.pages.apply(plan)
        first, self.frames_pushed = self.frames_pushed, self.frames_pushed + len(batch)
        if plan.store:
            self.last_stored = self.frames_pushed - 1
        return [self._result(first + i, plan, im) for i, im in enumerate(batch)]

    def rollback_last_frame(self, expected_frame_index=None):
        assert expected_frame_index in (None, self.last_stored)
        self.pages.rollback_last()
        frame, self.last_stored = self.last_stored, None
        self.frames_pushed = 0 if self.pages.in_phase1 else frame
        return frame

    @staticmethod
    def _id(image):
        return int(round(float(image[0, 0, 0]) * 1000))

    def _result(self, index, plan, image):
        k, sigma = self._id(image), self.scales[self.sequences % len(self.scales)]
        w2a = np.linalg.inv(self.anchor)
        c2w = w2a @ self.c2w[k]
        c2w[:3, 3] *= sigma
        enc = np.zeros(9)
        return FrameResult(frame_index=index, position=plan.positions[0], is_keyframe=plan.store, pose_enc=enc,
                           c2w=c2w, intrinsics=np.eye(3), depth=self.depth[k] * sigma,
                           confidence=np.full_like(self.depth[k], 2.0), frame=image)


def oracle_images(n):
    out = np.zeros((n, 3, 4, 6), dtype=np.float32)
    out[:, 0, 0, 0] = np.arange(n) / 1000
    return out


def trajectory(n, step=0.02, turn_deg=0.0, seed=0):
    """Camera i at x = step·i turning turn_deg per frame about y; frame 0 is the identity."""
    c2w = np.tile(np.eye(4), (n, 1, 1))
    half = np.radians(turn_deg * np.arange(n)) / 2
    c2w[:, :3, :3] = quaternion_to_matrix(np.stack([0 * half, np.sin(half), 0 * half, np.cos(half)], -1))
    c2w[:, 0, 3] = step * np.arange(n)
    depth = np.random.default_rng(seed).uniform(1.0, 3.0, size=(n, 4, 6))
    return c2w, depth


@pytest.mark.parametrize("overlap", [2, 4])
def test_trajectory_and_depth_are_continuous_across_restarts(overlap):
    n = 40
    c2w, depth = trajectory(n, step=0.03, turn_deg=3.0)
    oracle = PoseOracle(c2w, depth)
    long = LongStreamSession(oracle, LongStreamConfig(window_frames=6, overlap_frames=overlap))
    out = push_all(long, oracle_images(n))
    assert [r.frame_index for r in out] == list(range(n))
    assert long.window_index == (n - 6 - 1) // (6 - overlap) + 1 and oracle.sequences == long.window_index
    np.testing.assert_allclose(np.stack([r.c2w for r in out]), c2w, atol=1e-9)
    np.testing.assert_allclose(np.stack([r.depth for r in out]), depth, rtol=1e-9)
    assert long.window.last_fit.scale_source == "depth" and long.window.last_fit.centre_rmse < 1e-9


@pytest.mark.parametrize("step,turn,kw", [
    (0.02, 0.0, dict(motion_min_translation=0.05, motion_min_rotation_deg=0.0)),
    (0.0, 2.0, dict(motion_min_translation=0.0, motion_min_rotation_deg=5.0)),
])
def test_motion_policy_stores_a_frame_once_the_last_pose_moved_enough(step, turn, kw):
    n = 30
    c2w, depth = trajectory(n, step=step, turn_deg=turn)
    oracle = PoseOracle(c2w, depth)
    long = LongStreamSession(oracle, LongStreamConfig(window_frames=6, keyframe_policy="motion", **kw))
    out = push_all(long, oracle_images(n))
    # 0, 1: scale frames. Frame i is decided on frame i-1's pose: it has moved 3 steps (>= 0.05 or
    # >= 5 deg) from the last keyframe at i-4, so every 4th frame is stored.
    expected = [0, 1] + list(range(5, n, 4))
    assert [r.frame_index for r in out if r.is_keyframe] == expected
    assert long.window_index >= 1  # restarts happen on stored frames only and keep the trajectory
    np.testing.assert_allclose(np.stack([r.c2w for r in out]), c2w, atol=1e-9)
    # a forced decision overrides the policy
    (r,) = long.push(oracle_images(n)[-1], keyframe=True)
    assert r.is_keyframe


def test_still_camera_under_motion_policy_never_stores_or_restarts():
    c2w, depth = trajectory(20, step=0.0)
    oracle = PoseOracle(c2w, depth)
    long = LongStreamSession(oracle, LongStreamConfig(window_frames=6, keyframe_policy="motion"))
    out = push_all(long, oracle_images(20))
    assert [r.frame_index for r in out if r.is_keyframe] == [0, 1]
    assert long.stats().temporal_index == 2 and long.window_index == 0


# ----------------------------------------------------------------------------- the real model

def test_horizon_is_never_reached_over_a_long_stream(short_model, fixture_config, images):
    plain = StreamingSession(short_model, stream_cfg(fixture_config))
    with pytest.raises(CacheFullError, match="horizon"):
        push_all(plain, [frame(images, i) for i in range(HORIZON + 1)])

    long = make_long(short_model, fixture_config)
    windows, indices = [], []
    for i in range(60):
        for r in long.push(frame(images, i)):
            indices.append(r.frame_index)
            assert np.isfinite(r.c2w).all() and np.isfinite(r.depth).all()
        assert long.stats() is None or long.stats().temporal_index <= 6
        windows.append(long.window_index)
    assert indices == list(range(60)) and long.frames_pushed == 60
    assert windows == sorted(windows) and long.window_index == (60 - 6 - 1) // 4 + 1
    assert set(np.diff(windows)) <= {0, 1}


def test_without_auto_restart_a_full_window_attends_only(short_model, fixture_config, images, caplog):
    long = make_long(short_model, fixture_config, auto_restart=False)
    out = push_all(long, [frame(images, i) for i in range(9)])
    assert [r.is_keyframe for r in out] == [True] * 6 + [False] * 3
    assert long.stats().temporal_index == 6 and long.window_index == 0
    (r,) = long.push(frame(images, 9), keyframe=True)
    assert not r.is_keyframe and sum("auto_restart is off" in m for m in caplog.messages) == 1
    long.restart()
    assert long.window_index == 1 and long.stats().temporal_index == 2
    (r,) = long.push(frame(images, 10))
    assert r.is_keyframe and r.frame_index == 10


def signature(long):
    return signature_of(long.inner)


def signature_of(session):
    return None if session._runner.pages is None else session._runner.pages.state_signature()


def replay_inner(model, images, long, log=()):
    """A fresh StreamingSession fed what the long session's cache holds: its re-fed overlap (scale
    frames, then keyframes), then the window's surviving events in order: ("store", i) a keyframe,
    ("commit",) an eviction commit, ("defer", flag) a deferral change (they decide what each stored
    frame saw)."""
    s0 = long.cfg.num_scale_frames
    session = StreamingSession(model, long.cfg)
    push_all(session, [frame(images, i) for i in long.window.overlap_indices[:s0]])
    push_all(session, [frame(images, i) for i in long.window.overlap_indices[s0:]], keyframe=True)
    for event in log:
        if event[0] == "store":
            session.push(frame(images, event[1]), keyframe=True)
        elif event[0] == "commit":
            session.commit_eviction()
        else:
            session.set_deferred_eviction(event[1])
    session.set_deferred_eviction(long.deferred_eviction)
    return session


def test_results_after_a_restart_are_the_aligned_replay(short_model, fixture_config, images):
    long = make_long(short_model, fixture_config)
    out = push_all(long, [frame(images, i) for i in range(9)])
    assert long.window_index == 1 and long.window.overlap_indices == (4, 5) and long.window.start == 6

    replay = StreamingSession(short_model, long.cfg)
    fed = push_all(replay, [frame(images, i) for i in (4, 5)])
    again = push_all(replay, [frame(images, i) for i in range(6, 9)])
    assert long.inner._runner.pages.state_signature() == replay._runner.pages.state_signature()

    fit = estimate_window_sim3(np.stack([out[i].c2w for i in (4, 5)]), np.stack([r.c2w for r in fed]),
                               np.stack([out[i].depth for i in (4, 5)]), np.stack([r.depth for r in fed]),
                               np.stack([out[i].confidence for i in (4, 5)]), np.stack([r.confidence for r in fed]))
    sim = long.window.alignment
    assert sim.scale == pytest.approx(fit.sim3.scale, rel=1e-6)
    np.testing.assert_allclose(sim.rot, fit.sim3.rot, atol=1e-6)
    for got, raw in zip(out[6:], again):
        np.testing.assert_allclose(got.c2w, sim.apply_to_poses(raw.c2w), atol=1e-5)
        np.testing.assert_allclose(got.depth, raw.depth * sim.scale, rtol=1e-5)
        np.testing.assert_array_equal(got.confidence, raw.confidence)
        np.testing.assert_allclose(quaternion_to_matrix(got.pose_enc[3:7]), got.c2w[:3, :3], atol=1e-5)
        assert got.position == raw.position


def test_service_sequence_equals_a_fresh_replay(short_model, fixture_config, images):
    """Random pushes, rollbacks (right or wrong index), commits, deferral toggles and resets,
    across restarts: the cache always equals a replay of the frames it holds."""
    rng = np.random.default_rng(12)
    long = make_long(short_model, fixture_config, window_frames=8)
    nxt, log, window, probes = 0, [("defer", False)], 0, 0
    seen = {"restart": 0, "rollback": 0, "evicted": 0, "reset": 0}
    ops = ["push"] * 8 + ["push_attend", "rollback_wrong", "reset"] + ["rollback", "commit", "defer"] * 2

    def check(with_outputs):
        replay = replay_inner(short_model, images, long, log)
        assert signature(long) == signature_of(replay)
        assert dataclasses.replace(long.stats(), can_rollback=None) == dataclasses.replace(replay.stats(),
                                                                                           can_rollback=None)
        if with_outputs:  # an attend-only probe changes no cache state
            (got,) = long.push(frame(images, nxt), keyframe=False)
            (want,) = replay.push(frame(images, nxt), keyframe=False)
            np.testing.assert_allclose(got.c2w, long.window.alignment.apply_to_poses(want.c2w), atol=1e-5)
            np.testing.assert_allclose(got.depth, want.depth * long.window.alignment.scale, rtol=1e-5, atol=1e-6)
        return with_outputs

    for step in range(40):
        op = ops[rng.integers(len(ops))]
        if op.startswith("push"):
            results = long.push(frame(images, nxt), keyframe=False if op == "push_attend" else None)
            nxt += 1
            if long.window_index != window:
                window, log = long.window_index, [("defer", long.deferred_eviction)]
                seen["restart"] += 1
            log += [("store", r.frame_index) for r in results if r.is_keyframe]
        elif op.startswith("rollback"):
            before = signature(long)
            try:
                removed = long.rollback_last_frame(-5 if op == "rollback_wrong" else None)
            except SessionError:
                assert signature(long) == before
            else:
                assert op == "rollback" and long.frames_pushed == (removed if long.stats().temporal_index else 0)
                seen["rollback"] += 1
                cut = log.index(("store", removed))
                # the undo takes back the store and the commits after it, not deferral changes
                log = (log[:cut] if long.stats().temporal_index else log[:1]) + [("defer", long.deferred_eviction)]
                nxt = long.frames_pushed
        elif op == "commit":
            pending = long.stats().pending_evictions if long.stats() else 0
            assert long.commit_eviction() == pending
            log.append(("commit",))
            seen["evicted"] += pending
        elif op == "defer":
            long.set_deferred_eviction(not long.deferred_eviction)
            log.append(("defer", long.deferred_eviction))
        else:
            long.reset()
            with pytest.raises(SessionError, match="nothing to roll back"):
                long.rollback_last_frame()
            assert long.commit_eviction() == 0
            nxt, log, window = 0, [("defer", long.deferred_eviction)], 0
            seen["reset"] += 1
        if long.stats() is not None and long.stats().temporal_index:
            probes += check(with_outputs=step % 10 == 9)
            nxt = long.frames_pushed
    assert min(seen.values()) >= 1 and probes >= 2  # the seed exercises every transition


def test_rollback_of_the_frame_that_restarted_leaves_the_overlap(short_model, fixture_config, images):
    long = make_long(short_model, fixture_config)
    push_all(long, [frame(images, i) for i in range(7)])
    assert long.window_index == 1
    assert long.rollback_last_frame(6) == 6 and long.frames_pushed == 6
    assert signature(long) == signature_of(replay_inner(short_model, images, long))
    with pytest.raises(SessionError, match="since the window restart"):
        long.rollback_last_frame()
    (r,) = long.push(frame(images, 6))
    assert r.frame_index == 6 and r.is_keyframe and long.window_index == 1


def test_first_window_passes_results_through_and_rollback_of_scale_frames(short_model, fixture_config, images):
    long = make_long(short_model, fixture_config)
    plain = StreamingSession(short_model, long.cfg)
    got, want = push_all(long, images[:5]), push_all(plain, images[:5])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.c2w, b.c2w)
        np.testing.assert_array_equal(a.depth, b.depth)
        assert a.frame_index == b.frame_index
    long.reset()
    push_all(long, images[:2])
    assert long.rollback_last_frame(1) == 1 and long.frames_pushed == 0 and long.stats().temporal_index == 0
    assert long.push(images[0]) == [] and len(long.push(images[1])) == 2


# ----------------------------------------------------------------------------- faults

class FailingBackend(SdpaBackend):
    """SDPA that raises a CUDA out-of-memory error on its ``fail_at``-th attend call."""

    def __init__(self):
        super().__init__()
        self.fail_at, self.calls = None, 0

    def arm(self, call):
        self.fail_at, self.calls = call, 0

    def attend(self, q, k_pages, v_pages):
        self.calls += 1
        if self.calls == self.fail_at:
            self.fail_at = None
            raise torch.cuda.OutOfMemoryError("simulated out of memory")
        return super().attend(q, k_pages, v_pages)


@pytest.mark.parametrize("fail_frame,call", [
    (8, 3),  # mid-window step
    (6, 1),  # the restart's re-fed scale frames
    (6, 8),  # the first frame of the new window, after the restart succeeded
])
def test_failed_step_drops_the_frame_and_the_stream_goes_on(short_model, fixture_config, images, fail_frame, call):
    backend = FailingBackend()
    long = make_long(short_model, fixture_config, backend=backend)
    push_all(long, [frame(images, i) for i in range(fail_frame)])
    window, pushed, sig = long.window_index, long.frames_pushed, long.inner._runner.pages.state_signature()
    backend.arm(call)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        long.push(frame(images, fail_frame))
    assert long.frames_pushed == pushed
    if call == 1:
        assert long.restart_pending and long.window_index == window and long.stats().temporal_index == 0
        # the inner cache is empty, yet another resolution is refused: the restart would re-feed the old one
        with pytest.raises(InvalidFrameError, match="image size changed"):
            long.push(torch.rand(3, 56, 56))
        assert long.restart_pending and long.frames_pushed == pushed
        long.inner.check_frame(torch.rand(3, 56, 56))  # the empty inner session alone would take it
    elif call == 8:
        assert long.window_index == window + 1 and long.stats().temporal_index == 2
    else:
        assert long.inner._runner.pages.state_signature() == sig and long.window_index == window
    got = push_all(long, [frame(images, i) for i in range(fail_frame + 1, 11)])

    reference = make_long(short_model, fixture_config)  # never saw the failed frame
    want = push_all(reference, [frame(images, i) for i in range(11) if i != fail_frame])[fail_frame:]
    assert [r.frame_index for r in got] == [r.frame_index for r in want] == list(range(fail_frame, 10))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.c2w, b.c2w, atol=1e-5)
    assert long.window_index == reference.window_index and not long.restart_pending


def test_reset_after_a_failure_starts_a_clean_sequence(short_model, fixture_config, images):
    backend = FailingBackend()
    long = make_long(short_model, fixture_config, backend=backend)
    push_all(long, [frame(images, i) for i in range(6)])
    backend.arm(1)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        long.push(frame(images, 6))
    long.reset()
    assert long.window_index == 0 and long.frames_pushed == 0 and not long.restart_pending
    got = push_all(long, images[:4])
    want = push_all(StreamingSession(short_model, long.cfg), images[:4])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.c2w, b.c2w)


# ----------------------------------------------------------------------------- submit

def script_results(long, frames, submit):
    """The results of a script with restarts, forced decisions and a rollback (of the last stored
    frame after frame 10), fed with push, or with submit taking every result late (the newest
    first: that takes all earlier ones); and the frame rolled back."""
    pending, out, rolled = [], [], None
    for i, f in enumerate(frames):
        keyframe = {7: False, 8: True}.get(i)
        if submit:
            pending.append(long.submit(f, keyframe=keyframe))
        else:
            out.append(long.push(f, keyframe=keyframe))
        if i == 10:
            rolled = long.rollback_last_frame()  # needs the results taken so far
    if submit:
        out = [long.results(p) for p in reversed(pending)][::-1]
        assert out[3] is long.results(pending[3])  # asked again: the same list
    return out, rolled


@pytest.mark.parametrize("policy", ["interval", "motion"])
def test_submitted_frames_give_the_pushed_results(policy):
    """LongStreamSession.submit + results() later is push(): same global indices, poses, depths
    and keyframes across restarts, whatever the order the results are taken in."""
    n = 24
    c2w, depth = trajectory(n, step=0.03, turn_deg=2.0)
    runs = {}
    for submit in (False, True):
        oracle = PoseOracle(c2w, depth)
        long = LongStreamSession(oracle, LongStreamConfig(window_frames=6, keyframe_policy=policy,
                                                          motion_min_translation=0.05))
        runs[submit], runs[submit, "rolled"] = script_results(long, oracle_images(n), submit)
        runs[submit, "state"] = (long.window_index, long.frames_pushed, long.window.overlap_indices,
                                 oracle.pages.state_signature())
    assert runs[True, "state"] == runs[False, "state"] and runs[True, "state"][0] >= 1  # restarted
    assert runs[True, "rolled"] == runs[False, "rolled"] == (10 if policy == "interval" else 8)
    assert [len(x) for x in runs[True]] == [len(x) for x in runs[False]]
    pushed, submitted = sum(runs[False], []), sum(runs[True], [])
    assert [r.frame_index for r in submitted] == [r.frame_index for r in pushed]
    assert [r.is_keyframe for r in submitted] == [r.is_keyframe for r in pushed]
    for a, b in zip(submitted, pushed, strict=True):
        np.testing.assert_array_equal(a.c2w, b.c2w)
        np.testing.assert_array_equal(a.depth, b.depth)
    # and right: the trajectory of the images (after the rollback of frame k, image 11 is frame k)
    k = runs[False, "rolled"]
    assert [r.frame_index for r in pushed] == list(range(11)) + list(range(k, k + n - 11))
    np.testing.assert_allclose(np.stack([r.c2w for r in pushed]), c2w[[PoseOracle._id(r.frame) for r in pushed]],
                               atol=1e-9)


def test_submit_on_the_model_equals_push(short_model, fixture_config, images):
    """The same with the real inner session (its own PendingResults) over two restarts."""
    frames = [frame(images, i) for i in range(14)]
    pushed, rolled = script_results(make_long(short_model, fixture_config), frames, False)
    long = make_long(short_model, fixture_config)
    submitted, rolled_too = script_results(long, frames, True)
    pushed, submitted = sum(pushed, []), sum(submitted, [])
    assert rolled == rolled_too == 10 and long.window_index == 2 and long.frames_pushed == 13
    assert [r.frame_index for r in submitted] == [r.frame_index for r in pushed] == list(range(11)) + [10, 11, 12]
    for a, b in zip(submitted, pushed, strict=True):
        assert a.is_keyframe == b.is_keyframe
        np.testing.assert_array_equal(a.pose_enc, b.pose_enc)
        np.testing.assert_array_equal(a.depth, b.depth)


def test_results_submitted_before_a_reset_stay_with_the_old_sequence():
    n = 8
    c2w, depth = trajectory(n, step=0.03)
    long = LongStreamSession(PoseOracle(c2w, depth), LongStreamConfig(window_frames=6))
    pending = [long.submit(f) for f in oracle_images(n)[:4]]
    long.reset()
    assert long.frames_pushed == 0 and long.window_index == 0
    old = [r for p in pending for r in long.results(p)]
    assert [r.frame_index for r in old] == [0, 1, 2, 3]
    with pytest.raises(SessionError, match="nothing to roll back"):
        long.rollback_last_frame()  # the old results were not recorded into the new sequence
    out = push_all(long, oracle_images(n)[4:])
    assert [r.frame_index for r in out] == [0, 1, 2, 3]


def test_a_bad_frame_when_a_restart_is_due_changes_nothing(short_model, fixture_config, images):
    """The frame is checked before the restart it would trigger."""
    from lingbot_map_ros.stream import InvalidFrameError

    long = make_long(short_model, fixture_config)
    push_all(long, [frame(images, i) for i in range(6)])
    assert long.stats().temporal_index == 6  # full: the next stored frame restarts
    before = (signature(long), long.window_index, long.frames_pushed)
    for bad in (torch.rand(3, 56, 56), torch.rand(3, 42, 97)):
        with pytest.raises(InvalidFrameError):
            long.submit(bad)
        assert (signature(long), long.window_index, long.frames_pushed) == before
    (r,) = long.push(frame(images, 6))
    assert long.window_index == 1 and r.frame_index == 6
