"""lingbot-map-replay: stream recorded frames through the model and save what it predicts.

    lingbot-map-replay --images DIR               --out predictions.npz [options]
    lingbot-map-replay --bag PATH --topic TOPIC   --out predictions.npz --out-bag results [options]
    lingbot-map-replay --video FILE               --trajectory traj.tum --ply cloud.ply [options]

Inputs: a folder of images (sorted by name); a rosbag2 (sqlite3 or MCAP storage) or
ROS 1 bag topic of sensor_msgs/Image or sensor_msgs/CompressedImage, read without a
ROS install; a video file (PyAV). Frames are decoded one at a time on a prefetch
thread, never all in memory; --start, --duration, --stride and --max-frames choose
which (see ``io.sources``).

Outputs, written as the frames come (each gets its final name only when complete;
until then, or after a failure, ``<name>.partial``). An output that exists already is
refused before the model loads, unless --overwrite (then it is replaced only when the
new one is complete); so is an output folder that cannot be written:

- --out: npz with pose_enc [S,9], pose_c2w [S,4,4] (camera-to-world, OpenCV axes,
  world = first camera, model units), intrinsics [S,3,3], is_keyframe [S],
  stamp_ns [S], window [S]; depth and depth_conf [D,H,W] for the frames --save-depth
  keeps (rows depth_frames [D]), in the npz for short runs and in one npz per
  --chunk-frames frames beside it for long ones (``io.results.load_predictions``);
- --trajectory (TUM) and --ply (points with confidence > --conf-threshold, every
  --point-stride-th), in the same OpenCV world;
- --out-bag: a rosbag2 (MCAP) of the node's outputs in the REP-103 map frame
  (``io.results_bag``);
- with --loop-closure: --trajectory is the optimised trajectory, written when the run ends
  (the loop closer's corrections are final only then), and the raw one streams beside it as
  ``<stem>_raw<suffix>``; both TUM, one row per frame, the same stamps (``replay_loop``).

By default the frames go through the long-stream session as in the node (window
restarts aligned by a Sim(3), so any length works); --no-long-stream runs the plain
session (up to the model's horizon). Either way frame t+1 is submitted before frame t's
results are taken (the GPU stays busy while the host writes); with --loop-closure, a loop
candidate is verified by the model between two frames, after the frame in flight is taken. A
progress bar (frames/s, ETA, window) and one summary line (and one of loop closure) go to
stderr. Any input problem ends with one line ``lingbot-map-replay: error: ...`` and exit
status 2; undecodable frames of a bag or a video are skipped, counted and warned about
(--bad-frames). So does an output that cannot be written (a full or read-only disk, at any
point up to the final rename): the line names the outputs written, those not written and the
``.partial`` files kept (``incomplete`` where even those could not be finished).

This module opens the source and the session and drives the run; the flags and their checks
are ``replay_args``, the outputs ``replay_outputs``, what is said on stderr ``replay_console``,
loop closure ``replay_loop``.
"""
from __future__ import annotations

import argparse
import logging
import resource
import sys
import time
from collections import deque
from dataclasses import replace
from typing import Callable

from .replay_args import Settings, build_parser, configure
from .replay_console import PROG, StderrHandler, UserError, explain, log, loop_summary, progress_bar, say
from .replay_outputs import FrameMeta, OutputError, Outputs, close_failure, with_partial

MAX_SHOWN_BAD_FRAMES = 10  # warnings for the first bad frames; later ones are only counted


def open_source(args: argparse.Namespace, settings: Settings):
    from ..io.sources import BagSource, ImageFolderSource, SourceError, VideoSource

    try:
        if args.images is not None:
            source = ImageFolderSource(args.images, settings.selection)
        elif args.bag is not None:
            source = BagSource(args.bag, args.topic, settings.selection, args.topic_type)
        else:
            source = VideoSource(args.video, settings.selection)
    except SourceError as exc:
        raise UserError(str(exc)) from None
    s0 = settings.stream.num_scale_frames
    if args.images is not None:
        n = source.expected_frames()
        n = min(n, args.max_frames) if args.max_frames else n
        if n < s0:
            raise UserError(f"{n} image(s) in {args.images}, fewer than the {s0} scale frames the model needs")
    return source


