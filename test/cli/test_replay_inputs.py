"""The replay CLI's inputs: rosbag2 (sqlite3 and MCAP, raw and compressed images) and video
give the same predictions as the same frames in a folder; selection flags; bad input is
one line or a counted skip, never a traceback or an unannounced half-written output."""
from __future__ import annotations

import numpy as np
import pytest

from lingbot_map_ros.cli.replay import main
from replay_fixtures import NS, PERIOD, T0, error_line, replay, write_image_bag, write_video

RTOL = 1e-4
TOPIC = "/camera/image"


@pytest.fixture(scope="module")
def folder_pred(loop_folder, tiny, tmp_path_factory):
    """Predictions for the loop frames replayed from their folder."""
    out = tmp_path_factory.mktemp("folder") / "pred.npz"
    assert main(["--images", str(loop_folder), *tiny, "--out", str(out)]) == 0
    return dict(np.load(out))


def assert_same_predictions(pred: dict, ref: dict, rows=None) -> None:
    rows = np.arange(ref["pose_enc"].shape[0]) if rows is None else np.asarray(rows)
    assert pred["pose_enc"].shape[0] == len(rows)
    scale = np.abs(ref["pose_enc"][rows]).max(axis=1, keepdims=True)
    assert np.max(np.abs(pred["pose_enc"] - ref["pose_enc"][rows]) / scale) < RTOL
    for key in ("depth", "depth_conf"):
        assert np.max(np.abs(pred[key] - ref[key][rows]) / np.abs(ref[key][rows])) < RTOL
    np.testing.assert_allclose(pred["pose_c2w"], ref["pose_c2w"][rows], atol=1e-4)


@pytest.mark.parametrize("storage,kind,encoding", [("sqlite3", "raw", "bgr8"), ("mcap", "raw", "rgb8"),
                                                   ("mcap", "compressed", None), ("sqlite3", "compressed", None)])
def test_bag_equals_folder(loop_frames, folder_pred, tiny, tmp_path, capsys, storage, kind, encoding):
    bag = tmp_path / "in_bag"
    stamps = write_image_bag(bag, loop_frames, storage, kind, TOPIC, encoding=encoding or "rgb8")
    out = tmp_path / "pred.npz"
    code, err = replay(capsys, "--bag", bag, "--topic", TOPIC, *tiny, "--out", out)
    assert code == 0, err
    pred = dict(np.load(out))
    assert_same_predictions(pred, folder_pred)
    assert pred["stamp_ns"].tolist() == stamps  # the header stamps
    assert "8 frames" in err and "0 dropped" in err


def test_ros1_bag_equals_folder(loop_frames, folder_pred, tiny, tmp_path, capsys):
    from replay_fixtures import write_ros1_bag

    stamps = write_ros1_bag(tmp_path / "in.bag", loop_frames, TOPIC)
    out = tmp_path / "pred.npz"
    code, err = replay(capsys, "--bag", tmp_path / "in.bag", "--topic", TOPIC, *tiny, "--out", out)
    assert code == 0, err
    pred = dict(np.load(out))
    assert_same_predictions(pred, folder_pred)
    assert pred["stamp_ns"].tolist() == stamps


def test_bag_file_inside_the_directory_is_accepted(loop_frames, tiny, tmp_path, capsys):
    bag = tmp_path / "b"
    write_image_bag(bag, loop_frames[:3], "mcap", "compressed", TOPIC)
    code, err = replay(capsys, "--bag", bag / "b.mcap", "--topic", TOPIC, *tiny, "--trajectory", tmp_path / "t.tum")
    assert code == 0, err
    assert len((tmp_path / "t.tum").read_text().splitlines()) == 1 + 3


def test_selection_start_duration_stride_max_frames(loop_frames, folder_pred, tiny, tmp_path, capsys):
    bag = tmp_path / "b"
    stamps = write_image_bag(bag, loop_frames, "mcap", "raw", TOPIC)
    out = tmp_path / "sel.npz"
    # messages at 0.1 s steps: [0.15, 0.75) holds 0.2 .. 0.7 (6 messages), stride 2 takes 0.2, 0.4, 0.6
    code, err = replay(capsys, "--bag", bag, "--topic", TOPIC, "--start", "0.15", "--duration", "0.6",
                       "--stride", "2", *tiny, "--out", out)
    assert code == 0, err
    assert np.load(out)["stamp_ns"].tolist() == [stamps[2], stamps[4], stamps[6]]
    code, err = replay(capsys, "--bag", bag, "--topic", TOPIC, "--max-frames", "5", *tiny, "--out", out,
                       "--overwrite")
    assert code == 0, err
    assert np.load(out)["stamp_ns"].tolist() == stamps[:5]
    # a folder's time line is the frame number
    code, err = replay(capsys, "--images", loop_frames[0].parent, "--start", "3", "--max-frames", "2", *tiny,
                       "--out", out, "--overwrite")
    assert code == 0, err
    assert np.load(out)["stamp_ns"].tolist() == [3 * NS, 4 * NS]


