"""Camera geometry in numpy (no torch): pose decoding, intrinsics, unprojection,
point selection, voxel downsampling, quaternions and Sim(3) alignment.

Conventions (SPEC §6):
- Camera axes are OpenCV's: x right, y down, z forward. The "world" frame is the
  model's own (in practice close to frame 0's camera), in the model's units
  (metres-like, not guaranteed metric).
- ``c2w`` is the camera-to-world transform: ``p_world = R @ p_cam + t``, with
  ``t`` the camera centre in world coordinates. Matrices are [..., 4, 4].
- Quaternions are (x, y, z, w), Hamilton convention, returned with w ≥ 0.
- Intrinsics K are [..., 3, 3] at the model resolution, in pixels.

Non-finite values propagate as in plain numpy maths (e.g. a FoV of 0 gives an
infinite focal length, as in the reference fixtures); no warnings are emitted
for them.
"""
from __future__ import annotations

import math

import numpy as np

_EPS = 1e-12


def _float_dtype(*arrays: np.ndarray) -> np.dtype:
    """Output dtype: float64 if any input is float64, else float32."""
    return np.result_type(*arrays, np.float32)


# ----------------------------------------------------------------------------- quaternions

def quaternion_to_matrix(quat: np.ndarray) -> np.ndarray:
    """Rotation matrices from quaternions.

    Args:
        quat: [..., 4] quaternions (x, y, z, w); normalised here, need not be unit.
            A zero quaternion yields NaN.

    Returns:
        [..., 3, 3] rotation matrices (float64 if the input is float64, else float32).
    """
    q = np.asarray(quat, dtype=np.float64)
    if q.size == 4:  # one quaternion (a frame's pose): Python floats, same numbers
        return np.array(_quaternion_to_matrix_one(q), dtype=_float_dtype(np.asarray(quat))).reshape(
            q.shape[:-1] + (3, 3))
    with np.errstate(invalid="ignore", divide="ignore"):
        q = q / np.linalg.norm(q, axis=-1, keepdims=True)
    x, y, z, w = np.moveaxis(q, -1, 0)
    rot = np.stack(
        [
            1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w),
            2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w),
            2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y),
        ],
        axis=-1,
    ).reshape(q.shape[:-1] + (3, 3))
    return rot.astype(_float_dtype(np.asarray(quat)))


def _quaternion_to_matrix_one(q: np.ndarray) -> list[float]:
    """``quaternion_to_matrix`` of one float64 quaternion as 9 Python floats (row-major): the
    same operations in the same order (~10 µs instead of ~130 µs of small numpy calls)."""
    x, y, z, w = q.reshape(4).tolist()
    norm = math.sqrt(x * x + y * y + z * z + w * w)
    if norm == 0.0:
        return [math.nan] * 9
    x, y, z, w = x / norm, y / norm, z / norm, w / norm
    return [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w),
            2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w),
            2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)]


def matrix_to_quaternion(rot: np.ndarray) -> np.ndarray:
    """Quaternions from rotation matrices (Shepperd's method, vectorised).

    For each matrix the largest of |w|, |x|, |y|, |z| is computed from the
    diagonal and the other three from off-diagonal sums/differences, which is
    stable for every rotation (including 180° turns).

    Args:
        rot: [..., 3, 3] rotation matrices.

    Returns:
        [..., 4] unit quaternions (x, y, z, w) with w ≥ 0.
    """
    m = np.asarray(rot, dtype=np.float64)
    if m.shape == (3, 3):
        return _matrix_to_quaternion_one(m).astype(_float_dtype(np.asarray(rot)))
    m00, m01, m02 = m[..., 0, 0], m[..., 0, 1], m[..., 0, 2]
    m10, m11, m12 = m[..., 1, 0], m[..., 1, 1], m[..., 1, 2]
    m20, m21, m22 = m[..., 2, 0], m[..., 2, 1], m[..., 2, 2]
    # 4·w², 4·x², 4·y², 4·z² (up to rounding).
    four_sq = np.stack(
        [1 + m00 + m11 + m22, 1 + m00 - m11 - m22, 1 - m00 + m11 - m22, 1 - m00 - m11 + m22],
        axis=-1,
    )
    # Candidate c (pivot on w, x, y, z) as (w, x, y, z) scaled by 4·pivot.
    cand = np.stack(
        [
            np.stack([four_sq[..., 0], m21 - m12, m02 - m20, m10 - m01], axis=-1),
            np.stack([m21 - m12, four_sq[..., 1], m10 + m01, m02 + m20], axis=-1),
            np.stack([m02 - m20, m10 + m01, four_sq[..., 2], m12 + m21], axis=-1),
            np.stack([m10 - m01, m02 + m20, m12 + m21, four_sq[..., 3]], axis=-1),
        ],
        axis=-2,
    )  # [..., 4 candidates, 4 components]
    best = np.argmax(four_sq, axis=-1)[..., None, None]
    wxyz = np.take_along_axis(cand, best, axis=-2)[..., 0, :]
    wxyz = wxyz / np.maximum(np.linalg.norm(wxyz, axis=-1, keepdims=True), _EPS)
    wxyz = np.where(wxyz[..., :1] < 0, -wxyz, wxyz)
    return wxyz[..., [1, 2, 3, 0]].astype(_float_dtype(np.asarray(rot)))


