"""Undistort camera images before the model (numpy path; torch ``grid_sample`` path, used on
the session's device by the engine when that is a GPU: ``model_input_torch``).

The model assumes a pinhole camera. When a ``sensor_msgs/CameraInfo`` carries a non-zero
distortion, every output pixel ``(u, v)`` of the undistorted image (intrinsics ``K_out``:
the camera's ``K`` unchanged, or the rectified ``P[:3, :3]``) is mapped to the pixel of
the distorted source image it came from:

    x = (u − cx' − s'·y) / fx',  y = (v − cy') / fy'         (normalised, z = 1)
    (x_d, y_d) = distort(x, y)                                (the model below)
    u_s = fx·x_d + s·y_d + cx,  v_s = fy·y_d + cy             (source pixel, camera K)

and the source is sampled there (bilinear; or nearest for depth images). Pixels are
addressed at their centres with integer coordinates (OpenCV / ROS convention);
samples outside the source read 0. The rectification rotation ``R`` of a stereo pair is
not applied (monocular: R = I).

Distortion models (``CameraInfo.distortion_model``, coefficients ``D`` in ROS order):

* ``plumb_bob`` (k1, k2, p1, p2, k3): with r² = x² + y²,
  radial = 1 + k1 r² + k2 r⁴ + k3 r⁶;
  x_d = x·radial + 2 p1 x y + p2 (r² + 2x²), y_d = y·radial + p1 (r² + 2y²) + 2 p2 x y;
* ``rational_polynomial`` (k1, k2, p1, p2, k3, k4, k5, k6): the same with
  radial = (1 + k1 r² + k2 r⁴ + k3 r⁶) / (1 + k4 r² + k5 r⁴ + k6 r⁶);
* ``equidistant`` (k1, k2, k3, k4; fisheye): θ = atan(r),
  θ_d = θ (1 + k1 θ² + k2 θ⁴ + k3 θ⁶ + k4 θ⁸), (x_d, y_d) = (θ_d / r)·(x, y).

The remap grid is built once per camera (``CameraModel`` is hashable; ``Undistorter``
keeps the last few grids). ``undistort_points`` inverts ``distort_points`` by Newton's
method (for tests, and for anyone who needs undistorted keypoints).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

DISTORTION_MODELS = ("plumb_bob", "rational_polynomial", "equidistant")
_COEFFS = {"plumb_bob": 5, "rational_polynomial": 8, "equidistant": 4}
INTERPOLATIONS = ("bilinear", "nearest")


# ----------------------------------------------------------------------------- point maths

def _coefficients(model: str, D: Sequence[float]) -> np.ndarray:
    """``D`` padded to the model's length (plumb_bob accepts 4 = k3 zero; trailing zeros
    beyond the length are accepted). Raises ValueError naming the problem."""
    if model not in _COEFFS:
        raise ValueError(f"distortion model {model!r} is not supported (one of {', '.join(DISTORTION_MODELS)})")
    d = np.asarray(D, dtype=np.float64).reshape(-1)
    n = _COEFFS[model]
    if not np.isfinite(d).all():
        raise ValueError(f"{model} distortion coefficients must be finite, got {d.tolist()}")
    shortest = 4 if model == "plumb_bob" else n
    if d.size < shortest or np.any(d[n:] != 0):
        raise ValueError(f"{model} needs {n} distortion coefficients, got {d.size}: {d.tolist()}")
    return np.concatenate([d[:n], np.zeros(max(0, n - d.size))])


def distort_points(model: str, D: Sequence[float], xy: np.ndarray) -> np.ndarray:
    """Normalised undistorted points [..., 2] (z = 1) → normalised distorted points [..., 2]."""
    d = _coefficients(model, D)
    xy = np.asarray(xy, dtype=np.float64)
    x, y = xy[..., 0], xy[..., 1]
    r2 = x * x + y * y
    if model == "equidistant":
        r = np.sqrt(r2)
        theta = np.arctan(r)
        t2 = theta * theta
        theta_d = theta * (1 + t2 * (d[0] + t2 * (d[1] + t2 * (d[2] + t2 * d[3]))))
        with np.errstate(invalid="ignore", divide="ignore"):
            factor = np.where(r > 1e-12, theta_d / r, 1.0)  # θ_d/r → 1 at the centre
        return np.stack([x * factor, y * factor], axis=-1)
    k1, k2, p1, p2, k3 = d[:5]
    radial = 1 + r2 * (k1 + r2 * (k2 + r2 * k3))
    if model == "rational_polynomial":
        radial = radial / (1 + r2 * (d[5] + r2 * (d[6] + r2 * d[7])))
    xd = x * radial + 2 * p1 * x * y + p2 * (r2 + 2 * x * x)
    yd = y * radial + p1 * (r2 + 2 * y * y) + 2 * p2 * x * y
    return np.stack([xd, yd], axis=-1)


def undistort_points(model: str, D: Sequence[float], xy_d: np.ndarray, iterations: int = 30,
                     tol: float = 1e-13) -> np.ndarray:
    """Invert ``distort_points``: normalised distorted points [..., 2] → undistorted.

    Newton's method from ``x = x_d`` with a central-difference Jacobian, per point.
    Converges where the distortion is monotonic along the ray (inside the calibrated
    field of view); points where it does not are NaN.
    """
    target = np.asarray(xy_d, dtype=np.float64)
    x = target.copy()
    h = 1e-7
    for _ in range(iterations):
        res = distort_points(model, D, x) - target
        if np.all(np.abs(res) < tol):
            break
        jac = np.stack([(distort_points(model, D, x + h * e) - distort_points(model, D, x - h * e)) / (2 * h)
                        for e in (np.array([1.0, 0.0]), np.array([0.0, 1.0]))], axis=-1)  # [..., 2 out, 2 in]
        a, b, c, e = jac[..., 0, 0], jac[..., 0, 1], jac[..., 1, 0], jac[..., 1, 1]
        det = a * e - b * c
        with np.errstate(invalid="ignore", divide="ignore"):
            step = np.stack([(e * res[..., 0] - b * res[..., 1]) / det, (a * res[..., 1] - c * res[..., 0]) / det], -1)
        x = x - step
    bad = ~(np.abs(distort_points(model, D, x) - target) < 1e-9).all(axis=-1)
    x[bad] = np.nan
    return x


# ----------------------------------------------------------------------------- camera

@dataclass(frozen=True)
class CameraModel:
    """The parts of a ``sensor_msgs/CameraInfo`` undistortion needs (hashable: a cache key).

    K, K_out: row-major 3×3 intrinsics in pixels (``K_out`` = the undistorted image's,
    default ``K``); D: coefficients in ROS order; width, height: image size in pixels.
    """

    width: int
    height: int
    K: tuple[float, ...]
    D: tuple[float, ...]
    model: str
    K_out: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.width, int) and isinstance(self.height, int) and self.width > 0 and self.height > 0):
            raise ValueError(f"camera size must be positive integers, got {self.width!r}x{self.height!r} "
                             "(an uncalibrated CameraInfo has 0x0)")
        for name in ("K", "K_out"):
            k = getattr(self, name)
            if k is None:
                continue
            k = np.asarray(k, dtype=np.float64)
            if k.size != 9 or not np.isfinite(k).all() or k[0] <= 0 or k[4] <= 0:
                raise ValueError(f"camera {name} must be 9 finite numbers with fx, fy > 0, got {k.tolist()}")
        if self.distorted:
            _coefficients(self.model, self.D)

    @classmethod
    def from_camera_info(cls, info: Any, use_projection: bool = False) -> CameraModel:
        """From a ``CameraInfo``-like object (fields ``width height k d distortion_model p``).

        ``use_projection``: the undistorted image gets ``P[:3, :3]`` (the calibration's
        rectified intrinsics) instead of ``K``.
        """
        k_out = None
        if use_projection:
            p = np.asarray(info.p, dtype=np.float64).reshape(3, 4)
            k_out = tuple(float(v) for v in p[:, :3].reshape(-1))
        return cls(int(info.width), int(info.height), tuple(float(v) for v in info.k),
                   tuple(float(v) for v in info.d), str(info.distortion_model), k_out)

    @property
    def distorted(self) -> bool:
        """Whether any distortion coefficient is non-zero."""
        return any(v != 0 for v in self.D)

    def intrinsics_out(self) -> np.ndarray:
        """[3, 3] intrinsics of the undistorted image (pixels)."""
        return np.asarray(self.K_out if self.K_out is not None else self.K, dtype=np.float64).reshape(3, 3)

    def check_image(self, height: int, width: int) -> None:
        """Raise ValueError when an image is not this camera's size."""
        if (height, width) != (self.height, self.width):
            raise ValueError(f"CameraInfo is {self.width}x{self.height} (WxH) but the image is {width}x{height}: "
                             "refusing to undistort with a calibration of another resolution")