class Replay:
    """Feeds the source's frames to the session and the results to the outputs."""

    def __init__(self, args: argparse.Namespace, settings: Settings, session, outputs: Outputs,
                 observer: Callable[[int], None] | None = None, resume_after: int = -1, loop=None) -> None:
        self.args, self.settings, self.session, self.outputs = args, settings, session, outputs
        self.observer = observer
        self.loop = loop  # replay_loop.ReplayLoop with --loop-closure
        self.pending: deque[FrameMeta] = deque()  # pushed frames whose results have not come yet
        self.pushed = self.done = self.dropped = 0
        self.first_problem: str | None = None
        self._waiting = None  # the pending results of the frame submitted last
        self.bar = None
        self._postfix: tuple[int, int] | None = None
        # the input's frames are numbered (tags, journaled); --resume skips those up to this one
        self.skip_until = resume_after
        self.ordinal = -1

    def run(self, source) -> None:
        from ..io.preprocess import model_input
        from ..io.sources import Prefetcher

        width = self.settings.width
        total = source.expected_frames()
        if total is not None and self.args.max_frames:
            total = min(total, self.args.max_frames)
        with progress_bar(total, self.args.quiet) as self.bar, \
                Prefetcher(source.frames, lambda rgb: model_input(rgb, width)) as frames:
            try:
                for frame, image in frames:
                    self.ordinal += 1
                    if self.ordinal <= self.skip_until:
                        continue  # in the resumed journal already
                    if image is None:
                        self._bad(frame.error or f"{frame.name}: no image")
                        continue
                    self._push(image, FrameMeta(frame.stamp_ns, frame.camera_frame, frame.name))
                    if self.args.max_frames and self.pushed >= self.args.max_frames:
                        break
            except BaseException:  # the frame submitted last is complete: it is written before the error
                self._drain_after_failure()
                raise
            self._drain()

    def _push(self, image, meta: FrameMeta) -> None:
        """Submit a frame, then take the previous one's results (the model runs this one meanwhile)."""
        from ..stream.errors import InvalidFrameError

        if self.loop is not None:  # the keyframes taken go to the loop closer; a candidate's check may take
            self.loop.between_frames(self._drain)  # the frame in flight first (the model runs the candidate)
        try:
            submitted = self.session.submit(image, stamp=meta.stamp_ns, tag={"n": self.ordinal})
        except InvalidFrameError as exc:  # size differs from the sequence's, too small: nothing changed
            self._bad(f"{meta.name}: {exc}")
            return
        self.pushed += 1
        # a restart happens inside submit, so the window is the frame's own
        self.pending.append(replace(meta, window=self.session.window_index))
        previous, self._waiting = self._waiting, submitted
        if previous is not None:
            self._take(self.session.results(previous))

    def _drain(self) -> None:
        """Write the results of the frame submitted last, if any."""
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            self._take(self.session.results(waiting))

    def _drain_after_failure(self) -> None:
        try:
            self._drain()
        except OutputError:  # another output failed too (a full disk): its .partial says how far it got
            pass
        except Exception as exc:  # the first failure is the one reported
            log.warning("the results of the last submitted frame are lost: %s", exc)

    def _take(self, results) -> None:
        for r in results:
            meta = self.pending.popleft()
            self.outputs.add(r, meta)
            if self.loop is not None:
                self.loop.take(r, meta.stamp_ns / 1e9)
            self.done += 1
            if self.observer is not None:
                self.observer(self.done)
            self.bar.update(1)
            self._show(meta.window)

    def _bad(self, reason: str) -> None:
        if self.settings.bad_frames == "error":
            raise UserError(reason)
        self.dropped += 1
        self.first_problem = self.first_problem or reason
        if self.dropped <= MAX_SHOWN_BAD_FRAMES:
            log.warning("skipped a frame: %s%s", reason, "; later bad frames are counted, not shown"
                        if self.dropped == MAX_SHOWN_BAD_FRAMES else "")
        self._show(self.session.window_index)

    def _show(self, window: int) -> None:
        if self._postfix != (window, self.dropped):
            self._postfix = (window, self.dropped)
            self.bar.set_postfix(window=window, dropped=self.dropped, refresh=False)


def make_session(args: argparse.Namespace, settings: Settings):
    """(the session: a LongStreamSession, one window with --no-long-stream; its journal recorder
    or None; the tag number of the last frame a --resume found journaled, -1 for none)."""
    from ..io.checkpoint import CheckpointError, load_model
    from ..stream import BackendUnavailable
    from ..stream.long_stream import LongStreamSession
    from ..stream.session import StreamingSession

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        t0 = time.perf_counter()
        model = load_model(settings.model, args.checkpoint, settings.stream.device, settings.stream.dtype,
                           seed=args.seed)
        inner = StreamingSession(model, settings.stream, with_depth=not args.no_depth)
    except (CheckpointError, BackendUnavailable) as exc:
        raise UserError(str(exc)) from None
    session = LongStreamSession(inner, settings.long_stream)
    mode = "plain session" if settings.long_stream is None else \
        f"long stream, window {settings.long_stream.window_frames}"
    say(args, f"model ready in {time.perf_counter() - t0:.1f} s ({inner.backend.name}, {settings.stream.dtype}, "
              f"{settings.stream.device}, {mode})")
    if args.save_session or args.resume:
        return (session, *_journaled(args, session))
    return session, None, -1


def make_loop(settings: Settings, session):
    """The replay's loop closer (``replay_loop.ReplayLoop``) verifying candidates with a side session on
    ``session``'s model; None without --loop-closure."""
    if settings.loop is None:
        return None
    from ..runtime.loop_verify import ModelSideRunner
    from .replay_loop import ReplayLoop

    return ReplayLoop(settings.loop, ModelSideRunner(session.inner), settings.conf_threshold)


