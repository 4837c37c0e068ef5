"""lingbot-map-fleet on a local Ray (2 CPUs, the tiny model): three inputs (a folder, a sqlite3
bag, an MCAP bag) give what three single replays give; bad inputs (no image topic, not a
video, missing) fail alone with their reason; a second run skips what is complete; a worker
killed mid-input (SIGKILL) is retried and resumes from its journal; an input whose task could
not finish is resumed by the next run of the command."""
from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest
from fleet_helpers import ALL_OUTPUTS, assert_same_outputs, fleet, local_ray, read_json_or_none, result_of, \
    single_replay, wait_for
from replay_fixtures import typestore, write_image_bag

# window restarts every few stored frames and a new segment every 6 frames: both fall mid-input
MODEL = ["--keyframe-interval", "2", "--window-frames", "5", "--threads", "1"]
TOPIC = "/camera/image"
KILL_FRAMES = 30  # frames of the input whose worker is killed: 5 segments


@pytest.fixture(scope="module")
def ray_instance():
    with local_ray(num_cpus=2) as ray:
        yield ray


@pytest.fixture(scope="module")
def inputs(fixtures, tmp_path_factory) -> dict[str, Path]:
    """The fixture's 12 frames as a folder, a sqlite3 bag (raw images), an MCAP bag (10 PNG
    messages), and a bag without any image topic."""
    d = tmp_path_factory.mktemp("fleet_inputs")
    frames = sorted((fixtures / "frames").glob("*.png"))
    shutil.copytree(fixtures / "frames", d / "walk")
    write_image_bag(d / "yard", frames, storage="sqlite3", kind="raw", topic=TOPIC)
    write_image_bag(d / "hall", frames[:10], storage="mcap", kind="compressed", topic=TOPIC)
    _write_chatter_bag(d / "chatter")
    (d / "broken.mp4").write_bytes(bytes(range(256)) * 8)  # not a video
    return {"walk": d / "walk", "yard": d / "yard", "hall": d / "hall", "chatter": d / "chatter",
            "broken": d / "broken.mp4"}


def _write_chatter_bag(path: Path) -> None:
    from rosbags.rosbag2 import StoragePlugin, Writer

    store = typestore()
    with Writer(path, version=9, storage_plugin=StoragePlugin.MCAP) as writer:
        conn = writer.add_connection("/chatter", "std_msgs/msg/String", typestore=store)
        for i in range(3):
            writer.write(conn, i, store.serialize_cdr(store.types["std_msgs/msg/String"](data=str(i)),
                                                      "std_msgs/msg/String"))


def test_fleet_three_inputs_equal_single_replays_bad_inputs_fail_alone_and_a_rerun_skips(
        ray_instance, inputs, tiny, tmp_path, capsys):
    flags = [*tiny, *MODEL]
    refs = {name: single_replay(flag, inputs[name], flags + extra, tmp_path / "single" / name)
            for name, flag, extra in (("walk", "--images", []), ("yard", "--bag", ["--topic", TOPIC]),
                                      ("hall", "--bag", ["--topic", TOPIC]))}
    capsys.readouterr()
    root = tmp_path / "out"
    argv = [*(inputs[n] for n in ("walk", "yard", "hall", "chatter", "broken")), tmp_path / "missing.mcap",
            "-o", root, "--cpus-per-task", "1", "--segment-frames", "6", "--outputs", ALL_OUTPUTS,
            "--", *flags, "--topic", TOPIC]
    assert fleet(*argv) == 1
    table = capsys.readouterr().out
    for name in ("walk", "yard", "hall"):
        assert_same_outputs(root / name, refs[name])
        assert result_of(root / name)["status"] == "ok"
        assert not (root / name / ".fleet").exists()
    summary = json.loads((root / "fleet-summary.json").read_text())
    status = {r["name"]: r for r in summary["inputs"]}
    assert summary["counts"] == {"ok": 3, "skipped": 0, "failed": 3}
    assert [status[n]["frames"] for n in ("walk", "yard", "hall")] == [12, 12, 10]
    assert "has no topic /camera/image" in status["chatter"]["reason"]
    assert "it has no image topics" in status["chatter"]["reason"]
    assert status["broken"]["reason"].startswith(f"cannot read video {inputs['broken']}: InvalidDataError")
    assert status["missing"]["reason"] == f"no such file or folder: {tmp_path / 'missing.mcap'}"
    assert all(f" {status[n]['status']}" in table for n in status) and "no such file or folder" in table

    before = {p: p.stat().st_mtime_ns for p in root.glob("*/*") if p.is_file()}
    assert fleet(*argv) == 1  # the bad inputs still fail
    again = {r["name"]: r["status"] for r in json.loads((root / "fleet-summary.json").read_text())["inputs"]}
    assert again == {"walk": "skipped", "yard": "skipped", "hall": "skipped", "chatter": "failed",
                     "broken": "failed", "missing": "failed"}
    assert {p: p.stat().st_mtime_ns for p in root.glob("*/*") if p.is_file()} == before


