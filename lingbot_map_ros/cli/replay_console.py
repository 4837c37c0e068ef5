"""What ``lingbot-map-replay`` tells its user on stderr: its name, its logger, the one-line
errors (``UserError``, an OSError in a few words), the progress bar and the log handler that
prints above it, the summary line of loop closure. (The lines about the outputs, ``.partial``
files kept, are ``replay_outputs``'.)
"""
from __future__ import annotations

import errno
import logging
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

PROG = "lingbot-map-replay"

# the command's one logger (all its modules write to it): main() shows its records above the bar
log = logging.getLogger("lingbot_map_ros.cli.replay")


class UserError(Exception):
    """A problem with the user's input, reported as one line."""


def describe_os_error(exc: BaseException, name_file: bool = True) -> str:
    """``exc`` in a few words: an OSError's strerror with its errno name (``No space left on
    device (ENOSPC)``) and the file it names (``name_file``), else its text."""
    if isinstance(exc, OSError) and exc.errno is not None and exc.strerror:
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        where = f": {exc.filename}" if exc.filename and name_file else ""
        return f"{exc.strerror} ({name}){where}"
    return " ".join(str(exc).split()) or type(exc).__name__


def say(args: argparse.Namespace, message: str) -> None:
    """An informational line on stderr (not with --quiet)."""
    if not args.quiet:
        print(message, file=sys.stderr, flush=True)


class StderrHandler(logging.Handler):
    """Writes this CLI's log records to the current ``sys.stderr``, above the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            try:
                from tqdm import tqdm

                tqdm.write(message, file=sys.stderr)
            except ImportError:
                print(message, file=sys.stderr, flush=True)
        except Exception:
            self.handleError(record)


class _NoBar:
    """Stands in for tqdm's bar when it is not installed or not wanted."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **kwargs) -> None:
        pass


@contextmanager
def progress_bar(total: int | None, quiet: bool):
    """tqdm's bar on stderr (frames/s, ETA; log lines printed above it), or a silent stand-in
    with --quiet or without tqdm."""
    try:
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm
    except ImportError:
        quiet = True
    if quiet:
        yield _NoBar()
        return
    with tqdm(total=total, unit="frame", desc="replay", file=sys.stderr, dynamic_ncols=True, mininterval=0.5,
              smoothing=0.05) as bar, logging_redirect_tqdm():
        yield bar


def loop_summary(stats) -> str:
    """The summary line of --loop-closure (``stats``: ``runtime.loop_closure.LoopStats``)."""
    last = f"; the last decision: {stats.last_reason}" if stats.last_reason else ""
    return (f"loop closure: {stats.keyframes} keyframes, {stats.candidates} candidates, {stats.accepted} accepted, "
            f"{stats.rejected} rejected{last}")


def explain(exc: BaseException) -> str:
    """The text of the error line for ``exc``, which ended the run."""
    from ..stream import CacheError

    if isinstance(exc, CacheError):
        return f"{exc} (the plain session ends at the model's horizon; drop --no-long-stream for long inputs)"
    if isinstance(exc, OSError):
        return describe_os_error(exc)
    return str(exc)
