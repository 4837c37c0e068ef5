"""Where and how a benchmark result was made, recorded in every result file.

Scripts in ``benchmarks/<group>/`` import it with ``benchmarks/`` put on ``sys.path``.

``run_record()`` gives the commit (``LINGBOT_COMMIT`` when set: the device tool's copy of
the tree may carry stale git metadata; else git's HEAD; else "unknown"), whether tracked
files differed from git's HEAD, the device, the command line and the UTC date.
"""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} (cuda)"
    except ImportError:  # pragma: no cover
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs (cpu)"


def run_record(argv: list[str] | None = None, device: str | None = None) -> dict:
    """``argv``: the script's path and arguments (default ``sys.argv``); ``device``: a name
    that replaces ``device_name()`` (e.g. a node's device, not this process's)."""
    head = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no") if head else None
    args = sys.argv if argv is None else argv
    return {"commit": os.environ.get("LINGBOT_COMMIT") or head or "unknown",
            "tracked_files_modified": None if dirty is None else bool(dirty),
            "device": device or device_name(),
            "command": " ".join(["python", os.path.relpath(args[0], REPO)] + list(args[1:])),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


RESULTS = REPO / "benchmarks" / "results"


def write_result(result: dict, out: Path | None, device_name: str, suffix: str = "") -> Path:
    """Print ``result`` as JSON and write it to ``out``, or to ``results/<device name><suffix>.json``
    (the name lower-cased, non-alphanumerics as ``_``); returns the path."""
    import json
    import re

    text = json.dumps(result, indent=2)
    print(text)
    path = out or RESULTS / f"{re.sub(r'[^A-Za-z0-9]+', '_', device_name).strip('_').lower()}{suffix}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return path
