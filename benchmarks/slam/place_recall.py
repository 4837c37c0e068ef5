"""Place recognition with the classical descriptors (lingbot_map_ros/slam/descriptors.py) on the
120 real frames of ``../shared/data/loop``: do revisits find their place?

    python benchmarks/slam/place_recall.py [--loop ../shared/data/loop] [--revisits 40] [--window 30] [--out F]

Every frame goes into a ``PlaceDatabase`` in order. Then the first ``--revisits`` frames are
shown again as a camera coming back would see them: a small random crop (up to 6 % of each
side, resized back), a shift of up to 8 px, a brightness gain of 0.6–1.4 with an offset of ±20
levels, and JPEG recompression at quality 35–70 (seeded). Each revisit queries the database with
the current window (the last ``--window`` frames) excluded. A match within ``--tolerance``
frames of the source is right (neighbouring frames show the same place).

Two settings: ``same_view`` (the source frame is in the database) and ``neighbour_view`` (it is
left out, so the right place is a neighbour up to ``--tolerance`` frames away: a revisit from a
slightly different position).

Negatives: the last ``--window`` frames, perturbed the same way, whose own place is inside the
excluded window: whatever they match is wrong. Reported per descriptor: recall@1 and @5 of the
revisits; the similarity of the right place against the best place far from it (more than 10
frames away: how often it wins, the median margin); and at thresholds on the top-1 similarity,
precision (right matches among accepted revisits and negatives) and recall.

The model-token descriptor (``token_descriptor``) is not measured here: only random tiny weights
exist in this environment, whose tokens say nothing about places. Prints and writes one JSON
result (``provenance.write_result``); asserts nothing.
"""
from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from lingbot_map_ros.slam.descriptors import gradient_descriptor, thumbnail_descriptor  # noqa: E402
from lingbot_map_ros.slam.places import PlaceConfig, PlaceDatabase  # noqa: E402
from provenance import device_name, run_record, write_result  # noqa: E402

DESCRIPTORS = {"gradient_4x8x8": gradient_descriptor, "thumbnail_12x16": thumbnail_descriptor}
FAR = 10


def perturb(image: Image.Image, rng: np.random.Generator) -> np.ndarray:
    """A revisit's view of ``image`` (module text): uint8 [H, W, 3] of the same size."""
    w, h = image.size
    crop = rng.uniform(0, 0.06, 4) * np.array([w, h, w, h])
    box = (crop[0], crop[1], w - crop[2], h - crop[3])
    img = image.crop(tuple(int(round(v)) for v in box)).resize((w, h), Image.BICUBIC)
    dx, dy = rng.integers(-8, 9, 2)
    arr = np.asarray(img).astype(np.float64)
    arr = np.roll(arr, (int(dy), int(dx)), axis=(0, 1))
    arr = np.clip(arr * rng.uniform(0.6, 1.4) + rng.uniform(-20, 20), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=int(rng.integers(35, 71)))
    return np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))


def evaluate(describe, frames, revisits, negatives, window: range, tolerance: int, leave_out: bool) -> dict:
    start = time.perf_counter()
    base = [describe(np.asarray(f)) for f in frames]
    per_frame_ms = 1e3 * (time.perf_counter() - start) / len(frames)
    db = PlaceDatabase(PlaceConfig(base[0].size))
    for i, d in enumerate(base):
        db.add(i, d)
    top1, top5, wins, margins, scored = 0, 0, 0, [], []
    for source, image in revisits:
        q = describe(image)
        exclude = set(window) | ({source} if leave_out else set())
        hits = db.query(q, k=5, exclude=exclude)
        right = [abs(i - source) <= tolerance for i, _ in hits]
        top1 += right[0]
        top5 += any(right)
        scored.append((hits[0][1], right[0]))
        sims = {i: s for i, s in db.query(q, k=len(frames), exclude=exclude)}
        best_right = max(s for i, s in sims.items() if abs(i - source) <= tolerance)
        best_far = max(s for i, s in sims.items() if abs(i - source) > FAR)
        wins += best_right > best_far
        margins.append(best_right - best_far)
    for _, image in negatives:
        scored.append((db.query(describe(image), k=1, exclude=window)[0][1], False))
    n = len(revisits)
    curve = []
    for threshold in np.quantile([s for s, _ in scored], np.linspace(0, 0.95, 20)):
        accepted = [ok for s, ok in scored if s >= threshold]
        correct = sum(accepted)
        curve.append({"threshold": round(float(threshold), 4), "accepted": len(accepted),
                      "precision": round(correct / len(accepted), 3) if accepted else None,
                      "recall": round(correct / n, 3)})
    return {"dim": int(base[0].size), "describe_ms_per_frame": round(per_frame_ms, 2),
            "recall_at_1": round(top1 / n, 3), "recall_at_5": round(top5 / n, 3),
            "right_beats_far_fraction": round(wins / n, 3), "margin_median": round(float(np.median(margins)), 4),
            "precision_recall": curve}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loop", type=Path, default=REPO.parent / "shared" / "data" / "loop")
    ap.add_argument("--revisits", type=int, default=40)
    ap.add_argument("--window", type=int, default=30)
    ap.add_argument("--tolerance", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    paths = sorted(args.loop.glob("*.jpg"))
    if not paths:
        print(f"no frames in {args.loop}", file=sys.stderr)
        return 1
    frames = [Image.open(p).convert("RGB") for p in paths]
    rng = np.random.default_rng(args.seed)
    n = len(frames)
    window = range(n - args.window, n)
    revisits = [(i, perturb(frames[i], rng)) for i in range(args.revisits)]
    negatives = [(i, perturb(frames[i], rng)) for i in window]
    results = {name: {setting: evaluate(fn, frames, revisits, negatives, window, args.tolerance, leave_out)
                      for setting, leave_out in (("same_view", False), ("neighbour_view", True))}
               for name, fn in DESCRIPTORS.items()}
    result = {"run": run_record([__file__] + sys.argv[1:]), "frames": n, "frame_size": list(frames[0].size),
              "revisits": args.revisits, "negatives": len(negatives), "excluded_window": args.window,
              "tolerance_frames": args.tolerance, "far_frames": FAR, "descriptors": results,
              "token_descriptor": "not measured: only random tiny weights exist here, their tokens carry no "
                                  "place information"}
    write_result(result, args.out, device_name(), "_place_recall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
