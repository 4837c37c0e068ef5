"""Undistortion: point inverse round trips, and images whose known points must land back."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lingbot_map_ros.robot.undistort import (
    CameraModel,
    Undistorter,
    distort_points,
    needs_undistortion,
    undistort_points,
)

W, H = 160, 120
K_PINHOLE = (110.0, 0.0, 81.3, 0.0, 105.0, 58.7, 0.0, 0.0, 1.0)
K_FISHEYE = (60.0, 0.0, 79.6, 0.0, 61.0, 60.4, 0.0, 0.0, 1.0)
CASES = {
    "plumb_bob": (K_PINHOLE, (-0.25, 0.08, 0.001, -0.0015, -0.01), 0.6),
    "rational_polynomial": (K_PINHOLE, (0.3, -0.05, 0.001, 0.0005, 0.01, 0.6, 0.02, 0.0), 0.6),
    "equidistant": (K_FISHEYE, (-0.02, 0.005, -0.001, 0.0004), 1.5),
}  # model: (K, D, radius of normalised points inside the field of view)


def camera(model: str, k_out=None) -> CameraModel:
    K, D, _ = CASES[model]
    return CameraModel(W, H, K, D, model, k_out)


def to_pixels(K, xy: np.ndarray) -> np.ndarray:
    K = np.asarray(K, dtype=np.float64).reshape(3, 3)
    return np.stack([K[0, 0] * xy[:, 0] + K[0, 1] * xy[:, 1] + K[0, 2], K[1, 1] * xy[:, 1] + K[1, 2]], -1)


def to_normalised(K, uv: np.ndarray) -> np.ndarray:
    K = np.asarray(K, dtype=np.float64).reshape(3, 3)
    y = (uv[:, 1] - K[1, 2]) / K[1, 1]
    return np.stack([(uv[:, 0] - K[0, 2] - K[0, 1] * y) / K[0, 0], y], -1)


def render_blobs(centres: np.ndarray, sigma: float = 1.2) -> np.ndarray:
    """[H, W] float64 image with a Gaussian blob at each (u, v) centre (pixel centres at integers)."""
    v, u = np.mgrid[0:H, 0:W].astype(np.float64)
    img = np.zeros((H, W))
    for cu, cv in centres:
        img += np.exp(-((u - cu) ** 2 + (v - cv) ** 2) / (2 * sigma**2))
    return img


def centroid(img: np.ndarray, near: np.ndarray, half: int = 5) -> np.ndarray:
    u0, v0 = round(near[0]), round(near[1])
    patch = img[v0 - half:v0 + half + 1, u0 - half:u0 + half + 1]
    v, u = np.mgrid[v0 - half:v0 + half + 1, u0 - half:u0 + half + 1]
    return np.array([(patch * u).sum(), (patch * v).sum()]) / patch.sum()


@pytest.mark.parametrize("model", list(CASES))
def test_point_round_trips(model):
    _, D, radius = CASES[model]
    rng = np.random.default_rng(0)
    r = radius * np.sqrt(rng.random(500))
    a = rng.uniform(0, 2 * np.pi, 500)
    xy = np.stack([r * np.cos(a), r * np.sin(a)], -1)
    np.testing.assert_allclose(distort_points(model, D, undistort_points(model, D, xy)), xy, atol=1e-10)
    np.testing.assert_allclose(undistort_points(model, D, distort_points(model, D, xy)), xy, atol=1e-9)
    assert np.max(np.abs(distort_points(model, D, xy) - xy)) > 1e-2  # the distortion is not trivial


def test_coefficients_act_in_ros_order():
    """Each coefficient alone, against the textbook formula written out by hand."""
    x, y = 0.3, -0.2
    r2 = x * x + y * y
    pt = np.array([x, y])
    np.testing.assert_allclose(distort_points("plumb_bob", (0.1, 0, 0, 0, 0), pt), pt * (1 + 0.1 * r2))
    np.testing.assert_allclose(distort_points("plumb_bob", (0, 0.1, 0, 0, 0), pt), pt * (1 + 0.1 * r2**2))
    np.testing.assert_allclose(distort_points("plumb_bob", (0, 0, 0, 0, 0.1), pt), pt * (1 + 0.1 * r2**3))
    np.testing.assert_allclose(distort_points("plumb_bob", (0, 0, 0.01, 0, 0), pt),
                               [x + 2 * 0.01 * x * y, y + 0.01 * (r2 + 2 * y * y)])
    np.testing.assert_allclose(distort_points("plumb_bob", (0, 0, 0, 0.01, 0), pt),
                               [x + 0.01 * (r2 + 2 * x * x), y + 2 * 0.01 * x * y])
    np.testing.assert_allclose(distort_points("rational_polynomial", (0.1, 0, 0, 0, 0, 0.2, 0, 0.3), pt),
                               pt * (1 + 0.1 * r2) / (1 + 0.2 * r2 + 0.3 * r2**3))
    theta = np.arctan(np.sqrt(r2))
    np.testing.assert_allclose(distort_points("equidistant", (0, 0.05, 0, 0), pt),
                               pt * theta * (1 + 0.05 * theta**4) / np.sqrt(r2))
    np.testing.assert_allclose(distort_points("equidistant", (0, 0, 0, 0), np.zeros(2)), [0, 0])


@pytest.mark.parametrize("model, k_out_scale", [("plumb_bob", None), ("rational_polynomial", None),
                                                ("equidistant", None), ("plumb_bob", 0.8)])
def test_undistorted_image_puts_known_points_back(model, k_out_scale):
    K, D, _ = CASES[model]
    k_out = None
    if k_out_scale is not None:  # a rectified P with a wider view: focal lengths scaled
        k_out = (K[0] * k_out_scale, 0.0, K[2], 0.0, K[4] * k_out_scale, K[5], 0.0, 0.0, 1.0)
    cam = camera(model, k_out)
    # known points in the undistorted output image, on a grid away from the borders
    uu, vv = np.meshgrid(np.arange(22.0, 140.0, 23.3), np.arange(20.0, 102.0, 20.1))
    truth = np.stack([uu.ravel(), vv.ravel()], -1)
    # forward model: where each point shows up in the distorted camera image
    distorted = to_pixels(K, distort_points(model, D, to_normalised(cam.intrinsics_out(), truth)))
    keep = (distorted[:, 0] > 6) & (distorted[:, 0] < W - 7) & (distorted[:, 1] > 6) & (distorted[:, 1] < H - 7)
    truth, distorted = truth[keep], distorted[keep]
    assert len(truth) >= 12 and np.max(np.linalg.norm(distorted - truth, axis=1)) > 2.0
    out = Undistorter().undistort(render_blobs(distorted), cam)
    found = np.array([centroid(out, p) for p in truth])
    err = np.linalg.norm(found - truth, axis=1)
    assert err.max() < 0.25, err  # sub-pixel (a half-pixel convention error moves them by >= 0.5)


@pytest.mark.parametrize("model", list(CASES))
def test_torch_path_equals_numpy_path(model):
    cam = camera(model)
    rng = np.random.default_rng(1)
    img = rng.random((H, W, 3)).astype(np.float32)
    umap = Undistorter().map_for(cam)
    want = umap.apply(img)
    got = umap.apply_torch(torch.from_numpy(img).permute(2, 0, 1).contiguous())
    np.testing.assert_allclose(got.permute(1, 2, 0).numpy(), want, atol=2e-5)
    img8 = (img * 255).astype(np.uint8)
    got8 = umap.apply_torch(torch.from_numpy(img8).permute(2, 0, 1)[None])[0].permute(1, 2, 0).numpy()
    assert got8.dtype == np.uint8 and np.abs(got8.astype(int) - umap.apply(img8).astype(int)).max() <= 1
    np.testing.assert_array_equal(Undistorter().undistort_torch(torch.zeros(3, H, W), cam), torch.zeros(3, H, W))


def test_nearest_keeps_depth_values():
    cam = camera("plumb_bob")
    rng = np.random.default_rng(2)
    depth = rng.integers(300, 5000, size=(H, W)).astype(np.uint16)
    out = Undistorter().undistort(depth, cam, interpolation="nearest")
    assert out.dtype == np.uint16 and out.shape == (H, W)
    assert np.isin(out, np.r_[depth.ravel(), 0]).all()
    umap = Undistorter().map_for(cam)
    centre = (H // 2, W // 2)
    src = (int(np.rint(umap.map_y[centre])), int(np.rint(umap.map_x[centre])))
    assert out[centre] == depth[src]
    # a wider output view reads outside the source at the corners: 0 = invalid depth
    K = CASES["plumb_bob"][0]
    wide = camera("plumb_bob", (K[0] * 0.6, 0.0, K[2], 0.0, K[4] * 0.6, K[5], 0.0, 0.0, 1.0))
    assert Undistorter().undistort(depth, wide, interpolation="nearest")[0, 0] == 0
    # float metres with holes: NaN stays NaN, never blended into its neighbours
    metres = depth.astype(np.float32) / 1000
    metres[40:80, 60:100] = np.nan
    out_m = Undistorter().undistort(metres, cam, interpolation="nearest")
    finite = np.isfinite(out_m)
    assert np.isin(out_m[finite], np.r_[metres[np.isfinite(metres)], 0]).all() and (~finite).sum() > 1000
    with pytest.raises(ValueError, match="interpolation must be one of"):
        Undistorter().undistort(depth, cam, interpolation="cubic")


def test_size_mismatch_and_bad_calibrations_are_refused():
    cam = camera("plumb_bob")
    und = Undistorter()
    with pytest.raises(ValueError, match=r"CameraInfo is 160x120 \(WxH\) but the image is 320x240"):
        und.undistort(np.zeros((240, 320, 3), np.uint8), cam)
    with pytest.raises(ValueError, match="CameraInfo is 160x120"):
        und.undistort_torch(torch.zeros(3, 240, 320), cam)
    with pytest.raises(ValueError, match="plumb_bob needs 5 distortion coefficients, got 3"):
        CameraModel(W, H, K_PINHOLE, (0.1, 0.2, 0.3), "plumb_bob")
    with pytest.raises(ValueError, match="'kannala' is not supported"):
        CameraModel(W, H, K_PINHOLE, (0.1, 0.0, 0.0, 0.0), "kannala")
    with pytest.raises(ValueError, match="fx, fy > 0"):
        CameraModel(W, H, (0.0,) * 9, (0.1, 0.0, 0.0, 0.0, 0.0), "plumb_bob")
    with pytest.raises(ValueError, match="0x0"):
        CameraModel(0, 0, K_PINHOLE, (), "")


def test_no_distortion_passes_the_image_through():
    img = np.zeros((H, W, 3), np.uint8)
    for D, model in (((), ""), ((0.0,) * 5, "plumb_bob"), ((0.0,) * 4, "unknown_but_zero")):
        cam = CameraModel(W, H, K_PINHOLE, D, model)
        assert not cam.distorted and not needs_undistortion(model, D)
        assert Undistorter().undistort(img, cam) is img
    assert needs_undistortion("plumb_bob", (0.0, 0.1, 0.0, 0.0, 0.0))
    # plumb_bob with 4 coefficients = k3 zero
    four = CameraModel(W, H, K_PINHOLE, (-0.2, 0.05, 0.0, 0.0), "plumb_bob")
    five = CameraModel(W, H, K_PINHOLE, (-0.2, 0.05, 0.0, 0.0, 0.0), "plumb_bob")
    np.testing.assert_array_equal(Undistorter().map_for(four).map_x, Undistorter().map_for(five).map_x)


def test_maps_are_cached_per_camera():
    und = Undistorter(max_cameras=2)
    a, b, c = camera("plumb_bob"), camera("equidistant"), camera("rational_polynomial")
    assert und.map_for(a) is und.map_for(camera("plumb_bob"))
    map_a = und.map_for(a)
    und.map_for(b)
    und.map_for(c)  # evicts a (least recently used)
    assert und.map_for(a) is not map_a
    umap = und.map_for(a)
    assert umap.grid("cpu") is umap.grid("cpu")


def test_from_camera_info_reads_the_message_fields():
    K, D, _ = CASES["plumb_bob"]
    p = [88.0, 0.0, 80.0, 0.0, 0.0, 84.0, 60.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    info = SimpleNamespace(width=W, height=H, k=list(K), d=list(D), distortion_model="plumb_bob", p=p)
    cam = CameraModel.from_camera_info(info)
    assert cam == camera("plumb_bob") and hash(cam) == hash(camera("plumb_bob"))
    np.testing.assert_allclose(cam.intrinsics_out(), np.asarray(K).reshape(3, 3))
    rect = CameraModel.from_camera_info(info, use_projection=True)
    np.testing.assert_allclose(rect.intrinsics_out(), [[88, 0, 80], [0, 84, 60], [0, 0, 1]])


# ------------------------------------------------------------------ model input on the session's device
def textured(width: int, height: int, seed: int = 0) -> np.ndarray:
    """uint8 RGB [height, width, 3]: 8-pixel blocks plus a smooth wave (edges and gradients)."""
    rng = np.random.default_rng(seed)
    blocks = np.kron(rng.integers(0, 256, (height // 8 + 1, width // 8 + 1, 3)).astype(np.float32),
                     np.ones((8, 8, 1)))[:height, :width]
    v, u = np.mgrid[0:height, 0:width]
    wave = 127 + 120 * (np.sin(u / 7.0) * np.cos(v / 11.0))[..., None]
    return np.clip(0.6 * blocks + 0.4 * wave, 0, 255).astype(np.uint8)


@pytest.mark.parametrize("size, width", [((640, 360), 518), ((518, 294), 518), ((300, 520), 98)])
def test_model_input_torch_matches_the_host_path(size, width):
    """Undistort + preprocess with torch (CPU here; the engine uses it on the GPU) against the host
    path (numpy remap, then Pillow's resize and crop): same shape, every value within two 8-bit counts
    and fewer than 1 % of them off by any (float vs Pillow's fixed-point filter weights; measured: 0.2 %
    by one count, one value by two). Sizes: a downscale, a model-sized frame (no resize), a portrait
    frame (resize and centre crop)."""
    from lingbot_map_ros.io.preprocess import model_input, preprocess_array

    w, h = size
    cam = CameraModel(w, h, (0.8 * w, 0.0, w / 2 + 1.3, 0.0, 0.8 * w + 4, h / 2 - 2.1, 0.0, 0.0, 1.0),
                      (-0.28, 0.09, 0.001, -0.001, 0.0), "plumb_bob")
    rgb = textured(w, h)
    und = Undistorter()
    host_u8 = und.undistort(rgb, cam)
    host = preprocess_array(host_u8, width)
    got = und.model_input_torch(rgb, cam, width, "cpu")
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.device.type == "cpu"
    assert tuple(got.shape) == host.shape
    diff = np.abs(got.numpy() - host) * 255
    assert diff.max() <= 2.0 + 1e-3, diff.max()
    assert (diff > 0.5).mean() < 0.01, (diff > 0.5).mean()
    if size == (518, 294):  # no resize: only the remap's rounding can differ
        assert (diff > 0.5).mean() < 0.01 and isinstance(model_input(host_u8, width), np.ndarray)
    assert np.all(np.abs(got.numpy() * 255 - np.rint(got.numpy() * 255)) < 1e-3)  # multiples of 1/255


def test_model_input_torch_refuses_other_sizes_and_layouts():
    cam = camera("plumb_bob")
    with pytest.raises(ValueError, match=r"CameraInfo is 160x120 \(WxH\) but the image is 320x240"):
        Undistorter().model_input_torch(np.zeros((240, 320, 3), np.uint8), cam, 98, "cpu")
    with pytest.raises(ValueError, match="expected a uint8 RGB image"):
        Undistorter().model_input_torch(np.zeros((H, W, 3), np.float32), cam, 98, "cpu")
