"""The journal file and its writer without a model: records round-trip losslessly, a torn last
record is ignored, a damaged one ends reading with a reason, the writer never blocks, pauses
on a failing disk (full, not writable) and resumes with a complete journal, compaction and
saved copies are atomic, a kill mid-record or mid-rewrite leaves a journal that reads."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from lingbot_map_ros.journal import writer as writer_mod
from lingbot_map_ros.journal.format import (JournalError, Record, encode_record, iter_records, scan,
                                            write_journal)
from lingbot_map_ros.journal.writer import JournalWriter

REPO = Path(__file__).resolve().parents[2]
HEADER = {"format": 1, "identity": {"model": "x"}, "resolution": [4, 6]}


def frame(i: int, dtype=np.uint8) -> Record:
    rng = np.random.default_rng(i)
    if dtype == np.uint8:
        image = rng.integers(0, 256, (4, 6, 3), dtype=np.uint8)
    else:
        image = rng.random((3, 4, 6), dtype=np.float32)
    return Record("frame", {"i": i, "decision": "keyframe", "stamp": 10 * i}, {"image": image})


def write_file(path: Path, records, level=1) -> None:
    with open(path, "wb") as f:
        write_journal(f, HEADER, records, level)


def read(path):
    found = scan(path)
    return found, list(iter_records(found))


@pytest.mark.parametrize("level", [0, 1])
def test_records_round_trip_losslessly(tmp_path, level):
    records = [frame(0), frame(1, np.float32), Record("seen", {"i": 2, "c2w": [0.1 + 1e-17] * 16}),
               Record("restart", {"kept": []}, {"image0": np.zeros((4, 6, 3), np.uint8),
                                                "depth0": np.linspace(0, 1, 24, dtype=np.float32).reshape(4, 6)})]
    path = tmp_path / "j.lbj"
    write_file(path, records, level)
    found, got = read(path)
    assert found.stop == "" and found.header == HEADER and found.kinds == ["frame", "frame", "seen", "restart"]
    for a, b in zip(records, got):
        assert a.kind == b.kind and {k: v for k, v in b.meta.items()} == a.meta
        assert a.arrays.keys() == b.arrays.keys()
        for k in a.arrays:
            assert a.arrays[k].dtype == b.arrays[k].dtype
            np.testing.assert_array_equal(a.arrays[k], b.arrays[k])


def test_torn_last_record_is_ignored(tmp_path):
    path = tmp_path / "j.lbj"
    write_file(path, [frame(0), frame(1), frame(2)])
    full = path.read_bytes()
    last = len(encode_record(frame(2), 1))
    for cut in (1, 7, last - 1):
        path.write_bytes(full[:-cut])
        found, got = read(path)
        assert [r.meta["i"] for r in got] == [0, 1] and not found.corrupt
        assert found.stop.startswith("torn last record")


def test_a_damaged_record_ends_reading_with_its_name(tmp_path):
    path = tmp_path / "j.lbj"
    write_file(path, [frame(0), frame(1), frame(2)])
    data = bytearray(path.read_bytes())
    found = scan(path)
    data[found.offsets[1] + 40] ^= 0xFF  # inside record 1's body
    path.write_bytes(bytes(data))
    found, got = read(path)
    assert [r.meta["i"] for r in got] == [0] and found.corrupt
    assert found.stop == f"corrupt record 1 (frame) at byte {found.offsets[0] + len(encode_record(frame(0), 1))}" \
                         " (checksum mismatch)"


def test_a_journal_rewritten_between_scan_and_read_is_refused_not_misread(tmp_path):
    """A reader that scans while the writer compacts: the path now names a new file whose
    offsets differ; reading the old scan's offsets from it would decode other bytes."""
    path = tmp_path / "j.lbj"
    write_file(path, [frame(0), frame(1), frame(2)], level=0)
    found = scan(path)
    aside = tmp_path / "new.lbj"
    write_file(aside, [Record("seen", {"i": 5}), frame(3)], level=0)
    os.replace(aside, path)  # what atomic_write does
    with pytest.raises(JournalError, match="was replaced after it was scanned"):
        list(iter_records(found))
    found, got = read(path)  # scanned again: the new file reads
    assert [r.meta["i"] for r in got] == [5, 3]
    os.remove(path)
    with pytest.raises(JournalError, match="cannot open the journal"):
        list(iter_records(found))