def _matrix_to_quaternion_one(m: np.ndarray) -> np.ndarray:
    """``matrix_to_quaternion`` of one 3x3 matrix in Python floats: the same formulas and
    pivot (the first largest of 4w², 4x², 4y², 4z²) without a dozen small numpy calls
    (~5 µs instead of ~200 µs; the node converts a pose three times per frame)."""
    (m00, m01, m02), (m10, m11, m12), (m20, m21, m22) = m.tolist()
    four_sq = (1 + m00 + m11 + m22, 1 + m00 - m11 - m22, 1 - m00 + m11 - m22, 1 - m00 - m11 + m22)
    best = max(range(4), key=four_sq.__getitem__)
    w, x, y, z = ((four_sq[0], m21 - m12, m02 - m20, m10 - m01),
                  (m21 - m12, four_sq[1], m10 + m01, m02 + m20),
                  (m02 - m20, m10 + m01, four_sq[2], m12 + m21),
                  (m10 - m01, m02 + m20, m12 + m21, four_sq[3]))[best]
    norm = max(math.sqrt(w * w + x * x + y * y + z * z), _EPS)
    sign = -1.0 if w / norm < 0 else 1.0
    return np.array([sign * (x / norm), sign * (y / norm), sign * (z / norm), sign * (w / norm)])


# ----------------------------------------------------------------------------- model outputs

def pose_enc_to_c2w(pose_enc: np.ndarray) -> np.ndarray:
    """Decode the model's pose encoding to camera-to-world matrices (SPEC §6).

    Args:
        pose_enc: [..., 9] = translation (3, camera centre in world units),
            quaternion x, y, z, w (4, normalised here), fov_h, fov_w (ignored).

    Returns:
        [..., 4, 4] camera-to-world transforms, OpenCV camera axes
        (float64 if the input is float64, else float32).
    """
    enc = np.asarray(pose_enc)
    if enc.shape[-1:] != (9,):
        raise ValueError(f"pose_enc must have shape [..., 9], got {enc.shape}")
    c2w = np.zeros(enc.shape[:-1] + (4, 4), dtype=np.float64)
    c2w[..., :3, :3] = quaternion_to_matrix(enc[..., 3:7].astype(np.float64))
    c2w[..., :3, 3] = enc[..., :3]
    c2w[..., 3, 3] = 1.0
    return c2w.astype(_float_dtype(enc))


def fov_to_intrinsics(fov_h, fov_w, height: int, width: int) -> np.ndarray:
    """Pinhole intrinsics from fields of view (SPEC §6).

    ``fy = (H/2)/tan(fov_h/2)``, ``fx = (W/2)/tan(fov_w/2)``, principal point
    ``(W/2, H/2)``. A FoV of 0 gives an infinite focal length (no warning).

    Args:
        fov_h, fov_w: vertical / horizontal field of view in radians, scalars or
            arrays of one broadcastable shape [...].
        height, width: image size in pixels (model resolution).

    Returns:
        [..., 3, 3] intrinsic matrices in pixels.
    """
    fov_h, fov_w = np.broadcast_arrays(np.asarray(fov_h), np.asarray(fov_w))
    with np.errstate(divide="ignore", invalid="ignore"):
        fy = (height / 2.0) / np.tan(fov_h.astype(np.float64) / 2.0)
        fx = (width / 2.0) / np.tan(fov_w.astype(np.float64) / 2.0)
    K = np.zeros(fov_h.shape + (3, 3), dtype=np.float64)
    K[..., 0, 0] = fx
    K[..., 1, 1] = fy
    K[..., 0, 2] = width / 2.0
    K[..., 1, 2] = height / 2.0
    K[..., 2, 2] = 1.0
    return K.astype(_float_dtype(fov_h, fov_w))