@pytest.mark.parametrize("case", ["no_topic", "wrong_type", "no_image_topics"])
def test_topic_problems_list_the_image_topics(loop_frames, tiny, tmp_path, capsys, case):
    bag = tmp_path / "b"
    write_image_bag(bag, loop_frames[:2], "mcap", "raw", TOPIC)
    topic = {"no_topic": "/camera/missing", "wrong_type": "/chatter", "no_image_topics": "/x"}[case]
    if case == "no_image_topics":
        from rosbags.rosbag2 import StoragePlugin, Writer
        from replay_fixtures import typestore

        bag = tmp_path / "c"
        with Writer(bag, version=9, storage_plugin=StoragePlugin.SQLITE3) as w:
            conn = w.add_connection("/chatter", "std_msgs/msg/String", typestore=typestore())
            t = typestore()
            w.write(conn, T0, t.serialize_cdr(t.types["std_msgs/msg/String"](data="hi"), "std_msgs/msg/String"))
    code, err = replay(capsys, "--bag", bag, "--topic", topic, *tiny, "--out", tmp_path / "o.npz")
    assert code == 2
    line = error_line(err)
    if case == "no_image_topics":
        assert "has no topic /x" in line and "no image topics" in line
    else:
        assert f"{TOPIC} (sensor_msgs/msg/Image, 2 messages)" in line
        assert "/other/image/compressed (sensor_msgs/msg/CompressedImage" in line
        assert "/chatter (" not in line
    if case == "wrong_type":
        assert "carries std_msgs/msg/String" in line
    assert not (tmp_path / "o.npz").exists()


@pytest.mark.parametrize("case", ["metadata", "storage", "missing", "not_a_bag"])
def test_corrupt_bag_is_one_line(loop_frames, tiny, tmp_path, capsys, case):
    bag = tmp_path / "b"
    write_image_bag(bag, loop_frames[:3], "mcap", "raw", TOPIC)
    if case == "metadata":
        (bag / "metadata.yaml").write_text("rosbag2_bagfile_information: [unclosed\n")
    elif case == "storage":
        (bag / "b.mcap").write_bytes(b"\x89MCAP0\r\n" + bytes(range(256)) * 8)
    elif case == "missing":
        bag = tmp_path / "nope"
    else:
        bag = tmp_path / "plain"
        bag.mkdir()
    code, err = replay(capsys, "--bag", bag, "--topic", TOPIC, *tiny, "--out", tmp_path / "o.npz")
    assert code == 2
    line = error_line(err)
    assert str(bag) in line
    assert not list(tmp_path.glob("o.npz*"))


def test_broken_messages_are_counted_and_skipped(loop_frames, folder_pred, tiny, tmp_path, capsys):
    """A truncated CDR message, a truncated JPEG and raw data shorter than its size say: skipped,
    warned about, counted; the other frames give the folder's predictions for the same frames."""
    raw_bag, jpeg_bag = tmp_path / "raw", tmp_path / "jpeg"
    write_image_bag(raw_bag, loop_frames, "sqlite3", "raw", TOPIC, broken={3: "cdr", 6: "short"})
    write_image_bag(jpeg_bag, loop_frames, "mcap", "compressed", TOPIC, broken={5: "jpeg"})
    for bag, bad, needles in ((raw_bag, [3, 6], ["cannot deserialize", "truncated image data"]),
                              (jpeg_bag, [5], ["corrupt or truncated JPEG"])):
        out = tmp_path / f"{bag.name}.npz"
        code, err = replay(capsys, "--bag", bag, "--topic", TOPIC, *tiny, "--out", out)
        assert code == 0, err
        assert "Traceback" not in err
        warnings = [l for l in err.splitlines() if "skipped a frame" in l]
        assert len(warnings) == len(bad)
        for index, needle, line in zip(bad, needles, warnings):
            assert f"message {index} of {TOPIC}" in line and needle in line
        assert f"{len(loop_frames) - len(bad)} frames in" in err and f"{len(bad)} dropped" in err
        # the scale frames (0, 1) are intact, so every kept frame sees the folder run's history
        # up to the dropped ones: the frames before the first dropped one match exactly
        pred = dict(np.load(out))
        first_bad = bad[0]
        np.testing.assert_allclose(pred["pose_enc"][:first_bad], folder_pred["pose_enc"][:first_bad], rtol=RTOL,
                                   atol=1e-6)
        assert pred["stamp_ns"].tolist() == [T0 + i * PERIOD for i in range(len(loop_frames)) if i not in bad]
    code, err = replay(capsys, "--bag", raw_bag, "--topic", TOPIC, "--bad-frames", "error", *tiny, "--out",
                       tmp_path / "strict.npz")
    assert code == 2
    line = error_line(err)
    assert f"message 3 of {TOPIC}" in line  # frames 0-2 were written: they stay, marked partial
    assert f"partial outputs kept: {tmp_path / 'strict.npz.partial'}" in line
    assert not (tmp_path / "strict.npz").exists()
    assert np.load(tmp_path / "strict.npz.partial")["pose_enc"].shape == (3, 9)


