"""End-to-end latency of the ROS node: image stamp -> pose received, measured around the demo's graph.

    python benchmarks/node/node_latency.py --preset lingbot-map --device cuda --dtype bf16 \\
        --backend flashinfer-fa3 --width 518 --height 378 --frames 300 --rate 15 \\
        --warmup-poses 80 --no-save-map --json node_latency_518x378.json

Runs the graph of ``lingbot-map-demo`` (``lingbot_map_ros.cli.demo_graph.Graph``: the node and the
image folder publisher as processes on a private ROS domain on this machine, a recorder in
this process; every demo option applies) and measures it:

- ``--warmup-poses N`` first plays the images in a loop until N poses came back (model load,
  JIT compilation, CUDA-graph capture, filling the window; bounded by ``--startup-timeout``),
  waits until the node is idle, then publishes the ``--frames`` timed frames: only poses of
  images stamped after that point are measured;
- ``--node-script FILE`` runs the node from FILE instead of ``lingbot_map_ros.ros.main``
  (``benchmarks/node/node_probe.py``: the real node under probes, optionally with a simulated
  model step);
- ``--json PATH`` writes the measurement: latency (image header stamp -> pose received by
  the recorder, same clock) median/p95/p99/max in ms, frames published/received/processed/
  dropped, output rate in Hz, the node's own per-frame times from its ``~/status`` (model,
  stamp -> published, preprocessing, postprocessing, publication, ms), window restarts, GPU
  memory in MB, and in ``run`` where it ran: commit, device, command, date.

With ``--keyframe-selector`` the JSON also holds the node's decision counters over the timed
part, the decision round trip and the frames that waited behind a hold (definitions in
``lingbot_map_ros/cli/demo_selector.py``). ``benchmarks/node/node_latency.sh`` drives this
script on the GPU machine (ROS bundle, FlashInfer, several heights, with and without the
selector). A benchmark, not a test: nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH), str(BENCH.parent)]  # provenance.py; lingbot_map_ros without an install

import provenance

from lingbot_map_ros.cli import demo, demo_graph, demo_selector
from lingbot_map_ros.cli.demo_graph import COUNTERS, DemoError, counters
from lingbot_map_ros.io.atomic import atomic_write

PROG = "node_latency"
_stats = demo_selector.stats


def build_parser() -> argparse.ArgumentParser:
    """The demo's options plus the measurement's."""
    p = demo.build_parser()
    p.prog, p.description = PROG, __doc__.split("\n\n")[0]
    p.add_argument("--warmup-poses", type=int, default=0,
                   help="before the timed frames, loop the images until this many poses came back (excluded); "
                        "bounded by --startup-timeout")
    p.add_argument("--json", type=Path, default=None, help="write the measurement as JSON to this file")
    p.add_argument("--node-script", type=Path, default=None,
                   help="run the node from this Python script instead of lingbot_map_ros.ros.main (e.g. "
                        "benchmarks/node/node_probe.py: the real node under probes, optionally with a simulated "
                        "model step)")
    return p


# ------------------------------------------------------------------ warm-up
def warm_up(args: argparse.Namespace, graph: demo_graph.Graph, images: Path, t_start: float) -> dict:
    """Loop the images until ``--warmup-poses`` poses came back, stop, wait until the node is
    idle. Seconds since ``t_start`` (monotonic) of the first pose, of the warm-up, its poses
    and frames received."""
    t0 = time.monotonic()
    log = graph.out / "warmup_publisher.log"
    proc = demo_graph.start(demo_graph.publisher_cmd(images, args.rate, 0, graph.startup_timeout, loop=True), graph.env, log)
    first_pose_s = None
    deadline = t0 + graph.startup_timeout
    try:
        while True:
            poses, _ = graph.recorder.snapshot()
            if poses and first_pose_s is None:
                first_pose_s = round(time.monotonic() - t_start, 3)
            if len(poses) >= args.warmup_poses:
                break
            graph.check_alive(" during the warm-up")
            if proc.poll() is not None:
                raise DemoError(f"the warm-up publisher exited with status {proc.returncode}:\n{demo_graph.tail(log)}")
            if time.monotonic() > deadline:
                raise DemoError(f"warm-up: {len(poses)} of {args.warmup_poses} poses after {graph.startup_timeout} s "
                                f"(--startup-timeout):\n{demo_graph.tail(graph.out / 'node.log')}")
            time.sleep(0.05)
    finally:
        demo_graph.stop(proc)
    warmup_s = round(time.monotonic() - t0, 3)
    wait_drained(graph.recorder, deadline=time.monotonic() + args.timeout)
    poses, status = graph.recorder.snapshot()
    return {"first_pose_s": first_pose_s, "warmup_s": warmup_s, "warmup_poses": len(poses),
            "warmup_frames_received": counters(status)["frames_received"]}


def wait_drained(recorder, deadline: float, settle: float = 0.5) -> None:
    """Wait until the node accounted for every frame it received (nothing queued or in flight)
    and its counters stayed put for ``settle`` s; or nothing changed for 3 s."""
    last_change, last_seen = time.monotonic(), None
    while time.monotonic() < deadline:
        _, status = recorder.snapshot()
        seen = tuple(counters(status).values())
        if seen != last_seen:
            last_seen, last_change = seen, time.monotonic()
        quiet = time.monotonic() - last_change
        if status is not None and seen[0] == sum(seen[1:]) and quiet >= settle:
            return
        if quiet > 3.0:
            return
        time.sleep(0.05)


# ------------------------------------------------------------------ provenance
def device_name(device: str | None) -> str:
    """What ``device`` (the node's parameter) is on this machine: the GPU's or the CPU's name."""
    if device and device.startswith("cuda"):
        index = device.partition(":")[2] or "0"
        try:
            done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", index],
                                  capture_output=True, text=True, timeout=20, check=False)
            if done.returncode == 0 and done.stdout.strip():
                return f"{done.stdout.strip().splitlines()[0]} ({device})"
        except (OSError, subprocess.SubprocessError):
            pass
        return f"{device} (no name: nvidia-smi unavailable)"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs ({device or 'cpu'})"


