"""The real ROS node under probes, optionally with a SIMULATED model step.

Runs the node (``lingbot_map_ros.ros.main``) in this process (started by ``benchmarks/node/node_latency.py
--node-script benchmarks/node/node_probe.py``, which ``benchmarks/node/node_latency.sh --probe``
and ``--simulate MS`` do) and, when ``LINGBOT_PROBE_OUT`` names a file, writes there at
exit what stalls the node's threads:

- ``gil_wait_ms``: how late a thread that sleeps 5 ms wakes up (a Python thread
  cannot run while another holds the GIL: a long C call that keeps it, or a garbage
  collection), as a histogram;
- ``gc_pause_ms``: the garbage collections, by generation;
- ``calls_ms``: the age of an image when its callback starts (publisher, transport,
  executor), the duration of the node's per-frame parts (image conversion,
  preprocessing, ``push`` and, for the real session, its plan, graph replay,
  speculation and result copy; the cloud and status outputs);
- ``thread_cpu_s``: CPU seconds per thread name (which threads burn the cores);
- ``rss_mb``: the process's resident memory, sampled once a second (a soak's leak check).

A/B runs of the node's measured choices (``node_latency.sh --executor KIND --gil-switch-ms MS``):
``LINGBOT_BENCH_EXECUTOR`` (auto, events, single) and ``LINGBOT_BENCH_GIL_SWITCH_MS`` (Python's
own is 5) are passed to ``ros.main.main``; unset, the node's defaults.

Simulated model (``LINGBOT_SIM_STEP_MS`` set): everything but the model is the node's
code (rclpy executor, image conversion, preprocessing, the inference and output
threads, messages, the map). ``SimulatedSession`` spends ``LINGBOT_SIM_HOST_MS``
(default 2) of Python time holding the GIL per frame, as the real session's launch and
planning do, then waits the rest of ``LINGBOT_SIM_STEP_MS`` without it, as the real
session waits for the GPU, and returns outputs of the real shapes. Latency minus the
step is then the node's overhead, on any machine, without a GPU.
"""
from __future__ import annotations

import collections
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: lingbot_map_ros

from lingbot_map_ros.cache.pages import CacheStats  # noqa: E402
from lingbot_map_ros.config import StreamConfig  # noqa: E402
from lingbot_map_ros.ros import main as main_module  # noqa: E402
from lingbot_map_ros.ros import node as node_module  # noqa: E402
from lingbot_map_ros.stream.session import FrameResult, SessionError  # noqa: E402


class _Backend:
    name = "simulated"


def _size(image: np.ndarray) -> tuple[int, int]:
    """(H, W) of a frame as the node pushes it: uint8 [H, W, 3] or float32 [3, H, W]."""
    return tuple(image.shape[:2]) if image.dtype == np.uint8 else tuple(image.shape[-2:])


class _SimModelConfig:
    max_frame_num = 1 << 30  # the simulated step has no horizon

    def to_dict(self) -> dict:
        return {"simulated": True}


