"""lingbot-map-replay --loop-closure: the optimised trajectory in --trajectory, the raw one beside
it (``<stem>_raw<suffix>``), both TUM with one row per frame and the same stamps.

- Plumbing, with the tiny fixture weights (skipped without ../shared): both files, the raw one
  identical to a run without --loop-closure, the optimised one equal to it when no loop was
  accepted; candidates run through the tiny model's own side session and are each decided; an
  interrupted run keeps both as ``.partial``.
- Geometry, with stand-ins (no model): the replay's own loop path (``run``: the source, the
  session and the side session replaced) on a drifting circuit of a known scene
  (test/loop_scene.py): a closure is accepted, never verified while a frame is in flight, and
  the optimised trajectory's ATE against the truth is well below the raw one's.
- Bad input: one ``lingbot-map-replay: error:`` line, exit status 2, before the model loads.
"""
from __future__ import annotations

import numpy as np
import pytest

from lingbot_map_ros.cli.replay import main
from replay_fixtures import error_line, replay

pytest.importorskip("gtsam", reason="gtsam is not installed (scripts/bootstrap.sh installs it)")


def tum(path):
    """[N, 8] rows of a TUM file: t tx ty tz qx qy qz qw."""
    rows = [line.split() for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return np.array(rows, dtype=np.float64).reshape(-1, 8)


def loop_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("lingbot-map-replay: loop closure:")]
    assert len(lines) == 1, err
    return lines[0]


def counts(line: str) -> dict[str, int]:
    """{keyframes, candidates, accepted, rejected} of the loop closure summary line."""
    body = line.split("loop closure: ", 1)[1].split(";")[0]
    return {word: int(n) for n, word in (part.split() for part in body.split(", "))}


# ----------------------------------------------------------------------------- plumbing (tiny weights)

@pytest.fixture(scope="module")
def plain(fixtures, tiny, tmp_path_factory):
    """--trajectory of the fixture frames without --loop-closure."""
    out = tmp_path_factory.mktemp("plain") / "traj.tum"
    assert main(["--images", str(fixtures / "frames"), *tiny, "--trajectory", str(out)]) == 0
    return out.read_bytes()


def test_loop_closure_writes_the_optimised_and_the_raw_trajectory(fixtures, tiny, plain, tmp_path, capsys):
    traj = tmp_path / "traj.tum"
    code, err = replay(capsys, "--images", fixtures / "frames", *tiny, "--trajectory", traj, "--loop-closure")
    assert code == 0, err
    raw = tmp_path / "traj_raw.tum"
    assert raw.read_bytes() == plain  # the front end's poses, as without --loop-closure
    optimised, front = tum(traj), tum(raw)
    assert optimised.shape == front.shape == (12, 8)
    np.testing.assert_array_equal(optimised[:, 0], front[:, 0])
    np.testing.assert_array_equal(optimised, front)  # no loop accepted: nothing moved
    assert f"wrote {traj}, {raw}" in err
    assert counts(loop_line(err)) == {"keyframes": 12, "candidates": 0, "accepted": 0, "rejected": 0}
    assert not list(tmp_path.glob("*.partial"))


def test_candidates_run_through_the_models_side_session_and_are_each_decided(fixtures, tiny, plain, tmp_path,
                                                                            capsys):
    traj = tmp_path / "t.tum"
    code, err = replay(capsys, "--images", fixtures / "frames", *tiny, "--trajectory", traj, "--loop-closure",
                       "--loop-min-separation", "2", "--loop-min-similarity", "0.5")
    assert code == 0, err
    assert "Traceback" not in err and "ERROR" not in err and "Warning" not in err, err
    n = counts(loop_line(err))
    assert n["candidates"] >= 1 and n["candidates"] == n["accepted"] + n["rejected"], n
    assert (tmp_path / "t_raw.tum").read_bytes() == plain  # the side session left the stream alone
    optimised, front = tum(traj), tum(tmp_path / "t_raw.tum")
    np.testing.assert_array_equal(optimised[:, 0], front[:, 0])
    if n["accepted"] == 0:  # the tiny model's poses fail the checks: nothing may move
        np.testing.assert_array_equal(optimised, front)


def test_an_interrupted_run_keeps_both_trajectories_as_partial(fixtures, tiny, tmp_path, capsys):
    def interrupt(done):
        if done == 5:
            raise KeyboardInterrupt

    traj = tmp_path / "t.tum"
    code = main(["--images", str(fixtures / "frames"), *tiny, "--trajectory", str(traj), "--loop-closure"], interrupt)
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err
    kept = [tmp_path / "t.tum.partial", tmp_path / "t_raw.tum.partial"]
    assert err.strip().splitlines()[-1].endswith(f"partial outputs kept: {kept[0]}, {kept[1]}")
    rows = [tum(path) for path in kept]
    assert len(rows[0]) == len(rows[1]) and len(rows[0]) in (5, 6)
    assert not traj.exists() and not (tmp_path / "t_raw.tum").exists()


# ----------------------------------------------------------------------------- geometry (stand-ins)

class SceneSession:
    """Stands in for the LongStreamSession: every frame a keyframe, its pose the drifting front
    end's (``reported``, OpenCV camera-to-world), its depth the scene's true depth. Counts the
    frames submitted whose results were not taken yet (``in_flight``)."""

    def __init__(self, reported, true) -> None:
        self.reported, self.true = reported, true
        self.window_index, self.inner, self.in_flight, self._next = 0, None, 0, 0

    def submit(self, image, stamp=None, tag=None):
        i, self._next = self._next, self._next + 1
        self.in_flight += 1
        return i, image

    def results(self, pending):
        from lingbot_map_ros.stream.results import FrameResult
        from loop_scene import K, room_depth

        i, image = pending
        self.in_flight -= 1
        depth = room_depth(self.true[i])
        return [FrameResult(i, i, True, np.zeros(9, np.float32), self.reported[i].astype(np.float32), K.copy(), depth,
                            np.full(depth.shape, 5.0, np.float32), image)]


