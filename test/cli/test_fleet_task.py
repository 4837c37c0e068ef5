"""One lingbot-map-fleet task in this process (no Ray; the tiny model): its segments share one
model and their outputs put together equal a single replay (depth every K frames, depth
chunks, --max-frames); a bag without --topic gets its only image topic; refusals."""
from __future__ import annotations

import fcntl
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from fleet_helpers import assert_same_outputs, single_replay, tum_rows
from replay_fixtures import typestore

from lingbot_map_ros.cli import fleet_replay
from lingbot_map_ros.cli.fleet_inputs import CommonFlags, make_input, pick_topic
from lingbot_map_ros.cli.fleet_task import TaskPlan, fingerprint, run_input

MODEL = ["--keyframe-interval", "2", "--window-frames", "5", "--threads", "1"]


def plan_for(source: Path, flags: list[str], root: Path, outputs=("trajectory", "ply", "npz", "bag"),
             segment: int = 4) -> TaskPlan:
    item = make_input(source, None, None, CommonFlags.split(flags), [], "test")
    return TaskPlan(item, root / item.name, tuple(outputs), segment, "cpu", 1, "run", fingerprint(item, outputs))


def test_fleet_task_segments_share_one_model_and_equal_a_single_replay(fixtures, tiny, tmp_path):
    flags = [*tiny, *MODEL, "--save-depth", "every-4", "--chunk-frames", "2", "--max-frames", "11",
             "--bag-path-rate", "1", "--bag-path-length", "3"]  # a path message a frame (1 s apart), 3 poses
    reference = single_replay("--images", fixtures / "frames", flags, tmp_path / "single")
    loads = fleet_replay.model_loads
    result = run_input(plan_for(fixtures / "frames", flags, tmp_path / "out", segment=3))
    assert result.status == "ok", result.reason
    assert result.frames == 11 and result.attempts == 1 and result.resumed_from == 0
    assert fleet_replay.model_loads == loads + 1  # three segments (4, 4, 3 frames: every-4 keeps rows aligned)
    folder = tmp_path / "out" / "frames"
    assert_same_outputs(folder, reference)
    chunks = np.load(folder / "predictions.npz")["depth_chunks"]
    assert list(chunks) == list(np.load(reference / "predictions.npz")["depth_chunks"])  # rows 0, 4 | 8
    assert (folder / "session" / "journal.lbj").is_file() and not (folder / ".fleet").exists()
    again = run_input(plan_for(fixtures / "frames", flags, tmp_path / "out", segment=3))
    assert again.status == "skipped" and again.frames == 11 and not (folder / ".fleet").exists()


def _one_topic_bag(path: Path, frames: list[Path]) -> None:
    from rosbags.rosbag2 import StoragePlugin, Writer

    from replay_fixtures import PERIOD, T0, compressed_image

    store = typestore()
    with Writer(path, version=9, storage_plugin=StoragePlugin.MCAP) as writer:
        conn = writer.add_connection("/front/compressed", "sensor_msgs/msg/CompressedImage", typestore=store)
        for i, f in enumerate(frames):
            msg = compressed_image(store.types, f.read_bytes(), T0 + i * PERIOD, fmt="png")
            writer.write(conn, T0 + i * PERIOD, store.serialize_cdr(msg, "sensor_msgs/msg/CompressedImage"))


def test_fleet_task_takes_a_bags_only_image_topic(fixtures, tiny, tmp_path):
    bag = tmp_path / "front"
    _one_topic_bag(bag, sorted((fixtures / "frames").glob("*.png"))[:6])
    assert pick_topic(bag) == "/front/compressed"
    reference = tmp_path / "single.tum"
    from lingbot_map_ros.cli.replay import main

    assert main(["--bag", str(bag), "--topic", "/front/compressed", *tiny, *MODEL, "--trajectory",
                 str(reference)]) == 0
    result = run_input(plan_for(bag, [*tiny, *MODEL], tmp_path / "out", outputs=("trajectory",), segment=100))
    assert result.status == "ok", result.reason
    np.testing.assert_allclose(tum_rows(tmp_path / "out/front/trajectory.tum"), tum_rows(reference), rtol=0,
                               atol=1e-6)


