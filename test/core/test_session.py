"""StreamingSession transitions: defer/commit/rollback/reset, failures, bad input."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from lingbot_map_ros.cache.attention import SdpaBackend
from lingbot_map_ros.config import StreamConfig
from lingbot_map_ros.stream.session import InvalidFrameError, SessionError, StreamingSession


@pytest.fixture(scope="module")
def images(fixtures):
    return torch.from_numpy(np.load(fixtures / "reference_kf1.npz")["images"])


def make(model, fixture_config, **kw):
    cfg = StreamConfig.from_dict(fixture_config).with_overrides(backend="sdpa", **kw)
    return StreamingSession(model, cfg)


def push_all(session, frames):
    out = []
    for f in frames:
        out += session.push(f)
    return out


def test_phase1_buffers_then_returns_all_scale_frames(tiny_model, fixture_config, images):
    s = make(tiny_model, fixture_config)
    assert s.push(images[0]) == []
    results = s.push(images[1])
    assert [r.frame_index for r in results] == [0, 1] and all(r.is_keyframe for r in results)
    assert s.stats().temporal_index == 2


def test_rollback_equals_replay_without_the_frame(tiny_model, fixture_config, images):
    s = make(tiny_model, fixture_config)
    push_all(s, images[:6])
    s.set_deferred_eviction(True)
    before = s._runner.pages.state_signature()
    (r6,) = s.push(images[6])
    assert r6.is_keyframe and s.stats().pending_evictions == 1
    assert s.rollback_last_frame(expected_frame_index=6) == 6
    assert s._runner.pages.state_signature() == before
    s.set_deferred_eviction(False)
    (after,) = s.push(images[7])

    replay = make(tiny_model, fixture_config)
    push_all(replay, images[:6])
    (expected,) = replay.push(images[7])
    assert after.frame_index == expected.frame_index == 6
    np.testing.assert_array_equal(after.pose_enc, expected.pose_enc)
    np.testing.assert_array_equal(after.depth, expected.depth)


def test_rollback_guards(tiny_model, fixture_config, images):
    s = make(tiny_model, fixture_config)
    with pytest.raises(SessionError, match="nothing to roll back"):
        s.rollback_last_frame()
    push_all(s, images[:3])
    before = s._runner.pages.state_signature()
    with pytest.raises(SessionError, match="last stored frame is 2"):
        s.rollback_last_frame(expected_frame_index=1)
    assert s._runner.pages.state_signature() == before
    s.rollback_last_frame()
    with pytest.raises(SessionError, match="nothing to roll back"):
        s.rollback_last_frame()


def test_deferred_eviction_with_commit_after_each_frame(tiny_model, fixture_config, images):
    """Deferring and committing after every frame lets each frame see one extra window frame:
    exactly a plain session with sliding_window + 1."""
    window = fixture_config["sliding_window"]
    wider = make(tiny_model, fixture_config, sliding_window=window + 1)
    expected = push_all(wider, images[:10])

    s = make(tiny_model, fixture_config, deferred_eviction=True)
    got = push_all(s, images[:2])
    for image in images[2:10]:
        got += s.push(image)
        pending = s.stats().pending_evictions
        assert s.stats().window_pages == min(window + pending, s.stats().temporal_index - 2)
        assert s.commit_eviction() == pending
        assert s.commit_eviction() == 0
        assert s.stats().window_pages <= window
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a.pose_enc, b.pose_enc, rtol=1e-6, atol=1e-6)


def test_reset_starts_a_new_identical_sequence(tiny_model, fixture_config, images):
    s = make(tiny_model, fixture_config)
    first = push_all(s, images[:5])
    s.reset()
    assert s.stats().temporal_index == 0 and s.frames_pushed == 0
    second = push_all(s, images[:5])
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a.pose_enc, b.pose_enc)


def test_every_step_runs_with_the_one_step_options_object(tiny_model, fixture_config, images, monkeypatch):
    """The session builds its StepOptions once (frozen) from its configuration and hands the
    same object to every step; without depth the steps skip the depth head."""
    s = make(tiny_model, fixture_config, camera_iterations=2)
    o = s.step_options
    assert (o.camera_iterations, o.autocast_dtype, o.with_depth, o.fused, o.head_stream) == (2, None, True, False, None)
    assert (o.depth_head, o.camera_head) == (None, None)  # CPU float32: the model's own heads
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.fused = True
    seen = []
    real_step = type(tiny_model).step

    def spy(model, *args, **kwargs):
        seen.append(kwargs["options"])
        return real_step(model, *args, **kwargs)

    monkeypatch.setattr(type(tiny_model), "step", spy)
    assert len(push_all(s, images[:4])) == 4
    assert len(seen) == 3 and all(x is o for x in seen)  # phase 1, then one step per frame
    flat = StreamingSession(tiny_model, s.cfg, with_depth=False)
    assert not flat.step_options.with_depth
    results = push_all(flat, images[:3])
    assert len(results) == 3 and all(r.depth is None and r.confidence is None for r in results)
    np.testing.assert_array_equal(results[2].pose_enc, push_all(make(tiny_model, fixture_config,
                                                                      camera_iterations=2), images[:3])[2].pose_enc)


class FailingBackend(SdpaBackend):
    def __init__(self):
        super().__init__()
        self.fail_at = None
        self.calls = 0

    def attend(self, q, k_pages, v_pages):
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise torch.cuda.OutOfMemoryError("simulated out of memory")
        return super().attend(q, k_pages, v_pages)


def test_failed_step_leaves_cache_unchanged(tiny_model, fixture_config, images):
    backend = FailingBackend()
    cfg = StreamConfig.from_dict(fixture_config).with_overrides(backend="sdpa")
    s = StreamingSession(tiny_model, cfg, backend=backend)
    push_all(s, images[:5])
    before = s._runner.pages.state_signature()
    backend.calls, backend.fail_at = 0, 3
    with pytest.raises(torch.cuda.OutOfMemoryError):
        s.push(images[5])
    assert s._runner.pages.state_signature() == before and s.frames_pushed == 5
    backend.fail_at = None
    (got,) = s.push(images[5])
    replay = make(tiny_model, fixture_config)
    expected = push_all(replay, images[:6])[-1]
    np.testing.assert_array_equal(got.pose_enc, expected.pose_enc)


@pytest.mark.parametrize("bad,needle", [
    (torch.zeros(3, 56, 97), "multiple of the patch size"),
    (torch.zeros(1, 56, 98), r"\[3, H, W\]"),
    (torch.zeros(3, 14, 28), "too small"),
    (torch.zeros(3, 56, 98, dtype=torch.uint8), r"uint8 RGB image \[H, W, 3\]"),
    (torch.zeros(3, 56, 98, dtype=torch.int32), "float image"),
    (np.zeros((56, 97, 3), dtype=np.uint8), "multiple of the patch size"),
])
def test_bad_images_are_refused_without_state_change(tiny_model, fixture_config, images, bad, needle):
    s = make(tiny_model, fixture_config)
    push_all(s, images[:3])
    before = s._runner.pages.state_signature()
    with pytest.raises(InvalidFrameError, match=needle):
        s.push(bad)
    assert s._runner.pages.state_signature() == before
    with pytest.raises(InvalidFrameError, match=needle):
        s.check_frame(bad)
    assert isinstance(InvalidFrameError("x"), ValueError)  # callers catching ValueError still do


def test_resolution_change_needs_reset(tiny_model, fixture_config, images):
    s = make(tiny_model, fixture_config)
    push_all(s, images[:3])
    with pytest.raises(InvalidFrameError, match="size changed: 56x56, the sequence's frames are 98x56; reset the"):
        s.push(torch.rand(3, 56, 56))
    assert s.frames_pushed == 3 and s.window_index == 0
    s.check_frame(torch.rand(3, 56, 56), resolution=(56, 56))  # another resolution, when the caller names it
    s.reset()
    assert s.push(torch.rand(3, 56, 56)) == []
    assert len(s.push(torch.rand(3, 56, 56))) == 2


def test_forced_keyframe_decision(tiny_model, fixture_config, images):
    s = make(tiny_model, fixture_config, keyframe_interval=100)
    push_all(s, images[:2])
    (r,) = s.push(images[2], keyframe=False)
    assert not r.is_keyframe and s.stats().temporal_index == 2
    (r,) = s.push(images[3], keyframe=True)
    assert r.is_keyframe and s.stats().temporal_index == 3


def test_uint8_frames_give_the_float_frames_results(tiny_model, fixture_config, images):
    """A uint8 [H, W, 3] camera frame is converted on the session's device with the float32
    division of preprocessing: the same model input, so the same outputs, bit for bit."""
    from lingbot_map_ros.io.preprocess import uint8_to_image

    rng = np.random.default_rng(0)
    h, w = images.shape[-2:]
    frames_u8 = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(5)]
    as_float = make(tiny_model, fixture_config)
    as_u8 = make(tiny_model, fixture_config)
    ref = push_all(as_float, [uint8_to_image(f) for f in frames_u8])
    got = push_all(as_u8, frames_u8)
    assert len(got) == len(ref) == 5
    for a, b, f in zip(got, ref, frames_u8):
        np.testing.assert_array_equal(a.pose_enc, b.pose_enc)
        np.testing.assert_array_equal(a.depth, b.depth)
        assert a.frame.dtype == np.uint8 and a.frame.shape == (h, w, 3) and a.size == b.size == (h, w)
        np.testing.assert_array_equal(a.image, b.image)  # the float view of a uint8 frame
        pixels = np.array([0, 5, h * w - 1])
        np.testing.assert_array_equal(a.colors(pixels), f.reshape(-1, 3)[pixels])
        np.testing.assert_array_equal(b.colors(pixels), f.reshape(-1, 3)[pixels])
    # the division really is per pixel and exact: every byte value
    ramp = np.arange(256, dtype=np.uint8).reshape(1, 256, 1).repeat(3, axis=2)
    np.testing.assert_array_equal(uint8_to_image(ramp)[0, 0], np.arange(256, dtype=np.float32) / np.float32(255))


@pytest.mark.parametrize("refusal", ["FragmentedPool", "UngraphableStep"])
def test_a_step_its_graph_cannot_take_runs_eagerly_with_the_same_results(tiny_model, fixture_config, images,
                                                                         caplog, refusal):
    """A graphed step whose visible keys fall into more runs than its splits raises
    FragmentedPool (FlashInfer's UngraphableStep; the session knows only the latter) before
    launching anything; the session runs that step without the graph with the same results
    (and does not prepare the next step in that graph)."""
    from lingbot_map_ros.cache import attention, flashinfer_backend

    FragmentedPool = {"FragmentedPool": flashinfer_backend.FragmentedPool,
                      "UngraphableStep": attention.UngraphableStep}[refusal]

    class Fragmented:
        calls = prepares = 0
        output_stream = None

        def launch(self, frames, dplan, prepared=False):
            Fragmented.calls += 1
            raise FragmentedPool("9 runs of visible keys for 8 splits")

        def prepare(self, dplan):
            Fragmented.prepares += 1
            raise FragmentedPool("9 runs of visible keys for 8 splits")

    plain = push_all(make(tiny_model, fixture_config), images[:6])
    s = make(tiny_model, fixture_config)
    s._runner._graphed_step = lambda: Fragmented()
    with caplog.at_level("WARNING"):
        fallback = push_all(s, images[:6])
    steps = 6 - s.cfg.num_scale_frames
    assert Fragmented.calls == steps and Fragmented.prepares == 0 and s._runner.speculated is None
    assert s.graph_fallbacks == steps  # counted; warned about once, not at the frame rate
    assert sum("without its CUDA graph" in r.message for r in caplog.records) == 1
    for a, b in zip(fallback, plain, strict=True):
        np.testing.assert_array_equal(a.pose_enc, b.pose_enc)
        np.testing.assert_array_equal(a.depth, b.depth)
    # preparing the next step in a graph that cannot take it is skipped, not an error
    s._runner._speculate(Fragmented(), s.model.cfg.tokens_per_frame(*s.resolution))
    assert Fragmented.prepares == 1 and s._runner.speculated is None


def test_submitted_frames_give_the_pushed_results(tiny_model, fixture_config, images):
    """submit() + result() later, with transitions between, is push() (on CPU the step is
    done when submit returns; the GPU overlap is checked in test/gpu/test_graphs.py)."""
    pushed = push_all(make(tiny_model, fixture_config), images[:7])
    s = make(tiny_model, fixture_config)
    pending = [s.submit(f) for f in images[:7]]
    assert all(p.done for p in pending)
    assert [len(p.result()) for p in pending] == [0, 2, 1, 1, 1, 1, 1]
    submitted = [r for p in pending for r in p.result()]  # result() again: the same objects
    assert [r.frame_index for r in submitted] == [r.frame_index for r in pushed]
    for a, b in zip(submitted, pushed, strict=True):
        np.testing.assert_array_equal(a.pose_enc, b.pose_enc)
        np.testing.assert_array_equal(a.depth, b.depth)
    assert pending[3].result()[0] is pending[3].result()[0]
    s.wait()  # nothing in flight: a no-op


def test_bad_input_to_submit_is_refused_without_state_change(tiny_model, fixture_config, images):
    s = make(tiny_model, fixture_config)
    for f in images[:3]:
        s.submit(f)
    before = (s._runner.pages.state_signature(), s.frames_pushed)
    with pytest.raises(ValueError, match="image size changed"):
        s.submit(images[3][:, :42, :42])
    assert (s._runner.pages.state_signature(), s.frames_pushed) == before


class _Pending:
    """A stand-in for a step in flight: counts the waits for its results (like
    PendingResults, a second result() returns what the first took, without waiting)."""

    def __init__(self) -> None:
        self.taken = 0

    @property
    def settled(self) -> bool:
        return self.taken > 0

    def result(self):
        if not self.settled:
            self.taken += 1
        return []


def test_at_most_max_in_flight_steps_are_left_running(tiny_model, fixture_config):
    from lingbot_map_ros.stream.steps import MAX_IN_FLIGHT

    s = make(tiny_model, fixture_config)
    old, newer = _Pending(), _Pending()
    s._runner.in_flight.extend([old, newer])
    s._runner.make_room()  # MAX_IN_FLIGHT (2) running: the oldest is waited for, the newer keeps running
    assert MAX_IN_FLIGHT == 2 and old.taken == 1 and newer.taken == 0 and list(s._runner.in_flight) == [newer]
    s._runner.make_room()
    assert newer.taken == 0  # one running is allowed beside the next step
    newer.result()
    s._runner.make_room()  # settled ones are forgotten
    assert not s._runner.in_flight and newer.taken == 1
    s._runner.in_flight.extend([_Pending(), _Pending()])
    s.wait()
    assert not s._runner.in_flight