def needs_undistortion(model: str, D: Sequence[float]) -> bool:
    """True when ``D`` has a non-zero coefficient (an empty ``D`` means none)."""
    return any(float(v) != 0 for v in D)


def source_pixels(camera: CameraModel) -> tuple[np.ndarray, np.ndarray]:
    """Remap grid: for each pixel of the undistorted image, the distorted source pixel.

    Returns:
        (map_x, map_y): [height, width] float64 source column / row coordinates.
    """
    k_out, k_in = camera.intrinsics_out(), np.asarray(camera.K, dtype=np.float64).reshape(3, 3)
    v, u = np.mgrid[0:camera.height, 0:camera.width].astype(np.float64)
    y = (v - k_out[1, 2]) / k_out[1, 1]
    x = (u - k_out[0, 2] - k_out[0, 1] * y) / k_out[0, 0]
    xd = distort_points(camera.model, camera.D, np.stack([x, y], axis=-1))
    map_x = k_in[0, 0] * xd[..., 0] + k_in[0, 1] * xd[..., 1] + k_in[0, 2]
    map_y = k_in[1, 1] * xd[..., 1] + k_in[1, 2]
    return map_x, map_y


# ----------------------------------------------------------------------------- sampling

@dataclass(frozen=True, eq=False)
class _Plan:
    """Gather plan: output pixel i = Σ_k weight[k, i] · source.flat[index[k, i]]."""

    index: np.ndarray  # [K, N] int32 flat source indices (clipped into the image)
    weight: np.ndarray  # [K, N] float32 (0 for neighbours outside the image)