def pose_enc_to_intrinsics(pose_enc: np.ndarray, height: int, width: int) -> np.ndarray:
    """Intrinsics [..., 3, 3] (pixels) from pose_enc [..., 9] (its entries 7, 8)."""
    enc = np.asarray(pose_enc)
    return fov_to_intrinsics(enc[..., 7], enc[..., 8], height, width)


def unproject_depth(depth: np.ndarray, K: np.ndarray, c2w: np.ndarray) -> np.ndarray:
    """Lift a z-depth map to world points.

    Pixel (v=row, u=column) with depth z maps to the camera point
    ``((u − cx)·z/fx, (v − cy)·z/fy, z)`` — integer pixel indices, no half-pixel
    offset — then to world by ``c2w``.

    Args:
        depth: [..., H, W] z-depth along the optical axis (model units).
        K: [..., 3, 3] intrinsics in pixels.
        c2w: [..., 4, 4] (or [..., 3, 4]) camera-to-world transforms, OpenCV axes.

    Returns:
        [..., H, W, 3] world points.
    """
    depth = np.asarray(depth)
    K = np.asarray(K)
    c2w = np.asarray(c2w)
    dtype = _float_dtype(depth, K, c2w)
    height, width = depth.shape[-2:]
    fx, fy = K[..., 0, 0, None, None], K[..., 1, 1, None, None]
    cx, cy = K[..., 0, 2, None, None], K[..., 1, 2, None, None]
    u = np.arange(width, dtype=dtype)
    v = np.arange(height, dtype=dtype)[:, None]
    cam = np.stack(
        np.broadcast_arrays((u - cx) * depth / fx, (v - cy) * depth / fy, depth), axis=-1
    )  # [..., H, W, 3]
    flat = cam.reshape(cam.shape[:-3] + (height * width, 3))  # [..., H·W, 3]
    world = rotate(flat, c2w[..., :3, :3]) + c2w[..., None, :3, 3]
    return world.reshape(cam.shape).astype(dtype, copy=False)


