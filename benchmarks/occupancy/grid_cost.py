"""CPU cost of the occupancy grid (``lingbot_map_ros.robot.occupancy``): ``add_frame`` per
frame at several point counts, ``snapshot``, and ``rebuild`` of a whole trajectory.

The scene imitates a depth camera (90° x 50° field of view, 1 m above the floor) driving a
loop through a room-like space: each pixel ray ends on the floor or on a wall whose distance
(2–6 m) varies smoothly with the azimuth; points above ``max_height`` are ignored by the grid
as on a robot. Default GridConfig (5 cm cells).

    .venv/bin/python benchmarks/occupancy/grid_cost.py [--frames 1000] [--out FILE]

Prints and writes JSON with the run record (commit, device, command, date). Not a test.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance.py
from provenance import run_record, write_result  # noqa: E402
from lingbot_map_ros.robot.occupancy import GridConfig, GridFrame, GroundReference, OccupancyGridBuilder  # noqa: E402


def camera_frame(k: int, n_points: int, rng) -> GridFrame:
    """Frame ``k`` of a loop of radius 6 m: camera centre [3] and [n_points, 3] points (ground = map frame)."""
    t = 2 * math.pi * k / 400
    centre = np.array([6 * math.cos(t), 6 * math.sin(t), 1.0])
    yaw = t + math.pi / 2 + 0.3 * math.sin(5 * t)
    az = yaw + rng.uniform(-math.pi / 4, math.pi / 4, n_points)
    el = rng.uniform(math.radians(-30), math.radians(20), n_points)
    wall = 4 + 2 * np.sin(3 * az + k * 0.01) * np.cos(2 * az)
    floor = np.where(el < 0, centre[2] / np.tan(-np.minimum(el, -1e-6)), np.inf)
    dist = np.minimum(wall, floor)
    pts = np.stack([centre[0] + dist * np.cos(az), centre[1] + dist * np.sin(az),
                    np.where(floor <= wall, 0.0, centre[2] + dist * np.tan(el))], axis=1)
    return GridFrame(centre, pts.astype(np.float32))


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def cpu_timed(fn) -> float:
    """CPU time of this thread, ms: less disturbed than wall time by other processes on a shared CPU."""
    t = time.thread_time()
    fn()
    return (time.thread_time() - t) * 1e3


def per_frame(n_points: int, frames: int) -> dict:
    rng = np.random.default_rng(n_points)
    grid = OccupancyGridBuilder(GridConfig())
    grid.set_reference(GroundReference(np.eye(4)), metric=True)
    data = [camera_frame(k, n_points, rng) for k in range(frames)]
    for frame in data[:20]:  # warm-up: first allocations and growth
        grid.add_frame(*frame)
    times, cpu = [], []
    for frame in data[20:]:
        t = time.thread_time()
        times.append(timed(lambda f=frame: grid.add_frame(*f)))
        cpu.append((time.thread_time() - t) * 1e3)
    times.sort()
    snap = grid.snapshot()
    fresh = timed(lambda: (grid.add_frame(*data[0]), grid.snapshot()))
    return {"points": n_points, "frames": len(times), "add_frame_ms_min": round(times[0], 2),
            "add_frame_ms_median": round(statistics.median(times), 2),
            "add_frame_cpu_ms_median": round(statistics.median(cpu), 2),
            "add_frame_ms_p95": round(times[int(0.95 * (len(times) - 1))], 2),
            "grid_cells": snap.width * snap.height, "snapshot_cached_ms": round(timed(grid.snapshot), 3),
            "add_frame_plus_new_snapshot_ms": round(fresh, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=1000, help="keyframes of the rebuild")
    parser.add_argument("--rebuild-points", type=int, default=10000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    rows = [per_frame(n, 120) for n in (5000, 10000, 20000, 40000)]
    for row in rows:
        print(row, file=sys.stderr)
    rng = np.random.default_rng(0)
    frames = [camera_frame(k, args.rebuild_points, rng) for k in range(args.frames)]
    grid = OccupancyGridBuilder(GridConfig())
    grid.set_reference(GroundReference(np.eye(4)), metric=True)
    wall = time.perf_counter()
    rebuild_cpu_ms = cpu_timed(lambda: grid.rebuild(frames))
    rebuild_ms = (time.perf_counter() - wall) * 1e3
    snap = grid.snapshot()
    result = {"run": run_record(), "config": "GridConfig() defaults (0.05 m cells, 8 m range)",
              "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # shared CPU: before, after
              "per_frame": rows,
              "rebuild": {"keyframes": args.frames, "points_per_frame": args.rebuild_points,
                          "seconds": round(rebuild_ms / 1e3, 2), "cpu_seconds": round(rebuild_cpu_ms / 1e3, 2), "grid": f"{snap.width}x{snap.height}"}}
    write_result(result, args.out, "cpu", "_occupancy_grid")
    return 0


if __name__ == "__main__":
    sys.exit(main())
