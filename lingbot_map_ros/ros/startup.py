"""What the node does once, before it serves frames: the model and a session per camera
(``load_sessions``: the memory check, the checkpoint, one ``stream.multi.CameraSessions``; a managed
node's cleanup gives the memory back with ``release_memory``), the
library's log records forwarded to the node's logger, and the Fast DDS profile check."""
from __future__ import annotations

import gc
import logging
import os
import sys
import time
from typing import Any

from ..config import ConfigError
from ..runtime.params import NodeSettings


class StartupError(RuntimeError):
    """The node cannot start; the message says why (logged as one line, exit status 1)."""


class ForwardToRos(logging.Handler):
    """Sends the library's Python log records (model loading, cache sizes) to the node's logger."""

    def __init__(self, logger) -> None:
        super().__init__()
        self._logger = logger

    def emit(self, record: logging.LogRecord) -> None:
        text = f"[{record.name.rsplit('.', 1)[-1]}] {record.getMessage()}"
        level = record.levelno
        # One call site per severity: rclpy refuses a call site whose severity changes between calls.
        if level >= logging.ERROR:
            self._logger.error(text)
        elif level >= logging.WARNING:
            self._logger.warning(text)
        elif level >= logging.INFO:
            self._logger.info(text)
        else:
            self._logger.debug(text)


def check_memory(settings: NodeSettings, cameras: list[NodeSettings], log) -> None:
    """Refuse (MemoryBudgetError, a ConfigError) a configuration whose estimated GPU memory exceeds
    the device's free memory or ``gpu_memory_budget_gib`` (``stream.memory``); the largest
    camera's settings stand for all."""
    from ..stream.memory import check_fits

    if not settings.gpu_memory_check:
        return
    s = max(cameras, key=lambda c: (c.image_width, c.stream.sliding_window + c.stream.num_scale_frames))
    est = check_fits(s.model, s.stream, s.image_width, cameras=len(cameras), budget_gib=settings.gpu_memory_budget_gib)
    if est is not None:
        log.info(f"GPU memory estimate: {est.describe()}" + (
            f" per camera's K/V, {len(cameras)} cameras" if len(cameras) > 1 else ""))


def load_sessions(settings: NodeSettings, camera_settings: dict[str, NodeSettings], log) -> Any:
    """The one place the model is built: the memory check, the weights on the device, a session per
    camera (``CameraSessions``: one camera has a pool of its own, several share one K/V storage).
    StartupError with the reason when it cannot be."""
    from ..io.checkpoint import CheckpointError, load_model
    from ..stream import BackendUnavailable
    from ..stream.multi import CameraSessions

    s = settings
    t0 = time.perf_counter()
    try:
        check_memory(s, list(camera_settings.values()), log)
        if s.checkpoint is None:
            log.warning("checkpoint is empty: the model has RANDOM weights (seed "
                        f"{s.seed}); poses, depth and points are MEANINGLESS. Set the checkpoint "
                        "parameter to a .pt/.safetensors file or a Hugging Face id.")
        model = load_model(s.model, s.checkpoint, s.stream.device, s.stream.dtype, seed=s.seed)
        sessions = CameraSessions(model, {name: (cs.stream, cs.long_stream) for name, cs in camera_settings.items()})
    except (CheckpointError, BackendUnavailable, ConfigError, ValueError) as exc:
        raise StartupError(str(exc)) from None
    cameras = f" for {len(s.cameras)} cameras: {', '.join(s.cameras)}" if s.cameras else ""
    log.info(f"model loaded in {time.perf_counter() - t0:.1f} s "
             f"({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters){cameras}")
    return sessions


def release_memory() -> None:
    """After the model and sessions were dropped: collect them (objects frozen out of the collector's
    reach by ``runtime.engine`` after the first frame are unfrozen first, or a cycle through them would
    keep the model alive) and give CUDA's cached blocks back to the device."""
    gc.unfreeze()
    gc.collect()
    torch = sys.modules.get("torch")  # imported by the model's loading; nothing to give back without it
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def fastdds_without_profile() -> bool:
    """True when the RMW is Fast DDS (the default) and no XML profile is configured."""
    rmw = os.environ.get("RMW_IMPLEMENTATION", "") or "rmw_fastrtps_cpp"
    profile = os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE") or os.environ.get("FASTRTPS_DEFAULT_PROFILES_FILE")
    return rmw.startswith("rmw_fastrtps") and not profile


FASTDDS_WARNING = ("FASTDDS_DEFAULT_PROFILES_FILE is not set: with Fast DDS a raw image over 512 KB (518x378 RGB and "
                   "larger) travels as UDP fragments and is often lost on a best-effort subscription. Start the camera "
                   "driver (and this node) with FASTDDS_DEFAULT_PROFILES_FILE=<share>/lingbot_map_ros/config/"
                   "fastdds_large_messages.xml (the launch file sets it for the node), or use compressed input")

__all__ = ["StartupError", "ForwardToRos", "check_memory", "load_sessions", "release_memory", "fastdds_without_profile",
           "FASTDDS_WARNING"]
