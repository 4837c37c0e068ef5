"""State directories and saved sessions without ROS: resume at start, a journal of another
configuration set aside untouched, a damaged one resumed to its last good record with a
copy kept, save_session / load_session into a fresh session equal to the uninterrupted run."""
from __future__ import annotations

import numpy as np
import pytest

from lingbot_map_ros.journal import JOURNAL_NAME, JournalMismatch, journal_identity, load_session, \
    open_state_directory, save_session
from lingbot_map_ros.journal.format import scan

from test_journal_resume import assert_same, image, make, run_steps  # noqa: F401
from test_journal_resume import images, straight  # noqa: F401  pytest fixtures

K = 9


def opened(tiny_model, fixture_config, folder, **kw):
    """``open_state_directory`` on a fresh session; the result with the session beside it (``.session``)."""
    session = make(tiny_model, fixture_config, **kw)
    out = open_state_directory(folder, session, journal_identity(session, "fixture"))
    out.session = session
    return out


def test_state_directory_resumes_and_saved_sessions_load(tiny_model, fixture_config, images, straight, tmp_path):
    state = tmp_path / "state"
    first = opened(tiny_model, fixture_config, state)
    assert first.rebuilt is None and first.refused == ""
    run_steps(first.session, images, range(K))
    dest, size = save_session(first.recorder, tmp_path / "saved" / "kitchen")
    assert dest.stat().st_size == size and scan(dest).stop == ""
    first.recorder.writer.close()

    again = opened(tiny_model, fixture_config, state)  # a restart of the process
    assert again.rebuilt is not None and again.rebuilt.next_frame == straight[K - 1][1]
    assert_same(straight, run_steps(again.session, images, range(K, K + 4)), range(K, K + 4))
    again.recorder.writer.close()

    fresh = opened(tiny_model, fixture_config, tmp_path / "other")
    run_steps(fresh.session, images, range(3), script={})  # another map first
    rebuilt = load_session(fresh.session, fresh.recorder, tmp_path / "saved" / "kitchen")
    assert rebuilt.next_frame == straight[K - 1][1]
    assert_same(straight, run_steps(fresh.session, images, range(K, K + 4)), range(K, K + 4))
    # the loaded session is now the journal of that state directory
    assert scan(tmp_path / "other" / JOURNAL_NAME).kinds[:1] == ["begin"]
    fresh.recorder.writer.close()


def test_refused_and_damaged_journals(tiny_model, fixture_config, images, tmp_path):
    state = tmp_path / "state"
    first = opened(tiny_model, fixture_config, state)
    run_steps(first.session, images, range(5), script={})
    first.recorder.writer.close()
    original = (state / JOURNAL_NAME).read_bytes()

    # a saved session of another configuration does not load: state unchanged
    other = opened(tiny_model, fixture_config, tmp_path / "o", window_frames=9)
    run_steps(other.session, images, range(3), script={})
    before = other.session.frames_pushed
    with pytest.raises(JournalMismatch, match="window_frames: journal 8, here 9"):
        load_session(other.session, other.recorder, state)
    assert other.session.frames_pushed == before
    other.recorder.writer.close()

    # at start: set aside, untouched, and a new journal begins
    refused = opened(tiny_model, fixture_config, state, window_frames=9)
    assert "window_frames: journal 8, here 9" in refused.refused and refused.rebuilt is None
    assert refused.set_aside.read_bytes() == original
    refused.recorder.writer.close()
    assert scan(state / JOURNAL_NAME).kinds == ["begin"]

    # damaged: resumed up to the bad record, a copy kept
    (state / JOURNAL_NAME).write_bytes(original)
    found = scan(state / JOURNAL_NAME)
    data = bytearray(original)
    data[found.offsets[-1] + 30] ^= 0xFF
    (state / JOURNAL_NAME).write_bytes(bytes(data))
    damaged = opened(tiny_model, fixture_config, state)
    assert damaged.rebuilt.corrupt and "checksum mismatch" in damaged.rebuilt.stop
    assert damaged.set_aside.read_bytes() == bytes(data)
    damaged.recorder.writer.flush()
    assert scan(state / JOURNAL_NAME).stop == ""  # rewritten without the damaged tail
    damaged.recorder.writer.close()
