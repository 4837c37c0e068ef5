"""The CUDA-graph step (stream/graphs.py) against the eager step on the tiny fixture.

Two bf16 FlashInfer sessions, one with ``cuda_graphs`` and one without, see the same
frames and the same transitions: keyframe interval 2 (attend-only frames), deferred
eviction and its commit, a rollback, a reset and a second sequence. Their outputs must
agree to bf16 noise, the graphed one must really replay its graph, and a replayed step
(everything of a push but the conversion of its results) must not synchronise.
Run on the GPU machine: ``pytest -m gpu test/gpu/test_graphs.py -s`` prints the figures.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lingbot_map_ros.cache.attention import flashinfer_available
from lingbot_map_ros.config import ModelConfig, StreamConfig
from lingbot_map_ros.io.checkpoint import load_model
from lingbot_map_ros.stream.session import StreamingSession

from fixtures_path import fixture_dir  # test/ is on sys.path (test/conftest.py)

FIXTURES = fixture_dir()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(FIXTURES is None, reason="fixtures not found: set LINGBOT_FIXTURES, or copy "
                       "shared/fixtures/upstream_tiny to <repo>/.fixtures/upstream_tiny"),
    pytest.mark.skipif(not flashinfer_available(), reason="flashinfer is not installed (see GPU.md)"),
]

REL_TOL = 1e-2
FIELDS = ("pose_enc", "depth", "confidence")


def make_session(backend: str, graphs: bool, parallel_heads: bool = True) -> StreamingSession:
    config = json.loads((FIXTURES / "config.json").read_text())
    model = load_model(ModelConfig.from_dict(config), FIXTURES / "weights.safetensors", device="cuda", dtype="bf16")
    # float32 depth head: its bf16 copy amplifies rounding differences (split-KV merge order)
    # to ~1e-2 on this tiny model, which would hide what this test compares
    cfg = StreamConfig.from_dict(config).with_overrides(keyframe_interval=2, backend=backend, dtype="bf16",
                                                        device="cuda", cuda_graphs=graphs, bf16_depth_head=False,
                                                        parallel_heads=parallel_heads)
    return StreamingSession(model, cfg)


class NoSync:
    """Sync debug mode "error" for a push, switched off only while its results are converted."""

    def __init__(self, session: StreamingSession) -> None:
        self.convert = session._runner._results
        session._runner._results = self._convert_unchecked

    def _convert_unchecked(self, *args, **kwargs):
        torch.cuda.set_sync_debug_mode(0)
        return self.convert(*args, **kwargs)

    @staticmethod
    def _checked(call, image):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return call(image)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    def push(self, session: StreamingSession, image):
        return self._checked(session.push, image)

    def submit(self, session: StreamingSession, image):
        return self._checked(session.submit, image)


def script(session: StreamingSession, images: np.ndarray, checked: NoSync | None, queued: bool = False) -> list:
    """Frames and transitions; ``checked`` pushes the frames after the first graphed one without syncs.
    ``queued``: each frame is submitted before the previous frame's results are taken, and the
    transitions (commit, deferral, reset) come while a step is in flight."""
    results, waiting = [], []

    def push(i):
        if not queued:
            step = checked.push if checked is not None and i >= 4 else (lambda s, im: s.push(im))
            results.extend(step(session, images[i]))
            return
        step = checked.submit if checked is not None and i >= 4 else (lambda s, im: s.submit(im))
        waiting.append(step(session, images[i]))
        while len(waiting) > 1:
            results.extend(waiting.pop(0).result())

    def flush():
        while waiting:
            results.extend(waiting.pop(0).result())

    session.set_deferred_eviction(True)
    for i in range(10):  # phase 1 (2 frames), then keyframes and attend-only frames; the window (3) overflows
        push(i)
    assert session.stats().pending_evictions > 0
    assert session.commit_eviction() > 0
    session.set_deferred_eviction(False)
    for i in range(10, 12):
        push(i)
    flush()  # the rollback below names the last stored frame, which the results tell
    last = results[-1].frame_index if results[-1].is_keyframe else results[-2].frame_index
    assert session.rollback_last_frame(last) == last
    push(11)  # takes the rolled-back frame's place
    session.reset()
    for i in range(8):  # a second sequence: the same graph, the same buffers
        push(i)
    flush()
    return results


@pytest.mark.parametrize("backend", ["flashinfer-fa3", "flashinfer-fa2", "sdpa"])
def test_graphed_step_matches_eager(backend):
    if backend.endswith("fa3") and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FA3 needs a Hopper GPU")
    images = np.load(FIXTURES / "reference_kf2.npz")["images"]
    eager = script(make_session(backend, graphs=False), images, None)
    graphed_session = make_session(backend, graphs=True)
    graphed = script(graphed_session, images, NoSync(graphed_session))
    assert graphed_session._runner.graphed is not None and graphed_session._runner.graphed.graph is not None
    phase2 = sum(1 for r in graphed if r.frame_index >= graphed_session.cfg.num_scale_frames)
    assert graphed_session._runner.graphed.replays == phase2 > 12

    assert [(r.frame_index, r.position, r.is_keyframe) for r in graphed] == \
        [(r.frame_index, r.position, r.is_keyframe) for r in eager]
    errors = {}
    for field in FIELDS:
        a = np.stack([getattr(r, field) for r in graphed])
        b = np.stack([getattr(r, field) for r in eager])
        errors[field] = float(np.abs(a - b).max() / np.abs(b).max())
    print(f"GRAPHS {backend} {len(graphed)} frames, {graphed_session._runner.graphed.replays} replays, "
          + ", ".join(f"{k} rel {v:.2e}" for k, v in errors.items()))
    assert all(v <= REL_TOL for v in errors.values()), errors


def test_queued_steps_give_the_pushed_results():
    """Frames submitted before the previous results are taken (a step's heads graph then
    runs beside the next step's trunk graph) give what one-at-a-time pushes give, and the
    submits themselves do not synchronise."""
    backend = "flashinfer-fa3" if torch.cuda.get_device_capability()[0] == 9 else "flashinfer-fa2"
    images = np.load(FIXTURES / "reference_kf2.npz")["images"]
    pushed = script(make_session(backend, graphs=True), images, None)
    session = make_session(backend, graphs=True)
    queued = script(session, images, NoSync(session), queued=True)
    assert session._runner.graphed is not None and session._runner.graphed.replays > 12
    assert [(r.frame_index, r.position, r.is_keyframe) for r in queued] == \
        [(r.frame_index, r.position, r.is_keyframe) for r in pushed]
    for field in FIELDS:
        a = np.stack([getattr(r, field) for r in queued])
        b = np.stack([getattr(r, field) for r in pushed])
        assert np.array_equal(a, b) or float(np.abs(a - b).max() / np.abs(b).max()) < 1e-6, field


def test_a_step_keeps_running_while_the_next_is_submitted():
    """submit() returns without waiting for its step: behind ~0.1 s of queued GPU work the
    frame's results are not done when submit returns, the next frame can be submitted
    before they are taken (it may wait for the GPU only to reuse the attention plan's
    host buffer), and both come out as pushes give them."""
    backend = "flashinfer-fa3" if torch.cuda.get_device_capability()[0] == 9 else "flashinfer-fa2"
    images = np.load(FIXTURES / "reference_kf2.npz")["images"]
    session = make_session(backend, graphs=True)
    for i in range(6):
        session.push(images[i])
    reference = make_session(backend, graphs=True)
    for i in range(6):
        reference.push(images[i])
    expected = [reference.push(images[i])[0] for i in (6, 7)]
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU work ahead of the step
    first = session.submit(images[6])
    assert not first.done
    second = session.submit(images[7])
    got = [first.result()[0], second.result()[0]]
    for a, b in zip(got, expected):
        assert a.frame_index == b.frame_index
        np.testing.assert_allclose(a.pose_enc, b.pose_enc, rtol=0, atol=1e-6)


@pytest.mark.parametrize("graphs", [True, False])
def test_parallel_heads_give_the_same_results(graphs):
    """The camera head on its own stream (forked and joined inside the step, and inside the
    captured graph) computes exactly what it computes after the depth head."""
    backend = "flashinfer-fa3" if torch.cuda.get_device_capability()[0] == 9 else "flashinfer-fa2"
    images = np.load(FIXTURES / "reference_kf2.npz")["images"]
    runs = {}
    for parallel in (False, True):
        session = make_session(backend, graphs=graphs, parallel_heads=parallel)
        assert (session.step_options.head_stream is not None) == parallel
        runs[parallel] = script(session, images, None)
        if graphs:
            assert session._runner.graphed is not None and session._runner.graphed.replays > 12
    for field in FIELDS:
        a = np.stack([getattr(r, field) for r in runs[True]])
        b = np.stack([getattr(r, field) for r in runs[False]])
        assert np.array_equal(a, b) or float(np.abs(a - b).max() / np.abs(b).max()) < 1e-6, field
