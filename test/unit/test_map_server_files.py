"""map_server files (lingbot_map_ros.io.map_server): map.yaml + PGM as Nav2's map_server reads
them, image orientation, round trips, refusals, and crash safety (exceptions injected between
the steps of a save, and a child process that dies between the two renames).
"""
from __future__ import annotations

import errno
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from lingbot_map_ros.io import atomic, map_server
from lingbot_map_ros.io.atomic import STALE_AFTER_S, StagedFile
from lingbot_map_ros.io.map_server import (FREE_PIXEL, OCCUPIED_PIXEL, UNKNOWN_PIXEL, MapFile, MapFilesError,
                                          grid_to_image, image_to_grid, load_map_files, parse_map_yaml,
                                          save_map_files)
from lingbot_map_ros.robot.occupancy import GridConfig, GroundReference, OccupancyGridBuilder

REPO = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT = 60.0


def asymmetric_map(origin=(-1.5, 2.25, 0.0), resolution=0.05) -> MapFile:
    """3 x 2 cells, every value distinct per position: row 0 = [100, 0, -1], row 1 = [0, -1, 100]."""
    data = np.array([100, 0, -1, 0, -1, 100], np.int8)
    return MapFile(resolution=resolution, origin=origin, width=3, height=2, data=data)


def room_snapshot(yaw=0.3):
    """A snapshot of a small scene: a wall 1.5 m ahead of a camera at the ground origin, map frame yawed."""
    map_from_ground = np.eye(4)
    map_from_ground[:2, :2] = [[math.cos(yaw), -math.sin(yaw)], [math.sin(yaw), math.cos(yaw)]]
    map_from_ground[:3, 3] = [0.7, -0.4, 0.0]
    grid = OccupancyGridBuilder(GridConfig(resolution=0.1))
    grid.set_reference(GroundReference(np.linalg.inv(map_from_ground)), metric=True)
    ys = np.arange(-1.0, 1.0, 0.02)
    wall = np.stack([np.full(ys.size, 1.53), ys, np.full(ys.size, 0.5)], 1)
    pts = wall @ map_from_ground[:3, :3].T + map_from_ground[:3, 3]
    centre = map_from_ground[:3, :3] @ [0.02, 0.03, 1.0] + map_from_ground[:3, 3]
    for _ in range(3):
        grid.add_frame(centre, pts.astype(np.float32))
    return grid.snapshot()


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# ----------------------------------------------------------------------------- conventions

def test_yaml_fields_parse_with_a_yaml_reader_and_match_map_server(tmp_path):
    saved = save_map_files(tmp_path, asymmetric_map())
    fields = yaml.safe_load(saved.yaml.read_text())
    assert fields == {"image": saved.image.name, "mode": "trinary", "resolution": 0.05,
                      "origin": [-1.5, 2.25, 0.0], "negate": 0, "occupied_thresh": 0.65, "free_thresh": 0.196}
    assert isinstance(fields["resolution"], float) and all(isinstance(v, float) for v in fields["origin"])
    assert "/" not in fields["image"] and saved.image.parent == saved.yaml.parent == tmp_path
    assert parse_map_yaml(saved.yaml.read_text()) == fields


def test_image_is_binary_p5_with_the_top_row_the_grids_last_row(tmp_path):
    saved = save_map_files(tmp_path, asymmetric_map())
    raw = saved.image.read_bytes()
    assert raw.startswith(b"P5\n") and raw.endswith(bytes([FREE_PIXEL, UNKNOWN_PIXEL, OCCUPIED_PIXEL] +
                                                           [OCCUPIED_PIXEL, FREE_PIXEL, UNKNOWN_PIXEL]))
    with Image.open(saved.image) as img:
        assert img.mode == "L" and img.size == (3, 2)
        pixels = np.asarray(img)
    # top row = grid row 1 = [0, -1, 100]; bottom row = grid row 0 = [100, 0, -1]
    assert pixels.tolist() == [[254, 205, 0], [0, 254, 205]]


def test_round_trip_gives_the_grid_back(tmp_path):
    original = asymmetric_map(origin=(0.125, -3.0, 0.5), resolution=0.025)
    loaded = load_map_files(save_map_files(tmp_path, original).yaml)
    assert (loaded.width, loaded.height, loaded.resolution, loaded.origin) == (3, 2, 0.025, (0.125, -3.0, 0.5))
    assert loaded.mode == "trinary" and not loaded.negate and loaded.save_id
    assert np.array_equal(loaded.data, original.data)


