"""What ``lingbot-map-fleet`` shows while it runs and when it ends.

- On a terminal: one overall bar (inputs finished) and one bar per running input (frames
  done, frames/s, ETA when the input's length is known), drawn by tqdm on stderr from the
  tasks' ``progress.json`` files; a line above the bars for each input that ends.
- Anywhere else (a log file, CI): no bars, one plain line per input that ends.
- ``--quiet``: nothing until the summary.
- At the end: a table on stdout (input, frames, FPS, status, reason) and the summary JSON.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

from .fleet_task import PROGRESS_NAME, WORK, InputResult, read_json

PROG = "lingbot-map-fleet"


def describe(result: InputResult) -> str:
    """One line about an input that ended."""
    if result.status == "failed":
        return f"{result.name}: failed: {result.reason}"
    text = f"{result.name}: {result.status}, {result.frames} frames, {result.fps:.1f} FPS"
    if result.resumed_from:
        text += f", resumed at frame {result.resumed_from}"
    if result.attempts > 1:
        text += f", {result.attempts} attempts"
    return text


class Display:
    """Progress of ``total`` inputs on ``stream`` (see the module docstring)."""

    def __init__(self, total: int, quiet: bool, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total, self.quiet, self.ended = total, quiet, 0
        self.tqdm = None
        if not quiet and self.stream.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            self.tqdm = tqdm
        self.overall = None if self.tqdm is None else self.tqdm(
            total=total, desc="inputs", unit="input", file=self.stream, position=0, dynamic_ncols=True)
        self.bars: dict[str, Any] = {}  # name -> its bar while it runs

    def ended_input(self, result: InputResult) -> None:
        """An input ended (or was skipped, or failed before it ran)."""
        self.ended += 1
        bar = self.bars.pop(result.name, None)
        if bar is not None:
            bar.close()
        line = f"{PROG}: [{self.ended}/{self.total}] {describe(result)}"
        if self.overall is not None:
            self.tqdm.write(line, file=self.stream)
            self.overall.update(1)
        elif not self.quiet:
            print(line, file=self.stream, flush=True)

    def running(self, folders: dict[str, Path], run_id: str) -> None:
        """Redraw the bars of the inputs whose tasks report progress for this run."""
        if self.overall is None:
            return
        for name, folder in folders.items():
            progress = read_json(folder / WORK / PROGRESS_NAME)
            if progress is None or progress.get("run_id") != run_id:
                continue  # queued, or starting
            bar = self.bars.get(name)
            if bar is None:  # the first line below the overall bar that no running input holds
                taken = {abs(b.pos) for b in self.bars.values()}  # (tqdm keeps a given position negated)
                line = next(n for n in range(1, len(self.bars) + 2) if n not in taken)
                bar = self.bars[name] = self.tqdm(total=progress.get("expected"), desc=name, unit="frame",
                                                  file=self.stream, position=line, leave=False, dynamic_ncols=True)
            bar.total = progress.get("expected")
            bar.update(int(progress["frames"]) - bar.n)
            bar.set_postfix_str(f"{progress['stage']}, attempt {progress['attempt']}", refresh=True)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
        if self.overall is not None:
            self.overall.close()


def table(results: list[InputResult]) -> str:
    """The summary as a plain-text table."""
    rows = [("input", "frames", "FPS", "status", "reason")]
    for r in results:
        reason = r.reason or (f"resumed at frame {r.resumed_from}" if r.resumed_from else "")
        rows.append((r.name, str(r.frames), f"{r.fps:.1f}", r.status, reason))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0]), row[1].rjust(widths[1]), row[2].rjust(widths[2]), row[3].ljust(widths[3])]
        lines.append("  ".join(cells + [row[4]]).rstrip())
    return "\n".join(lines)


def counts(results: list[InputResult]) -> dict[str, int]:
    out = {"ok": 0, "skipped": 0, "failed": 0}
    for r in results:
        out[r.status] += 1
    return out


def summary(results: list[InputResult], command: list[str], root: Path, extra: dict[str, Any]) -> bytes:
    """The summary JSON: the command, the output root, the counts and each input's result."""
    data = {"command": command, "output_root": str(root), "counts": counts(results), **extra,
            "inputs": [{**asdict(r), "folder": str(root / r.name)} for r in results]}
    return (json.dumps(data, indent=1) + "\n").encode()