def unproject_pixels(depth: np.ndarray, K: np.ndarray, c2w: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``unproject_depth(depth, K, c2w).reshape(-1, 3)[index]`` for one [H, W] map, computed for
    the selected pixels only (``index``: flat row-major pixel indices)."""
    depth = np.asarray(depth)
    K, c2w, index = np.asarray(K), np.asarray(c2w), np.asarray(index)
    dtype = _float_dtype(depth, K, c2w)
    width = depth.shape[-1]
    z = depth.reshape(-1)[index].astype(dtype, copy=False)
    v, u = np.divmod(index, width)
    cam = np.stack([(u.astype(dtype) - K[0, 2]) * z / K[0, 0], (v.astype(dtype) - K[1, 2]) * z / K[1, 1], z], -1)
    return (rotate(cam, c2w[:3, :3]) + c2w[:3, 3]).astype(dtype, copy=False)


def rotate(points: np.ndarray, rot: np.ndarray) -> np.ndarray:
    """``points @ rot.T`` ([..., N, 3] by [..., 3, 3], broadcast) as three multiply-adds: no BLAS
    call, so no BLAS thread pool wakes (and spins) on the node's output thread for a small
    product."""
    rot = np.asarray(rot)
    return points[..., 0:1] * _column(rot, 0) + points[..., 1:2] * _column(rot, 1) + points[..., 2:3] * _column(rot, 2)


def _column(rot: np.ndarray, j: int) -> np.ndarray:
    """Column ``j`` of one [3, 3] as [3], of a batch [..., 3, 3] as [..., 1, 3] (broadcasting
    against the points' [..., N, 1])."""
    return rot[:, j] if rot.ndim == 2 else rot[..., :, j][..., None, :]


def select_points(
    points: np.ndarray,
    colors: np.ndarray | None,
    conf: np.ndarray,
    conf_threshold: float = 1.5,
    stride: int = 10,
):
    """Keep points with confidence > threshold, then every ``stride``-th of them
    (the reference viewer's rule: 1.5 and 10).

    Args:
        points: [..., 3] world points (e.g. [S, H, W, 3]).
        colors: [..., 3] per-point colours (any dtype, kept as is) or None.
        conf: [...] confidence (≥ 1 from the model), same leading shape.
        conf_threshold: strict lower bound on confidence.
        stride: keep every stride-th point after thresholding (1 = all).

    Returns:
        (points [M, 3], colors [M, 3] or None, conf [M]), in row-major order.
    """
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    points = np.asarray(points).reshape(-1, 3)
    conf = np.asarray(conf).reshape(-1)
    if conf.shape[0] != points.shape[0]:
        raise ValueError(f"conf has {conf.shape[0]} values for {points.shape[0]} points")
    idx = np.flatnonzero(conf > conf_threshold)[::stride]
    kept_colors = None
    if colors is not None:
        colors = np.asarray(colors).reshape(-1, 3)
        if colors.shape[0] != points.shape[0]:
            raise ValueError(f"colors has {colors.shape[0]} rows for {points.shape[0]} points")
        kept_colors = colors[idx]
    return points[idx], kept_colors, conf[idx]


def voxel_downsample(points: np.ndarray, colors: np.ndarray | None, voxel_size: float):
    """Merge points that fall into the same cubic voxel (for map accumulation).

    Voxel of a point = ``floor(p / voxel_size)``. Each occupied voxel yields one
    point, the mean of its points, and one colour, the mean of its colours
    (rounded back for integer colours). Non-finite points are dropped.

    Args:
        points: [N, 3] points (world units).
        colors: [N, 3] colours or None.
        voxel_size: voxel edge length in world units, > 0.

    Returns:
        (points [M, 3], colors [M, 3] or None) with M = number of occupied voxels,
        ordered by voxel index; dtypes as the inputs.
    """
    if not voxel_size > 0:
        raise ValueError(f"voxel_size must be > 0, got {voxel_size}")
    points = np.asarray(points)
    finite = np.isfinite(points).all(axis=-1)
    pts = points[finite]
    cols = None if colors is None else np.asarray(colors)[finite]
    if pts.shape[0] == 0:
        return pts, cols
    keys = np.floor(pts.astype(np.float64) / voxel_size).astype(np.int64)  # [N, 3]
    _, inverse, counts = np.unique(_pack_keys(keys), return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    out_pts = _segment_mean(pts.astype(np.float64), inverse, counts).astype(points.dtype)
    out_cols = None
    if cols is not None:
        mean = _segment_mean(cols.astype(np.float64), inverse, counts)
        if np.issubdtype(cols.dtype, np.integer):
            mean = np.rint(mean)
        out_cols = mean.astype(cols.dtype)
    return out_pts, out_cols


def _pack_keys(keys: np.ndarray) -> np.ndarray:
    """One sortable key per row of integer voxel coords [N, 3] (int64 when the
    range fits, else a void view of the rows)."""
    keys = keys - keys.min(axis=0)
    extent = keys.max(axis=0).astype(np.float64) + 1
    if np.prod(extent) < 2.0**62:
        return np.ravel_multi_index(keys.T, tuple(int(e) for e in extent))
    rows = np.ascontiguousarray(keys)
    return rows.view(np.dtype((np.void, rows.dtype.itemsize * 3))).reshape(-1)


def _segment_mean(values: np.ndarray, inverse: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Mean of values [N, C] per group id ``inverse`` [N] → [G, C]."""
    sums = np.stack(
        [np.bincount(inverse, weights=col, minlength=counts.size) for col in np.ascontiguousarray(values.T)], axis=-1
    )
    return sums / counts[:, None]


# ----------------------------------------------------------------------------- Sim(3)

def umeyama_sim3(src: np.ndarray, dst: np.ndarray, with_scale: bool = True):
    """Least-squares similarity transform mapping ``src`` onto ``dst`` (Umeyama 1991).

    Minimises ``Σ ||dst_i − (s·R·src_i + t)||²``.

    Args:
        src, dst: [N, 3] corresponding points (N ≥ 3, src not all coincident),
            e.g. camera centres of two trajectories.
        with_scale: estimate s; otherwise s = 1 (rigid SE(3) fit).

    Returns:
        (s float, R [3, 3] rotation with det +1, t [3]), all float64.
    """
    src = np.asarray(src, dtype=np.float64)
    dst = np.asarray(dst, dtype=np.float64)
    if src.shape != dst.shape or src.ndim != 2 or src.shape[1] != 3:
        raise ValueError(f"src and dst must both be [N, 3], got {src.shape} and {dst.shape}")
    if src.shape[0] < 3:
        raise ValueError(f"need at least 3 point pairs, got {src.shape[0]}")
    mu_src, mu_dst = src.mean(axis=0), dst.mean(axis=0)
    src_c, dst_c = src - mu_src, dst - mu_dst
    var_src = np.mean(np.sum(src_c**2, axis=1))
    if var_src < _EPS:
        raise ValueError("src points are (nearly) coincident: alignment is undefined")
    cov = dst_c.T @ src_c / src.shape[0]  # [3, 3]
    u, d, vt = np.linalg.svd(cov)
    sign = np.ones(3)
    if np.linalg.det(u) * np.linalg.det(vt) < 0:
        sign[2] = -1.0
    rot = (u * sign) @ vt
    scale = float(np.sum(d * sign) / var_src) if with_scale else 1.0
    trans = mu_dst - scale * rot @ mu_src
    return scale, rot, trans


def apply_sim3(scale: float, rot: np.ndarray, trans: np.ndarray, points: np.ndarray) -> np.ndarray:
    """``s·R·p + t`` for points [..., 3] → [..., 3]."""
    points = np.asarray(points)
    return scale * points @ np.asarray(rot).T + np.asarray(trans)


def apply_sim3_to_poses(
    scale: float, rot: np.ndarray, trans: np.ndarray, c2w: np.ndarray
) -> np.ndarray:
    """Re-express camera-to-world poses [..., 4, 4] in the Sim(3)-mapped world.

    New rotation ``R·R_c``, new camera centre ``s·R·t_c + t``; the camera's own
    scale is unchanged, so the result is again a rigid camera-to-world transform.
    """
    c2w = np.asarray(c2w)
    out = np.array(c2w, dtype=np.result_type(c2w, np.float64), copy=True)
    out[..., :3, :3] = np.asarray(rot) @ c2w[..., :3, :3]
    out[..., :3, 3] = apply_sim3(scale, rot, trans, c2w[..., :3, 3])
    return out


# ----------------------------------------------------------------------------- REP 103 map frame
OPTICAL_TO_REP103 = np.array(
    [[0.0, 0.0, 1.0, 0.0],    # map x (forward) = optical z
     [-1.0, 0.0, 0.0, 0.0],   # map y (left)    = -optical x
     [0.0, -1.0, 0.0, 0.0],   # map z (up)      = -optical y
     [0.0, 0.0, 0.0, 1.0]])
"""``T_M_W``: points of the model's world frame (optical axes x right, y down,
z forward) expressed in the REP-103 map frame (x forward, y left, z up)."""
OPTICAL_TO_REP103.setflags(write=False)

_REP103_TO_OPTICAL = OPTICAL_TO_REP103.T.copy()  # inverse of a pure rotation
_REP103_TO_OPTICAL.setflags(write=False)


def optical_pose_to_map(c2w: np.ndarray, optical_child: bool = True) -> np.ndarray:
    """Re-express the model's camera-to-world pose in the REP-103 map frame.

    Args:
        c2w: [..., 4, 4] ``T_W_C``, camera optical frame -> model world frame.
        optical_child: True returns ``T_M_C`` (child = the camera's optical
            frame, as for images and TF to ``*_optical_frame``); False returns
            the pose of a REP-103 camera body frame (x forward, y left, z up)
            at the same place, ``T_M_C @ inv(OPTICAL_TO_REP103)``.

    Returns:
        [..., 4, 4] float64 pose in the map frame.
    """
    pose = OPTICAL_TO_REP103 @ np.asarray(c2w, dtype=np.float64)
    return pose if optical_child else pose @ _REP103_TO_OPTICAL


def points_to_map(points: np.ndarray) -> np.ndarray:
    """[..., 3] points of the model's world frame -> REP-103 map frame (float32 stays float32)."""
    pts = np.asarray(points)
    rot = OPTICAL_TO_REP103[:3, :3].astype(np.result_type(pts.dtype, np.float32))
    return rotate(pts, rot)


def rotation_angle_deg(rot_a: np.ndarray, rot_b: np.ndarray) -> np.ndarray:
    """Angle (degrees) of the relative rotation ``rot_aᵀ · rot_b`` for [..., 3, 3] inputs."""
    rel = np.swapaxes(np.asarray(rot_a, dtype=np.float64), -1, -2) @ np.asarray(rot_b, dtype=np.float64)
    cos = (np.trace(rel, axis1=-2, axis2=-1) - 1.0) / 2.0
    return np.degrees(np.arccos(np.clip(cos, -1.0, 1.0)))
