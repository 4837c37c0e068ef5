"""lingbot-map-fleet: many recordings reconstructed on a Ray cluster, resumable, one command.

    lingbot-map-fleet runs/*.mcap walks/ -o out/ -- --checkpoint lingbot-map.pt --topic /cam/image
    lingbot-map-fleet --manifest fleet.csv -o /shared/out --address ray://head:10001 -- --dtype bf16

Each input (a rosbag2, a ROS 1 bag, an image folder or a video; paths, globs or the rows of
a CSV or YAML manifest with per-input flags) is one Ray task that runs ``lingbot-map-replay``
with the flags after ``--`` (and the row's), holding the model on the GPU Ray gave it (or
the CPU), and writes ``--outputs`` into ``<output root>/<name>/``: the same files as a single
replay of that input (``fleet_task``, ``fleet_merge``). Without ``--address`` a local Ray
instance is started on this machine (on the loopback interface) and shut down at the end.

Nothing is lost: each task journals its replay under its folder in segments; a task whose
worker dies is retried (``--max-retries``) and resumes from the last finished segment, and
running the same command again skips the inputs that are complete and resumes the others.
A bad input fails alone with its reason. At the end: a table on stdout, the summary JSON
(``<output root>/fleet-summary.json``), exit status 0 (every input ok or skipped), 1 (some
failed) or 2 (a usage error: ``lingbot-map-fleet: error: ...``, nothing run).

Ray is an optional dependency (``pip install lingbot_map_ros[fleet]``), imported only here,
when the command runs.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

from ..io.atomic import atomic_write
from .fleet_inputs import SUMMARY_NAME, CommonFlags, FleetInput, UsageError, collect
from .fleet_merge import DEFAULT_OUTPUTS, OUTPUTS
from .fleet_progress import PROG, Display, summary, table
from .fleet_task import RESULT_NAME, STATE_NAME, WORK, InputResult, TaskPlan, failed, fingerprint, read_json, \
    run_input

WAIT_S = 0.5  # how often the progress is redrawn while tasks run
INSTALL_HINT = "pip install 'lingbot_map_ros[fleet]' (or pip install ray)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Reconstruct many recordings with lingbot-map-replay on a Ray "
                                "cluster (or this machine): one task per input, resumable.",
                                epilog="Replay flags (model, selection, outputs' options) go after --, for every "
                                "input; a manifest row adds its own.")
    p.add_argument("inputs", nargs="*", help="rosbag2 folders (or a .mcap/.db3 inside one), ROS 1 .bag files, image "
                   "folders, videos; globs are expanded")
    p.add_argument("--manifest", type=Path, help="CSV (columns input, name, kind, topic, flags) or YAML (a list of "
                   "paths or of mappings with those keys); paths relative to the manifest")
    p.add_argument("-o", "--output-root", type=Path, required=True, help="one folder per input is made in it (a path "
                   "every Ray node sees the same way)")
    p.add_argument("--outputs", default=",".join(DEFAULT_OUTPUTS), help="comma-separated, of trajectory "
                   "(trajectory.tum), ply (map.ply), bag (results/), npz (predictions.npz); default %(default)s")
    r = p.add_argument_group("Ray")
    r.add_argument("--address", help="join this Ray cluster (ray://host:10001, host:6379, or auto); default: start a "
                   "local instance on this machine")
    r.add_argument("--num-cpus", type=int, help="CPUs of the local instance (default: all)")
    r.add_argument("--num-gpus", type=int, help="GPUs of the local instance (default: all it sees)")
    r.add_argument("--gpus-per-task", type=float, help="GPUs per input: 1 (default where the cluster has GPUs), a "
                   "fraction to share one among small models, or 0 for the CPU")
    r.add_argument("--cpus-per-task", type=float, help="CPUs per input (torch's threads): default 1 with a GPU, "
                   "else up to 4")
    r.add_argument("--max-retries", type=int, default=3, help="times a task whose worker died is started again "
                   "(default 3); it resumes from its journal")
    p.add_argument("--segment-frames", type=int, default=2000, help="frames a task replays between two durable "
                   "points; a retry loses at most this many (default 2000)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr, only the summary")
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the fleet's arguments, the replay flags after the first ``--``)."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    own, replay_flags = split_argv(argv)
    args = build_parser().parse_args(own)  # a bad flag: argparse's "lingbot-map-fleet: error: ...", status 2
    started = time.monotonic()
    extra = {"address": args.address or "local"}
    try:
        outputs = _outputs(args)
        _check_numbers(args)
        root = _output_root(args.output_root)
        items = collect(args.inputs, args.manifest, CommonFlags.split(replay_flags))
        display = Display(len(items), args.quiet)
        try:
            results = _run(args, items, root, outputs, display, extra)
        finally:
            display.close()
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; every input's journal is kept: run the same command again to resume",
              file=sys.stderr)
        return 130
    extra["seconds"] = round(time.monotonic() - started, 3)
    text = summary(results, [PROG, *argv], root, extra)
    try:
        atomic_write(root / SUMMARY_NAME, lambda f: f.write(text))
    except OSError as exc:
        print(f"{PROG}: cannot write {root / SUMMARY_NAME}: {exc.strerror or exc}", file=sys.stderr)
    print(table(results), flush=True)
    return 1 if any(r.status == "failed" for r in results) else 0


def _outputs(args: argparse.Namespace) -> tuple[str, ...]:
    names = tuple(n.strip() for n in args.outputs.split(",") if n.strip())
    unknown = [n for n in names if n not in OUTPUTS]
    if unknown or not names:
        raise UsageError(f"--outputs {args.outputs!r}: choose from {', '.join(OUTPUTS)} (comma-separated)")
    if len(set(names)) != len(names):
        raise UsageError(f"--outputs {args.outputs!r} names an output twice")
    return names


def _check_numbers(args: argparse.Namespace) -> None:
    for flag, value, low in (("--segment-frames", args.segment_frames, 1), ("--max-retries", args.max_retries, 0),
                             ("--num-cpus", args.num_cpus, 1), ("--num-gpus", args.num_gpus, 0),
                             ("--cpus-per-task", args.cpus_per_task, 0.01), ("--gpus-per-task", args.gpus_per_task, 0)):
        if value is not None and value < low:
            raise UsageError(f"{flag} must be at least {low:g}, got {value:g}")
    g = args.gpus_per_task
    if g is not None and g > 1 and g != int(g):
        raise UsageError(f"--gpus-per-task {g:g}: above 1, a whole number of GPUs")
    if args.address and (args.num_cpus is not None or args.num_gpus is not None):
        raise UsageError("--num-cpus and --num-gpus size a local instance; the cluster at --address has its own")


def _output_root(root: Path) -> Path:
    """The output root, made if needed; refused when no file can be made in it."""
    root = root.absolute()
    if os.path.lexists(root) and not root.is_dir():
        raise UsageError(f"--output-root {root} exists and is not a folder")
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{PROG}-probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"--output-root {root}: cannot write into it: {exc.strerror or exc}; nothing was run") \
            from None
    return root


def _import_ray(local: bool):
    """Ray, imported now. A local instance talks over the loopback interface only (Ray's own
    switch, read when it is imported)."""
    if local and "ray" not in sys.modules:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError:
        raise UsageError(f"the fleet runs on Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


@contextlib.contextmanager
def _ray_instance(ray, args: argparse.Namespace):
    """Join the cluster at --address, or start a local instance (shut down at the end); a Ray
    already initialized in this process (an embedding program, the tests) is used as it is."""
    if ray.is_initialized():
        yield
        return
    try:
        if args.address:
            ray.init(address=args.address, log_to_driver=False, logging_level=logging.WARNING)
        else:  # a private instance on the loopback interface: Ray's notices about clusters are not for it
            ray.init(address="local", num_cpus=args.num_cpus, num_gpus=args.num_gpus, include_dashboard=False,
                     log_to_driver=False, logging_level=logging.ERROR)
    except Exception as exc:  # noqa: BLE001 - Ray raises many kinds; the first line says what went wrong
        what = f"join the Ray cluster at {args.address}" if args.address else "start a local Ray instance"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"cannot {what}: {first}") from None
    try:
        yield
    finally:
        ray.shutdown()


def _resources(ray, args: argparse.Namespace) -> tuple[float, float]:
    """(GPUs, CPUs) per task: the flags, or the defaults; refused when no node could hold a task."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    most_gpus = max((n.get("GPU", 0.0) for n in nodes), default=0.0)
    most_cpus = max((n.get("CPU", 0.0) for n in nodes), default=0.0)
    gpus = args.gpus_per_task if args.gpus_per_task is not None else (1.0 if most_gpus >= 1 else 0.0)
    if gpus > most_gpus:
        raise UsageError(f"--gpus-per-task {gpus:g}: no node of the cluster has {gpus:g} GPU(s) (the most: "
                         f"{most_gpus:g}); --gpus-per-task 0 runs on the CPU")
    cpus = args.cpus_per_task if args.cpus_per_task is not None else (1.0 if gpus else max(1.0, min(4.0, most_cpus)))
    if cpus > most_cpus:
        raise UsageError(f"--cpus-per-task {cpus:g}: no node of the cluster has {cpus:g} CPUs (the most: "
                         f"{most_cpus:g})")
    return gpus, cpus


