"""What each journal compression costs and saves, per record, on this machine's CPU.

    python benchmarks/stream/journal_codecs.py [--frames 30] [--loop ../shared/data/loop] [--out F]

For each of ``journal.format.COMPRESSIONS`` (none, lz4, zlib level 1) it encodes the records a
518x378 stream journals — a stored frame (uint8 [378, 518, 3]: the loop's camera images
resized, and synthetic frames of the node benchmarks' kind: a gradient with noise) and a map
chunk (about 6,300 float32 points and their uint8 colours, as a frame of the map keeps after
voxel downsampling) — and reports the median encode time (the writer thread's CPU for that
record: compression and crc32) and bytes against raw. Decoding is timed too (a resume or a
load reads every record once). Prints and writes one JSON result (``provenance.write_result``);
asserts nothing. The loop images are read from ``--loop`` (skipped with a note when absent).
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
from lingbot_map_ros.journal.format import COMPRESSIONS, Record, encode_record, lz4_available  # noqa: E402
from provenance import device_name, run_record, write_result  # noqa: E402

H, W = 378, 518


def loop_frames(folder: Path, n: int) -> list[np.ndarray]:
    from PIL import Image

    files = sorted(p for p in folder.glob("*") if p.suffix.lower() in (".png", ".jpg", ".jpeg"))[:n]
    return [np.asarray(Image.open(p).convert("RGB").resize((W, H), Image.BILINEAR)) for p in files]


def synthetic_frames(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:H, 0:W]
    out = []
    for i in range(n):
        base = np.stack([(x + 3 * i) % 256, (y + 2 * i) % 256, ((x + y) // 2) % 256], -1)
        out.append(np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8))
    return out


def chunks(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [((rng.normal(size=(6300, 3)) * 2).astype(np.float32), rng.integers(0, 256, (6300, 3), dtype=np.uint8))
            for _ in range(n)]


def measure(records: list[Record], compression) -> dict:
    from lingbot_map_ros.journal.format import read_record
    import io

    enc, dec, sizes, raw = [], [], [], []
    for r in records:
        t0 = time.perf_counter()
        data = encode_record(r, compression)
        enc.append((time.perf_counter() - t0) * 1e3)
        sizes.append(len(data))
        raw.append(len(encode_record(r, "none")))
        f = io.BytesIO(data)
        t0 = time.perf_counter()
        read_record(f, 0)
        dec.append((time.perf_counter() - t0) * 1e3)
    return {"encode_ms_median": round(statistics.median(enc), 3), "decode_ms_median": round(statistics.median(dec), 3),
            "bytes_median": int(statistics.median(sizes)), "ratio_to_raw": round(sum(sizes) / sum(raw), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=30)
    ap.add_argument("--loop", type=Path, default=REPO.parent / "shared" / "data" / "loop")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not lz4_available():
        print("journal_codecs: the lz4 module is not installed; lz4 is left out", file=sys.stderr)
    sets = {"synthetic frame": [Record("frame", {"i": i}, {"image": im}) for i, im in
                                enumerate(synthetic_frames(args.frames))],
            "map chunk": [Record("chunk", {"i": i}, {"p": p, "c": c}) for i, (p, c) in enumerate(chunks(args.frames))]}
    notes = []
    if args.loop.is_dir():
        sets["loop frame"] = [Record("frame", {"i": i}, {"image": im}) for i, im in
                              enumerate(loop_frames(args.loop, args.frames))]
    else:
        notes.append(f"no loop images at {args.loop}: camera frames not measured")
    table = {}
    for name, records in sets.items():
        table[name] = {str(c): measure(records, c) for c in COMPRESSIONS if c != "lz4" or lz4_available()}
    result = {"run": run_record([__file__] + sys.argv[1:]), "resolution": [H, W], "records_per_set": args.frames,
              "what": "median per record: encode (compression + crc32, the writer thread's CPU), decode, bytes; "
                      "ratio: all bytes against raw", "results": table, "notes": notes}
    write_result(result, args.out, device_name(), "_journal_codecs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
