"""The process entry point of ``lingbot_map_node``: rclpy, the signals, the executors, the exit.

    ros2 run lingbot_map_ros lingbot_map_node --ros-args --params-file config/lingbot_map.yaml
    python -m lingbot_map_ros.ros.main --ros-args ...   (the same ``main``)

``main`` builds the node (``node.LingBotMapNode``), spins it on one executor thread and its
services (the helper node ``<name>_services``) on a multi-threaded executor of their own,
and on SIGINT/SIGTERM stops the node's threads before the context is shut down. Exit status
0 on shutdown, 1 when the node cannot start (one error line). With ``managed:=true`` the node
starts unconfigured and its lifecycle transitions run on the node's executor thread
(``lifecycle``); a failing configure leaves it running, unconfigured, and after the shutdown
transition it stays (finalized) until SIGINT/SIGTERM.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import rclpy
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.signals import SignalHandlerOptions

from .common import NODE_NAME
from .executors import make_executor
from .node import LingBotMapNode, StartupError


def _spin_quietly(executor) -> None:
    """Spin until the context shuts down (the service thread: its end is not an error)."""
    try:
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass


SERVICE_THREADS = 4  # concurrent service calls (a slow ~/save_map does not block ~/reset)
THREAD_JOIN_S = 10.0  # s; how long shutdown waits for the service thread to leave rclpy
SPIN_PERIOD = 0.2  # s; the main loop's longest wait, so SIGINT/SIGTERM are handled promptly
GIL_SWITCH_MS = 0.5  # ms; measured against Python's 5 ms in docs/performance.md ("GIL switch interval")


def set_gil_switch_interval(ms: float = GIL_SWITCH_MS) -> float:
    """Shorten CPython's GIL switch interval (5 ms by default) to ``ms`` for this latency-bound process.

    A thread that wakes up (the inference thread handed a frame, or back from waiting for
    the GPU) must get the GIL from whichever thread runs Python (the executor after a
    callback, the output thread); it is only forced to let go after the switch interval,
    so each hand-over can cost up to 5 ms. Returns the interval in force (s)."""
    if not ms > 0:  # zero, negative or NaN
        raise ValueError(f"GIL switch interval must be > 0 ms, got {ms!r}")
    sys.setswitchinterval(ms / 1e3)
    return sys.getswitchinterval()


def _join_threads(extra: list[threading.Thread], timeout: float) -> list[str]:
    """Join ``extra`` and every live thread named ``lingbot_map*`` within ``timeout`` seconds in all;
    returns the names of those still alive."""
    deadline = time.monotonic() + timeout
    threads = {t for t in threading.enumerate() if t.name.startswith("lingbot_map")} | set(extra)
    threads.discard(threading.current_thread())
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return sorted(t.name for t in threads if t.is_alive())


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # while the model loads, SIGTERM ends the node the way SIGINT does


def main(args: list[str] | None = None, executor: str = "auto", gil_switch_ms: float = GIL_SWITCH_MS) -> int:
    """Console entry point ``lingbot_map_node``: exit status 0 on shutdown (SIGINT, SIGTERM), 1 when
    it cannot start. ``executor`` (``executors.make_executor``) and ``gil_switch_ms`` are the
    measured choices by default; a benchmark's A/B run passes others (benchmarks/node/node_probe.py).

    rclpy's own signal handlers are off: they would shut the context down while the inference and
    output threads still publish ("publisher's context is invalid"). Here SIGINT/SIGTERM end the
    spin loop, the threads stop, and only then is the context shut down."""
    set_gil_switch_interval(gil_switch_ms)
    rclpy.init(args=args if args is not None else sys.argv, signal_handler_options=SignalHandlerOptions.NO)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        node = LingBotMapNode()
    except StartupError as exc:
        rclpy.logging.get_logger(NODE_NAME).error(f"cannot start: {exc}")
        rclpy.try_shutdown()
        return 1
    except KeyboardInterrupt:  # stopped while loading the model
        rclpy.try_shutdown()
        return 0
    # One executor thread for the node's callbacks: they are short (an image is converted and
    # handed over), and a pool of executor threads only adds GIL hand-offs that delay the
    # inference thread (the multi-threaded executor measured 2x the tail latency of this one,
    # benchmarks/node/node_probe.py). The services, which wait for the inference thread or write
    # files, get executor threads of their own.
    # From here a signal only sets a flag that the loop reads: an exception raised by a handler in
    # the middle of rclpy's C++ calls (taking a message) would surface as an unrelated error.
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    callbacks, kind = make_executor(executor, log=lambda line: rclpy.logging.get_logger(NODE_NAME).warning(line))
    rclpy.logging.get_logger(NODE_NAME).debug(f"callbacks on the {kind} executor")
    services = MultiThreadedExecutor(num_threads=SERVICE_THREADS)
    services.add_node(node.service_node)
    service_thread = threading.Thread(target=_spin_quietly, args=(services,), name="lingbot_map_services",
                                      daemon=True)
    service_thread.start()
    callbacks.add_node(node)
    try:
        while rclpy.ok() and not stop.is_set():
            callbacks.spin_once(timeout_sec=SPIN_PERIOD)  # returns now and then so a signal is seen
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second signal must not cut the clean-up short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        node.shutdown()  # inference and output threads stop first: nothing publishes after this
        services.shutdown(timeout_sec=1.0)
        callbacks.shutdown(timeout_sec=1.0)
        node.destroy_node()
        rclpy.try_shutdown()
        # A thread of ours may still be returning from rclpy's (or torch's) C++ code: if the
        # interpreter finalized under it, CPython would end it with pthread_exit, whose unwinding
        # through a noexcept C++ frame aborts the process ("terminate called without an active
        # exception"). So wait for them; one that never returns is left behind by a hard exit.
        left = _join_threads([service_thread], THREAD_JOIN_S)
        if left:
            rclpy.logging.get_logger(NODE_NAME).warning(
                f"threads {', '.join(left)} did not stop within {THREAD_JOIN_S:.0f} s; exiting without them")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