def test_failure_mid_run_keeps_partial_outputs_and_says_so(loop_folder, tiny, tmp_path, capsys, monkeypatch):
    """The input breaks after 5 frames: the outputs so far stay, named .partial, and the error line
    lists them; no output has its final name."""
    from lingbot_map_ros.io import sources

    real = sources.ImageFolderSource.frames

    def breaks(self):
        for i, frame in enumerate(real(self)):
            if i == 5:
                raise sources.SourceError(f"{self.path} is unreadable part-way: simulated")
            yield frame

    monkeypatch.setattr(sources.ImageFolderSource, "frames", breaks)
    out, tum, ply, bag = tmp_path / "p.npz", tmp_path / "t.tum", tmp_path / "c.ply", tmp_path / "res"
    code, err = replay(capsys, "--images", loop_folder, *tiny, "--out", out, "--trajectory", tum, "--ply", ply,
                       "--out-bag", bag)
    assert code == 2
    line = error_line(err)
    assert "simulated" in line and "partial outputs kept:" in line
    for path in (out, tum, ply, bag):
        assert not path.exists()
        assert f"{path}.partial" in line and path.with_name(path.name + ".partial").exists()
    from lingbot_map_ros.io.export import read_ply, read_tum

    assert len(read_tum(tum.with_name("t.tum.partial"))[0]) == 5
    assert read_ply(ply.with_name("c.ply.partial"))[0].shape[0] > 0
    assert np.load(out.with_name("p.npz.partial"))["pose_enc"].shape == (5, 9)


def test_video_equals_folder_and_has_container_stamps(loop_frames, folder_pred, tiny, tmp_path, capsys):
    from PIL import Image

    frames = [np.asarray(Image.open(p).convert("RGB")) for p in loop_frames]
    clip = tmp_path / "clip.mkv"
    write_video(clip, frames, "ffv1", rate=10)  # lossless: the decoded frames are the images
    out = tmp_path / "v.npz"
    code, err = replay(capsys, "--video", clip, *tiny, "--out", out)
    assert code == 0, err
    pred = dict(np.load(out))
    assert_same_predictions(pred, folder_pred)
    assert pred["stamp_ns"].tolist() == [i * PERIOD for i in range(len(frames))]
    # --start seeks: 0.35 s onwards is frames 4..7
    code, err = replay(capsys, "--video", clip, "--start", "0.35", *tiny, "--out", out, "--overwrite")
    assert code == 0, err
    assert np.load(out)["stamp_ns"].tolist() == [i * PERIOD for i in range(4, 8)]


def test_lossy_video_runs(tiny, tmp_path, capsys):
    rng = np.random.default_rng(0)
    frames = [np.clip(rng.normal(128, 40, (56, 98, 3)), 0, 255).astype(np.uint8) for _ in range(4)]
    clip = tmp_path / "clip.mp4"
    write_video(clip, frames, "libx264", rate=5)
    code, err = replay(capsys, "--video", clip, *tiny, "--trajectory", tmp_path / "t.tum")
    assert code == 0, err
    stamps = [float(l.split()[0]) for l in (tmp_path / "t.tum").read_text().splitlines()[1:]]
    np.testing.assert_allclose(stamps, [0.0, 0.2, 0.4, 0.6], atol=1e-6)


@pytest.mark.parametrize("case", ["garbage", "empty", "missing"])
def test_unreadable_video_is_one_line(tiny, tmp_path, capsys, case):
    clip = tmp_path / "clip.mp4"
    if case == "garbage":
        clip.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 4)
    elif case == "empty":
        clip.write_bytes(b"")
    code, err = replay(capsys, "--video", clip, *tiny, "--out", tmp_path / "o.npz")
    assert code == 2
    assert str(clip) in error_line(err)
    assert not list(tmp_path.glob("o.npz*"))