def _settled(item: FleetInput, folder: Path, fp: dict) -> InputResult | None:
    """The result of an input that needs no task: it cannot run, it is complete (``result.json``
    of the same fingerprint ``fp``, every output there), or its folder holds another run's outputs."""
    if item.problem:
        return failed(item, item.problem)
    done = read_json(folder / RESULT_NAME)
    if done is None or done.get("status") != "ok":
        return None
    if done.get("fingerprint") != fp:
        theirs = done.get("fingerprint") or {}
        differ = sorted(k for k in set(theirs) | set(fp) if theirs.get(k) != fp.get(k))
        return failed(item, f"{folder} holds the outputs of another run ({', '.join(differ)} differ); choose "
                            "another --output-root, or delete that folder to replay this input again")
    missing = [folder / OUTPUTS[o][1] for o in fp["outputs"] if not os.path.lexists(folder / OUTPUTS[o][1])]
    if missing:
        return failed(item, f"{folder / RESULT_NAME} says the input is complete, but {missing[0]} is missing; delete "
                            f"{folder} to replay this input again")
    fields = {k: done[k] for k in ("frames", "fps", "seconds", "attempts", "resumed_from", "dropped") if k in done}
    return InputResult(item.name, str(item.source), "skipped", **fields, outputs=tuple(done.get("outputs", ())))


