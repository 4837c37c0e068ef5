"""benchmarks/node/node_latency.py: the measurement around the demo's graph (warm-up, timed
part, JSON, provenance, probe script, keyframe selector) and benchmarks/node/node_latency_compare.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from lingbot_map_ros.cli import demo
from lingbot_map_ros.journal import JOURNAL_NAME
from lingbot_map_ros.journal.format import iter_records, scan
from lingbot_map_ros.runtime.map_journal import MAP_JOURNAL_NAME

pytestmark = pytest.mark.ros
REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "node"
sys.path.insert(0, str(BENCH))
import node_latency  # noqa: E402  (benchmarks/node/node_latency.py)


def _bench(*argv: str) -> list[str]:
    return [sys.executable, str(BENCH / "node_latency.py"), *argv]


# ------------------------------------------------------------------ options
def test_the_benchmark_takes_the_demo_options_plus_its_own():
    args = node_latency.build_parser().parse_args(["--preset", "tiny", "--height", "70", "--warmup-poses", "4",
                                                   "--json", "m.json", "--node-script", "probe.py"])
    assert (args.preset, args.height, args.warmup_poses) == ("tiny", 70, 4)
    assert (args.json, args.node_script) == (Path("m.json"), Path("probe.py"))
    for option in ("--warmup-poses", "--json", "--node-script"):  # not the demo's business any more
        with pytest.raises(SystemExit):
            demo.build_parser().parse_args([option, "1"])


@pytest.mark.parametrize("argv, message", [
    (["--warmup-poses", "-1"], "--warmup-poses"), (["--height", "100"], "--height"),
    (["--keyframe-selector", "--decision-timeout", "0"], "--decision-timeout")])
def test_bad_options_are_one_line_errors(argv, message, tmp_path, capsys):
    assert node_latency.main(argv + ["--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert message in err and err.startswith("node_latency: error:") and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------ measurement
class _FakeRecorder:
    """What measurement() reads from a Recorder: poses, the latest status, per-frame statuses."""

    def __init__(self, poses, status, frame_status):
        self.poses, self.status, self.frame_status = poses, status, frame_status

    def snapshot(self):
        return list(self.poses), self.status

    def frame_statuses(self, since_s=None):
        return [f for f in self.frame_status if since_s is None or f.stamp_s >= since_s]


def test_measurement_leaves_the_warm_up_out_and_counts_relative_to_the_baseline(tmp_path):
    import numpy as np

    from lingbot_map_ros.ros.recorder import FrameStatus, PoseRecord

    demo.synthetic_sequence(tmp_path / "frames", 1, size=(98, 70))
    warm = [PoseRecord(10.0 + i, 10.0 + i + 5.0, np.eye(4)) for i in range(4)]  # 5 s latency: excluded
    timed = [PoseRecord(100.0 + i / 10, 100.0 + i / 10 + 0.040 + 0.001 * i, np.eye(4)) for i in range(10)]
    statuses = [FrameStatus(p.stamp_s, i + 1, 0 if i < 8 else 1, 30.0 + i, 35.0, 1.0, 2.0, 0.5, 100.0 * i, 200.0)
                for i, p in enumerate(warm + timed)]
    final = SimpleNamespace(frames_received=16, frames_processed=14, frames_dropped_stale=2,
                            frames_dropped_invalid=0, frames_dropped_error=0)
    baseline = {"frames_received": 4, "frames_processed": 4, "frames_dropped_stale": 0,
                "frames_dropped_invalid": 0, "frames_dropped_error": 0}
    args = node_latency.build_parser().parse_args(["--preset", "lingbot-map", "--rate", "10", "--frames", "12",
                                                   "--warmup-poses", "4"])
    result = node_latency.measurement(_FakeRecorder(warm + timed, final, statuses), 100.0, baseline, 12,
                                      {"node_up_s": 1.0}, args,
                                      {"device": "cuda", "backend": "flashinfer-fa3", "dtype": "bf16"},
                                      tmp_path / "frames")
    assert result["frames"] == {"published": 12, "received": 12, "processed": 10, "dropped_stale": 2,
                                "dropped_invalid": 0, "dropped_error": 0, "poses_received": 10}
    lat = result["latency_ms"]
    assert lat["n"] == 10 and lat["min"] == pytest.approx(40.0) and lat["max"] == pytest.approx(49.0)
    assert lat["median"] == pytest.approx(44.5)
    assert result["output_rate_hz"] == pytest.approx(9 / 0.909, rel=1e-3)
    assert result["input_rate_of_poses_hz"] == pytest.approx(10.0, rel=1e-3)
    assert result["node_ms"]["model"]["n"] == 10 and result["node_ms"]["model"]["median"] == pytest.approx(38.5)
    assert result["window_restarts"] == 1 and result["window_indices"] == [0, 1]
    assert result["gpu_memory_mb"]["allocated_max"] == pytest.approx(1300.0)
    assert result["setting"]["frame_size"] == [98, 70] and result["setting"]["dtype"] == "bf16"
    assert result["setting"]["weights"] == "random lingbot-map (seed 0)"
    json.dumps(result, default=node_latency.json_default)


# ------------------------------------------------------------------ provenance
def test_run_info_names_commit_device_command_and_date(tmp_path, monkeypatch):
    args = node_latency.build_parser().parse_args(["--frames", "3"])
    args.argv = ["--frames", "3"]
    monkeypatch.setenv("LINGBOT_BENCH_COMMAND", "bash benchmarks/node/node_latency.sh --cpu-smoke")
    monkeypatch.delenv("LINGBOT_COMMIT", raising=False)
    info = node_latency.run_info(args, {"device": "cpu"})
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert info["commit"] == head.stdout.strip() and isinstance(info["tracked_files_modified"], bool)
    assert info["command"] == "python benchmarks/node/node_latency.py --frames 3"
    assert info["script_command"] == "bash benchmarks/node/node_latency.sh --cpu-smoke"
    assert "CPUs (cpu)" in info["device"] and info["date"].endswith("Z") and len(info["date"]) == 20
    # outside a git checkout: LINGBOT_COMMIT, else "unknown"
    monkeypatch.setattr(node_latency.provenance, "REPO", tmp_path)
    assert node_latency.run_info(args, {"device": "cpu"})["commit"] == "unknown"
    monkeypatch.setenv("LINGBOT_COMMIT", "abc1234")
    info = node_latency.run_info(args, {"device": "cuda:1"})
    assert info["commit"] == "abc1234" and info["tracked_files_modified"] is None
    assert "cuda:1" in info["device"]


# ------------------------------------------------------------------ benchmarks/node/node_latency_compare.py
def _result(median: float, p95: float, decisions: dict | None) -> dict:
    return {"latency_ms": {"n": 10, "median": median, "p95": p95, "max": p95 + 5}, "output_rate_hz": 14.9,
            "frames": {"published": 300, "processed": 298, "dropped_stale": 2},
            "setting": {"frame_size": [518, 378], "rate_hz": 15.0}, "decisions": decisions}


def test_compare_tool_prints_the_difference_and_refuses_a_run_without_the_selector(tmp_path):
    decisions = {"round_trip_ms": {"n": 290, "median": 3.1, "p95": 4.2}, "hold_waits": {"frames": 0},
                 "node": {"kept": 200, "dropped": 90, "timed_out": 0, "refused": 0}}
    plain, with_sel = tmp_path / "a.json", tmp_path / "b.json"
    plain.write_text(json.dumps(_result(28.0, 28.7, None)))
    with_sel.write_text(json.dumps(_result(29.5, 31.0, decisions)))
    tool = [sys.executable, str(BENCH / "node_latency_compare.py")]
    done = subprocess.run(tool + [str(plain), str(with_sel)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert "latency median 28.0 -> 29.5 ms (+1.50)" in line and "p95 28.7 -> 31.0 (+2.30)" in line
    assert "round trip median 3.1 ms" in line and "kept 200, dropped 90" in line
    done = subprocess.run(tool + [str(with_sel), str(plain)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "not a --keyframe-selector run" in done.stderr


# ------------------------------------------------------------------ end to end
E2E_TIMEOUT = 240  # s for each run (a hang guard)


def _e2e_commands(tmp: Path, domains: dict[str, int]) -> dict[str, tuple[list[str], dict, Path]]:
    """Each end-to-end run: its command, environment and working directory."""
    warm, probe, sel = (tmp / name for name in ("warm_up", "probe", "selector"))
    probe_env = {**os.environ, "LINGBOT_SIM_STEP_MS": "20", "LINGBOT_SIM_HOST_MS": "1",
                 "LINGBOT_PROBE_OUT": str(probe / "probe.json")}
    return {
        "warm_up": (_bench("--preset", "tiny", "--frames", "8", "--rate", "5", "--width", "98", "--height", "70",
                           "--warmup-poses", "4", "--startup-timeout", "90", "--no-save-map",
                           "--out", str(warm / "out"), "--json", str(warm / "out" / "m.json"),
                           "--domain-id", str(domains["warm_up"]), "--timeout", "60"), dict(os.environ), warm),
        "probe": (_bench("--preset", "tiny", "--width", "98", "--height", "70", "--frames", "10", "--rate", "10",
                         "--warmup-poses", "3", "--no-save-map", "--node-script", str(BENCH / "node_probe.py"),
                         "--out", str(probe / "out"), "--domain-id", str(domains["probe"]), "--timeout", "60",
                         "--json", str(probe / "result.json"),
                         "--node-param", f"state_directory={probe / 'state'}"), probe_env, REPO),
        # decision timeout 5 s: on a loaded CI machine no frame may fall back to the default
        "selector": (_bench("--preset", "tiny", "--frames", "8", "--rate", "4", "--width", "98", "--height", "70",
                            "--warmup-poses", "4", "--startup-timeout", "90", "--no-save-map", "--keyframe-selector",
                            "--decision-timeout", "5", "--out", str(sel / "out"), "--json", str(sel / "out" / "m.json"),
                            "--domain-id", str(domains["selector"]), "--timeout", "60"), dict(os.environ), REPO),
    }


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    """The three end-to-end runs, started at once (each on a domain id of its own: they overlap
    their process start-ups and waits); ``e2e(name)`` waits for one and returns (its
    CompletedProcess, its folder)."""
    pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")
    from graph_helpers import private_domain_id, stop_processes

    tmp = tmp_path_factory.mktemp("node_latency_e2e")
    domains = {name: private_domain_id(f"{__name__}:{name}", 1, 100, 17, offset)
               for name, offset in (("warm_up", 31), ("probe", 41), ("selector", 47))}
    procs = {}
    for name, (cmd, env, cwd) in _e2e_commands(tmp, domains).items():
        (tmp / name).mkdir()
        with open(tmp / name / "stdout.txt", "w") as out, open(tmp / name / "stderr.txt", "w") as err:
            procs[name] = (subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=err, text=True,
                                            stdin=subprocess.DEVNULL), cmd)
    started = time.monotonic()

    def result(name: str) -> tuple[subprocess.CompletedProcess, Path]:
        proc, cmd = procs[name]
        try:
            proc.wait(max(1.0, E2E_TIMEOUT - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            stop_processes(proc, grace=10.0)
            raise AssertionError(f"{name}: no exit within {E2E_TIMEOUT} s") from None
        folder = tmp / name
        return subprocess.CompletedProcess(cmd, proc.returncode, (folder / "stdout.txt").read_text(),
                                           (folder / "stderr.txt").read_text()), folder

    try:
        yield result
    finally:
        stop_processes(*(proc for proc, _ in procs.values()), grace=10.0)


@pytest.mark.slow
def test_warm_up_then_timed_frames_into_the_json(e2e):
    result, folder = e2e("warm_up")
    out = folder / "out"
    assert result.returncode == 0, result.stdout + result.stderr
    m = json.loads((out / "m.json").read_text())
    f = m["frames"]
    assert f["published"] == 8 and f["received"] == 8 and f["processed"] + f["dropped_stale"] == 8, f
    assert f["processed"] >= 4 and f["poses_received"] == f["processed"] and f["dropped_error"] == 0, f
    assert m["startup"]["warmup_poses"] >= 4 and m["startup"]["first_pose_s"] > 0
    assert m["latency_ms"]["n"] == f["poses_received"] and 0 < m["latency_ms"]["median"] < 5000
    assert m["node_ms"]["model"]["n"] == f["processed"] and m["setting"]["frame_size"] == [98, 70]
    assert m["run"]["command"].startswith("python benchmarks/node/node_latency.py --preset tiny")
    assert not (out / "map.ply").exists() and (out / "warmup_publisher.log").is_file()
    assert "Traceback" not in (out / "node.log").read_text()


@pytest.mark.slow
def test_node_probe_runs_the_real_node_with_a_simulated_step(e2e):
    """benchmarks/node/node_probe.py as the node: the node's own code around a simulated 20 ms
    step, and a probe report that saw that step, the node's threads and the image ages."""
    result, folder = e2e("probe")
    out, report, result_json = folder / "out", folder / "probe.json", folder / "result.json"
    assert result.returncode == 0, result.stdout + result.stderr
    measured = json.loads(result_json.read_text())
    assert measured["setting"]["node_script"].endswith("node_probe.py")
    assert measured["frames"]["processed"] + measured["frames"]["dropped_stale"] == 10
    assert measured["node_ms"]["model"]["median"] >= 20.0  # the simulated step, not a model
    assert "SIMULATED model" in (out / "node.log").read_text()
    probe = json.loads(report.read_text())
    assert probe["calls_ms"]["submit"]["n"] >= 10 and probe["calls_ms"]["submit"]["median"] >= 20.0  # the step ran in it
    assert probe["calls_ms"]["image age at the callback (stamp -> executor)"]["n"] >= 10
    waits = probe["gil_wait_ms"]
    assert waits["n"] > 0 and sum(waits["histogram"].values()) == waits["n"]
    assert "lingbot_map_inference" in probe["thread_cpu_s"] and "lingbot_map_outputs" in probe["thread_cpu_s"]
    rss = probe["rss_mb"]
    assert rss["samples"] >= 1 and 50 < rss["first"] <= rss["max"] and rss["last"] <= rss["max"]
    # with a state directory the simulated session is journaled as the real one is: its scale
    # frames and stored frames (uint8, the frame's size), and the map journal beside it
    found = scan(folder / "state" / JOURNAL_NAME)
    records = list(iter_records(found))
    frames = [r for r in records if r.kind == "frame"]
    assert found.stop == "" and [r.meta["decision"] for r in frames[:2]] == ["scale", "scale"], found.kinds
    assert frames[-1].meta["decision"] == "keyframe" and frames[-1].arrays["image"].shape == (70, 98, 3)
    assert (folder / "state" / MAP_JOURNAL_NAME).is_file()


