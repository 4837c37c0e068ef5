"""Geometry helpers: fixture pose decoding, quaternions, unprojection, point
selection, voxel downsampling and Sim(3) alignment."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fixtures_path import fixture_dir as find_fixtures

from lingbot_map_ros.geometry import (
    apply_sim3,
    apply_sim3_to_poses,
    fov_to_intrinsics,
    matrix_to_quaternion,
    pose_enc_to_c2w,
    pose_enc_to_intrinsics,
    quaternion_to_matrix,
    rotate,
    select_points,
    umeyama_sim3,
    unproject_depth,
    unproject_pixels,
    voxel_downsample,
)



def fixture_dir() -> Path:
    """The reference fixture set, or skip the test (see test/fixtures_path.py)."""
    path = find_fixtures()
    if path is None:
        pytest.skip("reference fixtures not found: ../shared/fixtures/upstream_tiny (or $LINGBOT_FIXTURES)")
    return path


def random_rotations(rng, n):
    q = rng.normal(size=(n, 4))
    return quaternion_to_matrix(q)


# ----------------------------------------------------------------------------- fixture

@pytest.mark.parametrize("name", ["reference_kf1.npz", "reference_kf2.npz"])
def test_fixture_pose_decoding(name):
    ref = np.load(fixture_dir() / name)
    c2w = pose_enc_to_c2w(ref["pose_enc"])
    assert c2w.shape == (12, 4, 4) and c2w.dtype == np.float32
    np.testing.assert_allclose(c2w[:, :3, :], ref["pose_3x4"], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(c2w[:, 3], np.broadcast_to([0, 0, 0, 1], (12, 4)))


@pytest.mark.parametrize("name", ["reference_kf1.npz", "reference_kf2.npz"])
def test_fixture_intrinsics_inf_aware(name):
    ref = np.load(fixture_dir() / name)
    height, width = ref["images"].shape[-2:]
    K = pose_enc_to_intrinsics(ref["pose_enc"], height, width)
    expected = ref["intrinsics"]
    assert K.shape == expected.shape and K.dtype == np.float32
    # FoV 0 → infinite focal length in the fixture; the inf pattern must match exactly.
    np.testing.assert_array_equal(np.isinf(K), np.isinf(expected))
    np.testing.assert_array_equal(np.isnan(K), np.isnan(expected))
    np.testing.assert_allclose(K, expected, rtol=1e-6, atol=0, equal_nan=True)
    if name == "reference_kf1.npz":
        assert np.isinf(expected).any() and np.isfinite(expected[7, 0, 0])  # both cases covered


# ----------------------------------------------------------------------------- quaternions

def test_quaternion_roundtrip_random():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(1000, 4))
    q_unit = q / np.linalg.norm(q, axis=1, keepdims=True)
    q_unit *= np.sign(q_unit[:, 3:])
    rot = quaternion_to_matrix(q)
    identity = np.broadcast_to(np.eye(3), rot.shape)
    np.testing.assert_allclose(rot @ np.swapaxes(rot, -1, -2), identity, atol=1e-12)
    np.testing.assert_allclose(np.linalg.det(rot), 1.0, atol=1e-12)
    back = matrix_to_quaternion(rot)
    assert np.all(back[:, 3] >= 0)
    np.testing.assert_allclose(back, q_unit, atol=1e-12)
    np.testing.assert_allclose(quaternion_to_matrix(-q), rot, atol=1e-15)


@pytest.mark.parametrize(
    "rot",
    [
        np.eye(3),
        np.diag([1.0, -1.0, -1.0]),  # 180° about x: w = 0
        np.diag([-1.0, 1.0, -1.0]),
        np.diag([-1.0, -1.0, 1.0]),
        np.array([[0.0, 1, 0], [1, 0, 0], [0, 0, -1]]),  # 180° about (1,1,0)/√2
    ],
)
def test_matrix_to_quaternion_special_cases(rot):
    q = matrix_to_quaternion(rot)
    assert q.shape == (4,) and q[3] >= 0
    np.testing.assert_allclose(np.linalg.norm(q), 1.0, atol=1e-12)
    np.testing.assert_allclose(quaternion_to_matrix(q), rot, atol=1e-12)


def test_quaternion_known_value():
    # 90° about z: (0, 0, sin45, cos45); maps x → y.
    q = np.array([0.0, 0.0, np.sqrt(0.5), np.sqrt(0.5)])
    np.testing.assert_allclose(quaternion_to_matrix(q) @ [1.0, 0, 0], [0, 1, 0], atol=1e-15)


def test_pose_enc_is_camera_to_world():
    enc = np.array([1.0, 2.0, 3.0, 0.0, 0.0, np.sqrt(0.5), np.sqrt(0.5), 0.5, 0.7])
    c2w = pose_enc_to_c2w(enc * 2.0)  # unnormalised quaternion
    assert c2w.dtype == np.float64
    np.testing.assert_allclose(c2w @ [0, 0, 0, 1.0], [2, 4, 6, 1])  # camera centre
    np.testing.assert_allclose(c2w[:3, :3] @ [1.0, 0, 0], [0, 1, 0], atol=1e-15)
    with pytest.raises(ValueError, match="9"):
        pose_enc_to_c2w(np.zeros(7))


# ----------------------------------------------------------------------------- intrinsics

def test_fov_to_intrinsics_values():
    K = fov_to_intrinsics(np.pi / 2, 2 * np.arctan(2.0), 56, 98)
    np.testing.assert_allclose(K, [[49 / 2, 0, 49], [0, 28, 28], [0, 0, 1]], atol=1e-12)
    batched = fov_to_intrinsics(np.full((2, 3), 0.9), np.full((2, 3), 1.1), 10, 20)
    assert batched.shape == (2, 3, 3, 3)
    assert fov_to_intrinsics(np.float32(0.0), np.float32(1.0), 10, 20).dtype == np.float32


# ----------------------------------------------------------------------------- unprojection

def make_pose(rng):
    c2w = np.eye(4)
    c2w[:3, :3] = random_rotations(rng, 1)[0]
    c2w[:3, 3] = rng.normal(size=3)
    return c2w


def test_unproject_plane():
    rng = np.random.default_rng(3)
    height, width = 12, 16
    K = np.array([[20.0, 0, 8], [0, 22.0, 6], [0, 0, 1]])
    c2w = make_pose(rng)
    # World plane n·p = d placed 5 units in front of the camera along its axis.
    normal = c2w[:3, :3] @ np.array([0.2, -0.1, 1.0])
    normal /= np.linalg.norm(normal)
    d = normal @ (c2w[:3, 3] + 5.0 * c2w[:3, 2])
    v, u = np.mgrid[0:height, 0:width].astype(np.float64)
    rays_cam = np.stack([(u - 8) / 20.0, (v - 6) / 22.0, np.ones_like(u)], axis=-1)  # z = 1
    rays_world = rays_cam @ c2w[:3, :3].T
    depth = (d - normal @ c2w[:3, 3]) / (rays_world @ normal)  # z-depth (ray z = 1)
    assert np.all(depth > 0)

    pts = unproject_depth(depth, K, c2w)
    assert pts.shape == (height, width, 3)
    np.testing.assert_allclose(pts @ normal, d, atol=1e-10)  # on the plane
    cam = (pts - c2w[:3, 3]) @ c2w[:3, :3]  # world → camera: Rᵀ(p − t)
    np.testing.assert_allclose(cam[..., 2], depth, atol=1e-10)
    proj = cam @ K.T
    np.testing.assert_allclose(proj[..., 0] / proj[..., 2], u, atol=1e-9)  # u = column
    np.testing.assert_allclose(proj[..., 1] / proj[..., 2], v, atol=1e-9)  # v = row


def test_unproject_identity_pixel_convention():
    K = np.array([[2.0, 0, 1], [0, 4.0, 2], [0, 0, 1]])
    pts = unproject_depth(np.full((3, 4), 2.0), K, np.eye(4))
    np.testing.assert_allclose(pts[2, 1], [0.0, 0.0, 2.0])  # pixel (row 2, col 1) = principal point
    np.testing.assert_allclose(pts[0, 3], [(3 - 1) * 2 / 2.0, (0 - 2) * 2 / 4.0, 2.0])


def test_unproject_pixels_is_the_selected_part_of_unproject_depth():
    rng = np.random.default_rng(7)
    depth = rng.uniform(0.5, 4, size=(6, 9)).astype(np.float32)
    K = np.array([[7.0, 0, 4.2], [0, 6.5, 2.9], [0, 0, 1]], np.float32)
    c2w = make_pose(rng).astype(np.float32)
    index = np.array([0, 5, 9, 17, 53])
    full = unproject_depth(depth, K, c2w).reshape(-1, 3)
    part = unproject_pixels(depth, K, c2w, index)
    assert part.shape == (5, 3) and part.dtype == np.float32
    np.testing.assert_allclose(part, full[index], rtol=1e-6, atol=1e-6)
    assert unproject_pixels(depth, K, c2w, np.zeros(0, np.int64)).shape == (0, 3)


def test_rotate_is_a_matrix_product():
    rng = np.random.default_rng(8)
    rots = random_rotations(rng, 4)  # [4, 3, 3]
    pts = rng.normal(size=(4, 10, 3))
    np.testing.assert_allclose(rotate(pts, rots), pts @ np.swapaxes(rots, -1, -2), atol=1e-12)
    np.testing.assert_allclose(rotate(pts[0], rots[0]), pts[0] @ rots[0].T, atol=1e-12)  # one [N, 3] set
    np.testing.assert_allclose(rotate(pts[0, 0], rots[0]), rots[0] @ pts[0, 0], atol=1e-12)  # one point


def test_unproject_batched_matches_single():
    rng = np.random.default_rng(4)
    depth = rng.uniform(1, 3, size=(3, 5, 7)).astype(np.float32)
    fov_h, fov_w = rng.uniform(0.5, 1.5, (2, 3))
    K = fov_to_intrinsics(fov_h, fov_w, 5, 7).astype(np.float32)
    c2w = np.stack([make_pose(rng) for _ in range(3)]).astype(np.float32)
    batched = unproject_depth(depth, K, c2w)
    assert batched.shape == (3, 5, 7, 3) and batched.dtype == np.float32
    for i in range(3):
        np.testing.assert_allclose(batched[i], unproject_depth(depth[i], K[i], c2w[i]), rtol=1e-6)


# ----------------------------------------------------------------------------- selection

def test_select_points_threshold_then_stride():
    points = np.arange(2 * 5 * 3, dtype=np.float32).reshape(2, 5, 3)
    colors = np.arange(2 * 5 * 3, dtype=np.uint8).reshape(2, 5, 3)
    conf = np.array([[1.0, 2.0, 1.5, 3.0, 2.5], [1.6, 1.0, 4.0, 1.2, 9.0]])
    # conf > 1.5 (strict): flat indices 1, 3, 4, 5, 7, 9 → every 2nd: 1, 4, 7
    p, c, k = select_points(points, colors, conf, conf_threshold=1.5, stride=2)
    np.testing.assert_array_equal(p, points.reshape(-1, 3)[[1, 4, 7]])
    np.testing.assert_array_equal(c, colors.reshape(-1, 3)[[1, 4, 7]])
    np.testing.assert_array_equal(k, [2.0, 2.5, 4.0])
    p, c, k = select_points(points, None, conf, 100.0, 1)
    assert p.shape == (0, 3) and c is None and k.shape == (0,)
    with pytest.raises(ValueError, match="stride"):
        select_points(points, None, conf, 1.5, 0)


# ----------------------------------------------------------------------------- voxels

@pytest.mark.parametrize("offset", [0.0, 1e16])
def test_voxel_downsample_bounds(offset):
    rng = np.random.default_rng(5)
    voxel = 0.25
    points = rng.uniform(-2, 2, size=(5000, 3))
    if offset:  # one far-away point: exercises the wide-range key path
        points[0] = offset
    colors = rng.integers(0, 256, size=(5000, 3), dtype=np.uint8)
    points[10] = np.nan
    out, out_colors = voxel_downsample(points, colors, voxel)

    finite = np.isfinite(points).all(axis=1)
    keys_in = {tuple(k) for k in np.floor(points[finite] / voxel).astype(np.int64)}
    keys_out = np.floor(out / voxel).astype(np.int64)
    assert out.shape == (len(keys_in), 3) and out_colors.shape == out.shape
    assert out.dtype == points.dtype and out_colors.dtype == np.uint8
    assert {tuple(k) for k in keys_out} == keys_in  # one point per occupied voxel, each inside it
    # The colour of a voxel is the rounded mean of its members.
    first = keys_out[1]
    members = np.all(np.floor(points[finite] / voxel).astype(np.int64) == first, axis=1)
    np.testing.assert_array_equal(out_colors[1], np.rint(colors[finite][members].mean(axis=0)))
    np.testing.assert_allclose(out[1], points[finite][members].mean(axis=0))


def test_voxel_downsample_edge_cases():
    pts, cols = voxel_downsample(np.zeros((0, 3), np.float32), None, 0.1)
    assert pts.shape == (0, 3) and cols is None
    three = np.array([[0.01, 0, 0], [0.02, 0, 0], [0.5, 0, 0]], np.float32)
    pts, cols = voxel_downsample(three, None, 0.1)
    np.testing.assert_allclose(pts, [[0.015, 0, 0], [0.5, 0, 0]], rtol=1e-6)
    with pytest.raises(ValueError, match="voxel_size"):
        voxel_downsample(pts, None, 0.0)


# ----------------------------------------------------------------------------- Sim(3)

def test_umeyama_recovers_sim3():
    rng = np.random.default_rng(6)
    src = rng.normal(size=(50, 3))
    s_true, R_true, t_true = 2.7, random_rotations(rng, 1)[0], rng.normal(size=3)
    dst = apply_sim3(s_true, R_true, t_true, src)
    s, R, t = umeyama_sim3(src, dst)
    assert s == pytest.approx(s_true, rel=1e-12)
    np.testing.assert_allclose(R, R_true, atol=1e-12)
    np.testing.assert_allclose(t, t_true, atol=1e-12)
    np.testing.assert_allclose(apply_sim3(s, R, t, src), dst, atol=1e-12)


def test_umeyama_rigid_and_reflection_guard():
    rng = np.random.default_rng(7)
    src = rng.normal(size=(20, 3))
    R_true = random_rotations(rng, 1)[0]
    dst = src @ R_true.T + 1.0
    s, R, t = umeyama_sim3(src, dst, with_scale=False)
    assert s == 1.0
    np.testing.assert_allclose(R, R_true, atol=1e-12)
    # A mirrored target must still give a proper rotation.
    _, R_m, _ = umeyama_sim3(src, src * [1, 1, -1])
    assert np.linalg.det(R_m) == pytest.approx(1.0)


def test_umeyama_errors():
    with pytest.raises(ValueError, match="at least 3"):
        umeyama_sim3(np.zeros((2, 3)), np.zeros((2, 3)))
    with pytest.raises(ValueError, match="coincident"):
        umeyama_sim3(np.ones((5, 3)), np.zeros((5, 3)))
    with pytest.raises(ValueError, match=r"\[N, 3\]"):
        umeyama_sim3(np.zeros((5, 3)), np.zeros((4, 3)))


def test_apply_sim3_to_poses():
    rng = np.random.default_rng(8)
    c2w = np.stack([make_pose(rng) for _ in range(4)])
    s, R, t = 0.5, random_rotations(rng, 1)[0], rng.normal(size=3)
    out = apply_sim3_to_poses(s, R, t, c2w)
    np.testing.assert_allclose(out[:, :3, 3], apply_sim3(s, R, t, c2w[:, :3, 3]))
    np.testing.assert_allclose(out[:, :3, :3], R @ c2w[:, :3, :3])
    np.testing.assert_allclose(np.linalg.det(out[:, :3, :3]), 1.0)
    np.testing.assert_array_equal(out[:, 3], np.broadcast_to([0, 0, 0, 1.0], (4, 4)))


def test_one_matrix_quaternion_is_the_batched_one_exactly():
    """The scalar path for a single 3x3 matrix (used per published pose) gives the batched
    path's numbers bit for bit, including the 180-degree turns where the pivot changes."""
    from lingbot_map_ros.geometry import matrix_to_quaternion

    rng = np.random.default_rng(7)
    q = rng.normal(size=(500, 4))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    x, y, z, w = q.T
    rots = np.stack([
        np.stack([1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)], -1),
        np.stack([2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)], -1),
        np.stack([2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)], -1)], -2)
    special = np.stack([np.eye(3), np.diag([1.0, -1, -1]), np.diag([-1.0, 1, -1]), np.diag([-1.0, -1, 1])])
    rots = np.concatenate([rots, special])
    batched = matrix_to_quaternion(rots)
    for r, b in zip(rots, batched):
        one = matrix_to_quaternion(r)
        assert one.shape == (4,) and np.array_equal(one, b)
        assert one[3] >= 0
    assert matrix_to_quaternion(rots[0].astype(np.float32)).dtype == np.float32


