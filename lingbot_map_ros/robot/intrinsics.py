"""The model's focal-length estimate next to the camera's calibration (for /diagnostics).

The model predicts a field of view per frame, turned into intrinsics ``K_m`` at the model
input resolution ``(w_m, h_m)`` (principal point at the centre: only the focal lengths are
estimated). The input image ``(w_in, h_in)`` was resized to ``w_m × h_r``
(``io.preprocess.target_size``: ``h_r`` = the height rounded to whole patches) and, when
``h_r > w_m``, cropped to ``w_m`` rows; a crop does not change the focal length. So, in the
input image's pixels:

    fx_in = fx_m · w_in / w_m          fy_in = fy_m · h_in / h_r

(the two ratios differ slightly because ``h_r`` is rounded). ``FocalTracker`` keeps the
last frames' ``(fx_in, fy_in)`` and compares their median with ``CameraInfo.k``
(after undistortion the model sees an image with the calibration's own ``K``). The
warning threshold is a hint for a wrong ``camera_info`` or a resized image, not a
calibrated bound on the model's error.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..io.preprocess import target_size

FOCAL_WINDOW = 30  # frames whose median is compared
WARN_FRACTION = 0.25  # relative focal difference above which the comparison says "warn"


def focal_in_input_pixels(K_model: np.ndarray, model_size: tuple[int, int],
                          input_size: tuple[int, int]) -> tuple[float, float]:
    """(fx, fy) of the model's [3, 3] intrinsics at ``model_size`` (w, h) in pixels of the input
    image of ``input_size`` (w, h) the frame was preprocessed from."""
    K = np.asarray(K_model, dtype=np.float64)
    w_m, _ = model_size
    w_in, h_in = input_size
    _, h_r = target_size(w_in, h_in, w_m)
    return float(K[0, 0] * w_in / w_m), float(K[1, 1] * h_in / h_r)


@dataclass(frozen=True)
class IntrinsicsComparison:
    """Median model focal lengths over the last ``frames`` frames vs the calibration's (input pixels)."""

    fx_model: float
    fy_model: float
    fx_camera: float
    fy_camera: float
    frames: int
    problem: str = ""  # set when the two cannot be compared (then the numbers are NaN where unknown)

    @property
    def fx_error(self) -> float:
        """(model − camera) / camera for fx; NaN when not comparable."""
        return (self.fx_model - self.fx_camera) / self.fx_camera if not self.problem else float("nan")

    @property
    def fy_error(self) -> float:
        return (self.fy_model - self.fy_camera) / self.fy_camera if not self.problem else float("nan")

    @property
    def warn(self) -> bool:
        """The model's median focal length is more than ``WARN_FRACTION`` off the calibration's."""
        return not self.problem and max(abs(self.fx_error), abs(self.fy_error)) > WARN_FRACTION

    def message(self) -> str:
        if self.problem:
            return self.problem
        worst = max(abs(self.fx_error), abs(self.fy_error))
        if self.warn:
            return (f"model focal length {100 * worst:.0f} % off camera_info's (more than {100 * WARN_FRACTION:.0f} "
                    "%): check camera_info's K and that it belongs to these images")
        return f"model focal length within {100 * worst:.0f} % of camera_info's"

    def values(self) -> dict[str, str]:
        """/diagnostics key/values (input image pixels)."""
        def f(v: float, fmt: str = ".1f") -> str:
            return format(v, fmt) if np.isfinite(v) else "n/a"

        return {"camera_info fx (px)": f(self.fx_camera), "camera_info fy (px)": f(self.fy_camera),
                f"model fx, median of the last {self.frames} frames (px)": f(self.fx_model),
                f"model fy, median of the last {self.frames} frames (px)": f(self.fy_model),
                "fx difference (%)": f(100 * self.fx_error, "+.1f"),
                "fy difference (%)": f(100 * self.fy_error, "+.1f")}


class FocalTracker:
    """The model's focal lengths of the last ``window`` frames in input pixels (engine thread
    adds, any thread compares: a deque append and a copy are atomic enough for a report)."""

    def __init__(self, window: int = FOCAL_WINDOW) -> None:
        self._focal: deque[tuple[float, float]] = deque(maxlen=window)
        self.input_size: tuple[int, int] | None = None  # (w, h) of the last frame's input image

    def add(self, K_model: np.ndarray, model_size: tuple[int, int], input_size: tuple[int, int]) -> None:
        """One processed frame: model intrinsics [3, 3] at ``model_size`` (w, h), input image (w, h)."""
        self._focal.append(focal_in_input_pixels(K_model, model_size, input_size))
        self.input_size = (int(input_size[0]), int(input_size[1]))

    def clear(self) -> None:
        self._focal.clear()
        self.input_size = None

    def __len__(self) -> int:
        return len(self._focal)

    def median(self) -> tuple[float, float] | None:
        focal = list(self._focal)
        if not focal:
            return None
        fx, fy = np.median(np.asarray(focal), axis=0)
        return float(fx), float(fy)

    def compare(self, camera_K: Sequence[float] | np.ndarray, camera_size: tuple[int, int]) -> IntrinsicsComparison:
        """Compare with a calibration: ``camera_K`` 9 numbers (row-major ``CameraInfo.k``) for
        images of ``camera_size`` (w, h)."""
        K = np.asarray(camera_K, dtype=np.float64).reshape(-1)
        nan = float("nan")
        fx_c, fy_c = (float(K[0]), float(K[4])) if K.size == 9 else (nan, nan)
        median, size = self.median(), self.input_size
        frames = len(self._focal)
        if not (K.size == 9 and np.isfinite(K).all() and fx_c > 0 and fy_c > 0):
            return IntrinsicsComparison(nan, nan, fx_c, fy_c, frames, "camera_info has no usable K")
        if median is None or size is None:
            return IntrinsicsComparison(nan, nan, fx_c, fy_c, 0, "no frame processed yet")
        if tuple(camera_size) != size:
            return IntrinsicsComparison(*median, fx_c, fy_c, frames,
                                        f"not comparable: camera_info is {camera_size[0]}x{camera_size[1]}, the images "
                                        f"are {size[0]}x{size[1]}")
        return IntrinsicsComparison(*median, fx_c, fy_c, frames)


__all__ = ["FOCAL_WINDOW", "WARN_FRACTION", "FocalTracker", "IntrinsicsComparison", "focal_in_input_pixels"]
