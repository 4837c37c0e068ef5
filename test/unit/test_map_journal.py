"""The map journal (runtime/map_journal.py): the accumulated map and the path survive the process.

A map and path driven through every operation the node applies (frames added, protected,
rolled back, cleared, thinned by the bound, compacted many times) are restored from
``map.lbj`` point for point, and the restored pair goes on exactly like the original; a torn
or damaged file restores what precedes the damage; a process killed at any moment leaves a
file that restores a prefix of the operations."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from lingbot_map_ros.journal import JournalError
from lingbot_map_ros.journal.format import scan
from lingbot_map_ros.journal.resume import read_journal
from lingbot_map_ros.runtime.map_journal import MAP_JOURNAL_NAME, MapJournal, restore_map
from lingbot_map_ros.runtime.mapping import MapAccumulator, PoseEntry, Trajectory

IDENTITY = {"model": "tiny", "seed": 1}


def new_pair(voxel=0.05, max_points=3000, path_len=40):
    return MapAccumulator(voxel, max_points), Trajectory(path_len)


def journal_of(folder: Path, m, t, min_bytes=20_000) -> MapJournal:
    mj = MapJournal(folder / MAP_JOURNAL_NAME, IDENTITY)
    mj.COMPACT_MIN_BYTES = min_bytes
    mj.attach(m, t)
    return mj


def drive(m, t, frames, rng, start=0):
    """What the node does to its map and path, with rollbacks and a reset on the way."""
    for i in range(start, start + frames):
        t.append(PoseEntry(i, 1000 + i, 1000.0 + i / 7, rng.normal(size=(4, 4))))
        m.protect_from(i)
        n = int(rng.integers(0, 300))
        m.add(i, rng.normal(scale=2.0, size=(n, 3)).astype(np.float32), rng.integers(0, 256, (n, 3)).astype(np.uint8))
        if i % 13 == 7:  # a rollback of the frame just stored
            m.remove_from(i)
            t.remove_from(i)
            m.protect_from(i)
        if i == start + 55:  # a reset
            m.clear()
            t.clear()


def assert_same(m1, t1, m2, t2):
    p1, c1, _ = m1.snapshot()
    p2, c2, _ = m2.snapshot()
    assert p1.shape == p2.shape and np.array_equal(p1, p2) and np.array_equal(c1, c2)
    assert m1.frames() == m2.frames() and m1.thinned == m2.thinned
    assert [e.frame_index for e in t1.entries()] == [e.frame_index for e in t2.entries()]
    assert np.array_equal(t1.poses(), t2.poses()) and np.array_equal(t1.stamps(), t2.stamps())


def test_the_map_and_path_come_back_point_for_point_and_go_on_alike(tmp_path):
    m, t = new_pair()
    mj = journal_of(tmp_path, m, t)
    drive(m, t, 150, np.random.default_rng(0))
    assert mj.writer.flush(10)
    assert mj.compactions > 3 and m.thinned  # compacted many times; the bound thinned the map
    assert (tmp_path / MAP_JOURNAL_NAME).stat().st_size < 6 * 15 * m.max_points  # a few times the map, not the run

    m2, t2 = new_pair()
    got = restore_map(tmp_path / MAP_JOURNAL_NAME, m2, t2, next_frame=10**9, identity=IDENTITY)
    assert got.note == "" and got.points == len(m) and got.poses == len(t)
    assert_same(m, t, m2, t2)
    # the restored pair is the same state, not only the same points: both go on identically
    drive(m, t, 60, np.random.default_rng(7), start=150)
    drive(m2, t2, 60, np.random.default_rng(7), start=150)
    assert_same(m, t, m2, t2)
    mj.close()


def test_a_restore_forgets_the_frames_the_keyframe_journal_did_not_reach(tmp_path):
    m, t = new_pair(max_points=10**6)
    mj = journal_of(tmp_path, m, t)
    drive(m, t, 30, np.random.default_rng(1))
    assert mj.writer.flush(10)
    m2, t2 = new_pair(max_points=10**6)
    restore_map(tmp_path / MAP_JOURNAL_NAME, m2, t2, next_frame=25)
    assert max(m2.frames()) == 24 and max(e.frame_index for e in t2.entries()) == 24
    m.remove_from(25)
    t.remove_from(25)
    assert_same(m, t, m2, t2)
    mj.close()


def test_a_torn_or_damaged_file_restores_what_precedes_it(tmp_path):
    m, t = new_pair(max_points=10**6)
    mj = journal_of(tmp_path, m, t, min_bytes=10**9)  # no compaction: one record per change
    drive(m, t, 20, np.random.default_rng(2))
    assert mj.writer.flush(10)
    mj.close()
    path = tmp_path / MAP_JOURNAL_NAME
    found = scan(path)
    last = found.offsets[-1]
    data = path.read_bytes()

    torn = tmp_path / "torn" / MAP_JOURNAL_NAME
    torn.parent.mkdir()
    torn.write_bytes(data[:-5])  # killed mid-write of the last record
    m2, t2 = new_pair(max_points=10**6)
    got = restore_map(torn, m2, t2, 10**9)
    assert got.records == len(found.offsets) - 1 and got.note.startswith("torn last record")

    bad = tmp_path / "bad" / MAP_JOURNAL_NAME
    bad.parent.mkdir()
    mid = found.offsets[len(found.offsets) // 2]
    broken = bytearray(data)
    broken[mid + 30] ^= 0xFF
    bad.write_bytes(bytes(broken))
    m3, t3 = new_pair(max_points=10**6)
    got = restore_map(bad, m3, t3, 10**9)
    assert got.records == len(found.offsets) // 2  # everything before the damaged record
    assert got.note.startswith(f"corrupt record {len(found.offsets) // 2}") and last > mid


def test_another_models_or_no_map_journal_restores_nothing_and_says_why(tmp_path):
    m, t = new_pair()
    mj = journal_of(tmp_path, m, t)
    drive(m, t, 5, np.random.default_rng(3))
    assert mj.writer.flush(10)
    mj.close()
    m2, t2 = new_pair()
    other = restore_map(tmp_path / MAP_JOURNAL_NAME, m2, t2, 10**9, identity={"model": "other"})
    assert other.records == 0 and "another model" in other.note and len(m2) == 0 and len(t2) == 0
    missing = restore_map(tmp_path / "nowhere" / MAP_JOURNAL_NAME, m2, t2, 10**9)
    assert missing.records == 0 and "start empty" in missing.note
    junk = tmp_path / "junk.lbj"
    junk.write_bytes(b"not a journal at all")
    assert "not a journal" in restore_map(junk, m2, t2, 10**9).note
    # a map journal is not a keyframe journal: --resume or a state directory refuses it by name
    with pytest.raises(JournalError, match="map journal, not a keyframe journal"):
        read_journal(tmp_path / MAP_JOURNAL_NAME)


def test_paused_changes_are_not_journaled_and_start_writes_the_state_as_it_is(tmp_path):
    m, t = new_pair()
    mj = journal_of(tmp_path, m, t)
    rng = np.random.default_rng(4)
    drive(m, t, 5, rng)
    mj.pause()
    m.clear()
    t.clear()
    drive(m, t, 4, rng, start=100)  # e.g. a resume filling the map: not journaled as changes
    mj.start()
    drive(m, t, 3, rng, start=104)
    assert mj.writer.flush(10)
    m2, t2 = new_pair()
    restore_map(tmp_path / MAP_JOURNAL_NAME, m2, t2, 10**9)
    assert_same(m, t, m2, t2)
    assert min(m2.frames()) == 100
    mj.close()


def test_without_a_map_the_path_alone_is_journaled(tmp_path):
    t = Trajectory(30)
    mj = MapJournal(tmp_path / MAP_JOURNAL_NAME, IDENTITY)
    mj.attach(None, t)
    rng = np.random.default_rng(5)
    for i in range(50):
        t.append(PoseEntry(i, 10 + i, 10.0 + i, rng.normal(size=(4, 4))))
    t.remove_from(45)
    assert mj.writer.flush(10)
    t2 = Trajectory(30)
    got = restore_map(tmp_path / MAP_JOURNAL_NAME, None, t2, 10**9)
    assert got.points == 0 and got.poses == 25  # frames 20..44: the last 30 appended, then 45..49 removed
    assert np.array_equal(t.poses(), t2.poses()) and [e.frame_index for e in t2.entries()][-1] == 44
    mj.close()


def test_map_and_path_changed_from_two_threads_restore_consistently(tmp_path):
    """The output thread adds points while the inference thread appends poses (the node's case):
    no deadlock between the map's lock and the journal's, and the restore equals both."""
    m, t = new_pair(max_points=2000)
    mj = journal_of(tmp_path, m, t, min_bytes=8_000)
    rng_map, rng_path = np.random.default_rng(6), np.random.default_rng(8)

    def outputs():
        for i in range(300):
            n = int(rng_map.integers(1, 100))
            m.add(i, rng_map.normal(size=(n, 3)).astype(np.float32), rng_map.integers(0, 256, (n, 3)).astype(np.uint8))
            m.protect_from(i)

    worker = threading.Thread(target=outputs)
    worker.start()
    for i in range(300):
        t.append(PoseEntry(i, i, float(i), rng_path.normal(size=(4, 4))))
    worker.join(60)
    assert not worker.is_alive()
    assert mj.writer.flush(10)
    m2, t2 = new_pair(max_points=2000)
    restore_map(tmp_path / MAP_JOURNAL_NAME, m2, t2, 10**9)
    assert_same(m, t, m2, t2)
    mj.close()


CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    from pathlib import Path
    from lingbot_map_ros.runtime.mapping import MapAccumulator, PoseEntry, Trajectory
    from lingbot_map_ros.runtime.map_journal import MapJournal
    m, t = MapAccumulator(0.05, 3000), Trajectory(40)
    mj = MapJournal(Path(sys.argv[1]), {"k": 1})
    mj.COMPACT_MIN_BYTES = 30_000
    mj.attach(m, t)
    rng = np.random.default_rng(11)
    for i in range(100000):
        t.append(PoseEntry(i, i, float(i), np.eye(4) * (i + 1)))
        m.protect_from(i)
        n = int(rng.integers(1, 200))
        m.add(i, rng.normal(scale=2.0, size=(n, 3)).astype(np.float32), rng.integers(0, 256, (n, 3)).astype(np.uint8))
        if i == 20:
            print("going", flush=True)
        time.sleep(0.002)
""")


