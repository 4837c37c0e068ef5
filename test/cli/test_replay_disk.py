"""The replay's outputs at the edges of the disk (issue 25): existing outputs are refused
unless --overwrite, an output folder that cannot be written is refused before the model
loads, and a full or read-only file system at any point of the run (a frame's write, the
final close that writes the npz) ends with one error line naming what was written, what
was not and what ``.partial`` is left, exit status 2, no traceback.

Full and read-only file systems are real ones where this process may mount (root: a small
tmpfs, ``mount -o remount,ro`` mid-run); as another user a read-only folder (chmod) stands in
for the read-only mount. The same paths are also driven in-process with a writer that raises
ENOSPC / EROFS, so they are covered where nothing can be mounted.
"""
from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from lingbot_map_ros.cli.replay_args import build_parser
from lingbot_map_ros.io.export import read_ply, read_tum
from disk_helpers import mount as _mount, tmpfs
from replay_fixtures import PROG, bag_types, error_line, replay

FRAMES = ["--max-frames", "3"]  # 2 scale frames + 1: enough to write every output, quick


def files_under(folder: Path) -> list[str]:
    """Every name under ``folder`` (hidden ones too), relative, sorted."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# ------------------------------------------------------------------ mounts
@contextmanager
def read_only_folder(folder: Path):
    """A folder that takes no new file: a read-only tmpfs as root (root ignores permissions),
    else a folder without write permission."""
    if os.geteuid() == 0:
        with tmpfs(folder, "1m", read_only=True):
            yield folder
        return
    folder.mkdir(parents=True)
    folder.chmod(0o555)
    try:
        yield folder
    finally:
        folder.chmod(0o755)


# ------------------------------------------------------------------ existing outputs
def _sentinels(tmp_path: Path) -> dict[str, Path]:
    """An existing file (or bag folder) at every output's place, each with its own content."""
    paths = {"--out": tmp_path / "p.npz", "--trajectory": tmp_path / "t.tum", "--ply": tmp_path / "c.ply",
             "--out-bag": tmp_path / "res"}
    for flag, path in paths.items():
        if flag == "--out-bag":
            path.mkdir()
            (path / "old.txt").write_text("old bag")
        else:
            path.write_text(f"old {flag}")
    return paths


def _outputs(paths: dict[str, Path]) -> list[str]:
    return [x for flag, path in paths.items() for x in (flag, str(path))]


def test_help_states_the_rule_for_existing_outputs():
    text = build_parser().format_help()
    assert "--overwrite" in text
    flat = " ".join(text.split())
    assert "An output that exists already" in flat and "is refused unless --overwrite" in flat
    assert "one error line naming what was written, what was not, and the .partial files kept" in flat


@pytest.mark.parametrize("flag", ["--out", "--chunks", "--trajectory", "--ply", "--out-bag"])
def test_an_existing_output_is_refused_without_overwrite(loop_folder, tiny, tmp_path, capsys, flag):
    """One rule for every output: an existing one (for --out also its .chunks folder) ends the run
    before the model loads, names the flag and --overwrite, and leaves every file as it was."""
    out = tmp_path / "out"
    out.mkdir()
    paths = {"--out": out / "p.npz", "--trajectory": out / "t.tum", "--ply": out / "c.ply", "--out-bag": out / "res"}
    existing = out / "p.chunks" if flag == "--chunks" else paths[flag]
    if flag == "--out-bag":
        existing.mkdir()
        (existing / "old.txt").write_text("old")
    elif flag == "--chunks":
        existing.mkdir()
        (existing / "depth_00000000_00000099.npz").write_text("old")
    else:
        existing.write_text("old")
    before = files_under(out)
    code, err = replay(capsys, "--images", loop_folder, *tiny, *FRAMES, *_outputs(paths))
    assert code == 2
    line = error_line(err)
    owner = "--out" if flag == "--chunks" else flag
    assert f"{owner} {paths[owner]}" in line and f"{existing} exists already" in line
    assert "pass --overwrite to replace it" in line
    assert files_under(out) == before  # nothing written, nothing replaced
    assert (existing / "old.txt" if flag == "--out-bag" else existing / "depth_00000000_00000099.npz"
            if flag == "--chunks" else existing).read_text() == "old"