def _bilinear_plan(map_x: np.ndarray, map_y: np.ndarray, height: int, width: int) -> _Plan:
    x0, y0 = np.floor(map_x), np.floor(map_y)
    fx, fy = map_x - x0, map_y - y0
    idx, wts = [], []
    for dy, dx, w in ((0, 0, (1 - fx) * (1 - fy)), (0, 1, fx * (1 - fy)), (1, 0, (1 - fx) * fy), (1, 1, fx * fy)):
        xs, ys = x0 + dx, y0 + dy
        inside = (xs >= 0) & (xs <= width - 1) & (ys >= 0) & (ys <= height - 1)
        flat = np.clip(ys, 0, height - 1).astype(np.int64) * width + np.clip(xs, 0, width - 1).astype(np.int64)
        idx.append(flat.reshape(-1).astype(np.int32))
        wts.append(np.where(inside, w, 0.0).reshape(-1))
    return _Plan(np.stack(idx), np.stack(wts).astype(np.float32))


def _nearest_plan(map_x: np.ndarray, map_y: np.ndarray, height: int, width: int) -> _Plan:
    xs, ys = np.rint(map_x), np.rint(map_y)
    inside = (xs >= 0) & (xs <= width - 1) & (ys >= 0) & (ys <= height - 1)
    flat = np.clip(ys, 0, height - 1).astype(np.int64) * width + np.clip(xs, 0, width - 1).astype(np.int64)
    return _Plan(flat.reshape(1, -1).astype(np.int32), inside.reshape(1, -1).astype(np.float32))


