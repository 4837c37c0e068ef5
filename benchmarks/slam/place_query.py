"""Query time of the keyframe place database (lingbot_map_ros/slam/places.py) on this CPU.

    python benchmarks/slam/place_query.py [--sizes 1000 10000 50000] [--dims 256 512 1024] [--out F]

For each database size × descriptor dimension: random L2-normalised float32 descriptors, then
``--queries`` single queries (k = 5, the last 72 keyframes excluded as the current window would
be, no similarity floor), median and p95 wall time; also the time to add all places. With
``--faiss`` (when ``faiss`` imports; it is not a dependency) the same queries through faiss's exact
``IndexFlatIP`` and approximate ``IndexHNSWFlat`` (M = 32, efSearch 64; its recall@5 against the
exact result), for the decision whether faiss earns a place. Prints and writes one JSON result
(``provenance.write_result``); asserts nothing.
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
from lingbot_map_ros.slam.places import PlaceConfig, PlaceDatabase  # noqa: E402
from provenance import device_name, run_record, write_result  # noqa: E402


def measure(size: int, dim: int, queries: int, rng: np.random.Generator, with_faiss: bool) -> dict:
    desc = rng.standard_normal((size, dim)).astype(np.float32)
    db = PlaceDatabase(PlaceConfig(dim, capacity=max(size, 1)))
    start = time.perf_counter()
    for i, vec in enumerate(desc):
        db.add(i, vec)
    add_s = time.perf_counter() - start
    window = range(size - 72, size)
    times = []
    for q in rng.standard_normal((queries, dim)).astype(np.float32):
        start = time.perf_counter()
        db.query(q, k=5, exclude=window)
        times.append(time.perf_counter() - start)
    row = {"places": size, "dim": dim, "query_ms_median": round(1e3 * statistics.median(times), 4),
           "query_ms_p95": round(1e3 * float(np.percentile(times, 95)), 4),
           "add_all_s": round(add_s, 3), "descriptor_mb": round(desc.nbytes / 2**20, 1)}
    if with_faiss:
        row["faiss"] = measure_faiss(db, desc, queries, rng)
    return row


def timed_queries(search, queries: np.ndarray) -> tuple[list[float], list[np.ndarray]]:
    times, found = [], []
    for q in queries:
        start = time.perf_counter()
        found.append(search(q[None]))
        times.append(time.perf_counter() - start)
    return times, found


def measure_faiss(db: PlaceDatabase, desc: np.ndarray, count: int, rng: np.random.Generator) -> dict:
    import faiss

    base = db.to_arrays()["descriptor"]
    queries = rng.standard_normal((count, desc.shape[1])).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    flat = faiss.IndexFlatIP(desc.shape[1])
    flat.add(base)
    hnsw = faiss.IndexHNSWFlat(desc.shape[1], 32, faiss.METRIC_INNER_PRODUCT)
    start = time.perf_counter()
    hnsw.add(base)
    build_s = time.perf_counter() - start
    hnsw.hnsw.efSearch = 64
    out = {"faiss": faiss.__version__, "hnsw_build_s": round(build_s, 3)}
    exact = None
    for name, index in (("flat_ip", flat), ("hnsw", hnsw)):
        times, found = timed_queries(lambda q, i=index: i.search(q, 5)[1][0], queries)
        out[f"{name}_query_ms_median"] = round(1e3 * statistics.median(times), 4)
        out[f"{name}_query_ms_p95"] = round(1e3 * float(np.percentile(times, 95)), 4)
        if exact is None:
            exact = found
        else:
            out["hnsw_recall_at_5"] = round(float(np.mean([len(set(a) & set(b)) / 5 for a, b in zip(exact, found)])), 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 50000])
    ap.add_argument("--dims", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--queries", type=int, default=50)
    ap.add_argument("--faiss", action="store_true", help="also time faiss (must import)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = [measure(size, dim, args.queries, rng, args.faiss) for size in args.sizes for dim in args.dims]
    for row in rows:
        print(row, file=sys.stderr)
    result = {"run": run_record([__file__] + sys.argv[1:]), "numpy": np.__version__, "k": 5,
              "excluded_window": 72, "rows": rows}
    write_result(result, args.out, device_name(), "_place_query")
    return 0


if __name__ == "__main__":
    sys.exit(main())
