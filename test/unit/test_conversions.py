"""ROS message <-> numpy conversions (lingbot_map_ros.ros.conversions), no ROS graph."""
from __future__ import annotations

import io

import numpy as np
import pytest

pytest.importorskip(
    "sensor_msgs.msg",
    reason="ROS 2 message packages not importable (run scripts/bootstrap.sh to install them)")

PIL = pytest.importorskip("PIL.Image", reason="Pillow not installed")

from geometry_msgs.msg import TransformStamped  # noqa: E402
from sensor_msgs.msg import CompressedImage, Image, PointCloud2, PointField  # noqa: E402
from std_msgs.msg import Header  # noqa: E402

from lingbot_map_ros.ros import conversions as cv  # noqa: E402

RNG_SEED = 1234


def header(frame: str = "cam_optical") -> Header:
    h = Header(frame_id=frame)
    h.stamp.sec, h.stamp.nanosec = 12, 345
    return h


def image_msg(payload: np.ndarray, encoding: str, pad: int = 0, bigendian: bool = False) -> Image:
    """Image whose rows are ``payload`` rows (bytes) followed by ``pad`` junk bytes."""
    rows = np.ascontiguousarray(payload).view(np.uint8).reshape(payload.shape[0], -1)
    junk = np.full((rows.shape[0], pad), 0xAB, dtype=np.uint8)
    data = np.concatenate([rows, junk], axis=1)
    width = payload.shape[1]
    return Image(height=payload.shape[0], width=width, encoding=encoding,
                 is_bigendian=int(bigendian), step=data.shape[1], data=data.tobytes())


# ----------------------------------------------------------------------------- raw encodings

@pytest.fixture
def rgb() -> np.ndarray:
    return np.random.default_rng(RNG_SEED).integers(0, 256, (5, 6, 3), dtype=np.uint8)


@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize("encoding", ["rgb8", "bgr8", "8UC3", "rgba8", "bgra8", "8UC4"])
def test_colour_encodings(rgb, encoding, pad):
    alpha = np.full(rgb.shape[:2] + (1,), 77, dtype=np.uint8)
    payload = {
        "rgb8": rgb, "bgr8": rgb[..., ::-1], "8UC3": rgb[..., ::-1],
        "rgba8": np.concatenate([rgb, alpha], -1),
        "bgra8": np.concatenate([rgb[..., ::-1], alpha], -1),
        "8UC4": np.concatenate([rgb[..., ::-1], alpha], -1),
    }[encoding]
    out = cv.image_to_rgb(image_msg(payload, encoding, pad))
    assert out.dtype == np.uint8 and out.shape == rgb.shape and out.flags.c_contiguous
    np.testing.assert_array_equal(out, rgb)


@pytest.mark.parametrize("encoding,bpp", [("rgb8", 3), ("rgba8", 4), ("bgr8", 3), ("mono8", 1), ("mono16", 2),
                                          ("yuv422", 2), ("bayer_rggb8", 1), ("bayer_bggr16", 2)])
def test_result_is_a_copy_not_a_view_of_the_message(encoding, bpp):
    data = np.random.default_rng(RNG_SEED).integers(0, 256, 4 * 6 * bpp, dtype=np.uint8)
    msg = Image(height=4, width=6, encoding=encoding, step=6 * bpp, data=data.tobytes())
    out = cv.image_to_rgb(msg)
    assert out.flags.owndata and out.flags.writeable and out.flags.c_contiguous
    before = out.copy()
    msg.data[0] ^= 0xFF  # the message's own buffer (array.array) changes after conversion
    np.testing.assert_array_equal(out, before)


@pytest.mark.parametrize("pad", [0, 5])
@pytest.mark.parametrize("encoding", ["mono8", "8UC1"])
def test_mono8(encoding, pad):
    mono = np.random.default_rng(RNG_SEED).integers(0, 256, (4, 7), dtype=np.uint8)
    out = cv.image_to_rgb(image_msg(mono, encoding, pad))
    np.testing.assert_array_equal(out, np.stack([mono] * 3, axis=-1))


