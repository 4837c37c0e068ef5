"""One input of ``lingbot-map-fleet``, run where Ray placed it: ``run_input(plan)``.

The input is replayed in segments of ``segment_frames`` frames, each one call of the replay's
``main(argv)`` in this process, with ``--max-frames`` the segment's length and
``--save-session`` its own journal folder; every segment after the first resumes from the
previous one's journal (``--resume``), so the model's state, the poses and the frame
numbering go on as in one uninterrupted replay. A segment's outputs are complete files
(the replay writes them atomically); once it has returned, the input's state file records
it, and the previous journal is removed.

A worker killed mid-input (SIGKILL, out of memory, a node lost) is retried by Ray: the new
attempt reads the state file, drops what the unfinished segment left, and resumes from the
last finished segment's journal, losing at most one segment's work. When the input ends,
the segments' outputs become the final files (``fleet_merge``), the last journal becomes
``session/``, and ``result.json``, written atomically last, marks the input complete: a
second run of the same command skips it.

Layout of an input's folder ``<output root>/<name>/``::

    trajectory.tum  map.ply  results/  predictions.npz   the outputs asked for
    session/journal.lbj                                  the final journal (``--resume``, ``load_session``)
    result.json                                          written last: the input is complete
    .fleet/                                              work, removed at the end: state.json,
                                                         progress.json, replay.log, part-*/, session-*/
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shutil
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..io.atomic import atomic_write
from .fleet_inputs import FleetInput, ReplayFlags, check_flags, pick_topic
from .fleet_merge import OUTPUTS, finish
from .fleet_replay import ReplayLog, log_to_current_stderr, models_kept, replay_main

WORK, RESULT_NAME, STATE_NAME, PROGRESS_NAME = ".fleet", "result.json", "state.json", "progress.json"
SESSION_NAME = "session"
PROGRESS_EVERY_S = 0.5  # progress.json is rewritten at most this often
_ENDED = "only 0 frame(s) reached the model"  # the replay's error for a resumed segment past the input's end
_KIND_FLAG = {"images": "--images", "bag": "--bag", "video": "--video"}


@dataclass(frozen=True)
class TaskPlan:
    """What a task needs (sent to the worker): the input, its folder ``<root>/<name>``, the outputs
    (``fleet_merge.OUTPUTS`` keys), frames per segment, the device ("cuda": the GPU Ray assigned,
    or "cpu"), torch's CPU threads, the command's run id, and the fingerprint of the outputs."""

    item: FleetInput
    folder: Path
    outputs: tuple[str, ...]
    segment_frames: int
    device: str
    threads: int
    run_id: str
    fingerprint: dict[str, Any]

    def __post_init__(self) -> None:
        if self.segment_frames < 1:
            raise ValueError(f"segment_frames must be at least 1, got {self.segment_frames}")
        unknown = [o for o in self.outputs if o not in OUTPUTS]
        if unknown or not self.outputs:
            raise ValueError(f"outputs must be some of {', '.join(OUTPUTS)}, got {self.outputs}")


@dataclass(frozen=True)
class InputResult:
    """How one input ended: status ``ok``, ``skipped`` (complete before this run) or ``failed``
    (``reason``); frames replayed; FPS over the segments' wall time (model start and journal
    rebuild included); attempts (this input's task starts, over every run of the command);
    resumed_from: frames already done when the last attempt started."""

    name: str
    input: str
    status: str
    frames: int = 0
    fps: float = 0.0
    seconds: float = 0.0
    attempts: int = 0
    resumed_from: int = 0
    dropped: int = 0
    reason: str = ""
    outputs: tuple[str, ...] = ()


def fingerprint(item: FleetInput, outputs: tuple[str, ...]) -> dict[str, Any]:
    """What an input's outputs depend on: the input, its replay flags, the outputs, and the size and
    modification time of the checkpoint and model configuration files (one replaced in place)."""
    flags = check_flags(list(item.flags), item.origin)
    return {"input": str(item.source), "kind": item.kind, "flags": list(item.flags), "outputs": sorted(outputs),
            "checkpoint": _file_identity(flags.checkpoint), "model_config": _file_identity(flags.model_config)}


def _file_identity(path: str | None) -> list | None:
    if not path or not os.path.isfile(path):
        return None  # random weights, the released configuration, or a hub id
    st = os.stat(path)
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns]


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: Path, data: dict[str, Any]) -> None:
    """``data`` as JSON, crash-safely (``io.atomic``)."""
    text = json.dumps(data, indent=1, sort_keys=True).encode()
    atomic_write(path, lambda f: f.write(text))


def run_input(plan: TaskPlan) -> InputResult:
    """Replay one input into ``plan.folder`` (see the module docstring); never raises for the
    input's own problems: they come back as a failed result with the reason."""
    log_to_current_stderr()
    done = read_json(plan.folder / RESULT_NAME)
    if done is not None and done.get("status") == "ok" and done.get("fingerprint") == plan.fingerprint:
        return InputResult(**{**_result_fields(done), "status": "skipped"})  # completed since the command started
    work = plan.folder / WORK
    try:
        work.mkdir(parents=True, exist_ok=True)
        lock = open(work / "lock", "a")
    except OSError as exc:
        return failed(plan.item, f"cannot write into {plan.folder}: {exc.strerror or exc}")
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        return failed(plan.item, f"another lingbot-map-fleet run is working on {plan.folder} (its {work}/lock is held)")
    try:
        return _Task(plan, work).run()
    except Exception as exc:  # a bug or an OS failure outside the replay: the reason, the trace in the log
        with contextlib.suppress(OSError), open(work / "replay.log", "a") as f:
            traceback.print_exc(file=f)
        return failed(plan.item, f"unexpected error: {type(exc).__name__}: {exc} (trace in {work / 'replay.log'})")
    finally:
        lock.close()


def failed(item: FleetInput, reason: str, **counts) -> InputResult:
    """A failed result of ``item`` with ``reason`` (on one line)."""
    return InputResult(item.name, str(item.source), "failed", reason=" ".join(reason.split()), **counts)


class _Task:
    """The segments of one input, resumed from its state file (see the module docstring)."""

    def __init__(self, plan: TaskPlan, work: Path) -> None:
        self.plan, self.work = plan, work
        self.flags: ReplayFlags = check_flags(list(plan.item.flags), plan.item.origin)
        self.state: dict[str, Any] = {}
        self.log = ReplayLog(work / "replay.log")
        self.expected: int | None = None
        self.scale_frames = 1
        self._progress_at = 0.0
        self._started = time.monotonic()
        self._start_frames = 0

    def run(self) -> InputResult:
        refused = self._load_state()
        if refused:
            return failed(self.plan.item, refused)
        self.state["attempts"] += 1
        write_json(self.work / STATE_NAME, self.state)
        self._start_frames = self.frames
        try:
            base = self._base_argv()
        except ValueError as exc:
            return failed(self.plan.item, str(exc), attempts=self.state["attempts"])
        self._probe(base)
        with self.log, models_kept():
            while not self.state["complete"]:
                problem = self._segment(base)
                if problem:
                    return failed(self.plan.item, problem, attempts=self.state["attempts"], frames=self.frames,
                                  resumed_from=self._start_frames)
        return self._finish()

    @property
    def frames(self) -> int:
        return sum(s["frames"] for s in self.state["segments"])

    def _load_state(self) -> str:
        """Read (or start) the state file; the reason when this input's work cannot be continued."""
        state = read_json(self.work / STATE_NAME)
        other = state is not None and (state.get("fingerprint") != self.plan.fingerprint
                                       or state.get("device") != self.plan.device)
        if other and not state.get("segments"):
            state = None  # another run's, but nothing of it finished (a failed first segment): start again
        if state is None:
            existing = [self.plan.folder / OUTPUTS[o][1] for o in self.plan.outputs]
            existing = [p for p in existing + [self.plan.folder / SESSION_NAME] if os.path.lexists(p)]
            if existing:
                return (f"{existing[0]} exists already and this run did not write it; the fleet replaces only "
                        "its own outputs (move it away, or choose another --output-root)")
            state = {"fingerprint": self.plan.fingerprint, "device": self.plan.device, "attempts": 0,
                     "segments": [], "complete": False}
        elif other:
            return (f"{self.work} holds an unfinished run of other flags, outputs or device ({state.get('device')}); "
                    f"delete {self.work} to replay this input from its start")
        self.state = state
        return ""

    def _base_argv(self) -> list[str]:
        item, flags = self.plan.item, self.flags
        argv = [_KIND_FLAG[item.kind], str(item.source), *item.flags]
        if item.kind == "bag" and not flags.has_topic:
            argv += ["--topic", self.state.get("topic") or pick_topic(item.source)]
            self.state["topic"] = argv[-1]
        argv += ["--device", self.plan.device, "-q"]
        return argv if flags.threads else argv + ["--threads", str(self.plan.threads)]

    def _probe(self, base: list[str]) -> None:
        """The scale frames and the input's frames (for the ETA), from the replay's own checks;
        when they fail, the first segment reports why."""
        from .replay import open_source
        from .replay_args import build_parser, configure

        try:
            args = build_parser().parse_args([*base, "--save-session", str(self.work / "probe")])
            settings = configure(args)
            self.scale_frames = settings.stream.num_scale_frames
            expected = open_source(args, settings).expected_frames()
        except (Exception, SystemExit):  # noqa: BLE001 - any problem is the first segment's to report
            return
        if expected is not None and self.flags.max_frames:
            expected = min(expected, self.flags.max_frames)
        self.expected = expected

    def _length(self) -> int:
        """Frames of the next segment: a multiple of --save-depth's K (depth rows stay aligned), at
        least the scale frames, and the rest of a --max-frames run when less would remain than those."""
        k = max(1, self.flags.depth_every)
        n = math.ceil(max(self.plan.segment_frames, self.scale_frames) / k) * k
        if self.flags.max_frames is None:
            return n
        left = self.flags.max_frames - self.frames
        return left if left - n < self.scale_frames else n

    def _segment(self, base: list[str]) -> str:
        """Run the next segment; "" when it went well (or the input had ended), else the reason."""
        k = len(self.state["segments"])
        part, session = self.work / f"part-{k:04d}", self.work / f"session-{k:04d}"
        for leftover in (part, session):
            shutil.rmtree(leftover, ignore_errors=True)  # what a killed attempt left
        part.mkdir()
        take = self._length()
        argv = [*base, *[a for o in self.plan.outputs for a in (OUTPUTS[o][0], str(part / OUTPUTS[o][1]))],
                "--max-frames", str(take), "--save-session", str(session)]
        if k:
            argv += ["--resume", str(self.work / f"session-{k - 1:04d}")]
        before, start = self.frames, time.monotonic()
        count = [0]

        def observer(n: int) -> None:
            count[0] = n
            self._progress(before + n)

        self._progress(before, force=True)
        rc = replay_main(argv, observer, self.log)
        if rc != 0:
            if k and count[0] == 0 and _ENDED in self.log.error:  # the input ended with the last segment
                self.state["complete"] = True
                write_json(self.work / STATE_NAME, self.state)
                return ""
            return self.log.error or f"lingbot-map-replay ended with exit status {rc}"
        self.state["segments"].append({"frames": count[0], "dropped": self.log.dropped,
                                       "seconds": round(time.monotonic() - start, 3)})
        self.state["complete"] = count[0] < take or (self.flags.max_frames or 0) == self.frames
        write_json(self.work / STATE_NAME, self.state)
        if k:
            shutil.rmtree(self.work / f"session-{k - 1:04d}", ignore_errors=True)
        return ""

    def _progress(self, frames: int, force: bool = False, stage: str = "running") -> None:
        now = time.monotonic()
        if not force and now - self._progress_at < PROGRESS_EVERY_S:
            return
        self._progress_at = now
        elapsed = now - self._started
        fps = (frames - self._start_frames) / elapsed if elapsed > 0 else 0.0
        data = {"run_id": self.plan.run_id, "pid": os.getpid(), "frames": frames, "expected": self.expected,
                "fps": round(fps, 3), "attempt": self.state["attempts"], "resumed_from": self._start_frames,
                "stage": stage}
        with contextlib.suppress(OSError):  # progress is a convenience: a failed write is not the input's failure
            _write_quick(self.work / PROGRESS_NAME, data)

    def _finish(self) -> InputResult:
        """The final outputs and session, then ``result.json`` (last), then the work folder goes."""
        folder, segments = self.plan.folder, self.state["segments"]
        self._progress(self.frames, force=True, stage="merging")
        parts = [self.work / f"part-{i:04d}" for i in range(len(segments))]
        written: list[Path] = []
        for output in self.plan.outputs:
            written += finish(output, parts, folder, self.flags.chunk_frames, self.flags.path_rate,
                              self.flags.path_length)
        last = self.work / f"session-{len(segments) - 1:04d}"
        if last.is_dir():
            if os.path.lexists(folder / SESSION_NAME):
                shutil.rmtree(folder / SESSION_NAME)
            os.replace(last, folder / SESSION_NAME)
        seconds = sum(s["seconds"] for s in segments)
        result = InputResult(self.plan.item.name, str(self.plan.item.source), "ok", self.frames,
                             round(self.frames / seconds, 3) if seconds > 0 else 0.0, round(seconds, 3),
                             self.state["attempts"], self._start_frames, sum(s["dropped"] for s in segments),
                             outputs=tuple(str(p) for p in written))
        write_json(folder / RESULT_NAME, {**asdict(result), "fingerprint": self.plan.fingerprint,
                                          "finished_unix": time.time()})
        shutil.rmtree(self.work, ignore_errors=True)
        return result


def _result_fields(data: dict[str, Any]) -> dict[str, Any]:
    """The InputResult fields of a ``result.json``."""
    fields = {k: data[k] for k in InputResult.__dataclass_fields__ if k in data}
    fields["outputs"] = tuple(fields.get("outputs", ()))
    return fields


def _write_quick(path: Path, data: dict[str, Any]) -> None:
    """``data`` as JSON through a temp file and a rename (no fsync: progress is not kept)."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_text(json.dumps(data))
    os.replace(temp, path)
