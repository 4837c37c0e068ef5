"""Stand-ins for what the node hands an ``InferenceEngine``: a recording output ``Sink`` and a
recording ``Log`` (not a test module; test/ is on sys.path, see conftest.py)."""
from __future__ import annotations


class Sink:
    """Records published frames (clouds filled into the frame they belong to), paths and statuses;
    ``wants`` names the optional outputs it listens to."""

    def __init__(self, wants=("points", "depth")) -> None:
        self.frames, self.statuses, self.paths = [], [], []
        self.path_entries, self.corrections = [], None  # the last path handed over and its corrections
        self._wants = set(wants)

    def wants(self, output):
        return output in self._wants

    def publish_frame(self, out):
        self.frames.append(out)

    def publish_clouds(self, out):  # fill in the clouds of the frame published before
        match = [i for i, o in enumerate(self.frames) if o.frame_index == out.frame_index and o.stamp == out.stamp]
        assert match, "clouds of a frame whose pose was not published"
        self.frames[match[-1]] = out

    def publish_path(self, entries, transform=None, corrections=None):
        self.paths.append([e.frame_index for e in entries])
        self.path_entries, self.corrections = list(entries), corrections

    def publish_status(self, status, stamp):
        self.statuses.append((status, stamp))

    def publish_frame_info(self, info, out):
        pass

    def configure(self, settings):
        self.settings = settings


class Log:
    """Records (level, message) lines."""

    def __init__(self) -> None:
        self.lines = []

    def debug(self, m):
        self.lines.append(("debug", m))

    def info(self, m):
        self.lines.append(("info", m))

    def warning(self, m):
        self.lines.append(("warning", m))

    def error(self, m):
        self.lines.append(("error", m))


def drain(scheduler, max_items: int = 10_000) -> int:
    """Run the scheduler's turns on this thread until a pass finds no work (the step in flight is
    finished too); returns the number of items run."""
    count = 0
    while count < max_items and scheduler.run_turn() is not None:
        count += 1
    scheduler.finish_in_flight()
    return count