def run_info(args: argparse.Namespace, values: dict) -> dict:
    """Where and how a measurement was made: ``provenance.run_record`` (commit, whether tracked
    files differed from it, command, date) with the node's device named, this host and
    LINGBOT_BENCH_COMMAND (the script command that ran this one: node_latency.sh)."""
    argv = getattr(args, "argv", None) or []
    info = provenance.run_record([str(Path(__file__)), *argv], device=device_name(values.get("device")))
    info.update(host=platform.node(), script_command=os.environ.get("LINGBOT_BENCH_COMMAND"))
    return info


# ------------------------------------------------------------------ measurement
def measurement(recorder, since_s: float | None, baseline: dict, published: int, startup: dict,
                args: argparse.Namespace, values: dict, images: Path, decisions: dict | None = None) -> dict:
    """The run's numbers: poses of images stamped at or after ``since_s`` (all when None), the
    node's counters relative to ``baseline``, the node's own per-frame times, and with the
    keyframe selector ``decisions`` (demo_selector.decision_measurement). Times in ms."""
    from lingbot_map_ros.io.preprocess import list_images, load_image

    poses, status = recorder.snapshot()
    if since_s is not None:
        poses = [p for p in poses if p.stamp_s >= since_s]
    frame_status = recorder.frame_statuses(since_s)
    final = counters(status)
    delta = {name: final[name] - baseline[name] for name in COUNTERS}
    latencies = [p.latency_ms for p in poses]
    span_out = poses[-1].received_s - poses[0].received_s if len(poses) > 1 else 0.0
    span_in = poses[-1].stamp_s - poses[0].stamp_s if len(poses) > 1 else 0.0
    frame_size = list(load_image(list_images(images)[0]).size)
    windows = sorted({f.window_index for f in frame_status})
    return {
        "run": run_info(args, values),
        "setting": {
            "weights": values.get("checkpoint") or f"random {args.preset or 'tiny'} (seed {args.seed})",
            "preset": args.preset, "device": values.get("device"), "backend": values.get("backend", "auto"),
            "dtype": values.get("dtype", "fp32"), "cuda_graphs": values.get("cuda_graphs", True),
            "frame_size": frame_size, "image_width": values.get("image_width"), "rate_hz": args.rate,
            "frames": args.frames, "warmup_poses": args.warmup_poses, "node_parameters": values,
            "node_script": str(args.node_script) if args.node_script else None,
            "fastdds_profile": os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE"),
            "keyframe_selector": bool(getattr(args, "keyframe_selector", False)),
            "selector_parameters": list(getattr(args, "selector_param", [])),
        },
        "startup": startup,
        "frames": {"published": published, "received": delta["frames_received"],
                   "processed": delta["frames_processed"], "dropped_stale": delta["frames_dropped_stale"],
                   "dropped_invalid": delta["frames_dropped_invalid"], "dropped_error": delta["frames_dropped_error"],
                   "poses_received": len(poses)},
        "latency_ms": _stats(latencies),  # image header stamp -> pose received by the recorder
        "output_rate_hz": round((len(poses) - 1) / span_out, 3) if span_out > 0 else 0.0,
        "input_rate_of_poses_hz": round((len(poses) - 1) / span_in, 3) if span_in > 0 else 0.0,
        "node_ms": {  # the node's own per-frame times (Status), same frames
            "model": _stats([f.model_ms for f in frame_status]),
            "total_stamp_to_published": _stats([f.total_ms for f in frame_status]),
            "preprocess": _stats([f.preprocess_ms for f in frame_status]),
            "postprocess": _stats([f.postprocess_ms for f in frame_status]),
            "publish": _stats([f.publish_ms for f in frame_status]),
        },
        "window_restarts": max(len(windows) - 1, 0), "window_indices": windows,
        "gpu_memory_mb": {"allocated_max": round(max((f.gpu_allocated_mb for f in frame_status), default=0.0), 1),
                          "reserved_max": round(max((f.gpu_reserved_mb for f in frame_status), default=0.0), 1)},
        "decisions": decisions,  # None without the keyframe selector
    }


