"""The graph of ``lingbot-map-demo`` (and of ``benchmarks/node/node_latency.py``): the node, the
keyframe selector and the image publisher as processes on this machine, and a ``Recorder`` of
the node's outputs in this process (``Graph``), with the helpers that start, stop and read
those processes.
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import demo_selector


class DemoError(RuntimeError):
    """Reported as one line, exit status 1."""


def start(cmd: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    """Start ``cmd`` in its own session, stdout and stderr into ``log_path``."""
    log = open(log_path, "w")
    try:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    finally:
        log.close()


def stop(proc: subprocess.Popen | None, timeout: float = 5.0) -> None:
    """SIGINT, then SIGKILL after ``timeout`` s; nothing when ``proc`` is None or done."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def publisher_cmd(images: Path, rate: float, max_frames: int, wait_timeout: float, loop: bool) -> list[str]:
    """The image folder publisher's command line (``max_frames`` 0: all; ``loop``: start over)."""
    return [sys.executable, "-m", "lingbot_map_ros.ros.image_folder_publisher", "--ros-args",
            "-p", f"images:={images}", "-p", f"rate:={float(rate)}", "-p", f"max_frames:={max_frames}",
            "-p", f"wait_timeout:={float(wait_timeout)}", "-p", f"loop:={'true' if loop else 'false'}"]


COUNTERS = ("frames_received", "frames_processed", "frames_dropped_stale", "frames_dropped_invalid",
            "frames_dropped_error")


def counters(status) -> dict[str, int]:
    """The node's cumulative frame counters from a Status message (zeros when None)."""
    return {name: int(getattr(status, name)) if status is not None else 0 for name in COUNTERS}


def published_count(log_path: Path) -> int | None:
    """Frames the image publisher reported as published (its last 'published N frame(s)' line)."""
    count = None
    try:
        for line in log_path.read_text(errors="replace").splitlines():
            if "published " in line and " frame(s)" in line:
                word = line.rsplit("published ", 1)[1].split()[0]
                if word.isdigit():
                    count = int(word)
    except OSError:
        pass
    return count