def test_overwrite_replaces_every_output_and_leaves_nothing_behind(loop_folder, tiny, tmp_path, capsys):
    paths = _sentinels(tmp_path)
    stale_chunks = tmp_path / "p.chunks"  # an older, longer run's depth chunks of p.npz
    stale_chunks.mkdir()
    (stale_chunks / "depth_00000000_00000099.npz").write_text("old")
    code, err = replay(capsys, "--images", loop_folder, *tiny, *FRAMES, *_outputs(paths), "--overwrite")
    assert code == 0, err
    assert np.load(paths["--out"])["pose_enc"].shape == (3, 9)
    assert len(read_tum(paths["--trajectory"])[0]) == 3
    assert read_ply(paths["--ply"])[0].shape[0] > 0
    assert "/tf" in bag_types(paths["--out-bag"]) and not (paths["--out-bag"] / "old.txt").exists()
    assert files_under(tmp_path) == sorted(["p.npz", "t.tum", "c.ply", "res"] + [
        f"res/{p.name}" for p in paths["--out-bag"].iterdir()])  # no stale chunks, temp or aside folder


def test_two_outputs_with_one_name_are_refused(loop_folder, tiny, tmp_path, capsys):
    code, err = replay(capsys, "--images", loop_folder, *tiny, "--trajectory", tmp_path / "x", "--ply",
                       tmp_path / "x")
    assert code == 2
    assert f"--trajectory and --ply both write {tmp_path / 'x'}" in error_line(err)
    assert files_under(tmp_path) == []


# ------------------------------------------------------------------ read-only and full file systems
def test_a_read_only_output_folder_is_refused_before_the_run(loop_folder, tiny, tmp_path, capsys):
    elsewhere = tmp_path / "rw"
    elsewhere.mkdir()
    with read_only_folder(tmp_path / "ro") as ro:
        code, err = replay(capsys, "--images", loop_folder, *tiny, *FRAMES, "--trajectory", elsewhere / "t.tum",
                           "--out", ro / "sub" / "p.npz")
        line = error_line(err)
        assert code == 2
        assert f"--out {ro / 'sub' / 'p.npz'}: cannot write into {ro}" in line and "nothing was written" in line
        assert "Read-only file system (EROFS)" in line or "Permission denied (EACCES)" in line
        assert files_under(ro) == []
    assert files_under(elsewhere) == []


def test_a_folder_that_turns_read_only_during_the_run_loses_only_that_output(loop_folder, tiny, tmp_path, capsys):
    """The file system under --out is remounted read-only while the frames run (as ext4 does on
    an error); the npz, written at the end, fails: one error line says the trajectory and the
    cloud were written, the npz not, and nothing is left on the read-only side."""
    rw = tmp_path / "rw"
    rw.mkdir()
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        def remount(done: int) -> None:
            if done == 1:
                _mount("-o", "remount,ro", str(mnt))

        out = mnt / "p.npz"
        code, err = replay(capsys, "--images", loop_folder, *tiny, *FRAMES, "--out", out, "--trajectory",
                           rw / "t.tum", "--ply", rw / "c.ply", observer=remount)
        line = error_line(err)
        assert code == 2
        assert line.startswith(f"{PROG}: error: 3 frames replayed, but not every output could be written: --out "
                               f"{out} (Read-only file system (EROFS)")
        assert line.endswith(f"; written: {rw / 't.tum'}, {rw / 'c.ply'}; not written: {out} (nothing of it kept)")
        assert files_under(mnt) == []
    assert len(read_tum(rw / "t.tum")[0]) == 3 and files_under(rw) == ["c.ply", "t.tum"]


def test_a_full_disk_at_the_final_npz_keeps_the_other_outputs(loop_folder, tiny, tmp_path, capsys):
    """--out on a 64 KiB file system: the frames run, the npz (~130 KiB with depth) does not fit at
    the end; the other outputs are written, the npz is named as not written, and no temp or
    .partial file is left on the full disk."""
    rw = tmp_path / "rw"
    rw.mkdir()
    with tmpfs(tmp_path / "mnt", "64k") as mnt:
        out = mnt / "p.npz"
        code, err = replay(capsys, "--images", loop_folder, *tiny, *FRAMES, "--out", out, "--trajectory",
                           rw / "t.tum", "--out-bag", rw / "res")
        line = error_line(err)
        assert code == 2
        assert line.startswith(f"{PROG}: error: 3 frames replayed, but not every output could be written: --out {out} "
                               "(No space left on device (ENOSPC)")
        assert line.endswith(f"; written: {rw / 't.tum'}, {rw / 'res'}; not written: {out} (nothing of it kept)")
        assert files_under(mnt) == []
    assert len(read_tum(rw / "t.tum")[0]) == 3 and "/tf" in bag_types(rw / "res")


