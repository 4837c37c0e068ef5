"""Checkpoint reading and model construction.

Official checkpoints (``lingbot-map.pt``, ``lingbot-map-long.pt``) load unchanged:
a ``.pt`` file holding the state dict under ``"model"`` or bare, or a
``.safetensors`` file; a Hugging Face ``org/repo[/file]`` id is downloaded
through ``huggingface_hub`` where a network exists. A checkpoint that does not
fit the configuration is refused with the offending keys named.

Dtype policy (the reference's): the aggregator may run in bf16, the heads stay
float32.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Mapping

import torch
from torch import Tensor, nn

from ..config import ModelConfig
from ..model.lingbot import LingBotMap

log = logging.getLogger(__name__)

IGNORED_PREFIXES = ("point_head.",)  # present in some checkpoints, unused by this model
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(/[\w./-]+)?$")
DEFAULT_HUB_FILE = "lingbot-map.pt"
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".safetensors")


class CheckpointError(RuntimeError):
    """The checkpoint cannot be read or does not fit the model."""


def _resolve(source: str | Path) -> Path:
    """A local file, else a Hugging Face id (``hf://org/repo[/file]`` or ``org/repo[/file]``)."""
    path = Path(source).expanduser()
    if path.exists():
        return path
    text = str(source)
    explicit = text.startswith("hf://")
    text = text.removeprefix("hf://")
    parts = text.split("/")
    looks_like_hub = bool(_HUB_ID.match(text)) and not text.startswith((".", "/", "~")) and (
        explicit or len(parts) >= 3 or not parts[-1].endswith(CHECKPOINT_SUFFIXES))
    if not looks_like_hub:
        raise CheckpointError(f"checkpoint file not found: {path}")
    return _download(text)


def _download(hub_id: str) -> Path:
    parts = hub_id.split("/")
    repo_id, filename = "/".join(parts[:2]), "/".join(parts[2:]) or DEFAULT_HUB_FILE
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise CheckpointError(f"{hub_id!r} is neither a local file nor loadable: huggingface_hub is not "
                              "installed (pip install huggingface_hub), or pass a local path") from None
    try:
        return Path(hf_hub_download(repo_id=repo_id, filename=filename))
    except Exception as exc:  # network errors, missing repo/file, offline mode
        raise CheckpointError(f"cannot download {filename!r} from Hugging Face repo {repo_id!r}: "
                              f"{type(exc).__name__}: {exc}") from None


def read_state_dict(source: str | Path) -> dict[str, Tensor]:
    """Read a state dict from a .pt/.pth/.safetensors file or a Hugging Face id (on CPU)."""
    path = _resolve(source)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            obj = load_file(str(path))
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}") from None
    if isinstance(obj, Mapping) and "model" in obj and isinstance(obj["model"], Mapping):
        obj = obj["model"]
    if not isinstance(obj, Mapping) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise CheckpointError(f"checkpoint {path} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in obj.items()}


def _names(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def check_state_dict(model: nn.Module, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Return the usable entries of ``state`` or raise CheckpointError naming every misfit."""
    expected = model.state_dict()
    usable = {k: v for k, v in state.items() if not k.startswith(IGNORED_PREFIXES)}
    missing = [k for k in expected if k not in usable]
    unexpected = [k for k in usable if k not in expected]
    misshaped = [f"{k} {tuple(usable[k].shape)} != {tuple(v.shape)}" for k, v in expected.items()
                 if k in usable and usable[k].shape != v.shape]
    problems = []
    if missing:
        problems.append(f"missing keys: {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_names(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped: {_names(misshaped, 4)}")
    if problems:
        raise CheckpointError("checkpoint does not fit the model configuration; " + "; ".join(problems))
    return usable


@torch.no_grad()
def init_random_(model: LingBotMap, seed: int = 0) -> LingBotMap:
    """Deterministic random weights (benchmarks and tests without a checkpoint)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "gamma":
            value = torch.full(param.shape, 0.1)
        elif leaf == "bias":
            value = torch.zeros(param.shape)
        elif param.ndim == 1:  # norm weights
            value = torch.ones(param.shape)
        else:
            value = torch.randn(param.shape, generator=gen) * 0.02
        param.copy_(value.to(param.dtype))
    return model


def load_model(cfg: ModelConfig, checkpoint: str | Path | None = None, device: str | torch.device = "cpu",
               dtype: str = "fp32", seed: int = 0) -> LingBotMap:
    """Build the model on ``device``, load ``checkpoint`` (random weights when None), apply the dtype
    policy: ``bf16`` casts the aggregator to bfloat16, the heads stay float32. Returned in eval mode."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(f"device {device} requested but CUDA is not available")
    state = read_state_dict(checkpoint) if checkpoint is not None else None
    with torch.device(device):
        model = LingBotMap(cfg)
    if state is None:
        log.warning("no checkpoint given: the model has RANDOM weights; outputs are meaningless")
        init_random_(model, seed)
    else:
        model.load_state_dict(check_state_dict(model, state))
        log.info("loaded checkpoint %s (%d tensors)", checkpoint, len(state))
    if dtype == "bf16":
        model.aggregator.to(torch.bfloat16)
    elif dtype != "fp32":
        raise CheckpointError(f"dtype must be 'fp32' or 'bf16', got {dtype!r}")
    return model.eval().requires_grad_(False)
