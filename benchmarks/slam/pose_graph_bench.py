"""What the keyframe pose graph (lingbot_map_ros/slam) costs at 10,000 keyframes, on this CPU.

    python benchmarks/slam/pose_graph_bench.py [--keyframes 10000] [--lap 100] [--out F]

A synthetic path of ``--keyframes`` keyframes going round a rounded square (``--lap`` keyframes
a lap) with drifting odometry (``slam.synthetic``) is built keyframe by keyframe (add, odometry
edge, ``PoseGraph.update``); then loops are added one at a time, each followed by ``update()``
(iSAM2 plus its reweighting iterations): one lap back, ten laps back, and back to the start (the
whole chain). Then a batch Levenberg–Marquardt ``batch_solve()`` over everything, reading every
pose, and ``to_arrays`` / ``from_arrays``. Reports wall times (ms), the per-keyframe update
times (median, p95, last 1,000), the ATE (Sim(3)-aligned RMSE, model units) before and after,
and the serialised size. Prints and writes one JSON result (``provenance.write_result``);
asserts nothing.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from lingbot_map_ros.slam import EdgeNoise, PoseGraph, PoseGraphConfig, ate, relative  # noqa: E402
from lingbot_map_ros.slam.synthetic import Drift, drifted_odometry, loop_measurement, square  # noqa: E402
from provenance import device_name, run_record, write_result  # noqa: E402

# odometry errors small enough that a loop over all 10,000 keyframes is a few sigmas of the chain
# (the robust kernel would rightly refuse one of tens of sigmas)
DRIFT = Drift(yaw_bias_deg=0.002, rotation_noise_deg=0.02, translation_bias=0.0005, translation_noise=0.002,
              scale_per_step=0.00002)
NOISE = EdgeNoise(rotation_deg=0.05, translation=0.002, translation_fraction=0.005, log_scale=0.0005)
LOOP_SIGMAS = [0.01] * 3 + [0.02] * 3 + [0.01]


def ms(seconds: float) -> float:
    return round(1e3 * seconds, 3)


def build(truth, odom) -> tuple[PoseGraph, list[float]]:
    graph = PoseGraph(PoseGraphConfig())
    times = []
    for k, pose in enumerate(odom):
        graph.add_keyframe(k, pose)
        if k:
            graph.add_odometry(k - 1, k, sigmas=NOISE.sigmas_for(relative(odom[k - 1], pose)))
        times.append(graph.update())
    return graph, times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keyframes", type=int, default=10000)
    ap.add_argument("--lap", type=int, default=100, help="keyframes per lap of the square")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    n, lap = args.keyframes, args.lap
    truth = (square(lap, side=10.0) * (n // lap + 1))[:n]
    odom = drifted_odometry(truth, DRIFT, np.random.default_rng(args.seed))
    centres = np.array([p.translation for p in truth])
    start = time.perf_counter()
    graph, times = build(truth, odom)
    build_s = time.perf_counter() - start
    drifted = ate(np.array([p.translation for p in odom]), centres)

    last = n - 1
    loops = []
    for back in (lap, 10 * lap, last):  # last → one lap back, ten laps back, the first keyframe
        other = last - back
        graph.add_loop(other, last, loop_measurement(truth, DRIFT, other, last), sigmas=LOOP_SIGMAS)
        seconds = graph.update()
        loops.append({"from": other, "to": last, "keyframes_spanned": back, "update_ms": ms(seconds),
                      "isam2_iterations": graph.last_iterations,
                      "ate_after": round(graph_ate(graph, centres), 5)})
    start = time.perf_counter()
    keys, mats = graph.poses()
    poses_s = time.perf_counter() - start
    batch_s = graph.batch_solve()
    after_batch = graph_ate(graph, centres)
    start = time.perf_counter()
    arrays = graph.to_arrays()
    to_arrays_s = time.perf_counter() - start
    start = time.perf_counter()
    PoseGraph.from_arrays(arrays)
    from_arrays_s = time.perf_counter() - start

    result = {
        "run": run_record([__file__] + sys.argv[1:]),
        "keyframes": n, "keyframes_per_lap": lap, "mode": graph.config.mode, "edges": graph.edge_counts(),
        "build_s": round(build_s, 3),
        "update_per_keyframe_ms": {"median": ms(statistics.median(times)),
                                   "p95": ms(float(np.percentile(times, 95))),
                                   "median_last_1000": ms(statistics.median(times[-1000:]))},
        "loops": loops,
        "batch_solve_ms": ms(batch_s),
        "read_all_poses_ms": ms(poses_s),
        "to_arrays_ms": ms(to_arrays_s), "from_arrays_ms": ms(from_arrays_s),
        "arrays_bytes": int(sum(np.asarray(a).nbytes for a in arrays.values())),
        "ate": {"odometry": round(drifted, 5), "after_loops": loops[-1]["ate_after"],
                "after_batch": round(after_batch, 5)},
        "notes": "update_ms of a loop includes iSAM2's reweighting iterations (PoseGraphConfig."
                 "iterations_after_loop, stopped once the loop ends move < loop_tolerance)",
    }
    write_result(result, args.out, device_name(), "_pose_graph")
    return 0


def graph_ate(graph: PoseGraph, centres: np.ndarray) -> float:
    _, mats = graph.poses()
    return ate(mats[:, :3, 3], centres)


if __name__ == "__main__":
    sys.exit(main())