def test_one_quaternion_matrix_is_the_batched_one_exactly():
    """The scalar path for one quaternion (every frame's pose) gives the batched path's
    numbers bit for bit, in both dtypes and shapes [4] / [1, 4]; a zero quaternion gives NaN
    (as the batched path) rather than raising."""
    from lingbot_map_ros.geometry import pose_enc_to_c2w, quaternion_to_matrix

    rng = np.random.default_rng(11)
    quats = np.concatenate([rng.normal(size=(300, 4)) * rng.uniform(0.01, 100, size=(300, 1)),
                            [[0, 0, 0, 1.0], [1.0, 0, 0, 0], [0, 0, 0, -3.0]]])
    for dtype in (np.float64, np.float32):
        qs = quats.astype(dtype)
        batched = quaternion_to_matrix(qs)
        assert batched.dtype == dtype
        for q, b in zip(qs, batched):
            one = quaternion_to_matrix(q)
            assert one.shape == (3, 3) and one.dtype == dtype and np.array_equal(one, b)
            assert np.array_equal(quaternion_to_matrix(q[None]), b[None])
    assert np.isnan(quaternion_to_matrix(np.zeros(4))).all()
    assert np.isnan(quaternion_to_matrix(np.zeros((2, 4)))).all()
    enc = rng.normal(size=(5, 9)).astype(np.float32)
    both = pose_enc_to_c2w(enc)
    for e, b in zip(enc, both):
        np.testing.assert_array_equal(pose_enc_to_c2w(e[None])[0], b)