def test_probability_values_round_trip_through_the_trinary_quantisation(tmp_path):
    values = np.array([0, 20, 21, 64, 65, 100, -1, 101, 50, 127], np.int8)
    expected = np.array([0, 0, -1, -1, 100, 100, -1, -1, -1, -1], np.int8)  # <= 20 free, >= 65 occupied
    grid = MapFile(resolution=0.1, origin=(0.0, 0.0, 0.0), width=5, height=2, data=values)
    assert np.array_equal(load_map_files(save_map_files(tmp_path, grid).yaml).data, expected)


def test_map_server_reading_rules_for_every_pixel_value():
    shade = np.arange(256, dtype=np.float64)[None, :] / 255.0
    grid = image_to_grid(shade, occupied_thresh=0.65, free_thresh=0.196)
    p = 1.0 - np.arange(256) / 255.0
    assert np.array_equal(grid, np.where(p > 0.65, 100, np.where(p < 0.196, 0, -1)))
    assert grid[UNKNOWN_PIXEL] == -1 and grid[FREE_PIXEL] == 0 and grid[OCCUPIED_PIXEL] == 100
    # ROS 2 map_saver's default free_thresh 0.25 would read unknown (205) as free: refused on save
    assert image_to_grid(shade, free_thresh=0.25)[UNKNOWN_PIXEL] == 0
    with pytest.raises(MapFilesError, match="free_thresh 0.25"):
        save_map_files("/nonexistent-never-created", asymmetric_map(), free_thresh=0.25)


def test_grid_to_image_rows_and_classes():
    data = np.array([[100, 0], [-1, 30], [65, 20]], np.int8).reshape(-1)
    assert grid_to_image(data, 2, 3).tolist() == [[0, 254], [205, 205], [0, 254]]


def test_snapshot_origin_is_the_map_frame_corner_with_yaw(tmp_path):
    snap = room_snapshot(yaw=0.3)
    saved = save_map_files(tmp_path, snap)
    loaded = load_map_files(saved.yaml)
    corner = snap.map_from_ground @ [snap.origin_xy[0], snap.origin_xy[1], 0.0, 1.0]
    assert np.allclose(loaded.origin, [corner[0], corner[1], 0.3], atol=1e-12)
    assert (loaded.width, loaded.height, loaded.resolution) == (snap.width, snap.height, 0.1)
    assert np.array_equal(loaded.data, snap.data) and (snap.data == 100).sum() >= 18


def test_a_tilted_ground_plane_is_refused(tmp_path):
    grid = OccupancyGridBuilder(GridConfig())
    tilt = np.eye(4)
    tilt[1:3, 1:3] = [[math.cos(0.2), -math.sin(0.2)], [math.sin(0.2), math.cos(0.2)]]
    grid.set_reference(GroundReference(tilt), metric=True)
    grid.add_frame(np.array([0.0, 0.0, 1.0]), np.array([[1.0, 0.0, 0.5]], np.float32))
    with pytest.raises(MapFilesError, match="tilted 11.46 deg"):
        save_map_files(tmp_path / "out", grid.snapshot())
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- refusals

def test_an_empty_or_unknown_grid_is_refused_and_touches_nothing(tmp_path):
    save_map_files(tmp_path, asymmetric_map())
    before = folder_bytes(tmp_path)
    empty = OccupancyGridBuilder(GridConfig()).snapshot()
    with pytest.raises(MapFilesError, match="empty"):
        save_map_files(tmp_path, empty)
    unknown = MapFile(resolution=0.1, origin=(0, 0, 0), width=2, height=2, data=np.full(4, -1, np.int8))
    with pytest.raises(MapFilesError, match="no known cell"):
        save_map_files(tmp_path, unknown)
    with pytest.raises(MapFilesError, match="empty"):
        save_map_files(tmp_path / "new", empty)
    assert folder_bytes(tmp_path) == before and not (tmp_path / "new").exists()


def test_inconsistent_grids_are_refused(tmp_path):
    with pytest.raises(MapFilesError, match="does not match 3 x 3 cells"):
        save_map_files(tmp_path, MapFile(0.1, (0, 0, 0), 3, 3, np.zeros(6, np.int8)))
    with pytest.raises(MapFilesError, match="bad map geometry"):
        save_map_files(tmp_path, MapFile(0.1, (float("nan"), 0, 0), 3, 2, np.zeros(6, np.int8)))
    with pytest.raises(MapFilesError, match="bad map geometry"):
        save_map_files(tmp_path, MapFile(0.0, (0, 0, 0), 3, 2, np.zeros(6, np.int8)))
    assert list(tmp_path.iterdir()) == []