@pytest.mark.parametrize("pad", [0, 2])
@pytest.mark.parametrize("bigendian", [False, True])
def test_mono16_scaled_to_8bit(bigendian, pad):
    mono = np.random.default_rng(RNG_SEED).integers(0, 65536, (4, 5), dtype=np.uint16)
    mono[0, :3] = [0, 65535, 257 * 100 + 128]
    payload = mono.astype(">u2" if bigendian else "<u2")
    out = cv.image_to_rgb(image_msg(payload, "mono16", pad, bigendian))
    expected = np.rint(mono.astype(np.float64) * 255.0 / 65535.0).astype(np.uint8)
    assert out[0, 0, 0] == 0 and out[0, 1, 0] == 255
    np.testing.assert_array_equal(out, np.stack([expected] * 3, axis=-1))


def test_mono16_byte_order_matters():
    mono = np.array([[0x0100, 0xFF00]], dtype="<u2")
    little = cv.image_to_rgb(image_msg(mono, "mono16", bigendian=False))[..., 0]
    swapped = cv.image_to_rgb(image_msg(mono, "mono16", bigendian=True))[..., 0]
    assert little.tolist() == [[1, 254]] and swapped.tolist() == [[0, 1]]


def yuv_reference(y: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Per-pixel BT.601 video-range YUV -> RGB with 4:2:2 chroma (pixel pairs share U, V)."""
    h, w = y.shape
    out = np.zeros((h, w, 3), dtype=np.uint8)
    for r in range(h):
        for c in range(w):
            yy, uu, vv = float(y[r, c]) - 16, float(u[r, c // 2]) - 128, float(v[r, c // 2]) - 128
            px = [1.164 * yy + 1.596 * vv, 1.164 * yy - 0.391 * uu - 0.813 * vv, 1.164 * yy + 2.018 * uu]
            out[r, c] = [min(255, max(0, round(p))) for p in px]
    return out


@pytest.mark.parametrize("pad", [0, 4])
@pytest.mark.parametrize("encoding", ["yuv422", "uyvy", "yuv422_yuy2", "yuyv"])
def test_yuv422(encoding, pad):
    rng = np.random.default_rng(RNG_SEED)
    h, w = 3, 8
    y = rng.integers(0, 256, (h, w), dtype=np.uint8)
    u = rng.integers(0, 256, (h, w // 2), dtype=np.uint8)
    v = rng.integers(0, 256, (h, w // 2), dtype=np.uint8)
    y[0, :4], u[0, :2], v[0, :2] = [16, 235, 0, 255], [128, 0], [128, 255]  # black/white/clipping
    if encoding in ("yuv422", "uyvy"):
        packed = np.stack([u, y[:, 0::2], v, y[:, 1::2]], axis=-1)
    else:
        packed = np.stack([y[:, 0::2], u, y[:, 1::2], v], axis=-1)
    payload = packed.reshape(h, w, 2)  # 2 bytes a pixel
    out = cv.image_to_rgb(image_msg(payload, encoding, pad))
    ref = yuv_reference(y, u, v)
    assert out.shape == (h, w, 3)
    assert np.abs(out.astype(int) - ref.astype(int)).max() <= 1
    np.testing.assert_array_equal(out[0, 0], [0, 0, 0])
    np.testing.assert_array_equal(out[0, 1], [255, 255, 255])


# ----------------------------------------------------------------------------- raw errors

@pytest.mark.parametrize("encoding", ["rgb16", "nv12", "RGB8", "bayer_rggb12", ""])
def test_unsupported_encoding_is_named(rgb, encoding):
    msg = image_msg(rgb, "rgb8")
    msg.encoding = encoding
    with pytest.raises(cv.ImageConversionError, match=f"unsupported image encoding {encoding!r}"):
        cv.image_to_rgb(msg)


@pytest.mark.parametrize("encoding,dtype", [("16UC1", "<u2"), ("16SC1", "<i2"), ("32FC1", "<f4"),
                                            ("32SC1", "<i4"), ("64FC1", "<f8")])
def test_depth_encodings_are_refused_with_the_likely_mistake(encoding, dtype):
    depth = np.random.default_rng(RNG_SEED).uniform(0, 4000, (4, 6)).astype(dtype)  # a plausible depth map
    with pytest.raises(cv.ImageConversionError) as info:
        cv.image_to_rgb(image_msg(depth, encoding))
    assert str(info.value) == (
        f"encoding {encoding!r} is a depth image, not a colour image: is a depth topic remapped to this "
        "node's image input? (mono16 is accepted as 16-bit greyscale)")
    assert encoding not in cv.SUPPORTED_ENCODINGS
    # the same bytes labelled mono16 (for the 16-bit ones) are accepted as greyscale
    if dtype == "<u2":
        assert cv.image_to_rgb(image_msg(depth, "mono16")).shape == (4, 6, 3)


@pytest.mark.parametrize("width,height", [(0, 4), (4, 0)])
def test_empty_image(width, height):
    msg = Image(width=width, height=height, encoding="rgb8", step=width * 3)
    with pytest.raises(cv.ImageConversionError, match="empty image"):
        cv.image_to_rgb(msg)


def test_step_too_small(rgb):
    msg = image_msg(rgb, "rgb8")
    msg.step = rgb.shape[1] * 3 - 1
    with pytest.raises(cv.ImageConversionError, match="step"):
        cv.image_to_rgb(msg)


def test_mono16_step_counts_two_bytes():
    msg = image_msg(np.zeros((2, 4), dtype="<u2"), "mono16")
    msg.step = 4  # enough for mono8, not for mono16
    with pytest.raises(cv.ImageConversionError, match="2 bytes per pixel"):
        cv.image_to_rgb(msg)


def test_data_too_short(rgb):
    msg = image_msg(rgb, "rgb8", pad=2)
    msg.data = bytes(msg.data)[:-1]
    with pytest.raises(cv.ImageConversionError, match="expected step"):
        cv.image_to_rgb(msg)


def test_too_many_pixels(rgb):
    msg = image_msg(rgb, "rgb8")
    with pytest.raises(cv.ImageConversionError, match="exceeds the limit"):
        cv.image_to_rgb(msg, max_pixels=rgb.shape[0] * rgb.shape[1] - 1)
    cv.image_to_rgb(msg, max_pixels=rgb.shape[0] * rgb.shape[1])  # at the limit: fine


def test_absurd_header_rejected_before_reading_data():
    msg = Image(width=100_000, height=100_000, encoding="rgb8", step=300_000, data=b"\0" * 16)
    with pytest.raises(cv.ImageConversionError, match="exceeds the limit"):
        cv.image_to_rgb(msg)


def test_yuv_odd_width():
    msg = Image(width=3, height=1, encoding="yuv422", step=6, data=bytes(6))
    with pytest.raises(cv.ImageConversionError, match="even width"):
        cv.image_to_rgb(msg)


def test_error_is_value_error():
    assert issubclass(cv.ImageConversionError, ValueError)


# ----------------------------------------------------------------------------- compressed

def encode(arr: np.ndarray, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    PIL.fromarray(arr).save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def smooth_rgb(h: int = 32, w: int = 48) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w]
    return np.stack([xx * 5, yy * 7, (xx + yy) * 3], axis=-1).astype(np.uint8)


def compressed(data: bytes, fmt: str) -> CompressedImage:
    return CompressedImage(header=header(), format=fmt, data=data)


def test_png_exact():
    img = smooth_rgb()
    out = cv.compressed_to_rgb(compressed(encode(img, "PNG"), "png"))
    np.testing.assert_array_equal(out, img)


def test_png_rgba_palette_and_grey():
    img = smooth_rgb()
    rgba = np.concatenate([img, np.full(img.shape[:2] + (1,), 9, np.uint8)], -1)
    np.testing.assert_array_equal(cv.compressed_to_rgb(compressed(encode(rgba, "PNG"), "png")), img)
    grey = img[..., 0]
    out = cv.compressed_to_rgb(compressed(encode(grey, "PNG"), "mono8; png compressed"))
    np.testing.assert_array_equal(out, np.stack([grey] * 3, -1))
    pal = PIL.fromarray(img).convert("P")
    buf = io.BytesIO()
    pal.save(buf, format="PNG")
    np.testing.assert_array_equal(cv.compressed_to_rgb(compressed(buf.getvalue(), "png")),
                                  np.asarray(pal.convert("RGB")))


def test_png_16bit_grey_scaled():
    mono = np.array([[0, 257, 65535, 32896]], dtype=np.uint16)
    img = PIL.fromarray(mono)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    out = cv.compressed_to_rgb(compressed(buf.getvalue(), "png"))
    assert out[..., 0].tolist() == [[0, 1, 255, 128]]


def test_jpeg_decodes_like_pillow():
    img = smooth_rgb()
    data = encode(img, "JPEG", quality=95)
    out = cv.compressed_to_rgb(compressed(data, "rgb8; jpeg compressed bgr8"))
    np.testing.assert_array_equal(out, np.asarray(PIL.open(io.BytesIO(data)).convert("RGB")))
    assert out.shape == img.shape and np.abs(out.astype(int) - img).mean() < 3


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated(fmt):
    data = encode(smooth_rgb(64, 64) ^ np.uint8(0x5A), fmt)
    with pytest.raises(cv.ImageConversionError, match="corrupt or truncated"):
        cv.compressed_to_rgb(compressed(data[: len(data) // 2], fmt.lower()))


def test_corrupt_png_body():
    data = bytearray(encode(smooth_rgb(), "PNG"))
    mid = len(data) // 2
    data[mid: mid + 16] = b"\xff" * 16  # IDAT payload and CRC no longer match
    with pytest.raises(cv.ImageConversionError):
        cv.compressed_to_rgb(compressed(bytes(data), "png"))


@pytest.mark.parametrize("data", [b"definitely not an image", b"\x89PNG\r\n\x1a\n" + b"\0" * 8, b""])
def test_garbage(data):
    with pytest.raises(cv.ImageConversionError):
        cv.compressed_to_rgb(compressed(data, "jpeg"))


def test_other_image_formats_refused():
    data = encode(smooth_rgb(), "BMP")
    with pytest.raises(cv.ImageConversionError, match="not a JPEG or PNG"):
        cv.compressed_to_rgb(compressed(data, "bmp"))


def test_decompression_bomb_guard():
    data = encode(np.zeros((200, 300, 3), np.uint8), "PNG")  # a few hundred bytes
    with pytest.raises(cv.ImageConversionError, match="exceeds the limit"):
        cv.compressed_to_rgb(compressed(data, "png"), max_pixels=200 * 300 - 1)


def test_compressed_depth_refused():
    with pytest.raises(cv.ImageConversionError, match="depth"):
        cv.compressed_to_rgb(compressed(encode(smooth_rgb(), "PNG"), "16UC1; compressedDepth png"))


# ----------------------------------------------------------------------------- outgoing images

@pytest.mark.parametrize("encoding", ["rgb8", "bgr8"])
def test_rgb_to_image_msg_round_trip(rgb, encoding):
    msg = cv.rgb_to_image_msg(rgb, header(), encoding)
    assert (msg.encoding, msg.height, msg.width, msg.step) == (encoding, 5, 6, 18)
    assert msg.header.frame_id == "cam_optical"
    np.testing.assert_array_equal(cv.image_to_rgb(msg), rgb)
    if encoding == "bgr8":
        assert bytes(msg.data[:3]) == rgb[0, 0, ::-1].tobytes()


def test_mono_to_image_msg(rgb):
    msg = cv.rgb_to_image_msg(rgb[..., 1], header(), "mono8")
    np.testing.assert_array_equal(cv.image_to_rgb(msg)[..., 0], rgb[..., 1])


def test_rgb_to_image_msg_rejects_bad_input(rgb):
    with pytest.raises(ValueError):
        cv.rgb_to_image_msg(rgb.astype(np.float32), header())
    with pytest.raises(ValueError):
        cv.rgb_to_image_msg(rgb[..., :2], header())
    with pytest.raises(ValueError):
        cv.rgb_to_image_msg(rgb, header(), "yuv422")


def test_depth_round_trip_keeps_nan():
    depth = np.random.default_rng(RNG_SEED).uniform(0.1, 20, (4, 6)).astype(np.float32)
    depth[1, 2] = np.nan
    msg = cv.depth_to_image_msg(depth, header())
    assert (msg.encoding, msg.step, msg.is_bigendian) == ("32FC1", 24, 0)
    raw = np.frombuffer(bytes(msg.data), dtype="<f4").reshape(4, 6)
    np.testing.assert_array_equal(raw, depth)  # NaN positions compare equal
    np.testing.assert_array_equal(cv.image_to_depth(msg), depth)
    np.testing.assert_array_equal(cv.depth_to_image_msg(depth.astype(np.float64), header()).data,
                                  msg.data)


# ----------------------------------------------------------------------------- point clouds

def random_cloud(n: int = 50):
    rng = np.random.default_rng(RNG_SEED)
    pts = rng.normal(size=(n, 3)).astype(np.float32)
    cols = rng.integers(0, 256, (n, 3), dtype=np.uint8)
    conf = rng.uniform(1, 10, n).astype(np.float32)
    return pts, cols, conf


def test_pointcloud2_layout():
    pts, cols, conf = random_cloud()
    msg = cv.make_pointcloud2(pts, cols, conf, header("map"))
    assert [(f.name, f.offset, f.datatype, f.count) for f in msg.fields] == [
        ("x", 0, PointField.FLOAT32, 1), ("y", 4, PointField.FLOAT32, 1),
        ("z", 8, PointField.FLOAT32, 1), ("rgb", 12, PointField.FLOAT32, 1),
        ("confidence", 16, PointField.FLOAT32, 1)]
    assert (msg.height, msg.width, msg.point_step, msg.row_step) == (1, 50, 20, 1000)
    assert not msg.is_bigendian and msg.is_dense and len(msg.data) == 1000
    assert msg.header.frame_id == "map"
    # First point, byte by byte: little-endian floats and the 0x00RRGGBB pattern.
    first = bytes(msg.data[:20])
    np.testing.assert_array_equal(np.frombuffer(first[:12], "<f4"), pts[0])
    r, g, b = (int(c) for c in cols[0])
    assert int.from_bytes(first[12:16], "little") == (r << 16) | (g << 8) | b
    assert np.frombuffer(first[16:], "<f4")[0] == conf[0]


def test_pointcloud2_round_trip():
    pts, cols, conf = random_cloud()
    out = cv.read_pointcloud2(cv.make_pointcloud2(pts, cols, conf, header()))
    np.testing.assert_array_equal(out["points"], pts)
    np.testing.assert_array_equal(out["colors"], cols)
    np.testing.assert_array_equal(out["confidence"], conf)
    assert out["rgb"].dtype == np.dtype("<f4")
    packed = out["rgb"].view(np.uint32)
    np.testing.assert_array_equal(packed >> 24, 0)


def test_pointcloud2_defaults_and_density():
    pts, _, _ = random_cloud(4)
    pts[2, 1] = np.nan
    msg = cv.make_pointcloud2(pts, None, None, header())
    out = cv.read_pointcloud2(msg)
    assert not msg.is_dense
    np.testing.assert_array_equal(out["colors"], np.full((4, 3), 255, np.uint8))
    assert np.isnan(out["confidence"]).all()


def test_pointcloud2_empty():
    msg = cv.make_pointcloud2(np.zeros((0, 3), np.float32), None, None, header())
    assert msg.width == 0 and len(msg.data) == 0
    assert cv.read_pointcloud2(msg)["points"].shape == (0, 3)


def test_pointcloud2_shape_checks():
    pts, cols, conf = random_cloud(5)
    with pytest.raises(ValueError):
        cv.make_pointcloud2(pts[:, :2], cols, conf, header())
    with pytest.raises(ValueError):
        cv.make_pointcloud2(pts, cols[:4], conf, header())
    with pytest.raises(ValueError):
        cv.make_pointcloud2(pts, cols.astype(np.float32), conf, header())
    with pytest.raises(ValueError):
        cv.make_pointcloud2(pts, cols, conf[:, None], header())


def test_read_pointcloud2_foreign_layout():
    """An organised big-endian cloud with padding between points and rows."""
    dtype = np.dtype({"names": ["x", "y", "z", "intensity"], "formats": [">f4", ">f4", ">f4", ">u2"],
                      "offsets": [0, 4, 8, 16], "itemsize": 24})
    grid = np.zeros((2, 3), dtype=dtype)
    grid["x"], grid["y"], grid["z"] = np.arange(6).reshape(2, 3), 1.5, -2.0
    grid["intensity"] = np.arange(6).reshape(2, 3) * 1000
    rows = np.concatenate([grid.view(np.uint8).reshape(2, 72), np.zeros((2, 8), np.uint8)], axis=1)
    fields = [PointField(name=n, offset=o, datatype=t, count=1) for n, o, t in
              [("x", 0, 7), ("y", 4, 7), ("z", 8, 7), ("intensity", 16, 4)]]
    msg = PointCloud2(height=2, width=3, fields=fields, is_bigendian=True, point_step=24,
                      row_step=80, data=rows.tobytes(), is_dense=True)
    out = cv.read_pointcloud2(msg)
    np.testing.assert_array_equal(out["x"], np.arange(6, dtype=np.float32))
    np.testing.assert_array_equal(out["intensity"], np.arange(6) * 1000)
    assert out["points"].shape == (6, 3) and "colors" not in out


# ----------------------------------------------------------------------------- rotations

def random_quaternions(n: int, rng) -> np.ndarray:
    q = rng.normal(size=(n, 4))
    return q / np.linalg.norm(q, axis=1, keepdims=True)


def axis_angle_matrix(axis: np.ndarray, angle: float) -> np.ndarray:
    """Rodrigues' formula, independent of the quaternion code under test."""
    a = np.asarray(axis, dtype=np.float64) / np.linalg.norm(axis)
    k = np.array([[0, -a[2], a[1]], [a[2], 0, -a[0]], [-a[1], a[0], 0]])
    return np.eye(3) + np.sin(angle) * k + (1 - np.cos(angle)) * k @ k


def assert_same_rotation_quat(q1: np.ndarray, q2: np.ndarray, atol: float) -> None:
    assert min(np.abs(q1 - q2).max(), np.abs(q1 + q2).max()) < atol


def test_quaternion_matrix_round_trip_random():
    rng = np.random.default_rng(RNG_SEED)
    quats = random_quaternions(500, rng)
    mats = cv.quaternion_to_matrix(quats)
    np.testing.assert_allclose(mats @ np.swapaxes(mats, -1, -2), np.broadcast_to(np.eye(3), mats.shape),
                               atol=1e-12)
    back = cv.matrix_to_quaternion(mats)
    assert (back[:, 3] >= 0).all()
    np.testing.assert_allclose(np.linalg.norm(back, axis=1), 1.0, atol=1e-12)
    for q, b in zip(quats, back):
        assert_same_rotation_quat(q, b, 1e-10)
    np.testing.assert_allclose(cv.quaternion_to_matrix(back), mats, atol=1e-12)


@pytest.mark.parametrize("angle", [np.pi, np.pi - 1e-7, np.pi - 1e-3, 1e-9, 0.0])
def test_matrix_to_quaternion_near_180_and_identity(angle):
    rng = np.random.default_rng(RNG_SEED)
    axes = [np.eye(3)[i] for i in range(3)] + list(rng.normal(size=(20, 3)))
    for axis in axes:
        rot = axis_angle_matrix(axis, angle)
        q = cv.matrix_to_quaternion(rot)
        assert q[3] >= 0 and abs(np.linalg.norm(q) - 1) < 1e-12
        np.testing.assert_allclose(cv.quaternion_to_matrix(q), rot, atol=1e-9)
        a = axis / np.linalg.norm(axis)
        expected = np.r_[a * np.sin(angle / 2), np.cos(angle / 2)]
        assert_same_rotation_quat(q, expected, 1e-8)


def test_quaternion_of_known_rotation():
    # 90 deg about z: x -> y.
    q = cv.matrix_to_quaternion(axis_angle_matrix([0, 0, 1], np.pi / 2))
    np.testing.assert_allclose(q, [0, 0, np.sqrt(0.5), np.sqrt(0.5)], atol=1e-12)


# ----------------------------------------------------------------------------- frames and poses

def test_optical_to_rep103_axes():
    A = cv.OPTICAL_TO_REP103
    R = A[:3, :3]
    np.testing.assert_array_equal(R @ [0, 0, 1], [1, 0, 0])    # optical forward -> map +x
    np.testing.assert_array_equal(R @ [0, 1, 0], [0, 0, -1])   # optical down -> map -z
    np.testing.assert_array_equal(R @ [1, 0, 0], [0, -1, 0])   # optical right -> map -y
    np.testing.assert_array_equal(A[3], [0, 0, 0, 1])
    np.testing.assert_array_equal(A[:3, 3], 0)
    assert np.isclose(np.linalg.det(R), 1.0)
    with pytest.raises(ValueError):
        A[0, 0] = 5.0  # read-only constant


def test_optical_pose_to_map():
    # Camera 2 units forward of the first camera, yawed 90 deg to its right
    # (about optical -y, i.e. about map -z).
    c2w = np.eye(4)
    c2w[:3, :3] = axis_angle_matrix([0, -1, 0], -np.pi / 2)
    c2w[:3, 3] = [0, 0, 2]
    body = cv.optical_pose_to_map(c2w, optical_child=False)
    np.testing.assert_allclose(body[:3, 3], [2, 0, 0], atol=1e-12)
    # The body's forward axis (x) now points to map -y (right), its up stays +z.
    np.testing.assert_allclose(body[:3, 0], [0, -1, 0], atol=1e-12)
    np.testing.assert_allclose(body[:3, 2], [0, 0, 1], atol=1e-12)
    optical = cv.optical_pose_to_map(c2w)
    np.testing.assert_allclose(optical[:3, 2], body[:3, 0], atol=1e-12)  # optical z = body x
    np.testing.assert_allclose(optical, cv.OPTICAL_TO_REP103 @ c2w)
    np.testing.assert_allclose(cv.optical_pose_to_map(np.eye(4), optical_child=False), np.eye(4))
    # A point seen by the camera lands at the same map position either way.
    p_cam = np.array([0.3, -0.2, 1.5, 1.0])
    np.testing.assert_allclose((optical @ p_cam)[:3], cv.points_to_map((c2w @ p_cam)[None, :3])[0])


def test_points_to_map_keeps_float32():
    pts = np.array([[1, 2, 3]], np.float32)
    out = cv.points_to_map(pts)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [[3, -1, -2]])


