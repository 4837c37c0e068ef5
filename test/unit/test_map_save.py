"""~/save_map's files (lingbot_map_ros.io.map_save): paths, refusals, crash safety, one id per pair.

Crash tests run a child Python that saves a map and is SIGKILLed at a chosen point
(half-way through a file, after both temp files, between the two renames); the
folder is then inspected as an operator would find it.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from lingbot_map_ros.io.atomic import STALE_AFTER_S
from lingbot_map_ros.io.export import read_ply, read_tum
from lingbot_map_ros.io.map_save import (MAP_FILE, TRAJECTORY_FILE, MapSaveError, check_map_pair, read_save_id,
                                         read_save_tag, resolve_save_directory, save_map_pair)

REPO = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT = 60.0
TEMP_NAME = re.compile(r"^\.(map\.ply|trajectory\.tum)\.tmp-[0-9a-f]{8}$")


def content(seed: int, n_points: int = 500, n_poses: int = 7):
    """(points [N,3] float32, colors [N,3] uint8, stamps [M] s, poses [M,4,4]) of a small fake map."""
    rng = np.random.default_rng(seed)
    poses = np.tile(np.eye(4), (n_poses, 1, 1))
    poses[:, :3, 3] = np.cumsum(rng.normal(size=(n_poses, 3)), axis=0)
    return (rng.normal(size=(n_points, 3)).astype(np.float32), rng.integers(0, 256, (n_points, 3), np.uint8),
            1_700_000_000.0 + np.arange(n_poses) * 0.1, poses)


def save(folder: Path, seed: int = 0, requested: str = "", **kwargs) -> tuple[Path, Path]:
    return save_map_pair(requested, str(folder), *content(seed, **kwargs))


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every entry of ``folder`` (no recursion): name -> bytes (links: b'-> target')."""
    out = {}
    for path in sorted(folder.iterdir()):
        out[path.name] = f"-> {os.readlink(path)}".encode() if path.is_symlink() else path.read_bytes()
    return out


# ----------------------------------------------------------------------------- a normal save

def test_pair_roundtrip_carries_one_id(tmp_path):
    points, colors, stamps, poses = content(1)
    ply, tum = save_map_pair("", str(tmp_path), points, colors, stamps, poses)
    assert (ply, tum) == (tmp_path / MAP_FILE, tmp_path / TRAJECTORY_FILE)
    assert sorted(os.listdir(tmp_path)) == [MAP_FILE, TRAJECTORY_FILE]  # no temp file left
    p, c = read_ply(ply)
    np.testing.assert_array_equal(p, points)
    np.testing.assert_array_equal(c, colors)
    t, back = read_tum(tum)
    np.testing.assert_allclose(t, stamps, atol=1e-6)
    np.testing.assert_allclose(back, poses, atol=1e-7)
    save_id = read_save_id(ply)
    assert save_id and save_id == read_save_id(tum) == check_map_pair(ply, tum)
    assert read_save_tag(ply).count == 7 and read_save_tag(tum).count == 500  # the other file's size
    assert (os.stat(ply).st_mode & 0o777) == (0o666 & ~_umask())  # a plain file, not mkstemp's 0600


def test_a_new_save_replaces_the_pair_with_a_new_id(tmp_path):
    first = read_save_id(save(tmp_path, seed=1)[0])
    ply, tum = save(tmp_path, seed=2, n_points=40)
    assert read_ply(ply)[0].shape == (40, 3)
    assert check_map_pair(ply, tum) != first