@pytest.mark.parametrize("argv,needle", [
    (["--topic", "/x"], "--topic goes with --bag"),
    (["--stride", "0"], "stride must be >= 1"),
    (["--start", "-1"], "start must be"),
    (["--save-depth", "some"], "--save-depth must be none, all or every-K"),
    (["--no-long-stream", "--window-frames", "10"], "--window-frames needs the long-stream mode"),
    (["--window-frames", "5000"], "window_frames 5000 must be below"),
])
def test_flag_problems_are_one_line(loop_folder, tiny, tmp_path, capsys, argv, needle):
    code, err = replay(capsys, "--images", loop_folder, *tiny, "--out", tmp_path / "o.npz", *argv)
    assert code == 2
    assert needle in error_line(err)


def test_bag_needs_topic_and_existing_out_bag_is_refused(loop_frames, tiny, tmp_path, capsys):
    bag = tmp_path / "b"
    write_image_bag(bag, loop_frames[:2], "mcap", "raw", TOPIC)
    code, err = replay(capsys, "--bag", bag, *tiny, "--out", tmp_path / "o.npz")
    assert code == 2 and "--bag needs --topic" in error_line(err)
    code, err = replay(capsys, "--bag", bag, "--topic", TOPIC, *tiny, "--out-bag", bag)
    assert code == 2 and "exists already" in error_line(err)


def test_bag_with_too_few_good_frames_is_one_line(loop_frames, tiny, tmp_path, capsys):
    bag = tmp_path / "b"
    write_image_bag(bag, loop_frames[:3], "mcap", "compressed", TOPIC, broken={0: "jpeg", 2: "cdr"})
    code, err = replay(capsys, "--bag", bag, "--topic", TOPIC, *tiny, "--out", tmp_path / "o.npz")
    assert code == 2
    line = error_line(err)
    assert "only 1 frame(s) reached the model, fewer than the 2 scale frames" in line
    assert "2 dropped, the first: message 0 of /camera/image: corrupt or truncated JPEG" in line
    assert not list(tmp_path.glob("o.npz*"))


def test_progress_bar_and_quiet(loop_folder, tiny, tmp_path, capsys):
    loud = [a for a in tiny if a != "-q"]
    code, err = replay(capsys, "--images", loop_folder, *loud, "--window-frames", "5", "--trajectory",
                       tmp_path / "t.tum")
    assert code == 0, err
    bar = err.replace("\r", "\n")
    assert "frame/s" in bar and "8/8" in bar and "window=1" in bar  # rate, count against the total, window
    assert "model ready" in err and "input: 8 images from" in err
    summary = err.strip().splitlines()[-1]
    assert summary.startswith("lingbot-map-replay: 8 frames in") and "FPS" in summary and "0 dropped" in summary
    assert "2 window(s)" in summary and f"wrote {tmp_path / 't.tum'}" in summary
    code, err = replay(capsys, "--images", loop_folder, *tiny, "--trajectory", tmp_path / "u.tum")
    assert code == 0 and "frame/s" not in err and "model ready" not in err
    assert len(err.strip().splitlines()) == 1 and "8 frames in" in err  # the summary only


def test_prefetcher_reads_ahead_a_few_stops_early_and_hands_over_errors():
    import threading

    from lingbot_map_ros.io.sources import Prefetcher, SourceError, SourceFrame

    produced, closed = [], threading.Event()

    def frames(fail_at=None):
        try:
            for i in range(1000):
                if i == fail_at:
                    raise SourceError("broken part-way")
                produced.append(i)
                yield SourceFrame(i, f"f{i}", np.full((2, 2, 3), i % 256, np.uint8))
        finally:
            closed.set()

    def prepare(rgb):
        if rgb[0, 0, 0] == 2:
            raise ValueError("too small")
        return int(rgb.sum())

    with Prefetcher(frames, prepare, depth=2) as p:
        seen = []
        for frame, prepared in p:
            seen.append((frame.stamp_ns, prepared, frame.error, frame.rgb))
            if len(seen) == 4:
                break
    assert closed.wait(5) and len(produced) <= 4 + 2 + 2  # the queue, one being prepared, one in hand
    assert seen == [(0, 0, None, None), (1, 12, None, None), (2, None, "f2: too small", None), (3, 36, None, None)]
    closed.clear()
    with pytest.raises(SourceError, match="broken part-way"):
        with Prefetcher(lambda: frames(fail_at=3), prepare) as p:
            list(p)
    assert closed.wait(5)