def pose_matrix(rng) -> np.ndarray:
    T = np.eye(4)
    T[:3, :3] = cv.quaternion_to_matrix(random_quaternions(1, rng)[0])
    T[:3, 3] = rng.normal(size=3)
    return T


def test_pose_transform_and_odometry_messages():
    T = pose_matrix(np.random.default_rng(RNG_SEED))
    pose = cv.pose_to_msg(T)
    q = [pose.orientation.x, pose.orientation.y, pose.orientation.z, pose.orientation.w]
    np.testing.assert_allclose(cv.quaternion_to_matrix(np.array(q)), T[:3, :3], atol=1e-12)
    np.testing.assert_allclose([pose.position.x, pose.position.y, pose.position.z], T[:3, 3])
    assert q[3] >= 0

    tf = cv.transform_stamped(T, header("map"), "camera_optical_frame")
    assert isinstance(tf, TransformStamped)
    assert (tf.header.frame_id, tf.child_frame_id) == ("map", "camera_optical_frame")
    assert (tf.header.stamp.sec, tf.header.stamp.nanosec) == (12, 345)
    t = tf.transform.translation
    np.testing.assert_allclose([t.x, t.y, t.z], T[:3, 3])
    assert tf.transform.rotation == pose.orientation

    odom = cv.odometry_msg(T, header("map"), "camera_link")
    assert (odom.header.frame_id, odom.child_frame_id) == ("map", "camera_link")
    assert odom.pose.pose == pose


