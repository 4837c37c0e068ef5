"""The session's speculative planning of the next graphed step, checked on CPU.

The CUDA-graph step is replaced by its static-shape eager twin (``GraphedStep`` with
``capture=False``, SDPA backend), so the whole speculation logic runs here: after each
graphed step the session plans the next one as the keyframe policy predicts and loads
it; the next push uses it only when its plan is identical. A session without graphs
sees the same frames and transitions (forced keyframe decisions, deferred eviction and
commit, rollback, reset); both must give the same outputs.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lingbot_map_ros.cache.attention import SdpaBackend
from lingbot_map_ros.config import StreamConfig
from lingbot_map_ros.stream.graphs import GraphedStep
from lingbot_map_ros.stream.session import StreamingSession


@pytest.fixture(scope="module")
def images(fixtures):
    return torch.from_numpy(np.load(fixtures / "reference_kf1.npz")["images"])


class Counting(GraphedStep):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.calls = {"prepared": 0, "planned": 0, "prepare": 0}

    def prepare(self, dplan):
        self.calls["prepare"] += 1
        super().prepare(dplan)

    def launch(self, frame, dplan, prepared=False):
        self.calls["prepared" if prepared and self._prepared is dplan.plan else "planned"] += 1
        return super().launch(frame, dplan, prepared)


def with_static_step(session: StreamingSession) -> StreamingSession:
    def graphed_step():
        if session._runner.graphed is None:
            session._runner.graphed = Counting(session.model, session._runner.pool, session._runner.camera, SdpaBackend(),
                                        session._runner.resolution, session.step_options, capture=False)
        return session._runner.graphed

    session._runner._graphed_step = graphed_step
    return session


def script(session: StreamingSession, images: torch.Tensor) -> list:
    out = []
    for i in range(8):  # phase 1, then keyframes and attend-only frames (interval 2)
        out += session.push(images[i % len(images)])
    out += session.push(images[8], keyframe=True)  # overrides the policy: the speculation misses
    out += session.push(images[9], keyframe=False)
    session.set_deferred_eviction(True)
    for i in range(10, 14):
        out += session.push(images[i % len(images)])
    session.commit_eviction()
    session.set_deferred_eviction(False)
    out += session.push(images[14 % len(images)])
    last = out[-1].frame_index if out[-1].is_keyframe else None
    if last is not None:
        session.rollback_last_frame(last)
    out += session.push(images[15 % len(images)])
    session.reset()
    for i in range(16, 24):
        out += session.push(images[i % len(images)])
    return out


def test_speculated_steps_equal_unspeculated_ones(tiny_model, fixture_config, images):
    cfg = StreamConfig.from_dict(fixture_config).with_overrides(backend="sdpa", keyframe_interval=2)
    plain = script(StreamingSession(tiny_model, cfg), images)
    graphed_session = with_static_step(StreamingSession(tiny_model, cfg))
    spec = script(graphed_session, images)
    calls = graphed_session._runner.graphed.calls
    assert calls["prepared"] >= 8 and calls["planned"] >= 3, calls  # both paths were taken
    assert [r.frame_index for r in spec] == [r.frame_index for r in plain]
    assert [r.is_keyframe for r in spec] == [r.is_keyframe for r in plain]
    for a, b in zip(spec, plain):
        np.testing.assert_allclose(a.pose_enc, b.pose_enc, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(a.depth, b.depth, rtol=1e-4, atol=1e-5)