class Graph:
    """The demo's ROS graph: a ``Recorder`` in this process (spun on a thread), and the node,
    keyframe selector and image publisher processes it starts; all stopped on exit.

    ``args``: the demo's options (``--rate``, ``--timeout``, ``--startup-timeout``,
    ``--keyframe-selector`` ...); logs go to ``out`` (``node.log``, ``publisher.log``,
    ``selector.log``)."""

    def __init__(self, args: argparse.Namespace, out: Path, env: dict, prog: str) -> None:
        self.args, self.out, self.env, self.prog = args, out, env, prog
        self.startup_timeout = args.startup_timeout if args.startup_timeout is not None else args.timeout
        self.node_proc: subprocess.Popen | None = None
        self.sel_proc: subprocess.Popen | None = None
        self.pub_proc: subprocess.Popen | None = None

    def __enter__(self) -> Graph:
        import rclpy

        from ..ros.executors import make_executor, spin_forever
        from ..ros.recorder import Recorder

        rclpy.init()
        self.recorder = Recorder("/lingbot_map")
        # the node's executor (events where rclpy has it): a pose's arrival is timed in its callback
        self._executor, _ = make_executor()
        self._executor.add_node(self.recorder)
        self._spin_stop = threading.Event()
        self._spin_thread = threading.Thread(target=spin_forever, args=(self._executor, self._spin_stop, 0.1),
                                             name="demo_recorder", daemon=True)
        self._spin_thread.start()
        return self

    def __exit__(self, *exc) -> None:
        import rclpy

        stop(self.pub_proc)
        stop(self.sel_proc)
        stop(self.node_proc)
        self._spin_stop.set()
        self._executor.shutdown(timeout_sec=1.0)
        # joined: a thread still in rclpy's C++ wait when the interpreter finalizes aborts the
        # process ("terminate called without an active exception")
        self._spin_thread.join(timeout=10.0)
        self.recorder.destroy_node()
        rclpy.try_shutdown()

    def start_node(self, params: Path, script: Path | None = None) -> float:
        """Start the node with ``params`` (``script``: run this Python file instead of
        ``lingbot_map_ros.ros.main``) and wait until it advertises ``~/pose``, bounded by
        ``--startup-timeout``; returns the seconds that took."""
        t0 = time.monotonic()
        node = [str(script)] if script else ["-m", "lingbot_map_ros.ros.main"]
        self.node_proc = start([sys.executable, *node, "--ros-args", "--params-file", str(params)], self.env,
                               self.out / "node.log")
        deadline = t0 + self.startup_timeout
        while time.monotonic() < deadline and self.recorder.count_publishers("/lingbot_map/pose") == 0:
            if self.node_proc.poll() is not None:
                raise DemoError(f"the node exited with status {self.node_proc.returncode}:\n"
                                f"{tail(self.out / 'node.log')}")
            time.sleep(0.1)
        if self.recorder.count_publishers("/lingbot_map/pose") == 0:
            raise DemoError(f"the node did not come up within {self.startup_timeout} s:\n"
                            f"{tail(self.out / 'node.log')}")
        return round(time.monotonic() - t0, 3)

    def start_selector(self) -> None:
        """Start the keyframe selector and wait until it subscribes to the node's ~/frame
        (bounded by ``--timeout``)."""
        args, log = self.args, self.out / "selector.log"
        self.sel_proc = start(demo_selector.selector_cmd(args.selector_param), self.env, log)
        deadline = time.monotonic() + args.timeout
        while self.recorder.count_subscribers("/lingbot_map/frame") == 0:
            if self.sel_proc.poll() is not None:
                raise DemoError(f"the keyframe selector exited with status {self.sel_proc.returncode}:\n{tail(log)}")
            if time.monotonic() > deadline:
                raise DemoError(f"the keyframe selector did not subscribe to /lingbot_map/frame within "
                                f"{args.timeout} s:\n{tail(log)}")
            time.sleep(0.1)
        print(f"{self.prog}: keyframe selector up; node decision hold keyframe_decision_timeout="
              f"{demo_selector.decision_timeout(args)} s", flush=True)

    def stop_selector(self) -> None:
        """Wait for the node's pending decision, then stop the selector (it logs its final
        summary on the way out)."""
        if self.sel_proc is None:
            return
        self.wait_decided()
        self.check_alive()
        stop(self.sel_proc)

    def check_alive(self, when: str = "") -> None:
        """DemoError (with the tail of its log) when the node or the selector has exited."""
        if self.node_proc is not None and self.node_proc.poll() is not None:
            raise DemoError(f"the node exited with status {self.node_proc.returncode}{when}:\n"
                            f"{tail(self.out / 'node.log')}")
        if self.sel_proc is not None and self.sel_proc.poll() is not None:
            raise DemoError(f"the keyframe selector exited with status {self.sel_proc.returncode}{when}:\n"
                            f"{tail(self.out / 'selector.log')}")

    def wait_decided(self) -> None:
        """With the selector: wait until the node's latest status holds no frame for a decision
        (at most the decision timeout + 5 s)."""
        if self.sel_proc is None:
            return
        deadline = time.monotonic() + demo_selector.decision_timeout(self.args) + 5.0
        while time.monotonic() < deadline:
            _, status = self.recorder.snapshot()
            if status is not None and not status.decision_pending:
                return
            time.sleep(0.05)

    def play(self, images: Path, frames: int, node_ready: bool = False) -> int:
        """Publish the first ``frames`` images at ``--rate``, wait for the publisher to end
        and for the node to account for every frame (or 3 s without change); returns the
        frames the publisher reported as published. ``node_ready``: the node already
        processes frames (after a warm-up); else the publisher's budget also covers the
        model load (the node subscribes after it)."""
        args = self.args
        done_before = sum(list(counters(self.recorder.snapshot()[1]).values())[1:])
        log = self.out / "publisher.log"
        self.pub_proc = start(publisher_cmd(images, args.rate, frames, self.startup_timeout, loop=False), self.env,
                              log)
        budget = frames / args.rate + args.timeout + (0 if node_ready else self.startup_timeout)
        deadline = time.monotonic() + budget
        while time.monotonic() < deadline and self.pub_proc.poll() is None:
            self.check_alive()
            time.sleep(0.1)
        if self.pub_proc.poll() is None:
            raise DemoError(f"the publisher did not finish within {budget:.0f} s:\n{tail(log)}")
        if self.pub_proc.returncode != 0:
            raise DemoError(f"the publisher failed:\n{tail(log)}")
        self._wait_accounted(frames, time.monotonic() + args.timeout, done_before)
        published = published_count(log)
        return frames if published is None else published

    def _wait_accounted(self, frames: int, deadline: float, done_before: int) -> None:
        """Until the node processed or dropped ``frames`` more than ``done_before``, or
        nothing changed for 3 s."""
        last_change, last_seen = time.monotonic(), None
        while time.monotonic() < deadline:
            _, status = self.recorder.snapshot()
            if status is not None:
                seen = tuple(counters(status).values())[1:]
                if sum(seen) - done_before >= frames:
                    return
                if seen != last_seen:
                    last_seen, last_change = seen, time.monotonic()
            if time.monotonic() - last_change > 3.0:
                return
            time.sleep(0.1)

    def save_map(self):
        """``~/save_map`` into the output folder (trajectory.tum, map.ply); the response."""
        from lingbot_map_ros.srv import SaveMap

        response = self.recorder.call(SaveMap, "/lingbot_map/save_map", SaveMap.Request(directory=str(self.out)),
                                      timeout=self.args.timeout)
        if response is None or not response.success:
            raise DemoError(f"~/save_map failed: {'timed out' if response is None else response.message}")
        return response