@pytest.mark.parametrize("bad", [np.eye(3), np.full((4, 4), np.nan)])
def test_pose_to_msg_rejects_bad_matrices(bad):
    with pytest.raises(ValueError):
        cv.pose_to_msg(bad)


def test_camera_info():
    K = np.array([[500.0, 0, 259.5], [0, 510.0, 189.5], [0, 0, 1]])
    info = cv.camera_info_msg(K, 518, 378, header())
    assert (info.width, info.height, info.distortion_model) == (518, 378, "plumb_bob")
    np.testing.assert_array_equal(np.reshape(info.k, (3, 3)), K)
    np.testing.assert_array_equal(np.reshape(info.r, (3, 3)), np.eye(3))
    np.testing.assert_array_equal(np.reshape(info.p, (3, 4)), np.c_[K, np.zeros(3)])
    assert list(info.d) == [0.0] * 5
    with pytest.raises(ValueError):
        cv.camera_info_msg(np.eye(4), 1, 1, header())


def test_messages_serialize():
    """The messages built here survive CDR serialisation (catches type slips)."""
    serialization = pytest.importorskip("rclpy.serialization", reason="rclpy not installed")
    pts, cols, conf = random_cloud(10)
    T = pose_matrix(np.random.default_rng(RNG_SEED))
    rgb = smooth_rgb(4, 6)
    msgs = [
        cv.rgb_to_image_msg(rgb, header()),
        cv.depth_to_image_msg(rgb[..., 0].astype(np.float32), header()),
        cv.make_pointcloud2(pts, cols, conf, header("map")),
        cv.transform_stamped(T, header("map"), "cam"),
        cv.odometry_msg(T, header("map"), "cam"),
        cv.camera_info_msg(np.eye(3), 6, 4, header()),
    ]
    for msg in msgs:
        back = serialization.deserialize_message(serialization.serialize_message(msg), type(msg))
        assert back == msg, type(msg).__name__
    back = serialization.deserialize_message(serialization.serialize_message(msgs[0]), Image)
    np.testing.assert_array_equal(cv.image_to_rgb(back), rgb)