class UndistortMap:
    """The remap of one camera, applied to numpy images or torch tensors."""

    def __init__(self, camera: CameraModel) -> None:
        self.camera = camera
        self.map_x, self.map_y = source_pixels(camera)
        self._plans: dict[str, _Plan] = {}
        self._grids: dict[tuple[str, Any], Any] = {}
        self._divisors: dict[str, Any] = {}

    def _plan(self, interpolation: str) -> _Plan:
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
        if interpolation not in self._plans:
            build = _bilinear_plan if interpolation == "bilinear" else _nearest_plan
            self._plans[interpolation] = build(self.map_x, self.map_y, self.camera.height, self.camera.width)
        return self._plans[interpolation]

    def apply(self, image: np.ndarray, interpolation: str = "bilinear") -> np.ndarray:
        """Undistort an image [H, W] or [H, W, C] (any numeric dtype; integers are rounded
        and clipped back to their range). Nearest leaves values untouched (use it for
        depth: no blending across edges; invalid 0/NaN stay invalid)."""
        img = np.asarray(image)
        self.camera.check_image(*img.shape[:2])
        plan = self._plan(interpolation)
        src = img.reshape(img.shape[0] * img.shape[1], -1)
        if interpolation == "nearest":
            out = np.where(plan.weight[0][:, None] > 0, src[plan.index[0]], np.zeros((), dtype=img.dtype))
            return out.reshape(img.shape)
        acc = np.zeros(src.shape, dtype=np.float32 if img.dtype != np.float64 else np.float64)
        for k in range(plan.index.shape[0]):
            acc += plan.weight[k][:, None] * src[plan.index[k]]
        if np.issubdtype(img.dtype, np.integer):
            info = np.iinfo(img.dtype)
            acc = np.clip(np.rint(acc), info.min, info.max)
        return acc.astype(img.dtype).reshape(img.shape)

    def divisor(self, device: Any):
        """A [1, 1, 1] float32 tensor of 255 on ``device`` (cached): a tensor divisor divides exactly as
        the host does (a scalar one is turned into a multiplication by its reciprocal)."""
        import torch

        key = str(device)
        if key not in self._divisors:
            self._divisors[key] = torch.full((1, 1, 1), 255.0, dtype=torch.float32, device=device)
        return self._divisors[key]

    def grid(self, device: Any = "cpu", dtype: Any = None):
        """[1, H, W, 2] ``grid_sample`` grid (align_corners=True) on ``device``, cached."""
        import torch

        dtype = dtype or torch.float32
        key = (str(device), dtype)
        if key not in self._grids:
            w, h = self.camera.width, self.camera.height
            gx = 2.0 * self.map_x / max(w - 1, 1) - 1.0
            gy = 2.0 * self.map_y / max(h - 1, 1) - 1.0
            self._grids[key] = torch.from_numpy(np.stack([gx, gy], axis=-1)[None]).to(device=device, dtype=dtype)
        return self._grids[key]

    def apply_torch(self, image, interpolation: str = "bilinear"):
        """Undistort a tensor [C, H, W] or [B, C, H, W] on its own device (same maths as
        ``apply``: zeros outside; integer tensors are computed in float32 and rounded back)."""
        import torch
        import torch.nn.functional as F

        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
        if image.dim() not in (3, 4):
            raise ValueError(f"image tensor must be [C, H, W] or [B, C, H, W], got shape {tuple(image.shape)}")
        self.camera.check_image(image.shape[-2], image.shape[-1])
        batch = image if image.dim() == 4 else image[None]
        work = batch if batch.is_floating_point() else batch.float()
        grid = self.grid(work.device, work.dtype).expand(work.shape[0], -1, -1, -1)
        out = F.grid_sample(work, grid, mode=interpolation, padding_mode="zeros", align_corners=True)
        if not batch.is_floating_point():
            info = torch.iinfo(batch.dtype)
            out = out.round().clamp(info.min, info.max).to(batch.dtype)
        return out if image.dim() == 4 else out[0]


