"""A camera frame -> what the session takes: ``ModelInput`` (undistortion, resize, crop).

The model assumes a pinhole camera: a frame whose camera (``InputFrame.camera``, from the
latest CameraInfo) is distorted is undistorted first (parameter ``undistort``), on the
session's device when that is a GPU (the frame goes there anyway: bytes up, remap, resize
and crop there, ``robot/undistort.model_input_torch``), else with numpy on the host. A
frame already at the model's size goes as uint8 [H, W, 3]; others as float32 [3, H', W']
(``io/preprocess.model_input``). Inference thread only; no ROS.
"""
from __future__ import annotations

from typing import Any

from ..io.preprocess import model_input, target_size
from ..robot.undistort import Undistorter
from .frames import InputFrame

MAX_RESIZE_ASPECT = 8  # an image is resized to image_width x (at most this many times image_width) before cropping


class ModelInput:
    """Preprocesses a camera's frames; caches the remap grids per CameraInfo (``undistorter``)."""

    def __init__(self) -> None:
        self.undistorter = Undistorter()
        self.frames_undistorted = 0

    def image(self, frame: InputFrame, image_width: int, undistort: bool, device: Any = None) -> Any:
        """What to push for ``frame`` (see the module docstring); ``device``: the session's GPU, or
        None for the host. Raises ValueError with the reason to report (camera_info of another size,
        an image too tall to resize)."""
        camera = frame.camera if undistort and frame.camera is not None and frame.camera.distorted else None
        if camera is not None:
            camera.check_image(*frame.rgb.shape[:2])  # "CameraInfo is WxH (WxH) but the image is ..."
        try:
            check_resize(frame.rgb.shape, image_width)
            if camera is None:
                return model_input(frame.rgb, image_width)  # uint8 as it came when no resize is needed
            if device is not None:
                image = self.undistorter.model_input_torch(frame.rgb, camera, image_width, device)
            else:
                image = model_input(self.undistorter.undistort(frame.rgb, camera), image_width)
        except ValueError as exc:
            raise ValueError(f"cannot preprocess the image: {exc}") from None
        self.frames_undistorted += 1
        return image


def gpu_device(session) -> Any:
    """The session's device when it is not the CPU (undistortion runs there), else None."""
    device = getattr(session, "device", None)
    return device if device is not None and getattr(device, "type", "cpu") != "cpu" else None


def check_resize(shape: tuple[int, ...], width: int) -> None:
    """Refuse (ValueError) an image so tall that its resize before the centre crop would be huge:
    preprocessing resizes the whole image to ``width`` x ``H'`` (float32) and keeps a centred square,
    so a 1 x 60000 image would cost gigabytes."""
    height_in, width_in = shape[:2]
    w_out, h_out = target_size(width_in, height_in, width)
    if h_out > MAX_RESIZE_ASPECT * w_out:
        raise ValueError(f"image {width_in}x{height_in} (WxH) is too tall: resized to width {w_out} it would be "
                         f"{h_out} px high, more than {MAX_RESIZE_ASPECT} times its width")


__all__ = ["ModelInput", "check_resize", "gpu_device", "MAX_RESIZE_ASPECT"]