@pytest.mark.parametrize("data, fmt", [
    (encode(smooth_rgb(64, 64) ^ np.uint8(0x5A), "JPEG")[:400], "jpeg"),  # truncated
    (b"definitely not an image", "jpeg"), (b"", "png"), (encode(smooth_rgb(), "BMP"), "bmp"),
    (encode(smooth_rgb(), "PNG"), "16UC1; compressedDepth png"),
])
def test_bag_and_live_messages_share_one_decoder(data, fmt):
    """The replay's bag reader (io.image_msgs, rosbags' dataclasses: data a numpy array) and the
    node's callback (a sensor_msgs message) decode alike and fail with the same error and text."""
    from types import SimpleNamespace

    from lingbot_map_ros.io import image_msgs

    bag_msg = SimpleNamespace(format=fmt, data=np.frombuffer(data, np.uint8))
    with pytest.raises(image_msgs.ImageDecodeError) as from_bag:
        image_msgs.message_to_rgb(bag_msg, "sensor_msgs/msg/CompressedImage")
    with pytest.raises(cv.ImageConversionError) as live:
        cv.compressed_to_rgb(compressed(data, fmt))
    assert type(live.value) is type(from_bag.value) and str(live.value) == str(from_bag.value)
    good = encode(smooth_rgb(), "PNG")
    np.testing.assert_array_equal(image_msgs.message_to_rgb(SimpleNamespace(format="png", data=np.frombuffer(
        good, np.uint8)), "sensor_msgs/CompressedImage"), cv.compressed_to_rgb(compressed(good, "png")))
