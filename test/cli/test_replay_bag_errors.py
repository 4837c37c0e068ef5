"""Bag errors that say what is there and what to do (issue 25): a bag without image topics lists
the topics it has; a topic carrying both Image and CompressedImage names both types and the
flag that picks one; a truncated MCAP says how to recover it. Bags are written here with
``rosbags``."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lingbot_map_ros.io.export import read_tum
from replay_fixtures import (PERIOD, PROG, T0, compressed_image, error_line, raw_image, replay, typestore,
                             write_image_bag)

TOPIC = "/camera/image"


def _no_image_bag(path: Path) -> Path:
    from rosbags.rosbag2 import StoragePlugin, Writer

    store = typestore()
    t = store.types
    with Writer(path, version=9, storage_plugin=StoragePlugin.MCAP) as w:
        chatter = w.add_connection("/chatter", "std_msgs/msg/String", typestore=store)
        count = w.add_connection("/count", "std_msgs/msg/Int32", typestore=store)
        w.write(chatter, T0, store.serialize_cdr(t["std_msgs/msg/String"](data="hi"), "std_msgs/msg/String"))
        for i in range(2):
            w.write(count, T0 + i, store.serialize_cdr(t["std_msgs/msg/Int32"](data=i), "std_msgs/msg/Int32"))
    return path


@pytest.mark.parametrize("topic", ["/camera/image", "/chatter"])
def test_a_bag_without_image_topics_lists_the_topics_it_has(tiny, tmp_path, capsys, topic):
    bag = _no_image_bag(tmp_path / "b")
    code, err = replay(capsys, "--bag", bag, "--topic", topic, *tiny, "--out", tmp_path / "o.npz")
    assert code == 2
    line = error_line(err)
    if topic == "/chatter":
        assert "topic /chatter of bag" in line
        assert "carries std_msgs/msg/String (1 message), not sensor_msgs/Image" in line
    else:
        assert f"has no topic {topic}" in line
    assert "it has no image topics (sensor_msgs/Image or sensor_msgs/CompressedImage)" in line
    assert "its topics: /chatter (std_msgs/msg/String), /count (std_msgs/msg/Int32)" in line
    assert "ros2 bag record" in line and "None" not in line
    assert not list(tmp_path.glob("o.npz*"))


def _mixed_bag(path: Path, loop_frames) -> Path:
    """/camera/image with 3 sensor_msgs/Image and 2 sensor_msgs/CompressedImage messages (two publishers)."""
    from PIL import Image
    from rosbags.rosbag2 import StoragePlugin, Writer

    store = typestore()
    t = store.types
    with Writer(path, version=9, storage_plugin=StoragePlugin.MCAP) as w:
        raw = w.add_connection(TOPIC, "sensor_msgs/msg/Image", typestore=store)
        jpeg = w.add_connection(TOPIC, "sensor_msgs/msg/CompressedImage", typestore=store)
        for i, f in enumerate(loop_frames[:5]):
            stamp = T0 + i * PERIOD
            if i < 3:
                msg = raw_image(t, np.asarray(Image.open(f).convert("RGB")), stamp)
                w.write(raw, stamp, store.serialize_cdr(msg, "sensor_msgs/msg/Image"))
            else:
                msg = compressed_image(t, f.read_bytes(), stamp)
                w.write(jpeg, stamp, store.serialize_cdr(msg, "sensor_msgs/msg/CompressedImage"))
    return path


def test_a_topic_with_both_image_types_names_both_and_the_flag_that_picks_one(loop_frames, tiny, tmp_path, capsys):
    bag = _mixed_bag(tmp_path / "b", loop_frames)
    code, err = replay(capsys, "--bag", bag, "--topic", TOPIC, *tiny, "--trajectory", tmp_path / "t.tum")
    assert code == 2
    line = error_line(err)
    assert "None" not in line
    assert (f"topic {TOPIC} of bag {bag} carries both sensor_msgs/msg/CompressedImage (2 messages) and "
            "sensor_msgs/msg/Image (3 messages)") in line
    assert "pass --topic-type Image or --topic-type CompressedImage" in line
    assert not (tmp_path / "t.tum").exists()
    # the flag picks one publisher's messages
    code, err = replay(capsys, "--bag", bag, "--topic", TOPIC, "--topic-type", "Image", *tiny, "--trajectory",
                       tmp_path / "t.tum")
    assert code == 0, err
    stamps, _ = read_tum(tmp_path / "t.tum")
    np.testing.assert_allclose(stamps, [(T0 + i * PERIOD) / 1e9 for i in range(3)])


def test_a_truncated_mcap_says_how_to_recover_it(loop_frames, tiny, tmp_path, capsys):
    bag = tmp_path / "b"
    write_image_bag(bag, loop_frames[:4], "mcap", "raw", TOPIC)
    (mcap,) = bag.glob("*.mcap")
    data = mcap.read_bytes()
    mcap.write_bytes(data[: len(data) * 2 // 3])  # a recording killed, a copy that stopped
    code, err = replay(capsys, "--bag", bag, "--topic", TOPIC, *tiny, "--out", tmp_path / "o.npz")
    assert code == 2
    line = error_line(err)
    assert f"cannot read bag {bag}" in line
    assert f"mcap recover {mcap} -o {bag / 'b-recovered.mcap'}" in line and f"in place of {mcap.name}" in line
    assert not list(tmp_path.glob("o.npz*"))