def model_input_torch(umap: UndistortMap, rgb: np.ndarray, width: int, device: Any):
    """Undistort and preprocess a uint8 RGB frame [H, W, 3] on ``device``: float32 [3, H', W'] in [0, 1],
    what ``io.preprocess.model_input(umap.apply(rgb), width)`` gives on the host, within one 8-bit
    count per pixel (see below), ready for ``StreamingSession.submit``.

    Steps, mirroring the host path: the bytes go to the device (page-locked on CUDA); bilinear
    remap (``apply_torch``), rounded to 8 bits as the host's uint8 undistorted image; when the
    frame is not the model's size, an antialiased bicubic resize to ``target_size`` (torch's
    ``antialias=True``, written after Pillow's filter) in Pillow's two passes, width then
    height, each rounded to 8 bits; the centre crop of rows; division by 255 with a tensor
    divisor (the host's float32 values). Differences from the host path: float vs Pillow's
    fixed-point filter weights, and float32 grid coordinates, move a pixel by a count at a
    rounding boundary (measured on CPU: 0.2 % of the values of a 640x360 frame to 518x294 differ
    by 1/255, one value by 2/255; ``test_undistort.py``).

    The resize stays a separate pass: one bilinear remap straight to the model width would
    sample 1 source pixel in 2.5 (1280 -> 518) and alias where Pillow's filter averages."""
    import torch
    import torch.nn.functional as F

    from ..io.preprocess import target_size

    img = np.asarray(rgb)
    if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"expected a uint8 RGB image [H, W, 3], got {img.dtype} {img.shape}")
    umap.camera.check_image(*img.shape[:2])
    device = torch.device(device)
    host = torch.from_numpy(np.ascontiguousarray(img))
    if device.type == "cuda":
        host = host.pin_memory()
    frame = host.to(device, non_blocking=True).permute(2, 0, 1)[None].float()  # [1, 3, H, W] in 0..255
    frame = umap.apply_torch(frame).round_().clamp_(0.0, 255.0)
    height, width_in = img.shape[:2]
    w_out, h_out = target_size(width_in, height, width)
    # Pillow resamples 8-bit images in two passes, columns then rows, rounding to 8 bits after each
    for size in ((height, w_out), (h_out, w_out)):
        if size != tuple(frame.shape[-2:]):
            frame = F.interpolate(frame, size=size, mode="bicubic", antialias=True, align_corners=False)
            frame = frame.round_().clamp_(0.0, 255.0)
    if h_out > w_out:  # centre crop of rows, as preprocess_pil
        top = (h_out - w_out) // 2
        frame = frame[:, :, top:top + w_out]
    return frame[0].contiguous().div_(umap.divisor(device))


class Undistorter:
    """Per-camera remap grids, built on first use and kept for the last ``max_cameras``.

    ``undistort(image, camera)`` returns ``image`` itself when the camera has no
    distortion; raises ValueError when the camera's size is not the image's.
    """

    def __init__(self, max_cameras: int = 4) -> None:
        if not (isinstance(max_cameras, int) and max_cameras >= 1):
            raise ValueError(f"max_cameras must be an integer >= 1, got {max_cameras!r}")
        self.max_cameras = max_cameras
        self._maps: OrderedDict[CameraModel, UndistortMap] = OrderedDict()

    def map_for(self, camera: CameraModel) -> UndistortMap:
        """The camera's ``UndistortMap`` (built once; least recently used evicted)."""
        if camera in self._maps:
            self._maps.move_to_end(camera)
            return self._maps[camera]
        log.info("building the undistortion map for a %dx%d %s camera", camera.width, camera.height, camera.model)
        umap = UndistortMap(camera)
        self._maps[camera] = umap
        while len(self._maps) > self.max_cameras:
            self._maps.popitem(last=False)
        return umap

    def undistort(self, image: np.ndarray, camera: CameraModel, interpolation: str = "bilinear") -> np.ndarray:
        """numpy image [H, W(, C)] → undistorted, same shape and dtype (see ``UndistortMap.apply``)."""
        img = np.asarray(image)
        camera.check_image(*img.shape[:2])
        if not camera.distorted:
            return image
        return self.map_for(camera).apply(img, interpolation)

    def model_input_torch(self, rgb: np.ndarray, camera: CameraModel, width: int, device: Any):
        """uint8 frame [H, W, 3] -> undistorted model input float32 [3, H', W'] on ``device``
        (``model_input_torch``); raises ValueError when the camera's size is not the image's."""
        camera.check_image(*np.asarray(rgb).shape[:2])
        return model_input_torch(self.map_for(camera), rgb, width, device)

    def undistort_torch(self, image, camera: CameraModel, interpolation: str = "bilinear"):
        """Tensor [C, H, W] / [B, C, H, W] → undistorted on its device (``UndistortMap.apply_torch``)."""
        camera.check_image(image.shape[-2], image.shape[-1])
        if not camera.distorted:
            return image
        return self.map_for(camera).apply_torch(image, interpolation)


__all__ = [
    "DISTORTION_MODELS",
    "CameraModel",
    "UndistortMap",
    "Undistorter",
    "distort_points",
    "model_input_torch",
    "needs_undistortion",
    "source_pixels",
    "undistort_points",
]