def test_not_a_journal_and_a_damaged_header_are_refused(tmp_path):
    path = tmp_path / "j.lbj"
    path.write_bytes(b"hello")
    with pytest.raises(JournalError, match="is not a journal"):
        scan(path)
    write_file(path, [])
    data = bytearray(path.read_bytes())
    data[15] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(JournalError, match="header is damaged"):
        scan(path)
    with pytest.raises(JournalError, match="cannot open the journal"):
        scan(tmp_path / "missing.lbj")


def test_writer_appends_and_rewrites(tmp_path):
    path = tmp_path / "j.lbj"
    w = JournalWriter(path)
    w.begin(HEADER, [Record("begin", {"deferred": False})])
    for i in range(5):
        w.append(frame(i))
    assert w.flush()
    found, got = read(path)
    assert found.kinds == ["begin"] + ["frame"] * 5
    # a new segment (a window restart): the file is replaced by it
    w.begin(HEADER, [Record("restart", {"kept": []})])
    w.append(frame(9))
    assert w.flush()
    assert scan(path).kinds == ["restart", "frame"]
    st = w.status()
    assert st.state == "ok" and st.rewrites == 2 and st.records == 2 and st.file_bytes == path.stat().st_size
    w.close()
    assert w.status().state == "closed"


def test_seen_and_state_records_collapse_in_the_segment(tmp_path):
    w = JournalWriter(tmp_path / "j.lbj")
    w.begin(HEADER)
    for i in range(5):
        w.append(Record("seen", {"i": i}))
    w.append(Record("state", {"name": "a", "data": 1}))
    w.append(frame(5))
    w.append(Record("state", {"name": "a", "data": 2}))
    w.append(Record("seen", {"i": 6}))
    _, records = w.snapshot()
    assert [(r.kind, r.meta.get("i", r.meta.get("data"))) for r in records] == \
        [("seen", 4), ("frame", 5), ("state", 2), ("seen", 6)]
    w.close()


def test_disk_full_pauses_with_a_reason_and_resumes_whole(tmp_path, monkeypatch, caplog):
    """A write that fails (ENOSPC) pauses journaling with the reason; frames keep coming and
    the producer is never blocked; once writes work again the journal holds every record."""
    path = tmp_path / "j.lbj"
    full = threading.Event()
    real = writer_mod.encode_record_parts

    def encode(record, level=0):
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(record, level)

    monkeypatch.setattr(writer_mod, "encode_record_parts", encode)
    real_write = writer_mod.write_journal

    def write_journal(f, header, records, level=0):
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(f, header, records, level)

    monkeypatch.setattr(writer_mod, "write_journal", write_journal)
    w = JournalWriter(path, retry_s=0.05)
    w.begin(HEADER)
    w.append(frame(0))
    assert w.flush()
    full.set()
    w.append(frame(1))
    w.flush()
    st = w.status()
    assert st.state == "paused" and st.reason == f"cannot write {path}: No space left on device" and st.pauses == 1
    assert "paused: cannot write" in caplog.text
    for i in range(2, 6):
        w.append(frame(i))  # never blocks, never raises
    assert w.status().state == "paused" and w.status().pauses == 1
    assert [r.meta["i"] for r in read(path)[1]] == [0]  # the file: what was written before
    full.clear()
    assert w.flush()  # the next retry rewrites the segment
    assert w.status().state == "ok"
    assert [r.meta["i"] for r in read(path)[1]] == list(range(6))
    w.append(frame(6))
    assert w.flush()
    assert [r.meta["i"] for r in read(path)[1]] == list(range(7))
    w.close()