def test_a_process_killed_at_any_moment_leaves_a_map_journal_that_restores_a_prefix(tmp_path):
    """SIGKILL at three moments of a busy writer (appends and compactions): each file restores
    the state after a prefix of the operations, exactly."""
    for n, wait in enumerate((0.3, 0.9, 1.7)):
        path = tmp_path / f"k{n}" / MAP_JOURNAL_NAME
        path.parent.mkdir()
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE,
                                 env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        assert child.stdout.readline().strip() == b"going"
        time.sleep(wait)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        m2, t2 = new_pair()
        got = restore_map(path, m2, t2, 10**9)
        assert got.records > 0 and (got.note == "" or got.note.startswith("torn last record")), got.note
        last = max(m2.frames()) if m2.frames() else -1
        assert last >= 20
        # the same operations replayed here up to that frame give the same map
        m, t = new_pair()
        rng = np.random.default_rng(11)
        for i in range(last + 1):
            t.append(PoseEntry(i, i, float(i), np.eye(4) * (i + 1)))
            m.protect_from(i)
            k = int(rng.integers(1, 200))
            m.add(i, rng.normal(scale=2.0, size=(k, 3)).astype(np.float32), rng.integers(0, 256, (k, 3)).astype(np.uint8))
        p1, c1, _ = m.snapshot()
        p2, c2, _ = m2.snapshot()
        assert np.array_equal(p1, p2) and np.array_equal(c1, c2), f"kill {n}: frame {last}"
        # the path holds the poses up to that frame (perhaps the next one's too: it is appended first)
        idx = [e.frame_index for e in t2.entries()]
        assert idx == list(range(idx[0], idx[-1] + 1)) and idx[-1] in (last, last + 1)


