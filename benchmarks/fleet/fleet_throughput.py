"""lingbot-map-fleet's throughput with one GPU and with two: the same inputs, the same flags,
a local Ray instance given 1 GPU, then 2 (issue 41: two GPUs give at least 1.8x).

    python benchmarks/fleet/fleet_throughput.py [--inputs 4] [--frames 1000] [--out FILE] [-- REPLAY FLAGS]
    python benchmarks/fleet/fleet_throughput.py --cpu-smoke        # tiny model, 1 CPU slot vs 2: checks the script

GPU (a machine with two): ``--inputs`` image folders of ``--frames`` frames each, made of
``--images`` (default ../shared/data/loop, 518x294 JPEG) repeated as needed (links, no
copies); the released architecture with random weights unless the replay flags after ``--``
name a checkpoint; ``--dtype bf16`` (the GPU's) unless given there. First one short untimed
replay fills the attention kernels' compilation cache. Then each configuration is one
``lingbot-map-fleet`` command (a subprocess, its own local Ray instance with ``--num-gpus``
1 or 2, one GPU per task, one segment per input), timed from start to exit: Ray's start,
each task's model load and the merge are in it, as an operator would see them. Recorded per
configuration: wall seconds, frames, frames/s over the wall time, each input's FPS (its
segments' wall time) and the command; then the speed-up of 2 GPUs over 1 and whether it
reaches ``--target`` (1.8).

CPU smoke: the tiny fixture model, ``--num-cpus`` 1 vs 2 with one CPU per task (``--frames``
24 by default): it checks the script and the fleet's plumbing, not a GPU's speed.

Prints and writes one JSON result (``provenance.write_result``); asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance.py
from provenance import REPO, run_record, write_result  # noqa: E402

LOOP = REPO.parent / "shared" / "data" / "loop"
FIXTURES = REPO.parent / "shared" / "fixtures" / "upstream_tiny"


def make_inputs(root: Path, count: int, frames: int, images: Path) -> list[Path]:
    """``count`` folders of ``frames`` links to ``images``' JPEG/PNG files, cycled (each folder starts elsewhere)."""
    files = sorted(p for p in images.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    if not files:
        sys.exit(f"no images in {images}")
    folders = []
    for i in range(count):
        folder = root / f"input{i}"
        folder.mkdir(parents=True)
        for n in range(frames):
            source = files[(n + i * 7) % len(files)]
            (folder / f"{n:06d}{source.suffix}").symlink_to(source)
        folders.append(folder)
    return folders


def run_fleet(inputs: list[Path], out: Path, slots: int, gpu: bool, frames: int, replay_flags: list[str]) -> dict:
    """One fleet command with ``slots`` GPUs (or CPUs) in its local Ray instance; its timing and summary."""
    resources = (["--num-gpus", str(slots), "--gpus-per-task", "1"] if gpu
                 else ["--num-cpus", str(slots), "--gpus-per-task", "0", "--cpus-per-task", "1"])
    command = [sys.executable, "-m", "lingbot_map_ros.cli.fleet", *map(str, inputs), "-o", str(out), *resources,
               "--segment-frames", str(frames), "--outputs", "trajectory", "-q", "--", *replay_flags]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - start
    summary = json.loads((out / "fleet-summary.json").read_text()) if (out / "fleet-summary.json").exists() else {}
    inputs_done = summary.get("inputs", [])
    total = sum(r["frames"] for r in inputs_done)
    return {"slots": slots, "exit_status": done.returncode, "wall_s": round(wall, 2), "frames": total,
            "fps_over_wall": round(total / wall, 2), "per_input": [
                {k: r[k] for k in ("name", "status", "frames", "fps", "seconds", "reason")} for r in inputs_done],
            "command": " ".join(command[1:]), "stderr_tail": done.stderr[-2000:]}


def warm_up(source: Path, out: Path, gpu: bool, replay_flags: list[str]) -> float:
    """One short replay before the timed runs, so that neither pays the attention kernels' first
    compilation (FlashInfer's JIT cache); its seconds."""
    command = [sys.executable, "-m", "lingbot_map_ros.cli.replay", "--images", str(source), "--max-frames", "32",
               "--device", "cuda" if gpu else "cpu", "--trajectory", str(out), "-q", *replay_flags]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode != 0:
        sys.exit(f"the warm-up replay failed: {done.stderr.strip()[-2000:]}")
    return round(time.perf_counter() - start, 2)


def replay_flags_for(args: argparse.Namespace) -> list[str]:
    if args.cpu_smoke:
        return ["--checkpoint", str(FIXTURES / "weights.safetensors"), "--model-config", str(FIXTURES / "config.json"),
                "--backend", "sdpa", *args.replay_flags]
    flags = list(args.replay_flags)
    return flags if "--dtype" in flags else [*flags, "--dtype", "bf16"]


def device_label(cpu_smoke: bool) -> str:
    if cpu_smoke:
        return f"cpu smoke, {os.cpu_count()} CPUs"
    import torch

    if not torch.cuda.is_available():
        sys.exit("no CUDA device here: run it on a machine with two GPUs, or pass --cpu-smoke")
    if torch.cuda.device_count() < 2:
        sys.exit(f"{torch.cuda.device_count()} GPU here; the comparison needs two")
    return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"


def main() -> None:
    argv = sys.argv[1:]
    own, replay = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inputs", type=int, default=4)
    p.add_argument("--frames", type=int, help="frames per input (default 1000 on the GPU, 24 with --cpu-smoke)")
    p.add_argument("--images", type=Path, default=LOOP, help="the frames the inputs are made of (default: the loop)")
    p.add_argument("--target", type=float, default=1.8, help="speed-up of 2 slots over 1 the issue asks for")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU: 1 CPU slot vs 2")
    p.add_argument("--out", type=Path, help="result file (default: results/<device>_fleet_throughput.json)")
    args = p.parse_args(own)
    args.replay_flags = replay
    frames = args.frames or (24 if args.cpu_smoke else 1000)
    device = device_label(args.cpu_smoke)
    flags = replay_flags_for(args)
    with tempfile.TemporaryDirectory(prefix="fleet_throughput_") as tmp:
        inputs = make_inputs(Path(tmp) / "inputs", args.inputs, frames, args.images)
        warm_s = warm_up(inputs[0], Path(tmp) / "warm.tum", not args.cpu_smoke, flags)
        runs = [run_fleet(inputs, Path(tmp) / f"out_{slots}", slots, not args.cpu_smoke, frames, flags)
                for slots in (1, 2)]
    one, two = runs
    speedup = two["fps_over_wall"] / one["fps_over_wall"] if one["fps_over_wall"] else None
    result = {"run": run_record(device=device), "what": "lingbot-map-fleet, 1 slot vs 2 (GPUs, or CPUs in the smoke)",
              "inputs": args.inputs, "frames_per_input": frames, "replay_flags": flags, "warm_up_s": warm_s,
              "runs": runs,
              "speedup_2_over_1": None if speedup is None else round(speedup, 3), "target": args.target,
              "meets_target": speedup is not None and speedup >= args.target}
    out = args.out or (Path(tempfile.gettempdir()) / "fleet_throughput_smoke.json" if args.cpu_smoke else None)
    write_result(result, out, device.replace(" x", "_x"), suffix="_fleet_throughput")


if __name__ == "__main__":
    main()
