"""Global place descriptors for the keyframe database (numpy only). Every descriptor is a float32
vector of fixed length, L2-normalised, compared by cosine similarity (``places``).

* ``token_descriptor``: pools the model's tokens of one frame ([N_tokens, C], the patch or camera
  tokens handed over as numpy) into one vector: the mean and the GeM (generalised mean, power p)
  of the tokens, each L2-normalised, concatenated [2C], then a fixed random projection to
  ``dim`` (a seeded Gaussian matrix with orthonormal rows: distances are kept up to a small
  distortion, and every process with the same seed builds the same matrix).
* ``gradient_descriptor``: a classical image descriptor for comparison: the grey image resized to
  a fixed size by area averaging, gradient orientations (unsigned, ``bins`` bins, soft-assigned)
  weighted by magnitude and pooled over a ``grid`` of cells, square-rooted, each cell
  L2-normalised (brightness and contrast drop out), then the whole vector.
* ``thumbnail_descriptor``: the simplest baseline, a tiny zero-mean grey thumbnail.

Measured on real frames in ``benchmarks/slam/place_recall.py``.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

EPS = 1e-12


def _unit(vec: np.ndarray) -> np.ndarray:
    return vec / max(float(np.linalg.norm(vec)), EPS)


@lru_cache(maxsize=8)
def projection(in_dim: int, dim: int, seed: int) -> np.ndarray:
    """[dim, in_dim] float64 random projection with orthonormal rows (or columns when dim > in_dim)."""
    gauss = np.random.default_rng(seed).standard_normal((max(dim, in_dim), min(dim, in_dim)))
    q, r = np.linalg.qr(gauss)
    q = q * np.sign(np.diag(r))  # a unique Q for the seed
    out = q.T if dim <= in_dim else q
    out.setflags(write=False)
    return out


def token_descriptor(tokens, dim: int = 256, p: float = 3.0, seed: int = 0) -> np.ndarray:
    """Pool one frame's tokens into a place descriptor.

    Args:
        tokens: [N, C] float tokens (patch or camera tokens of one frame), N ≥ 1, finite.
        dim: output length.
        p: GeM power (1 = mean of |x|, large = max of |x|), > 0.
        seed: of the random projection (keep it fixed for one database).

    Returns:
        [dim] float32, L2-normalised.
    """
    x = np.asarray(tokens, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"tokens must be [N, C] with N, C >= 1, got {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("tokens have non-finite values")
    if not (dim >= 1 and math.isfinite(p) and p > 0):
        raise ValueError(f"need dim >= 1 and p > 0, got dim={dim!r}, p={p!r}")
    gem = np.mean(np.abs(x) ** p, axis=0) ** (1.0 / p)
    feat = np.concatenate([_unit(x.mean(axis=0)), _unit(gem)])
    return _unit(projection(feat.size, dim, seed) @ feat).astype(np.float32)


def grey(image) -> np.ndarray:
    """[H, W] float64 in [0, 1] from an [H, W, 3] RGB or [H, W] image (uint8 or float in [0, 1])."""
    img = np.asarray(image)
    if img.ndim == 3 and img.shape[2] == 3:
        img = img.astype(np.float64) @ np.array([0.299, 0.587, 0.114])
    elif img.ndim != 2:
        raise ValueError(f"image must be [H, W, 3] or [H, W], got {img.shape}")
    img = img.astype(np.float64)
    if np.asarray(image).dtype == np.uint8:
        img = img / 255.0
    if not np.isfinite(img).all():
        raise ValueError("image has non-finite values")
    return img


def area_resize(img: np.ndarray, height: int, width: int) -> np.ndarray:
    """Box-filter resize of [H, W] to [height, width] (each output pixel the mean of its source
    box, boxes rounded to whole pixels, at least one pixel each)."""
    h, w = img.shape
    if h < 1 or w < 1:
        raise ValueError(f"image is empty: {img.shape}")
    integral = np.zeros((h + 1, w + 1))
    integral[1:, 1:] = img.cumsum(0).cumsum(1)
    r = np.floor(np.linspace(0, h, height + 1)).astype(int)
    c = np.floor(np.linspace(0, w, width + 1)).astype(int)
    r1, c1 = np.maximum(r[1:], r[:-1] + 1), np.maximum(c[1:], c[:-1] + 1)
    r1, c1 = np.minimum(r1, h), np.minimum(c1, w)
    r0, c0 = np.minimum(r[:-1], r1 - 1), np.minimum(c[:-1], c1 - 1)
    total = (integral[r1][:, c1] - integral[r0][:, c1] - integral[r1][:, c0] + integral[r0][:, c0])
    return total / np.outer(r1 - r0, c1 - c0)


def gradient_descriptor(image, grid: tuple[int, int] = (4, 8), bins: int = 8,
                        size: tuple[int, int] = (72, 128)) -> np.ndarray:
    """Gradient-orientation histograms over a grid of cells (module text).

    Args:
        image: [H, W, 3] RGB or [H, W] grey, uint8 or float in [0, 1].
        grid: (rows, columns) of cells.
        bins: orientation bins over [0, π).
        size: (height, width) the image is resized to first (multiples of the grid).

    Returns:
        [rows·columns·bins] float32, L2-normalised.
    """
    rows, cols = grid
    height, width = size
    if rows < 1 or cols < 1 or bins < 2 or height % rows or width % cols:
        raise ValueError(f"need grid >= 1, bins >= 2 and size a multiple of the grid; got grid={grid}, "
                         f"bins={bins}, size={size}")
    img = area_resize(grey(image), height, width)
    gx, gy = np.zeros_like(img), np.zeros_like(img)
    gx[:, 1:-1] = img[:, 2:] - img[:, :-2]
    gy[1:-1, :] = img[2:, :] - img[:-2, :]
    mag = np.hypot(gx, gy)
    pos = (np.arctan2(gy, gx) % math.pi) / math.pi * bins - 0.5  # bin centres at 0..bins-1
    low = np.floor(pos)
    frac = pos - low
    hist = np.zeros((rows, cols, bins))
    cell_r = np.arange(height) // (height // rows)
    cell_c = np.arange(width) // (width // cols)
    cr, cc = np.broadcast_arrays(cell_r[:, None], cell_c[None, :])
    for offset, weight in ((0, 1.0 - frac), (1, frac)):
        b = (low.astype(int) + offset) % bins
        np.add.at(hist, (cr, cc, b), mag * weight)
    hist = np.sqrt(hist)
    hist -= hist.mean(axis=2, keepdims=True)  # the orientation-free part (texture energy) out
    hist /= np.maximum(np.linalg.norm(hist, axis=2, keepdims=True), 1e-6)
    return _unit(hist.reshape(-1)).astype(np.float32)


def thumbnail_descriptor(image, size: tuple[int, int] = (12, 16)) -> np.ndarray:
    """Zero-mean grey thumbnail of ``size`` (height, width), L2-normalised: [h·w] float32."""
    thumb = area_resize(grey(image), *size)
    return _unit((thumb - thumb.mean()).reshape(-1)).astype(np.float32)
