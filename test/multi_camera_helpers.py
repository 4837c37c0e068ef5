"""Helpers of the multi-camera core tests (``test/core/test_multi_camera*.py``): the fixture's
stream configuration on SDPA, distinct frame sequences per camera, a single-camera replay to
compare with, and the comparison itself (fp32, <= ``TOL``)."""
from __future__ import annotations

import numpy as np
import torch

from lingbot_map_ros.cache.attention import make_backend
from lingbot_map_ros.config import StreamConfig
from lingbot_map_ros.stream.graphs import GraphedStep, StepSite
from lingbot_map_ros.stream.session import StreamingSession

TOL = 1e-4


class EagerStaticSteps:
    """A step capture for CPU tests (``StreamingSession(steps=...)``, ``CameraSessions(steps=...)``):
    the graphed steps' static-shape path run eagerly (no capture), each with a backend of its own,
    so the batched trunk and everything around it (plans, speculation, landing, per-camera heads)
    run on the CPU."""

    def applies(self, cfg: StreamConfig, device: torch.device, backend) -> bool:
        return device.type == "cpu"

    def make(self, site: StepSite) -> GraphedStep:
        return GraphedStep(site.model, site.pool, site.camera, make_backend(site.cfg.backend, site.pool.k.device),
                           site.resolution, site.options, capture=False)


def cfg(fixture_config, **kw) -> StreamConfig:
    return StreamConfig.from_dict(fixture_config).with_overrides(backend="sdpa", **kw)


def sequences(images, n: int) -> list[list[torch.Tensor]]:
    """n different frame sequences out of the fixture's 12 frames (shifted, one reversed)."""
    frames = list(images)
    out = [frames, frames[::-1], frames[5:] + frames[:5], frames[3:] + frames[:3]]
    return out[:n]


def replay(model, config: StreamConfig, frames, keyframes=None) -> list:
    """The results of one single-camera session fed ``frames`` (with forced ``keyframes``)."""
    s = StreamingSession(model, config)
    out = []
    for i, f in enumerate(frames):
        out += s.push(f, None if keyframes is None else keyframes[i])
    return out


def assert_same(results, reference) -> float:
    """Same frames, same keyframe flags, outputs within TOL; returns the largest difference."""
    assert [r.frame_index for r in results] == [r.frame_index for r in reference]
    assert [r.is_keyframe for r in results] == [r.is_keyframe for r in reference]
    worst = 0.0
    for a, b in zip(results, reference):
        for name in ("pose_enc", "depth", "confidence"):
            d = float(np.abs(getattr(a, name) - getattr(b, name)).max())
            worst = max(worst, d)
            assert d <= TOL, f"{name} of frame {a.frame_index}: {d}"
    return worst