class _SimModel(torch.nn.Module):
    """What the journal's identity reads of a model (a config and some weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.cfg = _SimModelConfig()
        self.stand_in = torch.nn.Parameter(torch.zeros(4))


class _Done:
    """The pending results of a simulated step (the step ran inside it)."""

    def __init__(self, results: list[FrameResult]) -> None:
        self._results = results

    def result(self) -> list[FrameResult]:
        return self._results


class SimulatedSessions:
    """What the node takes of ``stream.multi.CameraSessions``: a session per camera (each a real
    ``LongStreamSession`` around a ``SimulatedSession``), no shared storage."""

    storage = None

    def __init__(self, sessions: dict) -> None:
        self.sessions = sessions
        self.inner = {name: s.inner for name, s in sessions.items()}

    def pool_status(self):
        return None

    def submit_many(self, frames, keyframes=None):
        return {c: self.sessions[c].submit(f) for c, f in frames.items()}


class SimulatedSession:
    """The surface of StreamingSession a ``LongStreamSession`` uses (one window: it never restarts)
    with a timed stand-in for the model; with the node's ``state_directory`` the keyframe journal
    records its frames as it does the real session's (the scale frames, then every frame stored)."""

    def __init__(self, cfg: StreamConfig, step_ms: float, host_ms: float) -> None:
        self.cfg = cfg
        self.step_s, self.host_s = step_ms / 1e3, min(host_ms, step_ms) / 1e3
        self.device = None
        self.backend = _Backend()
        self.model = _SimModel()
        self.step_options = SimpleNamespace(with_depth=True)  # what the journal identity reads
        self.resolution = None
        self.deferred_eviction = False
        self.reset()

    def check_frame(self, image, resolution=None):
        return image  # the simulated step takes any frame

    def reset(self) -> None:
        self.frames_pushed = 0
        self._stored = 0
        self._waiting: list[np.ndarray] = []
        self._rng = np.random.default_rng(0)

    def stats(self) -> CacheStats:
        window = max(0, min(self._stored - self.cfg.num_scale_frames, self.cfg.sliding_window))
        scale = min(self._stored, self.cfg.num_scale_frames)
        return CacheStats(temporal_index=self._stored, resident_frames=scale + window, scale_pages=scale,
                          window_pages=window, free_pages=0, special_tokens=6 * self._stored, special_pages=1,
                          pending_evictions=0, deferred=False, can_rollback=self._stored > 0)

    def set_deferred_eviction(self, deferred: bool) -> None:
        self.deferred_eviction = deferred

    def commit_eviction(self) -> int:
        return 0

    def rollback_last_frame(self, expected_frame_index: int | None = None) -> int:
        if self._stored == 0:
            raise SessionError("nothing to roll back")
        self._stored -= 1
        self.frames_pushed -= 1
        return self.frames_pushed

    @property
    def scale_frames_waiting(self) -> int:
        return len(self._waiting)

    def is_keyframe_index(self, frame_index: int) -> bool:
        return True  # every frame is stored

    def step(self, image: np.ndarray, keyframe: bool | None = None) -> _Done:
        return _Done(self.push(image))

    def push(self, image: np.ndarray, keyframe: bool | None = None) -> list[FrameResult]:
        self.resolution = _size(image)
        self._waiting.append(image)
        if self.frames_pushed == 0 and len(self._waiting) < self.cfg.num_scale_frames:
            return []
        images, self._waiting = self._waiting, []
        return [self._step(im) for im in images]

    def _step(self, image: np.ndarray) -> FrameResult:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < self.host_s:  # launch/planning work: holds the GIL
            pass
        time.sleep(max(0.0, self.step_s - (time.perf_counter() - t0)))  # the GPU: GIL released
        h, w = _size(image)
        i = self.frames_pushed
        a = 0.05 * i
        c2w = np.eye(4)
        c2w[:3, :3] = [[np.cos(a), 0, np.sin(a)], [0, 1, 0], [-np.sin(a), 0, np.cos(a)]]
        c2w[:3, 3] = [np.sin(a), 0.0, 1.0 - np.cos(a)]
        K = np.array([[0.8 * w, 0, w / 2], [0, 0.8 * w, h / 2], [0, 0, 1]])
        depth = (1.0 + self._rng.random((h, w), dtype=np.float32)).astype(np.float32)
        conf = (1.0 + 2.0 * self._rng.random((h, w), dtype=np.float32)).astype(np.float32)
        model_ms = (time.perf_counter() - t0) * 1e3
        self.frames_pushed += 1
        self._stored += 1
        return FrameResult(frame_index=i, position=i, is_keyframe=True, pose_enc=np.zeros(9), c2w=c2w,
                           intrinsics=K, depth=depth, confidence=conf, frame=image,
                           timings={"model_ms": model_ms, "postprocess_ms": 0.0})