def test_path_entries_leave_the_map_snapshot_to_the_output_thread(tmp_path):
    """A path entry (the inference thread) never copies the whole map into a snapshot: a journal
    grown by path entries alone is compacted by the next map change (the output thread); with
    no map, by the path entry itself. Either way the restored pair is the original."""
    rng = np.random.default_rng(3)
    m, t = new_pair(path_len=300)
    mj = journal_of(tmp_path, m, t, min_bytes=2_000)
    m.add(0, rng.normal(size=(50, 3)).astype(np.float32), rng.integers(0, 256, (50, 3)).astype(np.uint8))
    first = mj.compactions
    i = 0
    while not mj._grown():  # path entries only (hundreds of bytes each) until past the threshold
        i += 1
        t.append(PoseEntry(i, 1000 + i, 1000.0 + i, rng.normal(size=(4, 4))))
    assert mj.compactions == first
    m.add(i + 1, rng.normal(size=(5, 3)).astype(np.float32), rng.integers(0, 256, (5, 3)).astype(np.uint8))
    assert mj.compactions == first + 1 and not mj._grown()
    for i in range(i + 2, i + 2000):  # frames without points for long: bounded all the same
        t.append(PoseEntry(i, 1000 + i, 1000.0 + i, rng.normal(size=(4, 4))))
    assert first + 1 < mj.compactions and not mj._grown(4)
    assert mj.writer.flush()
    m2, t2 = new_pair(path_len=300)
    restore_map(tmp_path / MAP_JOURNAL_NAME, m2, t2, next_frame=10**6, identity=IDENTITY)
    assert_same(m, t, m2, t2)
    mj.close()

    t3 = Trajectory(300)  # no map: the path entries compact the path journal themselves
    mj3 = journal_of(tmp_path / "nomap", None, t3, min_bytes=2_000)
    for i in range(80):
        t3.append(PoseEntry(i, 1000 + i, 1000.0 + i, rng.normal(size=(4, 4))))
    assert mj3.compactions > 1 and not mj3._grown()
    mj3.close()
