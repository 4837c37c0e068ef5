"""The executor of a process's own callbacks: rclpy's events executor where it exists.

``make_executor`` gives the node (``ros/main.py``) and the demo's pose recorder
(``cli/demo.py``) the same choice. rclpy's ``SingleThreadedExecutor`` rebuilds its wait set
in Python each time it wakes up; the events executor (``rclpy.experimental.EventsExecutor``,
rclpy 9 and later) dispatches each arriving message from C++, which takes less of the time between an image's
stamp and its pose (measured in docs/performance.md, "Through the node"). Drive it with ``spin_once`` in a loop (``spin_forever``): in the rclpy measured here its
``spin()`` ran no callbacks.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from rclpy.executors import SingleThreadedExecutor

EXECUTORS = ("auto", "events", "single")


def make_executor(kind: str = "auto", log: Callable[[str], None] | None = None):
    """The executor of the node's own callbacks (images, timers, parameters): (executor, kind).

    ``events``: rclpy's events executor (``rclpy.experimental.EventsExecutor``, rclpy 9 and
    later), which dispatches each arriving message from C++ instead of rebuilding a wait set
    in Python every time it wakes up. ``single``: rclpy's ``SingleThreadedExecutor``.
    ``auto`` (the default; measured faster in docs/performance.md) is ``events`` where this
    rclpy has it and ``single`` otherwise (ROS 2 Jazzy's rclpy has no events executor).
    ``log``: where ``events`` asked of an rclpy without it is said (a callable taking one line)."""
    if kind not in EXECUTORS:
        raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, got {kind!r}")
    if kind in ("auto", "events"):
        try:
            from rclpy.experimental import EventsExecutor
        except ImportError:
            if kind == "events" and log is not None:
                log("this rclpy has no events executor; using the single-threaded one")
        else:
            return EventsExecutor(), "events"
    return SingleThreadedExecutor(), "single"


def spin_forever(executor: Any, stop: threading.Event | None = None, period: float = 0.2,
                 ok: Callable[[], bool] | None = None) -> None:
    """Spin ``executor`` (either kind) with ``spin_once`` until ``stop`` is set or ``ok()`` turns
    False (default: rclpy's context is ok); returns quietly when the context shuts down."""
    import rclpy
    from rclpy.executors import ExternalShutdownException

    ok = ok or rclpy.ok
    try:
        while ok() and not (stop is not None and stop.is_set()):
            executor.spin_once(timeout_sec=period)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass


__all__ = ["make_executor", "spin_forever", "EXECUTORS"]