def test_bad_folders_are_refused_clearly(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(MapFilesError, match="is not a folder"):
        save_map_files(tmp_path / "a_file", asymmetric_map())
    with pytest.raises(MapFilesError, match="cannot create folder"):
        save_map_files(tmp_path / "a_file" / "sub", asymmetric_map())
    with pytest.raises(MapFilesError, match="no folder"):
        save_map_files("  ", asymmetric_map())
    with pytest.raises(MapFilesError, match="invalid map file name"):
        save_map_files(tmp_path, asymmetric_map(), stem="../map")
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "map.yaml").symlink_to(tmp_path / "a_file")
    with pytest.raises(MapFilesError, match="symbolic link"):
        save_map_files(tmp_path / "linked", asymmetric_map())
    assert (tmp_path / "a_file").read_text() == "x"
    assert sorted(p.name for p in (tmp_path / "linked").iterdir()) == ["map.yaml"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_gives_a_reason(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(MapFilesError, match="cannot write map files in .*Permission denied"):
            save_map_files(folder, asymmetric_map())
    finally:
        folder.chmod(0o700)


def test_a_full_disk_gives_a_reason_and_leaves_the_old_pair(tmp_path, monkeypatch):
    save_map_files(tmp_path, asymmetric_map())
    before = folder_bytes(tmp_path)

    def full(final, write):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic, "stage", full)
    with pytest.raises(MapFilesError, match="cannot write map files in .*No space left on device.*unchanged"):
        save_map_files(tmp_path, asymmetric_map(origin=(1.0, 1.0, 0.0)))
    assert folder_bytes(tmp_path) == before


def test_nested_folders_are_created(tmp_path):
    saved = save_map_files(tmp_path / "x" / "y", asymmetric_map())
    assert saved.yaml == tmp_path / "x" / "y" / "map.yaml" and saved.image.exists()


# ----------------------------------------------------------------------------- crash safety

def test_a_new_save_replaces_the_pair_and_removes_the_old_image(tmp_path):
    first = save_map_files(tmp_path, asymmetric_map())
    second = save_map_files(tmp_path, asymmetric_map(origin=(5.0, 5.0, 0.0)))
    assert first.save_id != second.save_id and first.image.name != second.image.name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["map.yaml", second.image.name])
    assert load_map_files(second.yaml).origin == (5.0, 5.0, 0.0)


@pytest.mark.parametrize("point", ["writing the image", "writing the yaml", "renaming the yaml"])
def test_an_exception_during_a_save_leaves_the_old_pair(tmp_path, monkeypatch, point):
    old = save_map_files(tmp_path, asymmetric_map())
    before = folder_bytes(tmp_path)
    real_stage, real_commit = atomic.stage, StagedFile.commit

    def stage(final, write):
        if final.suffix == (".pgm" if point == "writing the image" else ".yaml") and point.startswith("writing"):
            def broken(f):
                f.write(b"half")
                raise RuntimeError("injected")
            return real_stage(final, broken)
        return real_stage(final, write)

    def commit(self):
        if point == "renaming the yaml" and self.final.suffix == ".yaml":
            raise RuntimeError("injected")
        return real_commit(self)

    monkeypatch.setattr(atomic, "stage", stage)
    monkeypatch.setattr(StagedFile, "commit", commit)
    with pytest.raises(RuntimeError, match="injected"):
        save_map_files(tmp_path, asymmetric_map(origin=(9.0, 9.0, 0.0)))
    assert folder_bytes(tmp_path) == before, "old pair intact, no temp file, no new image"
    assert load_map_files(old.yaml).origin == (-1.5, 2.25, 0.0)


CHILD = textwrap.dedent("""
    import os, sys
    import numpy as np
    from lingbot_map_ros.io import map_server
    from lingbot_map_ros.io.atomic import StagedFile
    real_commit = StagedFile.commit
    def commit(self):
        if self.final.suffix == ".yaml":
            os._exit(9)  # dies like a SIGKILL: no finally, no cleanup
        return real_commit(self)
    StagedFile.commit = commit
    grid = map_server.MapFile(resolution=0.2, origin=(7.0, 7.0, 0.0), width=2, height=1,
                              data=np.array([100, 0], np.int8))
    map_server.save_map_files(sys.argv[1], grid)
""")


