"""The depth image the depth scale source reads (16UC1 millimetres, 32FC1 metres)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")

from sensor_msgs.msg import Image  # noqa: E402
from std_msgs.msg import Header  # noqa: E402

from lingbot_map_ros.ros.conversions import depth_to_image_msg  # noqa: E402
from lingbot_map_ros.ros.conversions import sensor_depth_array  # noqa: E402

pytestmark = pytest.mark.ros


def test_16uc1_with_row_padding_and_big_endian_is_read_in_millimetres():
    mm = np.arange(12, dtype=np.uint16).reshape(3, 4) * 250
    for big in (False, True):
        rows = mm.astype(">u2" if big else "<u2").view(np.uint8).reshape(3, 8)
        padded = np.concatenate([rows, np.zeros((3, 4), np.uint8)], axis=1)  # step 12 > 8
        msg = Image(header=Header(), height=3, width=4, encoding="16UC1", is_bigendian=big, step=12,
                    data=padded.tobytes())
        out = sensor_depth_array(msg)
        assert out.dtype == np.uint16
        np.testing.assert_array_equal(out, mm)


def test_32fc1_is_read_in_metres_and_other_encodings_are_refused():
    depth = np.linspace(0.5, 3.0, 12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(sensor_depth_array(depth_to_image_msg(depth, Header())), depth)
    with pytest.raises(ValueError, match="not 16UC1"):
        sensor_depth_array(Image(height=1, width=1, encoding="rgb8", step=3, data=b"abc"))