def test_a_disk_that_fills_mid_run_stops_only_that_output(loop_folder, tiny, tmp_path, capsys):
    """--ply on a 16 KiB file system fills after a frame or two: a warning says so, the run goes on
    for --out, and the error line at the end names the npz as written and the PLY as not written,
    with its incomplete .partial."""
    rw = tmp_path / "rw"
    rw.mkdir()
    with tmpfs(tmp_path / "mnt", "16k") as mnt:
        ply = mnt / "c.ply"
        code, err = replay(capsys, "--images", loop_folder, *tiny, "--out", rw / "p.npz", "--ply", ply,
                           "--point-stride", "1", "--conf-threshold", "0")
        line = error_line(err)
        assert code == 2
        assert f"cannot write --ply {ply} after" in err and "the run goes on for the other outputs" in err
        assert line.startswith(f"{PROG}: error: 8 frames replayed, but not every output could be written: --ply {ply} "
                               "(No space left on device (ENOSPC)")
        assert f"; written: {rw / 'p.npz'}; not written: {ply} (" in line
        left = files_under(mnt)
        assert left in ([], ["c.ply.partial"])
        if line.endswith(f"(kept as {ply}.partial)"):  # the frames before the failure, as a valid PLY
            points, _ = read_ply(mnt / "c.ply.partial")
            assert points.shape[0] % (56 * 98) == 0
        else:
            assert line.endswith(f"({ply}.partial left incomplete)" if left else "(nothing of it kept)")
    assert np.load(rw / "p.npz")["pose_enc"].shape == (8, 9)


def test_when_every_output_fails_the_run_stops_and_says_what_is_left(loop_folder, tiny, tmp_path, capsys):
    with tmpfs(tmp_path / "mnt", "16k") as mnt:
        ply = mnt / "c.ply"
        code, err = replay(capsys, "--images", loop_folder, *tiny, "--ply", ply, "--point-stride", "1",
                           "--conf-threshold", "0")
        line = error_line(err)
        assert code == 2
        assert line.startswith(f"{PROG}: error: cannot write --ply {ply}: No space left on device (ENOSPC)")
        left = files_under(mnt)
        assert f"{ply}.partial" in line if left else "nothing of it kept" in line
        assert set(left) <= {"c.ply.partial"}


# ------------------------------------------------------------------ the same paths without a mount
def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_simulated_full_disk_at_close_in_process(loop_folder, tiny, tmp_path, capsys, monkeypatch):
    """No mount needed: the npz's atomic write raises ENOSPC (at the close and at the .partial
    that follows); the trajectory is written, the npz named as not written, nothing left."""
    from lingbot_map_ros.io import results

    monkeypatch.setattr(results, "atomic_write", _no_space)
    out, tum = tmp_path / "p.npz", tmp_path / "t.tum"
    code, err = replay(capsys, "--images", loop_folder, *tiny, *FRAMES, "--out", out, "--trajectory", tum)
    assert code == 2
    assert error_line(err) == (f"{PROG}: error: 3 frames replayed, but not every output could be written: --out {out} "
                               f"(No space left on device (ENOSPC)); written: {tum}; not written: {out} (nothing of "
                               "it kept)")
    assert files_under(tmp_path) == ["t.tum"]


def test_simulated_failures_mid_run_and_at_the_rename_in_process(loop_folder, tiny, tmp_path, capsys, monkeypatch):
    """The trajectory's third line hits ENOSPC (the run goes on; its first two lines are kept as a
    complete .partial) and the results bag's final rename hits EROFS (the finished bag is kept as
    .partial); the npz is written. One error line lists all three."""
    from lingbot_map_ros.io import results, results_bag

    real_add = results.TumStreamWriter.add

    def add(self, *args):
        if self.count == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_add(self, *args)

    def read_only(new, final, overwrite):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(final))

    monkeypatch.setattr(results.TumStreamWriter, "add", add)
    monkeypatch.setattr(results_bag, "replace_folder", read_only)
    out, tum, bag = tmp_path / "p.npz", tmp_path / "t.tum", tmp_path / "res"
    code, err = replay(capsys, "--images", loop_folder, *tiny, *FRAMES, "--out", out, "--trajectory", tum,
                       "--out-bag", bag)
    assert code == 2
    assert error_line(err) == (
        f"{PROG}: error: 3 frames replayed, but not every output could be written: --trajectory {tum} (No space "
        f"left on device (ENOSPC)), --out-bag {bag} (Read-only file system (EROFS): {bag}); written: {out}; "
        f"not written: {tum} (kept as {tum}.partial), {bag} (kept as {bag}.partial)")
    assert len(read_tum(tmp_path / "t.tum.partial")[0]) == 2
    assert "/tf" in bag_types(tmp_path / "res.partial")
    assert files_under(tmp_path) == sorted(["p.npz", "t.tum.partial", "res.partial"] + [
        f"res.partial/{p.name}" for p in (tmp_path / "res.partial").iterdir()])