class Probe:
    """GIL wait, GC pauses, timed calls, per-thread CPU time (see the module doc)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.gil_wait: list[float] = []
        self.gc_pauses: dict[int, list[float]] = collections.defaultdict(list)
        self.calls: dict[str, list[float]] = collections.defaultdict(list)
        self.thread_cpu: dict[str, float] = {}
        self.rss_mb: list[tuple[float, float]] = []  # (seconds since start, resident MiB), once a second
        self._t_start = time.perf_counter()
        self._gc_t0 = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        gc.callbacks.append(self._on_gc)
        self._thread = threading.Thread(target=self._run, name="probe", daemon=True)
        self._thread.start()

    def time_calls(self, owner, name: str, label: str | None = None) -> None:
        """Record the duration of every call of ``owner.name`` (a class, module or instance attribute)."""
        fn = getattr(owner, name, None)
        if fn is None:
            return
        durations = self.calls[label or name]

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                durations.append((time.perf_counter() - t0) * 1e3)

        setattr(owner, name, timed)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_pauses[info["generation"]].append((time.perf_counter() - self._gc_t0) * 1e3)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(0.005)
            self.gil_wait.append(max(0.0, (time.perf_counter() - t0) * 1e3 - 5.0))  # a wake can be early
            if t0 - last > 1.0:  # threads end before write(): keep the latest reading
                self.thread_cpu, last = self._thread_cpu(), t0
                self.rss_mb.append((round(t0 - self._t_start, 1), self._rss_mb()))

    @staticmethod
    def _rss_mb() -> float:
        """Resident memory of this process in MiB (Linux /proc)."""
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)

    @staticmethod
    def _thread_cpu() -> dict[str, float]:
        """CPU seconds per thread of this process (Linux /proc): Python threads by their name,
        the others (BLAS, OpenMP, DDS, CUDA) by their OS name."""
        tick = os.sysconf("SC_CLK_TCK")
        names = {t.native_id: t.name for t in threading.enumerate()}
        cpu: dict[str, float] = collections.defaultdict(float)
        for task in Path("/proc/self/task").iterdir():
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            name = names.get(int(task.name)) or "os:" + stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            cpu[name] += (int(fields[11]) + int(fields[12])) / tick
        return {k: round(v, 2) for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])}

    def write(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
        gil_wait = list(self.gil_wait)  # one snapshot for the summary and the histogram

        def summary(values: list[float]) -> dict:
            values = list(values)  # other threads may still append
            v = np.array(values or [0.0])
            return {"n": len(values), "median": round(float(np.median(v)), 2),
                    "p95": round(float(np.percentile(v, 95)), 2), "max": round(float(v.max()), 2),
                    "total": round(float(v.sum()), 1)}

        waits = np.array(gil_wait or [0.0])
        edges = [0, 1, 5, 20, 50, 100, 200, 500, 1000, 1e9]
        hist = np.histogram(waits, bins=edges)[0]
        report = {
            "gil_wait_ms": {**summary(gil_wait),
                            "histogram": {f"{edges[i]:g}-{edges[i + 1]:g}": int(n) for i, n in enumerate(hist)}},
            "gc_pause_ms": {str(g): summary(v) for g, v in sorted(self.gc_pauses.items())},
            "gc_objects_at_exit": len(gc.get_objects()),
            "calls_ms": {k: summary(v) for k, v in self.calls.items()},
            "thread_cpu_s": self.thread_cpu,
            "rss_mb": _rss_summary(list(self.rss_mb)),
            "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        }
        with open(self.out, "w") as f:
            json.dump(report, f, indent=1)


def _rss_summary(samples: list[tuple[float, float]]) -> dict:
    """Resident memory over the run: first/last/max, and the last half's slope (MiB per minute)."""
    if not samples:
        return {}
    t = np.array([s[0] for s in samples])
    m = np.array([s[1] for s in samples])
    half = t >= t[-1] / 2
    slope = float(np.polyfit(t[half], m[half], 1)[0] * 60) if half.sum() >= 3 else 0.0
    return {"samples": len(samples), "first": float(m[0]), "last": float(m[-1]), "max": float(m.max()),
            "last_half_slope_mb_per_min": round(slope, 2)}


