"""How a fleet task calls ``lingbot-map-replay``: its ``main(argv)`` in the task's process,
with its stderr captured into the input's log (``ReplayLog``: the error line and the
dropped frames are kept for the result), the model loaded once for all the segments of a
task (``models_kept``), and the worker's library warnings in the same log.
"""
from __future__ import annotations

import contextlib
import logging
import re
import sys
from pathlib import Path
from typing import Any

ERROR_PREFIX = "lingbot-map-replay: error: "
_SUMMARY = re.compile(r"(\d+) frames in [\d.]+ s \([\d.]+ FPS\), (\d+) dropped")
model_loads = 0  # models loaded by tasks of this process (the tests check that segments share one)


def replay_main(argv: list[str], observer, capture: ReplayLog) -> int:
    """The replay's ``main(argv)`` with its stderr in ``capture``; its exit status (argparse's too)."""
    from .replay import main

    capture.begin()
    with contextlib.redirect_stderr(capture):
        try:
            return main(argv, observer)
        except SystemExit as exc:  # argparse's exit on a bad flag (its error line is in the capture)
            return exc.code if isinstance(exc.code, int) else 2


class ReplayLog:
    """The replay's stderr: appended to ``path``; its last error line (without the prefix) and
    the dropped frames of its summary line are kept for the result."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = None
        self.error, self.dropped, self._line = "", 0, ""

    def __enter__(self) -> "ReplayLog":
        self.file = open(self.path, "a", encoding="utf-8", errors="replace")
        return self

    def __exit__(self, *exc_info) -> None:
        self.file.close()

    def begin(self) -> None:
        self.error, self.dropped = "", 0

    def write(self, text: str) -> int:
        self.file.write(text)
        self._line += text
        *lines, self._line = self._line.split("\n")
        for line in lines:
            if line.startswith(ERROR_PREFIX):
                self.error = line[len(ERROR_PREFIX):]
            summary = _SUMMARY.search(line)
            if summary:
                self.dropped = int(summary.group(2))
        return len(text)

    def flush(self) -> None:
        self.file.flush()

    def isatty(self) -> bool:
        return False


@contextlib.contextmanager
def models_kept():
    """Within a task, every segment's replay gets the model the first one loaded (same
    configuration, checkpoint, device and dtype: the segments share their flags), instead of
    loading it again: the replay loads through ``io.checkpoint.load_model``, looked up when it runs.
    Sessions never change a model they share (``stream.session``)."""
    from ..io import checkpoint

    original = checkpoint.load_model
    kept: dict[str, Any] = {}

    def load_model(cfg, path=None, device="cpu", dtype="fp32", seed=0):
        global model_loads
        key = repr((cfg, str(path), str(device), dtype, seed))
        if key not in kept:
            kept.clear()
            kept[key] = original(cfg, path, device, dtype, seed=seed)
            model_loads += 1
        return kept[key]

    checkpoint.load_model = load_model
    try:
        yield
    finally:
        checkpoint.load_model = original


class _CurrentStderr(logging.Handler):
    """Writes records to whatever ``sys.stderr`` is now (a segment's log while a replay runs)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)


def log_to_current_stderr() -> None:
    """The root logger of a worker process writes to the current stderr (once per process), so the
    replay's library warnings land in the input's replay.log."""
    root = logging.getLogger()
    if not root.handlers:
        handler = _CurrentStderr(logging.WARNING)
        handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
        root.addHandler(handler)
