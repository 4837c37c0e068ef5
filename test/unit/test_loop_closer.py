"""LoopCloser (runtime/loop_closure.py) on a known scene, without the model: a drifting front end
goes once around a box room and comes back to its first places; the side session is a stand-in
that knows the true geometry (test/loop_scene.py). Covers detection against the right keyframe,
the verification (called, measured, accepted), the pose graph's closure and the corrections, the
rejection of a candidate whose geometry does not hold or whose side views cannot be measured, and
nothing accepted without a revisit."""
from __future__ import annotations

import numpy as np
import pytest

from lingbot_map_ros.geometry import optical_pose_to_map
from lingbot_map_ros.runtime.corrections import Corrections
from lingbot_map_ros.runtime.loop_closure import MAX_DEFER_S, KeyframeIn, LoopCloser, LoopConfig
from lingbot_map_ros.runtime.loop_keyframes import depth_thumbnail
from lingbot_map_ros.slam import LoopCheck

from loop_scene import K, TrueSideRunner, circuit, drifted, place_image, room_depth  # test/ is on sys.path

pytest.importorskip("gtsam", reason="gtsam is not installed (scripts/bootstrap.sh installs it)")

N = 40  # keyframes of the circuit; then the first REVISIT places are shown again
REVISIT = 6


def keyframe_in(index, T_cv, rgb, true_cv):
    """What the engine hands over: the front end's pose (REP-103 map frame), the true depth."""
    depth = room_depth(true_cv)
    d, k = depth_thumbnail(depth, np.full(depth.shape, 5.0, np.float32), K, 1.5)
    return KeyframeIn(index, float(index), optical_pose_to_map(T_cv), rgb, d, k, 1.0)


def run(frames, side, config):
    """Feed ``frames`` [(front-end c2w, image, true c2w)], verifying candidates as they come."""
    got = []
    closer = LoopCloser(config, side, got.append)
    try:
        for i, (T, rgb, true) in enumerate(frames):
            closer.keyframe(keyframe_in(i, T, rgb, true))
            assert closer.flush(30)
            while closer.run_idle():  # what the scheduler does when the stream leaves it time
                assert closer.flush(30)
        return closer, got
    finally:
        closer.stop()


@pytest.fixture(scope="module")
def scene():
    true = circuit(N)
    true = true + true[:REVISIT]  # the first places again
    reported = drifted(true)
    images = [place_image(i % N) for i in range(len(true))]
    side = TrueSideRunner(list(zip(images[:N], true[:N])))
    return true, reported, images, side


def test_closure_is_found_verified_and_pulls_the_revisit_onto_the_first_pass(scene):
    true, reported, images, side = scene
    config = LoopConfig(min_separation=20, min_similarity=0.9)
    closer, got = run(list(zip(reported, images, true)), side, config)
    stats = closer.stats
    assert stats.accepted >= 1 and side.calls >= 2, stats
    first = closer.markers[0]
    assert first.accepted and first.current >= N and first.kept == first.current - N  # the same place
    corrections = got[-1]
    assert isinstance(corrections, Corrections) and not corrections.identity
    # the revisit's corrected pose is where the first pass saw that place (the loop's measurement)
    for j in range(N, N + REVISIT):
        if j not in corrections.indices:
            continue
        raw = optical_pose_to_map(reported[j])
        fixed = corrections.pose(j, raw)
        first_pass = corrections.pose(j - N, optical_pose_to_map(reported[j - N]))
        before = np.linalg.norm(raw[:3, 3] - optical_pose_to_map(reported[j - N])[:3, 3])
        after = np.linalg.norm(fixed[:3, 3] - first_pass[:3, 3])
        assert after < 0.2 * before and after < 0.05, (j, before, after)
    closer.render_map()
    assert closer.flush(30) and closer.map[0].shape[0] > 0  # the keyframes' points, at the corrected poses


def test_no_revisit_no_closure(scene):
    true, reported, images, side = scene
    closer, got = run(list(zip(reported[:N], images[:N], true[:N])), side, LoopConfig(min_separation=20))
    assert closer.stats.accepted == 0 and closer.stats.candidates == 0 and not got


def test_a_candidate_whose_geometry_does_not_hold_is_rejected_with_its_reason(scene):
    """The side session says the revisit is somewhere else (a wrong place recognised): the depth
    does not reproject, the candidate is counted as rejected, the graph keeps no loop."""
    true, reported, images, _ = scene

    class Liar(TrueSideRunner):
        def run(self, imgs):
            views = super().run(imgs)
            moved = views[1].c2w.copy()
            moved[:3, 3] += np.array([1.5, 0.0, 1.0])  # far from where it really was
            return [views[0], type(views[1])(moved, views[1].depth, views[1].confidence, views[1].intrinsics)]

    side = Liar(list(zip(images[:N], true[:N])))
    closer, got = run(list(zip(reported, images, true)), side, LoopConfig(min_separation=20, check=LoopCheck()))
    assert closer.stats.accepted == 0 and closer.stats.rejected >= 1
    assert closer.stats.last_reason and not closer.markers[-1].accepted
    assert closer.graph.graph.edge_counts().get("loop", 0) == 0 and not got