@pytest.fixture(scope="module")
def long_input(loop_frames, tmp_path_factory) -> Path:
    """The first KILL_FRAMES frames of ../shared/data/loop."""
    frames = sorted(loop_frames[0].parent.glob("*.jpg"))[:KILL_FRAMES]
    assert len(frames) == KILL_FRAMES
    folder = tmp_path_factory.mktemp("long") / "loop"
    folder.mkdir()
    for f in frames:
        shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture(scope="module")
def long_reference(long_input, tiny, tmp_path_factory) -> Path:
    return single_replay("--images", long_input, [*tiny, *MODEL], tmp_path_factory.mktemp("long_ref") / "out")


def _kill_after_first_segment(work: Path) -> int:
    """SIGKILL the worker once it has finished a segment and runs the next; its pid."""
    def running_second_segment():
        state, progress = read_json_or_none(work / "state.json"), read_json_or_none(work / "progress.json")
        if state and progress and len(state["segments"]) >= 1 and progress["attempt"] == 1:
            return progress["pid"]
        return None

    pid = wait_for(running_second_segment, 120, "the first segment of the input")
    os.kill(pid, signal.SIGKILL)
    return pid


def _fleet_in_thread(argv) -> tuple[threading.Thread, dict]:
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(code=fleet(*argv)), daemon=True)
    thread.start()
    return thread, out


def test_fleet_worker_killed_mid_input_is_retried_and_resumes_from_its_journal(
        ray_instance, long_input, long_reference, tiny, tmp_path):
    root = tmp_path / "out"
    argv = [long_input, "-o", root, "--cpus-per-task", "1", "--segment-frames", "6", "--max-retries", "2",
            "--outputs", ALL_OUTPUTS, "-q", "--", *tiny, *MODEL]
    thread, out = _fleet_in_thread(argv)
    _kill_after_first_segment(root / "loop" / ".fleet")
    thread.join(timeout=300)
    assert not thread.is_alive() and out["code"] == 0
    result = result_of(root / "loop")
    assert result["status"] == "ok" and result["frames"] == KILL_FRAMES
    assert result["attempts"] == 2 and result["resumed_from"] >= 6  # the retry went on from the journal
    assert_same_outputs(root / "loop", long_reference)


def test_fleet_rerun_resumes_an_input_whose_task_could_not_finish(
        ray_instance, long_input, long_reference, tiny, tmp_path, capsys):
    root = tmp_path / "out"
    argv = [long_input, "-o", root, "--cpus-per-task", "1", "--segment-frames", "6", "--max-retries", "0",
            "--outputs", ALL_OUTPUTS, "-q", "--", *tiny, *MODEL]
    thread, out = _fleet_in_thread(argv)
    _kill_after_first_segment(root / "loop" / ".fleet")
    thread.join(timeout=300)
    assert not thread.is_alive() and out["code"] == 1
    failed = json.loads((root / "fleet-summary.json").read_text())["inputs"][0]
    assert failed["status"] == "failed" and "could not finish after 1 attempt" in failed["reason"]
    assert "run the command again to resume it" in capsys.readouterr().out
    assert fleet(*argv) == 0
    result = result_of(root / "loop")
    assert result["attempts"] == 2 and result["resumed_from"] >= 6 and result["frames"] == KILL_FRAMES
    assert_same_outputs(root / "loop", long_reference)