def test_a_full_queue_pauses_instead_of_blocking(tmp_path, monkeypatch):
    path = tmp_path / "j.lbj"
    gate = threading.Event()
    real = writer_mod.encode_record_parts

    def slow(record, level=0):
        gate.wait()
        return real(record, level)

    monkeypatch.setattr(writer_mod, "encode_record_parts", slow)
    w = JournalWriter(path, max_queue_records=3, retry_s=0.05)
    w.begin(HEADER)
    for i in range(10):
        w.append(frame(i))  # the disk "hangs": the queue fills, appends still return at once
    st = w.status()
    assert st.state == "paused" and "queue is full" in st.reason
    gate.set()
    assert w.flush()
    assert [r.meta["i"] for r in read(path)[1]] == list(range(10))
    w.close()


def test_save_copy_is_self_contained(tmp_path):
    w = JournalWriter(tmp_path / "j.lbj")
    with pytest.raises(ValueError, match="nothing to save"):
        w.save_copy(tmp_path / "s.lbj")
    w.begin(HEADER, [Record("begin", {"deferred": True})])
    w.append(frame(0))
    (tmp_path / "saved").mkdir()
    n = w.save_copy(tmp_path / "saved" / "s.lbj")
    found, got = read(tmp_path / "saved" / "s.lbj")
    assert n == (tmp_path / "saved" / "s.lbj").stat().st_size and found.kinds == ["begin", "frame"]
    w.close()