def test_bag_in_bag_out_without_rclpy(loop_frames, fixtures, tmp_path):
    """Bags in and out need no ROS: a whole run imports neither rclpy nor the ROS message packages."""
    import subprocess
    import sys

    write_image_bag(tmp_path / "in", loop_frames[:3], "sqlite3", "raw", TOPIC)
    script = ("import sys; from lingbot_map_ros.cli.replay import main; "
              f"code = main(['--bag', {str(tmp_path / 'in')!r}, '--topic', {TOPIC!r}, '--checkpoint', "
              f"{str(fixtures / 'weights.safetensors')!r}, '--model-config', {str(fixtures / 'config.json')!r}, "
              f"'-q', '--out-bag', {str(tmp_path / 'res')!r}]); "
              "ros = sorted(m for m in sys.modules if m.split('.')[0] in ('rclpy', 'sensor_msgs', 'nav_msgs')); "
              "print(code, ros)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "0 []", proc.stdout + proc.stderr
    assert (tmp_path / "res" / "metadata.yaml").is_file()


def test_plain_session_matches_reference_and_long_stream(fixtures, tiny, tmp_path, capsys):
    """--no-long-stream (queued submits) gives the reference predictions, as the long-stream default
    does inside its first window."""
    preds = {}
    for mode in ("--no-long-stream", "--long-stream"):
        out = tmp_path / f"{mode}.npz"
        code, err = replay(capsys, "--images", fixtures / "frames", *tiny, "--keyframe-interval", "2", mode,
                           "--out", out)
        assert code == 0, err
        preds[mode] = dict(np.load(out))
    ref = np.load(fixtures / "reference_kf2.npz")
    pred = preds["--no-long-stream"]
    scale = np.abs(ref["pose_enc"]).max(axis=1, keepdims=True)
    assert np.max(np.abs(pred["pose_enc"] - ref["pose_enc"]) / scale) < RTOL
    assert np.max(np.abs(pred["depth"] - ref["depth"]) / np.abs(ref["depth"])) < RTOL
    for key in ("pose_enc", "pose_c2w", "depth", "depth_conf", "is_keyframe"):
        np.testing.assert_array_equal(preds["--long-stream"][key], pred[key])


def test_horizon_ends_the_plain_session_not_the_long_stream(fixtures, tiny, tmp_path, capsys):
    """A model whose horizon is 6 frames: the plain session stops there with a hint and keeps the 6
    frames as partial outputs; the long-stream mode restarts windows and replays all 12."""
    import json

    config = json.loads((fixtures / "config.json").read_text())
    config["max_frame_num"] = 6
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    flags = [a if a != str(fixtures / "config.json") else str(tmp_path / "cfg.json") for a in tiny]
    code, err = replay(capsys, "--images", fixtures / "frames", *flags, "--no-long-stream", "--out",
                       tmp_path / "plain.npz")
    assert code == 2
    line = error_line(err)
    assert "horizon of 6 frames" in line and "drop --no-long-stream" in line
    assert np.load(tmp_path / "plain.npz.partial")["pose_enc"].shape == (6, 9)
    code, err = replay(capsys, "--images", fixtures / "frames", *flags, "--window-frames", "4", "--out",
                       tmp_path / "long.npz")
    assert code == 0, err
    pred = np.load(tmp_path / "long.npz")
    assert pred["pose_enc"].shape == (12, 9)
    assert pred["window"].tolist() == [0] * 4 + [1] * 2 + [2] * 2 + [3] * 2 + [4] * 2
    assert np.isfinite(pred["pose_c2w"]).all()


def test_interrupt_keeps_partial_outputs(loop_folder, tiny, tmp_path, capsys):
    def interrupt(done):
        if done == 4:
            raise KeyboardInterrupt

    out, tum = tmp_path / "p.npz", tmp_path / "t.tum"
    code = main(["--images", str(loop_folder), *tiny, "--out", str(out), "--trajectory", str(tum)], interrupt)
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err
    n = np.load(f"{out}.partial")["pose_enc"].shape[0]
    assert n in (4, 5)  # the frame submitted before ^C is complete and may be written too
    assert err.strip().splitlines()[-1] == (f"lingbot-map-replay: interrupted after {n} frames; partial outputs "
                                            f"kept: {out}.partial, {tum}.partial")
    assert not out.exists() and not tum.exists()
    assert len(tum.with_name("t.tum.partial").read_text().splitlines()) == n + 1
