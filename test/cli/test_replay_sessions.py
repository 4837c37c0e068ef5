"""lingbot-map-replay --save-session / --resume: a replay interrupted and resumed from its
journal writes the same trajectory as one straight run; a journal of other flags is refused."""
from __future__ import annotations

import numpy as np
import pytest

from lingbot_map_ros.cli.replay import main
from lingbot_map_ros.journal import JOURNAL_NAME
from lingbot_map_ros.journal.format import scan

FLAGS = ["--keyframe-interval", "2", "--window-frames", "5"]


def tum(path):
    rows = [l.split() for l in path.read_text().splitlines() if l and not l.startswith("#")]
    return np.array(rows, dtype=np.float64)


@pytest.fixture(scope="module")
def straight(fixtures, tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "traj.tum"
    assert main(["--images", str(fixtures / "frames"), *tiny, *FLAGS, "--trajectory", str(out)]) == 0
    rows = tum(out)
    assert len(rows) == 12
    return rows


@pytest.mark.parametrize("k", [3, 9])  # 9: right after the window restart at frame 8
def test_interrupted_and_resumed_equals_a_straight_run(fixtures, tiny, straight, tmp_path, k):
    session = tmp_path / "session"
    first, second = tmp_path / "first.tum", tmp_path / "second.tum"
    args = ["--images", str(fixtures / "frames"), *tiny, *FLAGS]
    assert main([*args, "--max-frames", str(k), "--save-session", str(session), "--trajectory", str(first)]) == 0
    assert scan(session / JOURNAL_NAME).stop == ""
    assert main([*args, "--resume", str(session), "--trajectory", str(second)]) == 0
    resumed = tum(second)
    done = tum(first)
    assert len(done) + len(resumed) == 12
    np.testing.assert_allclose(np.vstack([done, resumed]), straight, atol=1e-4)


def test_resume_with_other_flags_is_refused(fixtures, tiny, tmp_path, capsys):
    session = tmp_path / "session"
    args = ["--images", str(fixtures / "frames"), *tiny]
    assert main([*args, *FLAGS, "--max-frames", "4", "--save-session", str(session)]) == 0
    before = (session / JOURNAL_NAME).read_bytes()
    code = main([*args, "--keyframe-interval", "2", "--window-frames", "6", "--resume", str(session)])
    err = capsys.readouterr().err
    assert code != 0 and "cannot resume from" in err and "window_frames: journal 5, here 6" in err
    assert (session / JOURNAL_NAME).read_bytes() == before


def test_resume_from_a_folder_without_a_journal(fixtures, tiny, tmp_path, capsys):
    code = main(["--images", str(fixtures / "frames"), *tiny, "--resume", str(tmp_path)])
    assert code != 0 and "cannot open the journal" in capsys.readouterr().err


def test_save_session_never_overwrites_a_session(fixtures, tiny, tmp_path, capsys):
    (tmp_path / JOURNAL_NAME).write_bytes(b"precious")
    code = main(["--images", str(fixtures / "frames"), *tiny, "--save-session", str(tmp_path)])
    assert code != 0 and "already holds a session" in capsys.readouterr().err
    assert (tmp_path / JOURNAL_NAME).read_bytes() == b"precious"
