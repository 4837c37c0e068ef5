"""What a journal's state depends on: the model (architecture and weights), the streaming
configuration that changes what is stored or computed, and whether depth is predicted.

A resumed session must match in all of it; the device, the attention backend, CUDA graphs
and the kernels change only rounding and are left out (a journal written on the GPU can be
resumed on the CPU and back).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import torch

# StreamConfig fields that change the state or the outputs (not merely how fast they come)
STREAM_FIELDS = ("num_scale_frames", "sliding_window", "keyframe_interval", "camera_iterations", "dtype",
                 "max_pending_evictions", "kv_cache_dtype", "precision")  # the last two: where the config has them


def weights_fingerprint(model: torch.nn.Module, sample: int = 64) -> str:
    """sha256 over every parameter's name, shape, dtype and first ``sample`` values (one copy to
    the host for the whole model): tells checkpoints apart without reading a gigabyte."""
    names, runs = [], []  # runs: consecutive parameters on one device (a session may park the heads on the host)
    for name, p in model.named_parameters():
        names.append(f"{name}:{tuple(p.shape)}:{p.dtype}")
        head = p.detach().reshape(-1)[:sample].float()
        if runs and runs[-1][0].device == head.device:
            runs[-1].append(head)
        else:
            runs.append([head])
    h = hashlib.sha256("\n".join(names).encode())
    if runs:
        h.update(torch.cat([torch.cat(run).cpu() for run in runs]).numpy().tobytes())
    return h.hexdigest()[:32]


def journal_identity(session, checkpoint: str = "") -> dict[str, Any]:
    """The identity of ``session`` (a LongStreamSession) for the journal header. ``checkpoint``: a
    label of the weights (path or "random seed N"), shown in reasons."""
    core = session.inner
    model_cfg = json.dumps(core.model.cfg.to_dict(), sort_keys=True)
    out: dict[str, Any] = {
        "model_config": hashlib.sha256(model_cfg.encode()).hexdigest()[:32],
        "weights": weights_fingerprint(core.model),
        "checkpoint": checkpoint,
        "stream": {k: _plain(getattr(core.cfg, k)) for k in STREAM_FIELDS if hasattr(core.cfg, k)},
        "with_depth": bool(core.step_options.with_depth),
    }
    long_cfg = session.long_cfg
    out["long_stream"] = None if long_cfg is None else {k: _plain(v) for k, v in
                                                         dataclasses.asdict(long_cfg).items()}
    return out


def _plain(v):
    return list(v) if isinstance(v, tuple) else v


__all__ = ["journal_identity", "weights_fingerprint", "STREAM_FIELDS"]
