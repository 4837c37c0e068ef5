"""PLY / TUM round trips, the trajectory PNG, and crash-safe writing."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from PIL import Image

from lingbot_map_ros.geometry import quaternion_to_matrix
from lingbot_map_ros.io import export
from lingbot_map_ros.io.atomic import UnsafeDestinationError
from lingbot_map_ros.io.export import plot_trajectory_png, read_ply, read_tum, write_ply, write_tum


def random_c2w(rng, n):
    c2w = np.tile(np.eye(4), (n, 1, 1))
    c2w[:, :3, :3] = quaternion_to_matrix(rng.normal(size=(n, 4)))
    c2w[:, :3, 3] = np.cumsum(rng.normal(size=(n, 3)), axis=0)
    return c2w


# ----------------------------------------------------------------------------- PLY

def test_ply_roundtrip_with_colors(tmp_path):
    rng = np.random.default_rng(0)
    points = rng.normal(size=(1000, 3)).astype(np.float32)
    colors = rng.integers(0, 256, size=(1000, 3), dtype=np.uint8)
    path = tmp_path / "cloud.ply"
    write_ply(path, points, colors)
    data = path.read_bytes()
    header, body = data.split(b"end_header\n", 1)
    assert b"format binary_little_endian 1.0" in header and b"element vertex 1000" in header
    assert b"property float x" in header and b"property uchar red" in header
    assert len(body) == 1000 * 15  # 3 float32 + 3 uint8 per vertex
    p, c = read_ply(path)
    np.testing.assert_array_equal(p, points)
    np.testing.assert_array_equal(c, colors)


def test_ply_without_colors_and_float_colors(tmp_path):
    points = np.array([[0, 1, 2], [3, 4, 5]], dtype=np.float64)
    write_ply(tmp_path / "a.ply", points)
    p, c = read_ply(tmp_path / "a.ply")
    assert p.dtype == np.float32 and c is None
    np.testing.assert_array_equal(p, points)
    write_ply(tmp_path / "b.ply", points, np.array([[0.0, 0.5, 1.0], [1.0, 1.0, 0.0]]))
    np.testing.assert_array_equal(read_ply(tmp_path / "b.ply")[1], [[0, 128, 255], [255, 255, 0]])
    write_ply(tmp_path / "empty.ply", np.zeros((0, 3)), np.zeros((0, 3), np.uint8))
    p, c = read_ply(tmp_path / "empty.ply")
    assert p.shape == (0, 3) and c.shape == (0, 3)


def test_ply_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match=r"\[N, 3\]"):
        write_ply(tmp_path / "x.ply", np.zeros((4, 2)))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        write_ply(tmp_path / "x.ply", np.zeros((1, 3)), np.full((1, 3), 200.0))
    with pytest.raises(ValueError, match="colors must be"):
        write_ply(tmp_path / "x.ply", np.zeros((2, 3)), np.zeros((3, 3), np.uint8))
    (tmp_path / "ascii.ply").write_bytes(b"ply\nformat ascii 1.0\nelement vertex 0\nend_header\n")
    with pytest.raises(ValueError, match="binary_little_endian"):
        read_ply(tmp_path / "ascii.ply")


def test_read_ply_foreign_layout(tmp_path):
    # Extra properties, double coordinates and comments, as other tools write them.
    fields = [("x", "<f8"), ("y", "<f8"), ("z", "<f8"), ("nx", "<f4")]
    fields += [("red", "u1"), ("green", "u1"), ("blue", "u1")]
    rec = np.zeros(2, dtype=fields)
    rec["x"], rec["y"], rec["z"], rec["red"], rec["blue"] = [1, 2], [3, 4], [5, 6], [10, 20], [7, 8]
    header = (
        "ply\nformat binary_little_endian 1.0\ncomment made elsewhere\nelement vertex 2\n"
        "property double x\nproperty double y\nproperty double z\nproperty float nx\n"
        "property uchar red\nproperty uchar green\nproperty uchar blue\nend_header\n"
    )
    (tmp_path / "f.ply").write_bytes(header.encode() + rec.tobytes())
    p, c = read_ply(tmp_path / "f.ply")
    np.testing.assert_array_equal(p, [[1, 3, 5], [2, 4, 6]])
    np.testing.assert_array_equal(c, [[10, 0, 7], [20, 0, 8]])


# ----------------------------------------------------------------------------- TUM

def test_tum_roundtrip(tmp_path):
    rng = np.random.default_rng(1)
    c2w = random_c2w(rng, 30)
    stamps = 1_700_000_000.0 + np.arange(30) / 30.0 + 1.5e-7
    path = tmp_path / "traj.txt"
    write_tum(path, stamps, c2w)
    lines = [l for l in path.read_text().splitlines() if not l.startswith("#")]
    assert len(lines) == 30 and all(len(l.split()) == 8 for l in lines)
    assert lines[0].split()[0].startswith("1700000000.000000")  # 9 decimals written
    assert len(lines[0].split()[0].split(".")[1]) == 9
    t, back = read_tum(path)
    np.testing.assert_allclose(t, stamps, rtol=0, atol=1e-6)
    np.testing.assert_allclose(back, c2w, atol=1e-7)


def test_tum_quaternion_order(tmp_path):
    c2w = np.eye(4)[None].copy()
    c2w[0, :3, :3] = [[0, -1, 0], [1, 0, 0], [0, 0, 1]]  # 90° about z
    c2w[0, :3, 3] = [1, 2, 3]
    write_tum(tmp_path / "t.txt", [0.5], c2w)
    values = np.array(tmp_path.joinpath("t.txt").read_text().splitlines()[-1].split(), float)
    np.testing.assert_allclose(values, [0.5, 1, 2, 3, 0, 0, np.sqrt(0.5), np.sqrt(0.5)], atol=1e-9)


def test_tum_errors(tmp_path):
    with pytest.raises(ValueError, match="c2w"):
        write_tum(tmp_path / "t.txt", [0.0, 1.0], np.tile(np.eye(4), (3, 1, 1)))
    (tmp_path / "bad.txt").write_text("# header\n0 1 2 3 0 0 0 1\n1 2 3\n")
    with pytest.raises(ValueError, match="bad.txt:3"):
        read_tum(tmp_path / "bad.txt")


# ----------------------------------------------------------------------------- PNG

def test_trajectory_png(tmp_path):
    rng = np.random.default_rng(2)
    c2w = random_c2w(rng, 100)
    c2w[50, 0, 3] = np.nan  # skipped, not fatal
    path = tmp_path / "traj.png"
    plot_trajectory_png(path, c2w, "test run", size=(400, 300))
    img = Image.open(path)
    assert img.format == "PNG" and img.size == (400, 300)
    arr = np.asarray(img.convert("RGB")).astype(int)
    assert (arr != 255).any(axis=-1).mean() > 0.01  # something drawn
    assert len(np.unique(arr.reshape(-1, 3), axis=0)) > 4
    colours = {tuple(c) for c in arr.reshape(-1, 3)}
    assert (44, 160, 44) in colours and (214, 39, 40) in colours  # start / end markers
    assert (31, 119, 180) in colours  # path


def test_trajectory_png_degenerate(tmp_path):
    plot_trajectory_png(tmp_path / "one.png", np.eye(4)[None], "single pose")
    assert Image.open(tmp_path / "one.png").size == (640, 480)
    with pytest.raises(ValueError, match="finite"):
        plot_trajectory_png(tmp_path / "nan.png", np.full((3, 4, 4), np.nan))
    with pytest.raises(ValueError, match="size"):
        plot_trajectory_png(tmp_path / "small.png", np.eye(4)[None], size=(10, 10))


# ----------------------------------------------------------------------------- crash-safe writing

def test_writers_refuse_a_symlink_destination(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    for name, write in (("a.ply", lambda p: write_ply(p, np.zeros((2, 3)))),
                        ("a.tum", lambda p: write_tum(p, [0.0], np.eye(4)[None])),
                        ("a.png", lambda p: plot_trajectory_png(p, np.eye(4)[None]))):
        link = tmp_path / name
        link.symlink_to(victim)
        with pytest.raises(UnsafeDestinationError, match=f"{name} is a symbolic link"):
            write(link)
        assert link.is_symlink() and victim.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ply", "a.png", "a.tum", "victim.txt"]


def test_failed_write_keeps_the_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "cloud.ply"
    write_ply(path, np.ones((10, 3)))
    old = path.read_bytes()

    def disk_full(f, data):
        f.write(bytes(memoryview(data).cast("B")[:7]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export, "_write_chunked", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_ply(path, np.zeros((1000, 3)))
    assert path.read_bytes() == old and os.listdir(tmp_path) == ["cloud.ply"]


def test_large_ply_is_written_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(export, "CHUNK_BYTES", 1000)  # 15-byte vertices: chunks split records
    rng = np.random.default_rng(3)
    points = rng.normal(size=(777, 3)).astype(np.float32)
    colors = rng.integers(0, 256, (777, 3), np.uint8)
    write_ply(tmp_path / "c.ply", points, colors, comments=["made by a test"])
    assert b"comment made by a test\n" in (tmp_path / "c.ply").read_bytes()[:200]
    p, c = read_ply(tmp_path / "c.ply")
    np.testing.assert_array_equal(p, points)
    np.testing.assert_array_equal(c, colors)


def test_comments_must_be_one_ascii_line(tmp_path):
    with pytest.raises(ValueError, match="one line of ASCII"):
        write_ply(tmp_path / "x.ply", np.zeros((1, 3)), comments=["two\nlines"])
    with pytest.raises(ValueError, match="one line of ASCII"):
        write_tum(tmp_path / "x.tum", [0.0], np.eye(4)[None], comments=["caf\u00e9"])
    write_tum(tmp_path / "x.tum", [0.0], np.eye(4)[None], comments=["note"])
    assert (tmp_path / "x.tum").read_text().splitlines()[1] == "# note"
    assert read_tum(tmp_path / "x.tum")[0].tolist() == [0.0]
    assert sorted(os.listdir(tmp_path)) == ["x.tum"]