@pytest.mark.parametrize("broken", ["intrinsics", "pose", "raises"])
def test_a_side_session_that_gives_garbage_costs_the_candidate_not_the_loop_thread(scene, broken):
    """A side session with infinite intrinsics, a NaN pose or an exception (what random weights
    can give): each candidate is refused with its reason and counted; the loop thread goes on."""
    true, reported, images, _ = scene

    class Broken(TrueSideRunner):
        def run(self, imgs):
            if broken == "raises":
                raise RuntimeError("CUDA error: an illegal memory access")
            views = super().run(imgs)
            v = views[1]
            K, c2w = v.intrinsics.copy(), v.c2w.copy()
            if broken == "intrinsics":
                K[0, 0] = np.inf
            else:
                c2w[0, 3] = np.nan
            return [views[0], type(v)(c2w, v.depth, v.confidence, K)]

    side = Broken(list(zip(images[:N], true[:N])))
    closer, got = run(list(zip(reported, images, true)), side, LoopConfig(min_separation=20))
    stats = closer.stats
    assert stats.candidates >= 1 and stats.rejected == stats.candidates and stats.accepted == 0, stats
    assert {"intrinsics": "non-finite", "pose": "non-finite", "raises": "illegal memory"}[broken] in stats.last_reason
    assert not got


def test_a_kept_keyframes_image_comes_back_writable():
    """The side session hands it to torch, which warns about a read-only array (and may write into it)."""
    from lingbot_map_ros.runtime.loop_keyframes import LoopKeyframe, jpeg

    rgb = place_image(3)
    kf = LoopKeyframe(0, 0.0, np.eye(4), jpeg(rgb), np.zeros(4, np.float32), np.zeros((7, 12), np.float32),
                      np.zeros((7, 12, 3), np.uint8), K)
    back = kf.rgb()
    assert back.flags.writeable and back.shape == rgb.shape and back.dtype == np.uint8


def test_a_verification_runs_one_side_run_at_a_time_and_only_when_it_fits_before_the_next_frame(scene):
    """run_idle(budget): a candidate is two side-session runs (with the kept keyframe, then with its
    partner), one per idle turn; a run that took longer than the time to the next frame waits."""
    import time as _time

    true, reported, images, side = scene

    class Slow(TrueSideRunner):
        def run(self, imgs):
            _time.sleep(0.05)
            return super().run(imgs)

    slow = Slow(list(zip(images[:N], true[:N])))
    closer = LoopCloser(LoopConfig(min_separation=20, min_similarity=0.9), slow, lambda c: None)
    try:
        frames = list(zip(reported, images, true))
        for i, (T, rgb, tr) in enumerate(frames):
            closer.keyframe(keyframe_in(i, T, rgb, tr))
            assert closer.flush(30)
            if closer.candidate_waiting:
                break
        assert closer.candidate_waiting
        assert closer.run_idle(budget_s=1.0) and slow.calls == 1 and closer.candidate_waiting  # first run only
        assert closer.side_s is not None and closer.side_s >= 0.05
        assert not closer.run_idle(budget_s=0.01) and slow.calls == 1  # no room before the next frame
        assert closer.run_idle(budget_s=None) and slow.calls == 2 and not closer.candidate_waiting  # no frame due
        assert closer.flush(30) and closer.stats.accepted + closer.stats.rejected == 1
        # never a gap long enough (a side run longer than the time between frames): after MAX_DEFER_S of
        # waiting the candidate runs in a short gap anyway, or loop closure would never verify one
        for i, (T, rgb, tr) in enumerate(frames[len(frames) // 2:], start=len(frames)):
            closer.keyframe(keyframe_in(i, T, rgb, tr))
            assert closer.flush(30)
            if closer.candidate_waiting:
                break
        assert closer.candidate_waiting
        calls = slow.calls
        assert not closer.run_idle(budget_s=0.01) and slow.calls == calls
        with closer._idle:
            closer._jobs[0].queued_at -= MAX_DEFER_S  # as if it had waited that long
        assert closer.run_idle(budget_s=0.01) and slow.calls == calls + 1
    finally:
        closer.stop()


def test_corrections_made_on_two_threads_never_share_a_version():
    """Caches (the path's messages, the grid) rebuild when the corrections' version moves. A
    relocalisation's entry (inference thread, ``with_entry``) and the loop thread's next solution
    are different sets: they must not carry the same number, as ``version + 1`` on both sides did."""
    from lingbot_map_ros.slam import Sim3

    loop_side = Corrections({0: Sim3.identity()})
    relocated = loop_side.with_entry(5, Sim3(np.eye(3), np.array([1.0, 0.0, 0.0]), 1.0))
    next_solution = Corrections({0: Sim3.identity(), 5: Sim3.identity()})
    versions = {loop_side.version, relocated.version, next_solution.version, Corrections().version}
    assert len(versions) == 4
    assert relocated.pose(6, np.eye(4))[0, 3] == 1.0 and loop_side.pose(6, np.eye(4))[0, 3] == 0.0