def test_mixed_or_damaged_pairs_are_detected(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    ply_a, tum_a = save(a, seed=1)
    ply_b, tum_b = save(b, seed=2)
    with pytest.raises(MapSaveError, match="not one pair"):
        check_map_pair(ply_a, tum_b)
    body = ply_b.read_bytes()
    ply_b.write_bytes(body[:-15])  # one vertex short
    with pytest.raises(MapSaveError, match="damaged"):
        check_map_pair(ply_b, tum_b)
    lines = tum_a.read_text().splitlines()
    tum_a.write_text("\n".join(lines[:-1]) + "\n")  # one pose short
    with pytest.raises(MapSaveError, match="incomplete: 500 points and 6 poses, its tags say 500 and 7"):
        check_map_pair(ply_a, tum_a)
    (tmp_path / "plain.tum").write_text("0 0 0 0 0 0 0 1\n")
    with pytest.raises(MapSaveError, match="carries no save id"):
        check_map_pair(ply_a, tmp_path / "plain.tum")


def test_map_without_colours(tmp_path):
    points, _, stamps, poses = content(3)
    ply, tum = save_map_pair("", str(tmp_path), points, None, stamps, poses)
    assert read_ply(ply)[1] is None
    check_map_pair(ply, tum)


# ----------------------------------------------------------------------------- refusals that keep old files

def test_empty_map_is_refused_and_old_files_stay(tmp_path):
    save(tmp_path, seed=1)
    before = snapshot(tmp_path)
    points, colors, stamps, poses = content(2)
    with pytest.raises(MapSaveError, match=r"the map is empty \(0 points\).*existing files left"):
        save_map_pair("", str(tmp_path), points[:0], colors[:0], stamps, poses)
    with pytest.raises(MapSaveError, match=r"the trajectory is empty \(0 poses\)"):
        save_map_pair("", str(tmp_path), points, colors, stamps[:0], poses[:0])
    with pytest.raises(MapSaveError, match="cannot encode the map: colors must be"):
        save_map_pair("", str(tmp_path), points, colors[:3], stamps, poses)
    with pytest.raises(MapSaveError, match="cannot encode the map: c2w"):
        save_map_pair("", str(tmp_path), points, colors, stamps, poses[:2])
    assert snapshot(tmp_path) == before


def test_empty_map_does_not_create_the_folder(tmp_path):
    points, colors, stamps, poses = content(2)
    with pytest.raises(MapSaveError, match="empty"):
        save_map_pair("new", str(tmp_path), points[:0], colors[:0], stamps, poses)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("linked", [MAP_FILE, TRAJECTORY_FILE])
def test_symlink_at_a_destination_is_refused_not_followed(tmp_path, linked):
    folder, victim = tmp_path / "out", tmp_path / "victim.txt"
    save(folder, seed=1)
    victim.write_bytes(b"precious")
    (folder / linked).unlink()
    (folder / linked).symlink_to(victim)
    before = snapshot(folder)
    with pytest.raises(MapSaveError, match=f"{re.escape(str(folder / linked))} is a symbolic link"):
        save(folder, seed=2)
    assert victim.read_bytes() == b"precious"
    assert snapshot(folder) == before  # the link, the other file, and no temp file


def test_dangling_symlink_target_is_not_created(tmp_path):
    target = tmp_path / "elsewhere" / "created.ply"
    target.parent.mkdir()
    (tmp_path / MAP_FILE).symlink_to(target)
    with pytest.raises(MapSaveError, match="symbolic link"):
        save(tmp_path)
    assert not target.exists() and sorted(os.listdir(tmp_path)) == ["elsewhere", MAP_FILE]


def test_folder_at_a_destination_is_refused(tmp_path):
    (tmp_path / TRAJECTORY_FILE).mkdir()
    with pytest.raises(MapSaveError, match="is a folder"):
        save(tmp_path)
    assert sorted(os.listdir(tmp_path)) == [TRAJECTORY_FILE]


# ----------------------------------------------------------------------------- where files go

@pytest.mark.parametrize("requested", ["../../..", "..", "a/../../b", "a/../..", "../" + "x"])
def test_relative_path_may_not_leave_output_directory(tmp_path, requested):
    base = tmp_path / "deep" / "out"
    base.mkdir(parents=True)
    with pytest.raises(MapSaveError, match=r"outside output_directory .*must stay inside it"):
        save(base, requested=requested)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["deep", "deep/out"]


def test_symlinked_subfolder_may_not_lead_outside(tmp_path):
    base, outside = tmp_path / "out", tmp_path / "outside"
    base.mkdir()
    outside.mkdir()
    (base / "link").symlink_to(outside)
    with pytest.raises(MapSaveError, match="outside output_directory"):
        save(base, requested="link/run1")
    assert list(outside.iterdir()) == []


def test_relative_paths_inside_and_defaults(tmp_path, monkeypatch):
    base = tmp_path / "out"
    assert save(base, requested="a/../run1/x")[0] == base / "run1" / "x" / MAP_FILE
    assert save(base, requested="  ")[0] == base / MAP_FILE  # blank = the output directory
    monkeypatch.chdir(tmp_path)
    assert resolve_save_directory("", "rel_out") == tmp_path / "rel_out"  # relative to the working directory
    assert resolve_save_directory("r", "rel_out") == tmp_path / "rel_out" / "r"


def test_absolute_and_home_paths_are_allowed(tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere" / "maps"
    ply, tum = save(tmp_path / "out", requested=str(elsewhere))
    assert ply == elsewhere / MAP_FILE and check_map_pair(ply, tum)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_save_directory("~/maps", str(tmp_path / "out")) == tmp_path / "home" / "maps"


def test_nul_byte_and_file_in_the_way(tmp_path):
    with pytest.raises(MapSaveError, match="invalid directory"):
        save(tmp_path, requested="a\0b")
    (tmp_path / "file").write_text("x")
    with pytest.raises(MapSaveError, match=r"cannot create folder .*file/sub"):
        save(tmp_path, requested="file/sub")


# ----------------------------------------------------------------------------- read-only folder

def drop_dac() -> None:
    """preexec_fn: as root, give up CAP_DAC_OVERRIDE (1) and CAP_DAC_READ_SEARCH (2) so that file
    permissions apply to the child (raises OSError where the container forbids it)."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (1, 2):
            if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


_RO_CHILD = """
import sys
import numpy as np
from lingbot_map_ros.io.map_save import MapSaveError, save_map_pair
try:
    save_map_pair("", sys.argv[1], np.zeros((3, 3), np.float32), None, np.zeros(1), np.eye(4)[None])
except MapSaveError as exc:
    print("REFUSED", exc)
else:
    print("WROTE")
"""


def test_read_only_folder_gives_a_reason(tmp_path):
    folder = tmp_path / "ro"
    save(folder, seed=1)
    before = snapshot(folder)
    folder.chmod(0o555)
    try:
        try:
            done = subprocess.run([sys.executable, "-c", _RO_CHILD, str(folder)], capture_output=True, text=True,
                                  timeout=CHILD_TIMEOUT, env=_child_env(), preexec_fn=drop_dac)
        except subprocess.SubprocessError as exc:
            pytest.skip(f"cannot drop root's permission override here ({exc}); read-only test not run")
    finally:
        folder.chmod(0o755)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"REFUSED cannot write in {folder}: Permission denied"
    assert snapshot(folder) == before


# ----------------------------------------------------------------------------- killed mid-save

_KILL_CHILD = """
import io, os, sys, time
import numpy as np
from lingbot_map_ros.io import atomic, map_save

mode, folder, ready = sys.argv[1:4]

def hang():
    open(ready, "w").close()
    time.sleep(600)

real_stage, calls = atomic.stage, []
half_of = {"mid_ply": 1, "mid_tum": 2}.get(mode)  # which staged file is cut half-way
def stage(final, write):
    calls.append(final)
    if len(calls) == half_of:
        def half(f):
            buf = io.BytesIO()
            write(buf)
            f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            f.flush()
            hang()
        return real_stage(final, half)
    return real_stage(final, write)
atomic.stage = stage

real_replace = os.replace
def replace(src, dst):
    if mode == "before_renames":
        hang()
    real_replace(src, dst)
    if mode == "between_renames":
        hang()
atomic.os.replace = replace

rng = np.random.default_rng(7)
n = 200_000
map_save.save_map_pair("", folder, rng.normal(size=(n, 3)).astype(np.float32),
                       rng.integers(0, 256, (n, 3), np.uint8), np.arange(9.0), np.tile(np.eye(4), (9, 1, 1)))
print("finished without being killed")
"""


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@contextlib.contextmanager
def child_at(folder: Path, mode: str, ready: Path) -> Iterator[subprocess.Popen]:
    """Run a saving child until it reaches ``mode``'s point; SIGKILL it on exit."""
    proc = subprocess.Popen([sys.executable, "-c", _KILL_CHILD, mode, str(folder), str(ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_child_env())
    try:
        deadline = time.monotonic() + CHILD_TIMEOUT
        while not ready.exists():
            if proc.poll() is not None:
                out, err = proc.communicate()
                pytest.fail(f"child ended before the kill point: {out.decode()} {err.decode()[-2000:]}")
            assert time.monotonic() < deadline, "child never reached the kill point"
            time.sleep(0.02)
        yield proc
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=CHILD_TIMEOUT) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=CHILD_TIMEOUT)
        proc.stdout.close()
        proc.stderr.close()


def kill_during_save(folder: Path, mode: str, ready: Path) -> None:
    with child_at(folder, mode, ready):
        pass


def temp_files(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n not in (MAP_FILE, TRAJECTORY_FILE))


def age(folder: Path, names: list[str]) -> None:
    old = time.time() - 10 * STALE_AFTER_S
    for name in names:
        os.utime(folder / name, (old, old))


@pytest.mark.parametrize("mode,leftovers", [("mid_ply", 1), ("mid_tum", 2), ("before_renames", 2)])
def test_killed_save_leaves_the_previous_pair(tmp_path, mode, leftovers):
    folder = tmp_path / "out"
    ply, tum = save(folder, seed=1)
    before = snapshot(folder)
    kill_during_save(folder, mode, tmp_path / "ready")
    after = snapshot(folder)
    assert {n: after[n] for n in (MAP_FILE, TRAJECTORY_FILE)} == before  # byte-identical
    check_map_pair(ply, tum)
    temps = temp_files(folder)
    assert len(temps) == leftovers and all(TEMP_NAME.match(n) for n in temps), temps
    assert all(after[n] for n in temps)  # the interrupted content went to the temp files only
    # the next save removes the leftovers once they are not locked by a live writer
    age(folder, temps)
    ply, tum = save(folder, seed=3)
    assert temp_files(folder) == [] and check_map_pair(ply, tum)


def test_kill_between_the_renames_is_detected(tmp_path):
    folder = tmp_path / "out"
    ply, tum = save(folder, seed=1)
    old_id = read_save_id(ply)
    kill_during_save(folder, "between_renames", tmp_path / "ready")
    assert read_save_id(tum) == old_id and read_save_id(ply) != old_id  # PLY renamed, TUM not yet
    with pytest.raises(MapSaveError, match="not one pair"):
        check_map_pair(ply, tum)
    assert [TEMP_NAME.match(n).group(1) for n in temp_files(folder)] == [TRAJECTORY_FILE]


def test_stale_temp_cleanup_spares_live_and_fresh_writers(tmp_path):
    save(tmp_path, seed=1)
    for name in (".map.ply.tmp-0000dead", ".map.ply.tmp-00000001", ".map.ply.tmp-00000002",
                 ".trajectory.tum.tmp-0000dead"):
        (tmp_path / name).write_bytes(b"partial")
    age(tmp_path, [".map.ply.tmp-0000dead", ".map.ply.tmp-00000001", ".trajectory.tum.tmp-0000dead"])
    (tmp_path / ".map.ply.tmp-link").symlink_to(tmp_path / MAP_FILE)
    with open(tmp_path / ".map.ply.tmp-00000001", "rb") as held:  # a writer still at work
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        save(tmp_path, seed=2)
    assert temp_files(tmp_path) == [".map.ply.tmp-00000001", ".map.ply.tmp-00000002", ".map.ply.tmp-link"]


def test_temp_of_a_live_writer_is_not_removed(tmp_path):
    folder = tmp_path / "out"
    save(folder, seed=1)
    with child_at(folder, "mid_ply", tmp_path / "ready"):
        temps = temp_files(folder)
        age(folder, temps)  # old enough, but its writer holds the lock
        save(folder, seed=2)
        assert temp_files(folder) == temps and len(temps) == 1
    save(folder, seed=3)  # the writer is dead now
    assert temp_files(folder) == []


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
