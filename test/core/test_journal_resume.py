"""Journal → rebuild at the stream level: a run interrupted after step k and resumed from its
journal in a fresh session gives the uninterrupted run's poses, depth and frame indices
(tiny fixture model, fp32, CPU), for k in the scale phase, mid-window, right after window
restarts, around deferred evictions committed and rolled back, and after a reset."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lingbot_map_ros.config import StreamConfig
from lingbot_map_ros.journal import JOURNAL_NAME, JournalMismatch, JournalRecorder, JournalWriter, journal_identity
from lingbot_map_ros.journal.format import scan
from lingbot_map_ros.journal.resume import rebuild
from lingbot_map_ros.stream.errors import SessionError
from lingbot_map_ros.stream.long_stream import LongStreamConfig, LongStreamSession
from lingbot_map_ros.stream.session import StreamingSession

STEPS = 30
TOL = 1e-4


@pytest.fixture(scope="module")
def images(fixtures):
    return np.load(fixtures / "reference_kf1.npz")["images"]


def image(images, step, uint8=True):
    """Step ``step``'s input: the 12 fixture images, mirrored on odd passes; uint8 [H, W, 3]
    (what the node pushes) or float32 [3, H, W]."""
    im = images[step % len(images)]
    if (step // len(images)) % 2:
        im = im[:, :, ::-1]
    if uint8:
        return np.ascontiguousarray(np.rint(np.transpose(im, (1, 2, 0)) * 255).astype(np.uint8))
    return np.ascontiguousarray(im)


def make(model, fixture_config, long=True, **long_kw):
    cfg = StreamConfig.from_dict(fixture_config).with_overrides(backend="sdpa", keyframe_interval=2)
    inner = StreamingSession(model, cfg)
    return LongStreamSession(inner, LongStreamConfig(**{"window_frames": 8, **long_kw}) if long else None)


# ops run before the step's frame; rollback/commit outcomes (or their refusal) are compared too
SCRIPT = {
    5: ["defer_on"],
    11: ["commit"],
    13: ["rollback"],
    15: ["defer_off"],
    19: ["rollback"],
    26: ["reset"],
}


def run_steps(session, images, steps, script=SCRIPT, uint8=True):
    """{step: outcome}: the frames' (index, stored, c2w, depth) and the services' results."""
    out = {}
    for s in steps:
        got = []
        for op in script.get(s, []):
            try:
                if op == "defer_on":
                    session.set_deferred_eviction(True)
                elif op == "defer_off":
                    session.set_deferred_eviction(False)
                elif op == "commit":
                    got.append(("commit", session.commit_eviction()))
                elif op == "rollback":
                    got.append(("rollback", session.rollback_last_frame()))
                elif op == "reset":
                    session.reset()
            except SessionError as exc:
                got.append((op, "refused", str(exc)))
        im = image(images, s, uint8)
        results = session.push(im, tag={"n": s})
        got += [(r.frame_index, r.is_keyframe, r.c2w, r.depth) for r in results]
        out[s] = (got, session.frames_pushed, session.window_index)
    return out


def assert_same(a, b, steps):
    for s in steps:
        (ga, fa, wa), (gb, fb, wb) = a[s], b[s]
        assert (fa, wa) == (fb, wb), f"step {s}: frames_pushed/window {fb, wb}, uninterrupted {fa, wa}"
        assert len(ga) == len(gb), f"step {s}: {len(gb)} outcomes, uninterrupted {len(ga)}"
        for x, y in zip(ga, gb):
            if isinstance(x[0], str):
                assert x == y, f"step {s}: {y} != {x}"
                continue
            assert x[:2] == y[:2], f"step {s}: frame (index, stored) {y[:2]}, uninterrupted {x[:2]}"
            np.testing.assert_allclose(y[2], x[2], atol=TOL, err_msg=f"step {s} frame {x[0]} pose")
            np.testing.assert_allclose(y[3], x[3], atol=TOL, rtol=TOL, err_msg=f"step {s} frame {x[0]} depth")


@pytest.fixture(scope="module")
def straight(tiny_model, fixture_config, images):
    return run_steps(make(tiny_model, fixture_config), images, range(STEPS))


def journaled(session, path, **kw):
    """``session`` observed by a journal recorder writing ``path`` (``session.events``)."""
    writer = JournalWriter(path, **kw)
    session.observe(JournalRecorder(writer, journal_identity(session, "fixture"), session.deferred_eviction))
    return session, writer


def resume(tiny_model, fixture_config, path, long=True):
    session = make(tiny_model, fixture_config, long)
    ident = journal_identity(session, "fixture")
    rebuilt = rebuild(session, path, ident)
    writer = JournalWriter(path)
    recorder = JournalRecorder(writer, ident, begin=False)
    recorder.adopt(rebuilt.records, rebuilt.scale_count, rebuilt.state_records, session.inner.resolution)
    session.observe(recorder)
    return session, writer, rebuilt


def test_the_script_covers_restarts_deferral_and_rollbacks(straight):
    windows = {w for _, _, w in straight.values()}
    assert max(windows) >= 1 and straight[14][2] == 0 and straight[15][2] == 1  # a restart at step 14
    outcomes = [g for s in SCRIPT for g in straight[s][0] if isinstance(g[0], str)]
    assert ("commit", 2) in outcomes  # deferred evictions committed
    assert ("rollback", 12) in outcomes and ("rollback", 16) in outcomes  # in both windows
    assert straight[26][1] == 0  # the reset


# 1: in the scale phase; 9: deferred evictions pending; 14: after a rollback (deferred);
# 15: right after the window restart; 20: after a rollback in window 1; 27: after the reset,
# in the new sequence's scale phase
KILLS = (1, 9, 14, 15, 20, 27)


@pytest.fixture(scope="module")
def journals(tiny_model, fixture_config, images, straight, tmp_path_factory):
    """One journaled run over all steps; the journal as it was on disk after step k-1 for each
    k of KILLS (the run equals the uninterrupted one while it journals)."""
    folder = tmp_path_factory.mktemp("journals")
    path = folder / JOURNAL_NAME
    session, writer = journaled(make(tiny_model, fixture_config), path)
    copies = {}
    for s in range(STEPS):
        assert_same(straight, run_steps(session, images, [s]), [s])
        if s + 1 in KILLS:
            assert writer.flush() and writer.status().state == "ok"
            copies[s + 1] = folder / f"after{s + 1}.lbj"
            copies[s + 1].write_bytes(path.read_bytes())
    writer.close()
    return copies


@pytest.mark.parametrize("k", KILLS)
def test_resumed_run_equals_the_uninterrupted_one(tiny_model, fixture_config, images, straight, journals, tmp_path,
                                                  k):
    path = tmp_path / JOURNAL_NAME
    path.write_bytes(journals[k].read_bytes())
    resumed, writer, rebuilt = resume(tiny_model, fixture_config, path)
    assert rebuilt.stop == "" and rebuilt.max_pose_error <= TOL
    assert resumed.frames_pushed == straight[k - 1][1] and resumed.window_index == straight[k - 1][2]
    tail = range(k, min(STEPS, k + 8))  # through the next services, restart or reset
    assert_same(straight, run_steps(resumed, images, tail), tail)
    writer.close()


def test_resume_twice_in_a_row(tiny_model, fixture_config, images, straight, tmp_path):
    """Interrupted at 7 and again at 15: the second resume reads the journal the first resumed
    session continued (rewritten at adopt, compacted at its restarts)."""
    path = tmp_path / JOURNAL_NAME
    session, writer = journaled(make(tiny_model, fixture_config), path)
    run_steps(session, images, range(7))
    writer.close()
    resumed, writer, _ = resume(tiny_model, fixture_config, path)
    run_steps(resumed, images, range(7, 15))
    writer.close()
    resumed, writer, _ = resume(tiny_model, fixture_config, path)
    assert_same(straight, run_steps(resumed, images, range(15, 22)), range(15, 22))
    writer.close()


def test_float_frames_and_a_session_without_windows(tiny_model, fixture_config, images, tmp_path):
    """float32 [3, H, W] inputs are journaled as they came; a session without windows (no
    LongStreamConfig) resumes too."""
    script = {5: ["defer_on"], 9: ["rollback"], 10: ["commit"]}
    steps = range(14)
    straight = run_steps(make(tiny_model, fixture_config, long=False), images, steps, script, uint8=False)
    path = tmp_path / JOURNAL_NAME
    session, writer = journaled(make(tiny_model, fixture_config, long=False), path)
    run_steps(session, images, range(8), script, uint8=False)
    writer.close()
    resumed, writer, rebuilt = resume(tiny_model, fixture_config, path, long=False)
    kinds = scan(path).kinds
    assert "frame" in kinds
    assert_same(straight, run_steps(resumed, images, range(8, 14), script, uint8=False), range(8, 14))
    writer.close()


def test_journal_is_compacted_at_restarts(tiny_model, fixture_config, images, straight, tmp_path):
    """After a window restart the journal holds only the restart record and what followed."""
    path = tmp_path / JOURNAL_NAME
    session, writer = journaled(make(tiny_model, fixture_config), path)
    run_steps(session, images, range(20))
    writer.flush()
    found = scan(path)
    assert found.kinds[0] == "restart"
    assert found.kinds.count("restart") == 1
    assert writer.status().rewrites >= 2  # the first begin, then one per restart
    writer.close()


def test_a_journal_of_another_configuration_is_refused_and_left_alone(tiny_model, fixture_config, images,
                                                                       tmp_path):
    path = tmp_path / JOURNAL_NAME
    session, writer = journaled(make(tiny_model, fixture_config), path)
    run_steps(session, images, range(6))
    writer.close()
    before = path.read_bytes()
    other = make(tiny_model, fixture_config, window_frames=9)
    with pytest.raises(JournalMismatch, match=r"long_stream.window_frames: journal 8, here 9"):
        rebuild(other, path, journal_identity(other, "fixture"))
    same = make(tiny_model, fixture_config)
    with pytest.raises(JournalMismatch, match="image_width is 112"):
        rebuild(same, path, journal_identity(same, "fixture"), width=112)
    assert path.read_bytes() == before
    assert other.frames_pushed == 0


def test_named_states_survive_compaction(tiny_model, fixture_config, images, tmp_path):
    path = tmp_path / JOURNAL_NAME
    session, writer = journaled(make(tiny_model, fixture_config), path)
    session.events.note_state("metric_scale", {"scale": 1.5, "samples": 3})
    run_steps(session, images, range(10))
    session.events.note_state("map_offset", {"t": [1.0, 2.0, 3.0]})
    session.events.note_state("metric_scale", {"scale": 1.25, "samples": 9})
    run_steps(session, images, range(10, 16), script={})
    writer.close()
    _, _, rebuilt = resume(tiny_model, fixture_config, path)
    assert rebuilt.states == {"metric_scale": {"scale": 1.25, "samples": 9}, "map_offset": {"t": [1.0, 2.0, 3.0]}}


def test_pipelined_submits_journal_in_order(tiny_model, fixture_config, images, straight, tmp_path):
    """submit t+1 before taking t's results (the node's pipelined path): the same journal."""
    path = tmp_path / JOURNAL_NAME
    session, writer = journaled(make(tiny_model, fixture_config), path)
    pending = []
    for s in range(9):
        if s in SCRIPT:
            assert SCRIPT[s] == ["defer_on"]
            session.set_deferred_eviction(True)  # takes the earlier results first: journaled in order
        pending.append(session.submit(image(images, s), tag={"n": s}))
        if len(pending) == 2:
            session.results(pending.pop(0))
    for p in pending:
        session.results(p)
    writer.close()
    resumed, writer, _ = resume(tiny_model, fixture_config, path)
    assert_same(straight, run_steps(resumed, images, range(9, 17)), range(9, 17))
    writer.close()


def test_torch_frames_are_copied(tiny_model, fixture_config, images, tmp_path):
    """A frame given as a tensor is journaled by value (the caller may reuse its buffer)."""
    path = tmp_path / JOURNAL_NAME
    session, writer = journaled(make(tiny_model, fixture_config, long=False), path)
    buf = torch.from_numpy(image(images, 0, uint8=False).copy())
    for s in range(4):
        buf.copy_(torch.from_numpy(image(images, s, uint8=False)))
        session.push(buf)
    writer.close()
    from lingbot_map_ros.journal.format import iter_records

    frames = [r for r in iter_records(scan(path)) if r.kind == "frame"]
    assert [r.meta["i"] for r in frames] == [0, 1, 2]
    for r, s in zip(frames, [0, 1, 2]):
        np.testing.assert_array_equal(r.arrays["image"], image(images, s, uint8=False))