def _run(args, items: list[FleetInput], root: Path, outputs, display: Display, extra: dict) -> list[InputResult]:
    """Settle the inputs that need no task, then (if any is left) start or join Ray, submit a task
    per input and wait for them all, drawing the progress."""
    results: dict[str, InputResult] = {}
    todo = []
    for item in items:
        fp = fingerprint(item, outputs)
        settled = _settled(item, root / item.name, fp)
        if settled is None:
            todo.append((item, fp))
        else:
            results[item.name] = settled
            display.ended_input(settled)
    if todo:
        ray = _import_ray(local=args.address is None)
        with _ray_instance(ray, args):
            gpus, cpus = _resources(ray, args)
            extra.update(gpus_per_task=gpus, cpus_per_task=cpus)
            run_id = uuid.uuid4().hex
            plans = [TaskPlan(item, root / item.name, outputs, args.segment_frames, "cuda" if gpus > 0 else "cpu",
                              max(1, int(cpus)), run_id, fp) for item, fp in todo]
            results.update(_wait(ray, plans, args.max_retries, gpus, cpus, display))
    return [results[item.name] for item in items]


def _wait(ray, plans: list[TaskPlan], retries: int, gpus: float, cpus: float,
          display: Display) -> dict[str, InputResult]:
    """One Ray task per plan (``gpus`` and ``cpus`` each, restarted up to ``retries`` times when its
    worker dies); their results by input name. Ctrl-C cancels them (their journals stay)."""
    task = ray.remote(run_input)
    pending = {}
    results = {}
    try:
        for plan in plans:
            ref = task.options(num_cpus=cpus, num_gpus=gpus, max_retries=retries, retry_exceptions=False,
                               name=f"{PROG}:{plan.item.name}").remote(plan)
            pending[ref] = plan
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=WAIT_S)
            for ref in ready:
                plan = pending.pop(ref)
                results[plan.item.name] = _result(ray, ref, plan)
                display.ended_input(results[plan.item.name])
            display.running({p.item.name: p.folder for p in pending.values()}, plans[0].run_id)
    except KeyboardInterrupt:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise
    return results


def _result(ray, ref, plan: TaskPlan) -> InputResult:
    """The task's result; a task that could not finish (its worker died more than --max-retries
    times, the node was lost) is a failed input, with Ray's reason."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as exc:
        state = read_json(plan.folder / WORK / STATE_NAME) or {}
        attempts = int(state.get("attempts", 0))
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return failed(plan.item, f"its task could not finish after {attempts} attempt(s) ({type(exc).__name__}: "
                            f"{lines[0] if lines else 'no detail'}); run the command again to resume it",
                      attempts=attempts)


if __name__ == "__main__":
    sys.exit(main())