def json_default(value):
    """numpy scalars and paths in the measurement, for ``json.dumps``."""
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def decisions_report(decisions: dict) -> str:
    """One report line: the node's decisions over the timed part, round trip, hold waits."""
    n, rt, waits = decisions["node"], decisions["round_trip_ms"], decisions["hold_waits"]
    return (f"decisions        : kept {n['kept']}, dropped {n['dropped']}, timed out {n['timed_out']}, refused "
            f"{n['refused']}; round trip median {rt.get('median')} ms, p95 {rt.get('p95')} ms, max {rt.get('max')} "
            f"ms; {waits['frames']} frame(s) waited behind a hold")


# ------------------------------------------------------------------ run
def run(args: argparse.Namespace) -> int:
    if args.warmup_poses < 0:
        raise DemoError("need --warmup-poses >= 0")
    demo.check_options(args)
    with tempfile.TemporaryDirectory(prefix="lingbot_node_latency_") as tmp_name:
        setup = demo.prepare(args, Path(tmp_name))
        demo.announce(args, setup, PROG)
        with demo_graph.Graph(args, setup.out, setup.env, PROG) as graph:
            return measure(args, graph, setup)


def measure(args: argparse.Namespace, graph: demo_graph.Graph, setup: demo.Setup) -> int:
    """Node up, selector, warm-up, the timed frames; the JSON and the report."""
    from lingbot_map_ros.io.preprocess import list_images

    recorder = graph.recorder
    status_log = demo_selector.StatusLog(recorder, "/lingbot_map") if args.keyframe_selector else None
    t_start = time.monotonic()
    startup = {"node_up_s": graph.start_node(setup.params, args.node_script)}
    if args.keyframe_selector:
        graph.start_selector()
    frames = min(args.frames, len(list_images(setup.images)))
    since_s = None
    if args.warmup_poses:
        startup.update(warm_up(args, graph, setup.images, t_start))
        since_s = time.time()  # poses of images stamped from here on are measured
    graph.wait_decided()
    baseline = counters(recorder.snapshot()[1])
    decisions_baseline = demo_selector.decision_counts(recorder.snapshot()[1])
    print(f"{PROG}: node up after {startup['node_up_s']:.1f} s"
          + (f", warmed up with {startup['warmup_poses']} poses in {startup['warmup_s']:.1f} s"
             if args.warmup_poses else "")
          + f"; publishing {frames} frames at {args.rate} Hz", flush=True)
    published = graph.play(setup.images, frames, node_ready=bool(args.warmup_poses))
    decisions = None
    if status_log is not None:
        graph.stop_selector()
        decisions = demo_selector.decision_measurement(
            status_log.events(), since_s, decisions_baseline, recorder.snapshot()[1], demo_selector.decision_timeout(args),
            demo_selector.selector_summary(setup.out / "selector.log"))
    response = None if args.no_save_map else graph.save_map()
    result = measurement(recorder, since_s, baseline, published, startup, args, setup.values, setup.images,
                         decisions)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(result, indent=2, default=json_default) + "\n"
        atomic_write(args.json, lambda f: f.write(text.encode()))
    f = result["frames"]
    dropped = f"{f['dropped_stale']} stale, {f['dropped_invalid']} invalid, {f['dropped_error']} error"
    return demo.report(recorder, setup.out, response, since_s, dropped,
                       [decisions_report(decisions)] if decisions else [])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    try:
        return run(args)
    except DemoError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