def _journaled(args: argparse.Namespace, session):
    """The journal recorder observing ``session`` (--save-session, --resume; a resumed session is
    rebuilt from it first) and the tag number of the last frame it holds (-1: none)."""
    from ..journal import JOURNAL_NAME, JournalError, JournalRecorder, JournalWriter, journal_identity, rebuild
    from ..journal.writer import usable_compression

    label = args.checkpoint or f"random seed {args.seed}"
    identity = journal_identity(session, label)
    folder = args.save_session or args.resume
    if args.save_session and not args.resume and (folder / JOURNAL_NAME).exists():
        raise UserError(f"{folder} already holds a session: continue it with --resume {folder}, or choose another "
                        "folder")
    rebuilt = None
    if args.resume:
        try:
            rebuilt = rebuild(session, args.resume / JOURNAL_NAME, identity, progress=None)
        except JournalError as exc:
            raise UserError(f"cannot resume from {args.resume}: {exc}") from None
        say(args, f"resumed {rebuilt.frames_replayed} stored frames from {args.resume} in {rebuilt.seconds:.1f} s; "
                  f"continuing at frame {rebuilt.next_frame}" + (f" ({rebuilt.stop})" if rebuilt.stop else ""))
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the session folder {folder}: {exc.strerror or exc}") from None
    writer = JournalWriter(folder / JOURNAL_NAME, compression=usable_compression("lz4"))
    recorder = JournalRecorder(writer, identity, session.deferred_eviction, begin=rebuilt is None)
    resume_after = -1
    if rebuilt is not None:
        recorder.adopt(rebuilt.records, rebuilt.scale_count, rebuilt.state_records, session.inner.resolution)
        resume_after = -1 if rebuilt.last_tag is None else int(rebuilt.last_tag["n"])
    session.observe(recorder)
    return recorder, resume_after


def run(args: argparse.Namespace, observer: Callable[[int], None] | None = None) -> int:
    """The whole replay; ``observer(frames_done)`` is called after each frame's outputs are written."""
    from ..io.sources import SourceError
    from ..stream import CacheError

    settings = configure(args)
    source = open_source(args, settings)
    say(args, f"input: {source.description}")
    if args.compare_precision:  # a precision check instead of a replay (cli.compare_precision)
        from .compare_precision import run_comparison

        try:
            return run_comparison(args, settings, source, say)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    session, journal, resume_after = make_session(args, settings)
    loop = make_loop(settings, session)
    outputs = Outputs(args, settings, loop)
    replay = Replay(args, settings, session, outputs, observer, resume_after, loop)
    start = time.perf_counter()
    try:
        replay.run(source)
        s0 = settings.stream.num_scale_frames
        if replay.done == 0:
            detail = f"; {replay.dropped} dropped, the first: {replay.first_problem}" if replay.dropped else ""
            raise UserError(f"only {replay.pushed} frame(s) reached the model, fewer than the {s0} scale frames "
                            f"it needs{detail}")
        if loop is not None:
            loop.finish()  # the last candidate verified: the corrections are final
    except (UserError, SourceError, CacheError, OutputError, OSError) as exc:  # OSError: a source's file system
        raise UserError(with_partial(explain(exc), *outputs.abort())) from None
    except KeyboardInterrupt:
        print(f"{PROG}: {with_partial(f'interrupted after {replay.done} frames', *outputs.abort())}",
              file=sys.stderr)
        return 130
    except BaseException:
        kept, unfinished = outputs.abort()
        if kept or unfinished:
            print(f"{PROG}: {with_partial('unexpected error', kept, unfinished)}", file=sys.stderr)
        raise
    finally:
        if journal is not None:
            journal.writer.close()  # what was journaled is on disk: --resume continues from it
        if loop is not None:
            loop.stop()
    elapsed = time.perf_counter() - start
    closed = outputs.close()
    if closed.failed:
        raise UserError(close_failure(replay.done, closed))
    windows = session.window_index + 1
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(f"{PROG}: {replay.done} frames in {elapsed:.1f} s ({replay.done / max(elapsed, 1e-9):.2f} FPS), "
          f"{replay.dropped} dropped, {windows} window(s), peak RSS {peak:.0f} MiB; wrote "
          f"{', '.join(map(str, closed.written))}", file=sys.stderr, flush=True)
    if loop is not None:
        print(f"{PROG}: {loop_summary(loop.stats)}", file=sys.stderr, flush=True)
    return 0


def main(argv: list[str] | None = None, observer: Callable[[int], None] | None = None) -> int:
    args = build_parser().parse_args(argv)
    fmt = f"{PROG}: %(levelname)s: %(message)s"
    logging.basicConfig(level=logging.WARNING, format=fmt)  # the library's own warnings
    handler = StderrHandler(logging.WARNING)
    handler.setFormatter(logging.Formatter(fmt))
    log.addHandler(handler)  # this CLI's warnings (skipped frames): always on stderr, once
    log.propagate = False
    try:
        return run(args, observer)
    except UserError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    finally:
        log.removeHandler(handler)
        log.propagate = True


if __name__ == "__main__":
    sys.exit(main())