def test_a_save_killed_between_the_renames_leaves_the_old_pair(tmp_path):
    old = save_map_files(tmp_path, asymmetric_map())
    yaml_before = old.yaml.read_bytes()
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=env, timeout=CHILD_TIMEOUT,
                          capture_output=True)
    assert proc.returncode == 9, proc.stderr.decode()[-2000:]
    names = sorted(p.name for p in tmp_path.iterdir())
    orphans = [n for n in names if n.endswith(".pgm") and n != old.image.name]
    assert len(orphans) == 1, names  # the new image got renamed; the yaml did not
    assert [n for n in names if n.startswith(".")] == [n for n in names if n.startswith(".map.yaml.tmp-")] != []
    assert old.yaml.read_bytes() == yaml_before
    loaded = load_map_files(old.yaml)
    assert loaded.origin == (-1.5, 2.25, 0.0) and np.array_equal(loaded.data, asymmetric_map().data)
    # the next save removes the orphan image and the yaml's temp file once they are stale (the writer is gone)
    for name in set(names) - {"map.yaml", old.image.name}:
        past = os.stat(tmp_path / name).st_mtime - STALE_AFTER_S - 1
        os.utime(tmp_path / name, (past, past))
    newest = save_map_files(tmp_path, asymmetric_map())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["map.yaml", newest.image.name])


# ----------------------------------------------------------------------------- reading other files

def test_reading_map_saver_style_files_and_png(tmp_path):
    pixels = np.array([[0, 254, 205, 100]], np.uint8)
    Image.fromarray(np.stack([pixels] * 3, -1)).save(tmp_path / "rgb.png")
    (tmp_path / "other.yaml").write_text(textwrap.dedent("""\
        ---
        # written by hand
        image: 'rgb.png'   # an RGB PNG
        resolution: 0.050000
        origin: [ -10.0 , -1e-05, 0 ]
        negate: false
        occupied_thresh: 0.65
        free_thresh: 0.196
        """))
    loaded = load_map_files(tmp_path / "other.yaml")
    assert loaded.mode == "trinary" and loaded.origin == (-10.0, -1e-05, 0.0) and loaded.save_id is None
    assert loaded.data.tolist() == [100, 0, -1, -1]  # 100 -> p = 0.61: between the thresholds
    (tmp_path / "neg.yaml").write_text("image: rgb.png\nmode: raw\nresolution: 1\norigin: [0, 0, 0]\n"
                                       "negate: 1\noccupied_thresh: 0.65\nfree_thresh: 0.196\n")
    assert load_map_files(tmp_path / "neg.yaml").data.tolist() == [0, -1, -1, 100]


@pytest.mark.parametrize("text,message", [
    ("resolution: 0.05\norigin: [0, 0, 0]\nnegate: 0\noccupied_thresh: 0.65\nfree_thresh: 0.196\n", "missing field 'image'"),
    ("image: m.pgm\nresolution: 0.05\norigin: [0, 0]\nnegate: 0\noccupied_thresh: 0.65\nfree_thresh: 0.196\n",
     "'origin' must be"),
    ("image: m.pgm\nresolution: -1\norigin: [0, 0, 0]\nnegate: 0\noccupied_thresh: 0.65\nfree_thresh: 0.196\n",
     "'resolution' must be > 0"),
    ("image: m.pgm\nresolution: 0.05\norigin: [0, 0, 0]\nnegate: 0\noccupied_thresh: 0.65\nfree_thresh: 0.196\n",
     "does not exist"),
    ("image: m.pgm\nmode: fancy\nresolution: 0.05\norigin: [0, 0, 0]\nnegate: 0\noccupied_thresh: 0.65\n"
     "free_thresh: 0.196\n", "'mode' must be"),
    ("image:\n  nested: 1\n", "line 1: 'image' has no value"),
    ("image: a\nimage: b\n", "line 2: duplicate key"),
    ("- a\n", "line 1: not a 'key: value'"),
])
def test_bad_map_files_are_refused_with_the_reason(tmp_path, text, message):
    (tmp_path / "m.yaml").write_text(text)
    with pytest.raises(MapFilesError, match=message):
        load_map_files(tmp_path / "m.yaml")


def test_the_yaml_subset_agrees_with_a_yaml_reader():
    text = textwrap.dedent("""\
        # comment
        image: "my map.pgm"  # trailing
        mode: trinary
        resolution: 0.05
        origin: [-12.5, 3.0e+2, -1.5707963267948966]
        negate: 0
        occupied_thresh: 0.65
        free_thresh: 0.196
        name: 'it''s # not a comment'
        """)
    assert parse_map_yaml(text) == yaml.safe_load(text)