def test_fleet_bags_without_one_image_topic_name_their_topics(fixtures, tmp_path):
    from replay_fixtures import write_image_bag

    write_image_bag(tmp_path / "two", sorted((fixtures / "frames").glob("*.png"))[:2])
    with pytest.raises(ValueError, match=r"has 2 image topics \(/camera/image, /other/image/compressed\); choose"):
        pick_topic(tmp_path / "two")
    with pytest.raises(ValueError, match="cannot read bag"):
        pick_topic(tmp_path)


def test_fleet_task_refusals_leave_what_is_there(fixtures, tiny, tmp_path):
    plan = plan_for(fixtures / "frames", [*tiny, *MODEL], tmp_path / "out")
    folder = plan.folder
    folder.mkdir(parents=True)
    (folder / "map.ply").write_bytes(b"precious")
    result = run_input(plan)
    assert result.status == "failed" and "map.ply exists already and this run did not write it" in result.reason
    assert (folder / "map.ply").read_bytes() == b"precious"
    shutil.rmtree(folder)

    work = folder / ".fleet"
    work.mkdir(parents=True)
    other = {"fingerprint": {"flags": ["--stride", "2"]}, "device": "cpu", "attempts": 1,
             "segments": [{"frames": 4, "dropped": 0, "seconds": 1.0}], "complete": False}
    (work / "state.json").write_text(json.dumps(other))
    result = run_input(plan)
    assert result.status == "failed" and "holds an unfinished run of other flags" in result.reason
    assert json.loads((work / "state.json").read_text()) == other

    with open(work / "lock", "a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        result = run_input(plan)
    assert result.status == "failed" and "another lingbot-map-fleet run is working on" in result.reason


def test_fleet_task_finishes_again_when_it_died_while_finishing(fixtures, tiny, tmp_path, monkeypatch):
    from lingbot_map_ros.cli import fleet_task

    reference = single_replay("--images", fixtures / "frames", [*tiny, *MODEL], tmp_path / "single")
    plan = plan_for(fixtures / "frames", [*tiny, *MODEL], tmp_path / "out", segment=100)  # one segment: moved
    real = fleet_task.write_json

    def dies_before_the_result(path: Path, data: dict) -> None:
        if path.name == "result.json":
            raise OSError(5, "Input/output error")  # as a kill after the outputs went into place
        real(path, data)

    monkeypatch.setattr(fleet_task, "write_json", dies_before_the_result)
    first = run_input(plan)
    assert first.status == "failed" and "Input/output error" in first.reason
    assert (plan.folder / "trajectory.tum").is_file() and not (plan.folder / "result.json").exists()
    monkeypatch.setattr(fleet_task, "write_json", real)
    again = run_input(plan)
    assert again.status == "ok" and again.frames == 12 and again.attempts == 2 and again.resumed_from == 12
    assert_same_outputs(plan.folder, reference)


def test_fleet_task_failed_before_any_segment_starts_again_with_other_flags(fixtures, tiny, tmp_path):
    bad = run_input(plan_for(fixtures / "frames", [*tiny, *MODEL, "--start", "100"], tmp_path / "out",
                             outputs=("trajectory",)))
    assert bad.status == "failed" and "no image of" in bad.reason and "lies in the selected range" in bad.reason
    assert (tmp_path / "out/frames/.fleet/replay.log").read_text().count("lingbot-map-replay: error:") == 1
    fixed = run_input(plan_for(fixtures / "frames", [*tiny, *MODEL], tmp_path / "out", outputs=("trajectory",)))
    assert fixed.status == "ok" and fixed.frames == 12 and fixed.attempts == 1