def instrument(probe: Probe, session) -> None:
    """Time the node's per-frame work: conversion, preprocessing, the session's parts, the outputs."""
    from lingbot_map_ros.ros import camera_channel, common, outputs
    from lingbot_map_ros.runtime import engine as engine_module

    probe.time_calls(node_module, "image_to_rgb")
    ages = probe.calls["image age at the callback (stamp -> executor)"]
    accept = camera_channel.CameraChannel.accept

    def aged_accept(self, msg, convert, now=None):
        now = now if now is not None else self.node.get_clock().now().nanoseconds * 1e-9
        ages.append((now - common.stamp_seconds(msg.header.stamp)) * 1e3)
        return accept(self, msg, convert, now)

    camera_channel.CameraChannel.accept = aged_accept
    # hand-over: the executor's submit_frame until the inference thread starts on the frame
    handover = probe.calls["hand-over (submit -> inference thread)"]
    submitted: dict[int, float] = {}
    submit, admit = engine_module.InferenceEngine.submit_frame, engine_module.InferenceEngine.admit

    def timed_submit(self, frame):
        submitted[id(frame)] = time.perf_counter()
        return submit(self, frame)

    def timed_admit(self, frame):
        t = submitted.pop(id(frame), None)
        if t is not None:
            handover.append((time.perf_counter() - t) * 1e3)
        return admit(self, frame)

    engine_module.InferenceEngine.submit_frame = timed_submit
    engine_module.InferenceEngine.admit = timed_admit
    from lingbot_map_ros.runtime import model_input as model_input_module

    probe.time_calls(model_input_module, "model_input")
    probe.time_calls(session, "submit")
    probe.time_calls(session, "results")
    from lingbot_map_ros.runtime import clouds as clouds_module

    probe.time_calls(clouds_module.CloudOutput, "publish", "_publish_clouds")
    from lingbot_map_ros.runtime import status as status_module

    probe.time_calls(status_module.StatusReporter, "publish", "StatusReporter.publish")
    probe.time_calls(outputs.RosOutputs, "publish_frame")
    runner = getattr(session.inner, "_runner", None)  # the StreamingSession's StepRunner (none when simulated)
    if runner is not None:
        from lingbot_map_ros.stream import graphs, steps as steps_module

        probe.time_calls(steps_module, "make_device_plan")
        probe.time_calls(runner, "_speculate")
        probe.time_calls(runner, "_results")
        probe.time_calls(runner, "_eager_step")
        probe.time_calls(graphs.GraphedStep, "__call__", "GraphedStep.__call__")
        probe.time_calls(graphs.GraphedStep, "prepare", "GraphedStep.prepare")
        probe.time_calls(graphs.GraphedStep, "_capture", "GraphedStep._capture")


def main() -> int:
    step = os.environ.get("LINGBOT_SIM_STEP_MS")
    host_ms = float(os.environ.get("LINGBOT_SIM_HOST_MS", "2"))
    out = os.environ.get("LINGBOT_PROBE_OUT")
    probe = Probe(out) if out else None
    real_load = node_module.load_sessions

    def load_sessions(settings, camera_settings, log):
        if step is not None:
            from lingbot_map_ros.stream.long_stream import LongStreamSession

            log.warning(f"SIMULATED model: {step} ms per frame ({host_ms} ms holding the GIL); outputs are synthetic")
            sessions = SimulatedSessions({name: LongStreamSession(SimulatedSession(cs.stream, float(step), host_ms))
                                          for name, cs in camera_settings.items()})
        else:
            sessions = real_load(settings, camera_settings, log)
        if probe is not None:
            instrument(probe, next(iter(sessions.sessions.values())))  # the first camera's (the benchmark runs one)
            probe.start()
        return sessions

    node_module.load_sessions = load_sessions
    gil_ms = os.environ.get("LINGBOT_BENCH_GIL_SWITCH_MS")
    try:
        return main_module.main(executor=os.environ.get("LINGBOT_BENCH_EXECUTOR") or "auto",
                                gil_switch_ms=float(gil_ms) if gil_ms else main_module.GIL_SWITCH_MS)
    finally:
        if probe is not None:
            probe.write()


if __name__ == "__main__":
    sys.exit(main())
