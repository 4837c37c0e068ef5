"""Compare two node_latency JSONs: a run without and one with the keyframe selector in the loop.

    python benchmarks/node/node_latency_compare.py node_latency_518x378.json node_latency_518x378_selector.json

Prints one line (``node_latency: COMPARE ...``): latency median/p95/max (image stamp -> pose
received, ms), output rate, processed/published and stale drops of each, their differences,
and the decision round trip of the second (see lingbot_map_ros/cli/demo_selector.py).
Exit status 1 with one line when a file is missing, is not such a JSON, or the second run
had no selector.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
        data["latency_ms"], data["frames"], data["output_rate_hz"]  # noqa: B018 - the keys this needs
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"node_latency_compare: {path}: not a node_latency result ({type(exc).__name__}: {exc})")
    return data


def _diff(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None else f"{b - a:+.2f}"


def compare(plain: dict, with_selector: dict) -> str:
    """The COMPARE line for ``plain`` (no selector) and ``with_selector``."""
    dec = with_selector.get("decisions")
    if not dec:
        raise SystemExit("node_latency_compare: the second file has no 'decisions': not a --keyframe-selector run")
    a, b = plain["latency_ms"], with_selector["latency_ms"]
    fa, fb = plain["frames"], with_selector["frames"]
    size = "x".join(map(str, with_selector["setting"]["frame_size"]))
    rt, n = dec["round_trip_ms"], dec["node"]
    median, p95 = _diff(a.get("median"), b.get("median")), _diff(a.get("p95"), b.get("p95"))
    return (f"node_latency: COMPARE {size} at {with_selector['setting']['rate_hz']} Hz, without -> with the keyframe "
            f"selector: latency median {a.get('median')} -> {b.get('median')} ms ({median}), "
            f"p95 {a.get('p95')} -> {b.get('p95')} ({p95}), max {a.get('max')} -> "
            f"{b.get('max')}; output {plain['output_rate_hz']} -> {with_selector['output_rate_hz']} Hz; processed/"
            f"published {fa['processed']}/{fa['published']} -> {fb['processed']}/{fb['published']}, stale "
            f"{fa['dropped_stale']} -> {fb['dropped_stale']}; decision round trip median {rt.get('median')} ms, "
            f"p95 {rt.get('p95')} (n {rt['n']}); decisions kept {n['kept']}, dropped {n['dropped']}, timed out "
            f"{n['timed_out']}, refused {n['refused']}; frames behind a hold {dec['hold_waits']['frames']}")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    print(compare(_load(argv[0]), _load(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
