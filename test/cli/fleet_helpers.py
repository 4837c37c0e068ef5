"""Helpers of the lingbot-map-fleet tests: single replays to compare with, the comparison of
an input's outputs (TUM, PLY, npz, results bag) to theirs, a local Ray for a test module."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from lingbot_map_ros.io.export import read_ply
from lingbot_map_ros.io.results import load_predictions
from replay_fixtures import read_bag

ALL_OUTPUTS = "trajectory,ply,bag,npz"
FILES = {"--trajectory": "trajectory.tum", "--ply": "map.ply", "--out": "predictions.npz", "--out-bag": "results"}
ATOL = 1e-6


def fleet(*argv) -> int:
    """lingbot-map-fleet in this process (its Ray: the module's, already initialized)."""
    from lingbot_map_ros.cli.fleet import main

    return main([str(a) for a in argv])


def single_replay(kind_flag: str, source: Path, flags: list[str], out: Path) -> Path:
    """One uninterrupted lingbot-map-replay of ``source`` writing every output into ``out``."""
    from lingbot_map_ros.cli.replay import main

    out.mkdir(parents=True)
    outputs = [a for flag, name in FILES.items() for a in (flag, str(out / name))]
    assert main([kind_flag, str(source), *flags, *outputs]) == 0
    return out


def tum_rows(path: Path) -> np.ndarray:
    rows = [line.split() for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return np.array(rows, dtype=np.float64)


def assert_same_outputs(folder: Path, reference: Path) -> None:
    """``folder``'s outputs (those present in ``reference``) equal a single replay's to ATOL."""
    tum = tum_rows(folder / "trajectory.tum")
    assert tum.shape == tum_rows(reference / "trajectory.tum").shape
    np.testing.assert_allclose(tum, tum_rows(reference / "trajectory.tum"), rtol=0, atol=ATOL)
    points, colors = read_ply(folder / "map.ply")
    ref_points, ref_colors = read_ply(reference / "map.ply")
    assert points.shape == ref_points.shape and points.shape[0] > 0
    np.testing.assert_allclose(points, ref_points, rtol=0, atol=ATOL)
    np.testing.assert_array_equal(colors, ref_colors)
    got, want = load_predictions(folder / "predictions.npz"), load_predictions(reference / "predictions.npz")
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].shape == want[key].shape, key
        if want[key].dtype.kind in "fc":
            np.testing.assert_allclose(got[key], want[key], rtol=0, atol=ATOL, err_msg=key)
        elif key != "depth_chunks":
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert_same_bags(folder / "results", reference / "results")


def assert_same_bags(path: Path, reference: Path) -> None:
    """Every topic has the same messages (log times, stamps, frames, numbers to ATOL)."""
    got, want = read_bag(path), read_bag(reference)
    assert sorted(got) == sorted(want)
    for topic, messages in want.items():
        assert len(got[topic]) == len(messages), topic
        for (t_got, m_got), (t_want, m_want) in zip(got[topic], messages):
            assert t_got == t_want, topic
            _same_message(m_got, m_want, topic)


def _same_message(a, b, where: str) -> None:
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _same_message(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, np.ndarray) and a.dtype.kind in "fc":
        np.testing.assert_allclose(a, b, rtol=0, atol=ATOL, err_msg=where)
    elif isinstance(a, np.ndarray) and a.dtype == np.uint8 and where.endswith(".data"):
        _same_bytes_as_floats(a, b, where)
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=where)
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same_message(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert abs(a - b) <= ATOL, (where, a, b)
    else:
        assert a == b, (where, a, b)


def _same_bytes_as_floats(a: np.ndarray, b: np.ndarray, where: str) -> None:
    """Point clouds and depth images: float32 payloads, compared as numbers (NaN where NaN)."""
    assert a.shape == b.shape, where
    if a.size % 4 == 0:
        np.testing.assert_allclose(a.view("<f4"), b.view("<f4"), rtol=0, atol=ATOL, err_msg=where)
    else:
        np.testing.assert_array_equal(a, b, err_msg=where)


def read_json_or_none(path: Path) -> dict | None:
    from lingbot_map_ros.cli.fleet_task import read_json

    return read_json(path)


def result_of(folder: Path) -> dict:
    return json.loads((folder / "result.json").read_text())


def wait_for(condition, timeout_s: float, what: str, every_s: float = 0.05):
    """condition()'s first truthy value; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every_s)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


@contextlib.contextmanager
def local_ray(num_cpus: int = 2):
    """A local Ray instance on the loopback interface, in a temp folder under /tmp; shut down at the
    end, its processes gone (waited for, bounded; checked where psutil is installed)."""
    before = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray's switch: the node's address is 127.0.0.1
    ray = pytest.importorskip("ray", reason="the fleet tests need Ray: pip install ray (scripts/bootstrap.sh does)")
    temp = Path(tempfile.mkdtemp(prefix="rayf-", dir="/tmp"))
    earlier = set(_children())
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _temp_dir=str(temp), log_to_driver=False,
             object_store_memory=100 << 20, logging_level=logging.ERROR)
    try:
        assert ray.nodes()[0]["NodeManagerAddress"] == "127.0.0.1"  # loopback only
        yield ray
    finally:
        ray.shutdown()
        alive = _children_left(earlier)
        shutil.rmtree(temp, ignore_errors=True)
        if before is None:
            os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        else:
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = before
        assert not alive, f"Ray left processes behind: {alive}"


def _children() -> list:
    """This process's children (psutil processes); [] without psutil."""
    try:
        import psutil
    except ImportError:
        return []
    return psutil.Process().children(recursive=True)


def _children_left(earlier: set) -> list[int]:
    """The children started since ``earlier`` (Ray's) still alive 15 s after its shutdown (then ended)."""
    started = [p for p in _children() if p not in earlier]
    if not started:
        return []
    import psutil

    _, alive = psutil.wait_procs(started, timeout=15)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return [p.pid for p in alive]