class SceneSource:
    description = "the loop scene"

    def __init__(self, images) -> None:
        self.images = images

    def expected_frames(self) -> int:
        return len(self.images)

    def frames(self):
        from lingbot_map_ros.io.sources import SourceFrame

        for i, rgb in enumerate(self.images):
            yield SourceFrame(1_000_000_000 + i * 100_000_000, f"frame {i}", rgb)


def test_a_closure_on_a_drifting_circuit_lowers_the_optimised_trajectorys_ate(tmp_path, capsys, monkeypatch):
    """Geometry with stand-ins: a drifting front end goes once around a box room and sees its first
    places again; the side session knows the true geometry (test/loop_scene.py)."""
    import lingbot_map_ros.cli.replay as replay_module
    import lingbot_map_ros.runtime.loop_verify as loop_verify
    from lingbot_map_ros.slam import ate
    from loop_scene import TrueSideRunner, circuit, drifted, place_image

    n, revisit = 40, 6
    true = circuit(n)
    true = true + true[:revisit]
    reported = drifted(true)
    images = [place_image(i % n) for i in range(len(true))]
    session = SceneSession(reported, true)

    class Side(TrueSideRunner):
        in_flight: list[int] = []  # frames in flight at each verification

        def run(self, imgs):
            self.in_flight.append(session.in_flight)
            return super().run(imgs)

    side = Side(list(zip(images[:n], true[:n])))
    monkeypatch.setattr(replay_module, "open_source", lambda args, settings: SceneSource(images))
    monkeypatch.setattr(replay_module, "make_session", lambda args, settings: (session, None, -1))
    monkeypatch.setattr(loop_verify, "ModelSideRunner", lambda inner: side)

    traj = tmp_path / "traj.tum"
    code, err = replay(capsys, "--images", tmp_path, "--width", "98", "-q", "--trajectory", traj, "--loop-closure",
                       "--loop-min-separation", "20", "--loop-min-similarity", "0.9")
    assert code == 0, err
    got = counts(loop_line(err))
    assert got["keyframes"] == len(true) and got["accepted"] >= 1 and side.calls >= 1, got
    assert side.in_flight == [0] * side.calls  # the frame in flight was taken before the model ran the candidate
    optimised, raw = tum(traj), tum(tmp_path / "traj_raw.tum")
    assert optimised.shape == raw.shape == (len(true), 8)
    np.testing.assert_array_equal(optimised[:, 0], raw[:, 0])
    np.testing.assert_allclose(raw[:, 1:4], np.array(reported)[:, :3, 3], atol=1e-5)  # the front end as it came
    truth = np.array(true)[:, :3, 3]
    before, after = ate(raw[:, 1:4], truth), ate(optimised[:, 1:4], truth)
    assert after < 0.6 * before, (before, after)  # what one lap's closure does on this drift: 0.053 -> 0.025
    # the revisits land where the first lap saw their places
    gap_raw = np.linalg.norm(raw[n:, 1:4] - raw[:revisit, 1:4], axis=1)
    gap_optimised = np.linalg.norm(optimised[n:, 1:4] - optimised[:revisit, 1:4], axis=1)
    assert np.all(gap_optimised < 0.2 * gap_raw), (gap_raw, gap_optimised)


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("argv, needle", [
    (["--loop-closure", "--out", "o.npz"], "--loop-closure needs --trajectory"),
    (["--loop-closure", "--trajectory", "t.tum", "--no-depth"], "--loop-closure needs depth; drop --no-depth"),
    (["--loop-closure", "--trajectory", "t.tum", "--resume", "s"], "--loop-closure does not go with --resume"),
    (["--trajectory", "t.tum", "--loop-min-separation", "5"], "--loop-min-separation goes with --loop-closure"),
    (["--loop-closure", "--trajectory", "t.tum", "--loop-min-similarity", "0"],
     "--loop-min-similarity must be in (0, 1], got 0.0"),
    (["--loop-closure", "--trajectory", "t.tum", "--loop-min-separation", "0"],
     "--loop-min-separation must be at least 1, got 0"),
    (["--loop-closure", "--trajectory", "t.tum", "--ply", "t_raw.tum"], "raw trajectory and --ply both write"),
    (["--loop-closure", "--trajectory", "old.tum"], "raw trajectory {d}/old_raw.tum exists already; pass --overwrite"),
])
def test_bad_loop_closure_flags_are_one_line_before_the_model_loads(tmp_path, capsys, argv, needle):
    (tmp_path / "old_raw.tum").write_text("mine\n")
    argv = [a if a.startswith("-") or a == "0" or a == "5" else tmp_path / a for a in argv]
    code, err = replay(capsys, "--images", tmp_path, *argv)
    assert code == 2
    assert needle.format(d=tmp_path) in error_line(err)
    assert "model ready" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old_raw.tum"]
    assert (tmp_path / "old_raw.tum").read_text() == "mine\n"


def test_the_fleet_refuses_loop_closure():
    from lingbot_map_ros.cli.fleet_inputs import UsageError, check_flags

    with pytest.raises(UsageError, match="--loop-closure is for lingbot-map-replay alone"):
        check_flags(["--loop-closure"], "flags")
