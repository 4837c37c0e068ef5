"""The node refuses at start, with the numbers, a configuration larger than the GPU memory it finds
(here the parameter gpu_memory_budget_gib gives the size, so this runs on a CPU), instead of failing
mid-stream."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytest.importorskip("rclpy")
from graph_helpers import private_domain_id, ros_env, stop_processes  # noqa: E402

pytestmark = [pytest.mark.ros]
START_TIMEOUT = 90.0
DOMAIN_ID = private_domain_id(__name__, 1, 100, 7, 13 + 41)  # not the other graph modules' offsets


def node_command(tmp_path, fixtures, name: str, **params) -> list[str]:
    """The node on the tiny fixture (CPU), parameters in a file under ``tmp_path``."""
    from lingbot_map_ros.runtime.params import write_params_file

    values = {"checkpoint": str(fixtures / "weights.safetensors"), "model_config": str(fixtures / "config.json"),
              "image_width": 98, "num_scale_frames": 2, "sliding_window": 3, "device": "cpu", **params}
    path = write_params_file(tmp_path / f"{name}.yaml", values)
    return [sys.executable, "-m", "lingbot_map_ros.ros.main", "--ros-args", "--params-file", str(path),
            "-r", f"__node:={name}"]


def run_node(tmp_path, fixtures, memory_gib: float, **params):
    proc = subprocess.run(node_command(tmp_path, fixtures, "lingbot_map_memory", gpu_memory_budget_gib=memory_gib,
                                       **params),
                          env=ros_env(DOMAIN_ID), capture_output=True, text=True, timeout=START_TIMEOUT,
                          stdin=subprocess.DEVNULL)
    return proc.returncode, proc.stdout + proc.stderr


def test_too_little_memory_refuses_at_start_with_the_numbers(tmp_path, fixtures):
    code, log = run_node(tmp_path, fixtures, 0.6)
    errors = [line for line in log.splitlines() if "[ERROR]" in line]
    assert code == 1, log[-3000:]
    assert len(errors) == 1 and "cannot start: " in errors[0], log[-3000:]
    assert "not enough GPU memory" in errors[0] and "has 0.6 GiB free of 0.6 GiB" in errors[0]
    assert "taken as a 0.6 GiB card: gpu_memory_budget_gib" in errors[0]
    assert "needs about" in errors[0] and "K/V cache" in errors[0] and "config/profiles" in errors[0]
    assert "Traceback" not in log


def test_the_check_can_be_switched_off(tmp_path, fixtures):
    """gpu_memory_check false: the same configuration gets past the check (the node then runs until
    it is stopped: here it must reach "ready" and still be alive)."""
    log_path = tmp_path / "off.log"
    with open(log_path, "w") as out:
        proc = subprocess.Popen(node_command(tmp_path, fixtures, "lingbot_map_memory_off", gpu_memory_check=False,
                                             gpu_memory_budget_gib=0.6),
                                env=ros_env(DOMAIN_ID), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        text = ""
        for _ in range(int(START_TIMEOUT * 10)):  # bounded: START_TIMEOUT seconds
            text = log_path.read_text()
            if "ready: listening" in text or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert proc.poll() is None, text[-3000:]
        assert "ready: listening" in text and "not enough GPU memory" not in text
    finally:
        stop_processes(proc)
