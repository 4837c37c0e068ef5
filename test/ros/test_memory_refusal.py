"""The node refuses at start, with the numbers, a configuration larger than the GPU memory it finds
(faked with $LINGBOT_GPU_MEMORY_GIB, so this runs on a CPU), instead of failing mid-stream."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("rclpy")
pytestmark = [pytest.mark.ros]
START_TIMEOUT = 90.0
DOMAIN_ID = str(1 + (os.getpid() * 11 + 29) % 100)  # a private domain, as the other node tests


def run_node(tmp_path, fixtures, memory_gib: str, **params):
    from lingbot_map_ros.runtime.params import write_params_file

    values = {"checkpoint": str(fixtures / "weights.safetensors"), "model_config": str(fixtures / "config.json"),
              "image_width": 98, "num_scale_frames": 2, "sliding_window": 3, "device": "cpu", **params}
    path = write_params_file(tmp_path / "params.yaml", values)
    env = dict(os.environ, ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST", ROS_DOMAIN_ID=DOMAIN_ID,
               LINGBOT_GPU_MEMORY_GIB=memory_gib)
    cmd = [sys.executable, "-m", "lingbot_map_ros.ros.node", "--ros-args", "--params-file", str(path),
           "-r", "__node:=lingbot_map_memory"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=START_TIMEOUT,
                          stdin=subprocess.DEVNULL)
    return proc.returncode, proc.stdout + proc.stderr


def test_too_little_memory_refuses_at_start_with_the_numbers(tmp_path, fixtures):
    code, log = run_node(tmp_path, fixtures, "0.6")
    errors = [line for line in log.splitlines() if "[ERROR]" in line]
    assert code == 1, log[-3000:]
    assert len(errors) == 1 and "cannot start: " in errors[0], log[-3000:]
    assert "not enough GPU memory" in errors[0] and "has 0.6 GiB free of 0.6 GiB" in errors[0]
    assert "needs about" in errors[0] and "K/V cache" in errors[0] and "config/profiles" in errors[0]
    assert "Traceback" not in log


def test_the_check_can_be_switched_off(tmp_path, fixtures):
    """gpu_memory_check false: the same configuration gets past the check (the node then runs until
    it is stopped: here the process is given a few seconds and must still be alive)."""
    from lingbot_map_ros.runtime.params import write_params_file

    values = {"checkpoint": str(fixtures / "weights.safetensors"), "model_config": str(fixtures / "config.json"),
              "image_width": 98, "num_scale_frames": 2, "sliding_window": 3, "device": "cpu",
              "gpu_memory_check": False}
    path = write_params_file(tmp_path / "params.yaml", values)
    env = dict(os.environ, ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST", ROS_DOMAIN_ID=DOMAIN_ID, LINGBOT_GPU_MEMORY_GIB="0.6")
    cmd = [sys.executable, "-m", "lingbot_map_ros.ros.node", "--ros-args", "--params-file", str(path),
           "-r", "__node:=lingbot_map_memory_off"]
    log_path = tmp_path / "off.log"
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        deadline_text = ""
        for _ in range(int(START_TIMEOUT * 10)):
            deadline_text = log_path.read_text()
            if "ready: listening" in deadline_text or proc.poll() is not None:
                break
            import time
            time.sleep(0.1)
        assert proc.poll() is None, deadline_text[-3000:]
        assert "ready: listening" in deadline_text and "not enough GPU memory" not in deadline_text
    finally:
        if proc.poll() is None:
            import signal
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