def _drop_dac() -> None:
    """preexec_fn: as root, give up CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH so permissions apply."""
    import ctypes

    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (1, 2):
            if libc.prctl(24, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


_RO_CHILD = """
import sys, time
import numpy as np
from lingbot_map_ros.journal.format import Record
from lingbot_map_ros.journal.writer import JournalWriter
w = JournalWriter(sys.argv[1] + "/j.lbj", retry_s=0.05)
w.begin({"format": 1})
w.append(Record("frame", {"i": 0}, {"image": np.zeros((2, 2, 3), np.uint8)}))
w.flush()
print(w.status().state, w.status().reason)
"""


def test_a_folder_that_is_not_writable_pauses_the_journal(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        try:
            done = subprocess.run([sys.executable, "-c", _RO_CHILD, str(folder)], capture_output=True, text=True,
                                  timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=_drop_dac)
        except subprocess.SubprocessError as exc:
            pytest.skip(f"cannot drop root's permission override here ({exc})")
    finally:
        folder.chmod(0o755)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"paused cannot write {folder}/j.lbj: Permission denied"
    assert os.listdir(folder) == []


_KILL_CHILD = """
import os, sys
import numpy as np
from lingbot_map_ros.journal import writer as wm
from lingbot_map_ros.journal.format import Record
from lingbot_map_ros.journal.writer import JournalWriter
path, mode = sys.argv[1], sys.argv[2]
w = JournalWriter(path)
w.begin({"format": 1}, [Record("begin", {"deferred": False})])
for i in range(3):
    w.append(Record("frame", {"i": i}, {"image": np.full((64, 64, 3), i, np.uint8)}))
w.flush()
if mode == "record":  # die in the middle of appending a record
    real = wm.encode_record_parts
    def half(record, level=0):
        data = b"".join(real(record, level))
        w._file.write(data[: len(data) // 2]); w._file.flush()
        os.kill(os.getpid(), 9)
    wm.encode_record_parts = half
    w.append(Record("frame", {"i": 3}, {"image": np.full((64, 64, 3), 3, np.uint8)}))
else:  # die in the middle of a rewrite (compaction): the temp file is half written
    real = wm.write_journal
    def half(f, header, records, level=0):
        f.write(b"LBMJRNL\\n\\x00\\x00"); f.flush()
        os.kill(os.getpid(), 9)
    wm.write_journal = half
    w.begin({"format": 1}, [Record("restart", {"kept": []})])
w.flush(10)
"""


@pytest.mark.parametrize("mode", ["record", "rewrite"])
def test_kill_mid_write_leaves_a_readable_journal(tmp_path, mode):
    path = tmp_path / "j.lbj"
    done = subprocess.run([sys.executable, "-c", _KILL_CHILD, str(path), mode], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == -signal.SIGKILL, done.stderr
    found, got = read(path)
    assert [r.kind for r in got] == ["begin", "frame", "frame", "frame"]
    assert [r.meta["i"] for r in got[1:]] == [0, 1, 2]
    if mode == "record":
        assert found.stop.startswith("torn last record") and not found.corrupt
    else:
        assert found.stop == ""
        assert any(n.startswith(".j.lbj.tmp-") for n in os.listdir(tmp_path))  # the next rewrite removes it


def _compressible(i: int) -> Record:
    """A frame that compresses (smooth, as camera images are) beside a float array."""
    y, x = np.mgrid[0:48, 0:64] // 8
    image = np.stack([(x * 30 + i) % 256, (y * 50) % 256, (x + y) % 256], -1).astype(np.uint8)
    depth = np.repeat(np.linspace(1, 2, 48 * 8, dtype=np.float32), 8)
    return Record("frame", {"i": i}, {"image": image, "depth": depth})


@pytest.mark.parametrize("compression", ["none", "lz4", "zlib", 6])
def test_each_compression_round_trips_and_a_reader_needs_no_setting(tmp_path, compression):
    path = tmp_path / "j.lbj"
    w = JournalWriter(path, compression=compression)
    w.begin(HEADER, [Record("begin", {"deferred": False})])
    for i in range(3):
        w.append(_compressible(i))
    assert w.flush()
    w.close()
    found, got = read(path)
    assert found.stop == "" and [r.meta.get("i") for r in got] == [None, 0, 1, 2]
    for r, i in zip(got[1:], range(3)):
        want = _compressible(i)
        for k in want.arrays:
            np.testing.assert_array_equal(r.arrays[k], want.arrays[k])
    raw = sum(len(encode_record(_compressible(i), "none")) for i in range(3))
    packed = sum(len(encode_record(_compressible(i), compression)) for i in range(3))
    assert (packed == raw) if compression == "none" else (packed < raw), (compression, packed, raw)


def test_lz4_torn_record_and_a_missing_module_have_clear_answers(tmp_path, monkeypatch):
    from lingbot_map_ros.journal import format as fmt

    path = tmp_path / "j.lbj"
    write_file(path, [_compressible(0), _compressible(1)], level="lz4")
    full = path.read_bytes()
    path.write_bytes(full[:-5])  # torn inside the last LZ4 frame: the framing says so, nothing decodes it
    found, got = read(path)
    assert [r.meta["i"] for r in got] == [0] and found.stop.startswith("torn last record")
    path.write_bytes(full)
    found = scan(path)
    monkeypatch.setattr(fmt, "_lz4", lambda: None)  # a machine without the lz4 module
    with pytest.raises(JournalError, match="written with LZ4 compression: install the lz4 module"):
        list(iter_records(found))
    with pytest.raises(ValueError, match="needs the lz4 module"):
        JournalWriter(tmp_path / "k.lbj", compression="lz4")
    for bad in ("gzip", "", 10, -1, True, None):
        with pytest.raises(ValueError, match="journal compression"):
            JournalWriter(tmp_path / "k.lbj", compression=bad)


def test_a_hold_keeps_records_from_the_thread_until_it_ends_and_loses_none(tmp_path):
    """What is appended under a hold (nested, from two threads) reaches the file only after the
    outermost hold ends, in order; flush and close inside a hold do not wait for it."""
    path = tmp_path / "j.lbj"
    w = JournalWriter(path)
    w.begin(HEADER)
    w.append(frame(0))
    assert w.flush()
    with w.hold():
        w.append(frame(1))
        with w.hold():
            other = threading.Thread(target=lambda: [w.append(Record("seen", {"i": 100 + k})) for k in range(3)])
            other.start()
            other.join()
        time.sleep(0.2)  # the thread had time: nothing reached it
        assert [r.meta["i"] for r in read(path)[1]] == [0]
        assert w.status().queued == 4
    assert w.flush()
    assert [r.meta["i"] for r in read(path)[1]] == [0, 1, 100, 101, 102]
    with w.hold():
        w.append(frame(2))
        assert w.flush(5)  # a flush inside a hold hands the held records over first
        assert [r.meta["i"] for r in read(path)[1]][-1] == 2
        w.append(frame(3))
        w.close(5)  # so does close
    assert [r.meta["i"] for r in read(path)[1]] == [0, 1, 100, 101, 102, 2, 3]