@pytest.mark.slow
def test_the_selector_in_the_loop_measures_the_decisions(e2e):
    result, folder = e2e("selector")
    out = folder / "out"
    assert result.returncode == 0, result.stdout + result.stderr
    m = json.loads((out / "m.json").read_text())
    f, d = m["frames"], m["decisions"]
    assert f["published"] == 8 and f["processed"] + f["dropped_stale"] == 8 and f["processed"] >= 4, f
    assert m["setting"]["keyframe_selector"] and m["setting"]["node_parameters"]["keyframe_decision_timeout"] == 5.0
    n = d["node"]
    # every processed frame of the timed part is stored and held (the scale frames were warm-up frames)
    assert n["kept"] + n["dropped"] == f["processed"] and n["timed_out"] == 0 and n["refused"] == 0, d
    assert d["round_trip_ms"]["n"] == f["processed"] and 0 < d["round_trip_ms"]["median"] < 5000, d
    assert d["selector"] is not None and d["selector"]["kept"] + d["selector"]["dropped"] >= f["processed"], d
    assert m["run"]["command"].endswith("--timeout 60") and m["run"]["commit"]
    assert "decisions        : kept" in result.stdout and "round trip median" in result.stdout
    for name in ("node.log", "selector.log"):
        assert "Traceback" not in (out / name).read_text(), name
