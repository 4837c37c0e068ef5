"""Typed configuration: the model architecture, the streaming policy and the long-stream
windows (``LongStreamConfig``).

All are frozen dataclasses that validate themselves and name the bad value.
Field names follow the released configuration (SPEC §1) and the fixture
``config.json`` so that a JSON file of either can be loaded unchanged.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping

SPECIAL_TOKENS = 6  # [camera, register x4, scale] prepended to every frame
HEAD_DIM = 64  # aggregator head width; the 3D RoPE split (20/22/22) needs exactly 64


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent."""


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the LingBot-Map streaming model (defaults = released checkpoints)."""

    img_size: int = 518
    patch_size: int = 14
    dino_dim: int = 1024
    dino_depth: int = 24
    dino_heads: int = 16
    num_register_tokens: int = 4
    embed_dim: int = 1024
    depth: int = 24
    num_heads: int = 16
    intermediate_layer_idx: tuple[int, ...] = (4, 11, 17, 23)
    camera_dim: int = 2048
    camera_trunk_depth: int = 4
    camera_num_heads: int = 16
    dpt_features: int = 256
    dpt_out_channels: tuple[int, ...] = (256, 512, 1024, 1024)
    max_frame_num: int = 1024
    mlp_ratio: float = 4.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "intermediate_layer_idx", tuple(int(i) for i in self.intermediate_layer_idx))
        object.__setattr__(self, "dpt_out_channels", tuple(int(c) for c in self.dpt_out_channels))
        for name in ("img_size", "patch_size", "dino_dim", "dino_depth", "dino_heads", "embed_dim", "depth",
                     "num_heads", "camera_dim", "camera_trunk_depth", "camera_num_heads", "dpt_features",
                     "max_frame_num"):
            _require(int(getattr(self, name)) > 0, f"{name} must be positive, got {getattr(self, name)!r}")
        _require(self.img_size % self.patch_size == 0,
                 f"img_size {self.img_size} is not a multiple of patch_size {self.patch_size}")
        _require(self.dino_dim % self.dino_heads == 0,
                 f"dino_dim {self.dino_dim} is not divisible by dino_heads {self.dino_heads}")
        _require(self.embed_dim == self.dino_dim, f"embed_dim {self.embed_dim} must equal dino_dim {self.dino_dim}")
        _require(self.embed_dim == self.num_heads * HEAD_DIM,
                 f"embed_dim {self.embed_dim} / num_heads {self.num_heads} must give head_dim {HEAD_DIM}")
        _require(self.camera_dim == 2 * self.embed_dim,
                 f"camera_dim {self.camera_dim} must be 2 * embed_dim ({2 * self.embed_dim})")
        _require(self.camera_dim % self.camera_num_heads == 0,
                 f"camera_dim {self.camera_dim} is not divisible by camera_num_heads {self.camera_num_heads}")
        _require(len(self.intermediate_layer_idx) == 4,
                 f"intermediate_layer_idx needs 4 entries, got {self.intermediate_layer_idx}")
        _require(all(0 <= i < self.depth for i in self.intermediate_layer_idx)
                 and list(self.intermediate_layer_idx) == sorted(set(self.intermediate_layer_idx)),
                 f"intermediate_layer_idx {self.intermediate_layer_idx} must be increasing and < depth {self.depth}")
        _require(len(self.dpt_out_channels) == 4, f"dpt_out_channels needs 4 entries, got {self.dpt_out_channels}")
        _require(self.dpt_features % 2 == 0 and (self.dpt_features // 2) % 4 == 0,
                 f"dpt_features {self.dpt_features} must be a multiple of 8")
        _require(all(c % 4 == 0 for c in self.dpt_out_channels),
                 f"dpt_out_channels {self.dpt_out_channels} must be multiples of 4")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def pos_grid(self) -> int:
        """Side of DINO's square position-embedding grid (37 for 518/14)."""
        return self.img_size // self.patch_size

    def tokens_per_frame(self, height: int, width: int) -> int:
        return SPECIAL_TOKENS + (height // self.patch_size) * (width // self.patch_size)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelConfig":
        """Build from a mapping; keys that are not model fields (streaming settings, notes) are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(load_json(path))

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[name]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PRESETS: dict[str, ModelConfig] = {
    "lingbot-map": ModelConfig(),
    "tiny": ModelConfig(dino_dim=128, dino_depth=2, dino_heads=2, embed_dim=128, depth=6, num_heads=2,
                        intermediate_layer_idx=(1, 3, 4, 5), camera_dim=256, camera_trunk_depth=2,
                        camera_num_heads=4, dpt_features=32, dpt_out_channels=(16, 32, 64, 64)),
}

FA3_TILES = (128, 192, 2)  # query rows, keys, pipeline stages of the project-built FA3 kernel (kernels.fa3_tiles)


def check_fa3_tiles(tiles: Any) -> tuple[int, int, int]:
    """``tiles`` as a (query rows, keys, stages) tuple of ints, or ConfigError naming the bad
    value: rows and keys multiples of 64 in [64, 256], 2 or 3 pipeline stages."""
    values = tuple(tiles) if isinstance(tiles, (tuple, list)) else ()
    _require(len(values) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in values),
             f"fa3_tiles must be 3 integers (query rows, keys, stages), e.g. {FA3_TILES}, got {tiles!r}")
    q, kv, stages = values
    _require(q % 64 == 0 and 64 <= q <= 256 and kv % 64 == 0 and 64 <= kv <= 256 and stages in (2, 3),
             f"fa3_tiles {tiles!r}: query rows and keys must be multiples of 64 in [64, 256] and stages 2 or 3")
    return q, kv, stages


def parse_fa3_tiles(text: str) -> tuple[int, int, int]:
    """'128x192x2' (query rows x keys x pipeline stages; any case of x) -> (128, 192, 2), for
    command-line flags; ConfigError naming the text otherwise."""
    parts = text.strip().lower().split("x")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(f"FA3 tiles must look like 128x192x2 (query rows x keys x pipeline stages), got {text!r}")
    return check_fa3_tiles(tuple(int(p) for p in parts))


BACKENDS = ("auto", "sdpa", "flashinfer", "flashinfer-fa2", "flashinfer-fa2-paged", "flashinfer-fa3",
            "flashinfer-fa3-paged", "flashinfer-fa3-stock")
DTYPES = ("fp32", "bf16")
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")  # StreamConfig.kv_cache_dtype (cache.fp8 for fp8)
PRECISIONS = ("bf16", "fp8")  # StreamConfig.precision (kernels.fp8_gemm for fp8)


@dataclass(frozen=True)
class StreamConfig:
    """How frames are streamed through the model and how the paged cache is managed.

    ``num_scale_frames`` frames are processed together first (phase 1) and their
    patch pages are pinned; afterwards one frame per step, keyframes stored into a
    FIFO window of ``sliding_window`` frames. Frame ``i`` (0-based, since reset) is
    a keyframe when ``(i - num_scale_frames) % keyframe_interval == 0``.
    ``max_pending_evictions`` bounds how far the window may grow while eviction is
    deferred (it sizes the page pool). ``cuda_graphs`` replays the one-frame phase-2
    step from a CUDA graph (CUDA with a FlashInfer backend, or ``sdpa`` on a GPU of sm_80
    or later with a bf16 pool; elsewhere ignored).
    ``kv_splits`` splits each global-attention call over that many runs of keys
    (FlashInfer FA3 and FA2, ``sdpa`` on a GPU; 0 = chosen from the GPU's SM count). ``fused_kernels`` runs the
    Triton kernels of ``lingbot_map_ros.kernels`` where they apply (CUDA, bf16).
    ``bf16_depth_head`` runs the DPT depth head's convolutions in bf16, channels-last,
    when the stream runs in bf16 on CUDA (the reference keeps the heads in float32).
    ``bf16_camera_head`` likewise gives the camera head bf16 weights (its activations
    and sums stay float32), read by the ``kernels.gemv`` kernel (so only where
    ``fused_kernels`` applies). ``parallel_heads`` runs the camera head on a
    second CUDA stream, concurrently with the depth head (CUDA only; same results).
    ``fa3_tiles``: (query rows, keys, pipeline stages) of the project-built FA3 attention
    kernel that backend ``flashinfer-fa3`` compiles (Hopper, bf16; a tuning knob).
    ``kv_cache_dtype``: how the K/V pages are stored: ``auto``/``bf16`` in the stream's dtype,
    ``fp8`` in float8 e4m3 with a scale per token and head, read through a dequantised
    one-layer buffer (``cache.fp8``; about half the cache's memory, single camera only).
    ``precision``: ``fp8`` runs the aggregator's projections and MLPs (qkv, proj, fc1, fc2 of
    every DINO, frame and global block) as FP8 GEMMs with row-wise scales (``kernels.fp8_gemm``;
    the model's linears are converted in place when the session is made); ``bf16``: as loaded.
    """

    num_scale_frames: int = 8
    sliding_window: int = 64
    keyframe_interval: int = 1
    camera_iterations: int = 4
    deferred_eviction: bool = False
    max_pending_evictions: int = 8
    backend: str = "auto"
    dtype: str = "fp32"
    device: str = "cpu"
    cuda_graphs: bool = True
    kv_splits: int = 0
    fused_kernels: bool = True
    bf16_depth_head: bool = True
    bf16_camera_head: bool = True
    parallel_heads: bool = True
    fa3_tiles: tuple[int, int, int] = FA3_TILES
    kv_cache_dtype: str = "auto"
    precision: str = "bf16"

    def __post_init__(self) -> None:
        object.__setattr__(self, "fa3_tiles", check_fa3_tiles(self.fa3_tiles))
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _require(self.precision in PRECISIONS, f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        _require(self.kv_cache_dtype != "bf16" or self.dtype == "bf16",
                 f"kv_cache_dtype 'bf16' needs dtype 'bf16' (the stream runs in {self.dtype}); use 'auto' or 'fp8'")
        _require(self.num_scale_frames >= 1, f"num_scale_frames must be >= 1, got {self.num_scale_frames}")
        _require(self.sliding_window >= 1, f"sliding_window must be >= 1, got {self.sliding_window}")
        _require(self.keyframe_interval >= 1, f"keyframe_interval must be >= 1, got {self.keyframe_interval}")
        _require(self.camera_iterations >= 1, f"camera_iterations must be >= 1, got {self.camera_iterations}")
        _require(self.max_pending_evictions >= 0,
                 f"max_pending_evictions must be >= 0, got {self.max_pending_evictions}")
        _require(isinstance(self.kv_splits, int) and 0 <= self.kv_splits <= 64,
                 f"kv_splits must be an integer in 0..64 (0 = automatic), got {self.kv_splits!r}")
        _require(self.backend in BACKENDS, f"backend must be one of {BACKENDS}, got {self.backend!r}")
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(isinstance(self.device, str) and self.device.split(":")[0] in ("cpu", "cuda"),
                 f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StreamConfig":
        """Streaming fields of a mapping (e.g. the fixture config.json); other keys are ignored."""
        aliases = {"camera_num_iterations": "camera_iterations"}
        names = {f.name for f in fields(cls)}
        out: dict[str, Any] = {}
        for key, value in data.items():
            key = aliases.get(key, key)
            if key in names:
                out[key] = value
        return cls(**out)

    def with_overrides(self, **overrides: Any) -> "StreamConfig":
        """A copy with the given fields replaced; ``None`` values are ignored."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


KEYFRAME_POLICIES = ("interval", "motion")  # LongStreamConfig.keyframe_policy


@dataclass(frozen=True)
class LongStreamConfig:
    """Windowed restarts and keyframe selection for unbounded streams.

    window_frames: stored frames per window; storing one more restarts the cache.
        Must stay below the model's ``max_frame_num`` (the released model was trained
        on ~320 cached views, hence the default).
    overlap_frames: keyframes carried into the next window, re-fed as its first frames;
        None = ``num_scale_frames``. At least ``num_scale_frames`` (they refill phase 1),
        at most ``num_scale_frames + sliding_window`` (no eviction while re-feeding).
    keyframe_policy: "interval" (``StreamConfig.keyframe_interval``) or "motion".
    motion_min_translation: camera-centre distance (global model units) from the last
        keyframe that makes the next frame a keyframe; 0 disables the criterion.
    motion_min_rotation_deg: rotation (degrees) from the last keyframe that makes the
        next frame a keyframe; 0 disables the criterion.
    auto_restart: restart automatically when the window is full; otherwise a full
        window attends only until ``restart()`` or ``reset()``.
    """

    window_frames: int = 320
    overlap_frames: int | None = None
    keyframe_policy: str = "interval"
    motion_min_translation: float = 0.05
    motion_min_rotation_deg: float = 5.0
    auto_restart: bool = True

    def __post_init__(self) -> None:
        _require(isinstance(self.window_frames, int) and self.window_frames >= 2,
                 f"window_frames must be an integer >= 2, got {self.window_frames!r}")
        _require(self.overlap_frames is None or (isinstance(self.overlap_frames, int) and self.overlap_frames >= 1),
                 f"overlap_frames must be None or an integer >= 1, got {self.overlap_frames!r}")
        _require(self.overlap_frames is None or self.overlap_frames < self.window_frames,
                 f"overlap_frames {self.overlap_frames} must be smaller than window_frames {self.window_frames}")
        _require(self.keyframe_policy in KEYFRAME_POLICIES,
                 f"keyframe_policy must be one of {KEYFRAME_POLICIES}, got {self.keyframe_policy!r}")
        for name in ("motion_min_translation", "motion_min_rotation_deg"):
            value = getattr(self, name)
            _require(isinstance(value, (int, float)) and math.isfinite(value) and value >= 0,
                     f"{name} must be a finite number >= 0, got {value!r}")
        _require(self.keyframe_policy != "motion" or self.motion_min_translation > 0
                 or self.motion_min_rotation_deg > 0,
                 "keyframe_policy 'motion' needs motion_min_translation > 0 or motion_min_rotation_deg > 0")

    def overlap_for(self, stream: StreamConfig) -> int:
        return stream.num_scale_frames if self.overlap_frames is None else self.overlap_frames

    def check(self, stream: StreamConfig, max_frame_num: int) -> None:
        """Raise ConfigError unless these settings fit the stream and the model's horizon."""
        overlap = self.overlap_for(stream)
        _require(self.window_frames < max_frame_num,
                 f"window_frames {self.window_frames} must be below the model's max_frame_num {max_frame_num}")
        _require(stream.num_scale_frames <= overlap <= stream.num_scale_frames + stream.sliding_window,
                 f"overlap_frames {overlap} must be between num_scale_frames ({stream.num_scale_frames}) and "
                 f"num_scale_frames + sliding_window ({stream.num_scale_frames + stream.sliding_window})")
        _require(overlap < self.window_frames,
                 f"overlap_frames {overlap} must be smaller than window_frames {self.window_frames}")


def load_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"configuration file not found: {path}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read configuration {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"configuration {path} must hold a JSON object")
    return data


__all__ = ["ModelConfig", "StreamConfig", "LongStreamConfig", "ConfigError", "PRESETS", "SPECIAL_TOKENS", "HEAD_DIM",
           "KEYFRAME_POLICIES", "FA3_TILES", "check_fa3_tiles", "parse_fa3_tiles", "load_json"]
