"""Shared pieces of the real-DDS graph tests (test/ros/test_*_graph.py and friends).

Not a test module (pytest collects ``test_*.py`` only); the test modules import it by name
(``from graph_helpers import ...``: pytest puts test/ros on ``sys.path``) after their
``pytest.importorskip("rclpy")``. What is here:

- a private ROS environment: ``private_domain_id`` (a module's own ROS_DOMAIN_ID, claimed for
  the life of the process), ``ros_env`` (the child processes' environment, loopback only);
- node processes: ``start_node`` / ``start_ros_process`` (``python -m ... --ros-args``, log
  captured to a file), ``stop_processes`` (SIGINT, then kill, every wait bounded), ``log_tail``;
- parameters: ``fixture_params`` / ``write_node_params`` (the tiny fixture model's paths added);
- inputs: ``generated_frames`` and ``image_msg``;
- ``GraphClient``: a test node in its own context that records messages and waits on a
  condition with a real timeout (``publish_until``: a first message, sent until it arrived);
  ``InProcessNode``: the node itself in this process, spun as ``main.main`` spins it;
- expectations: ``replay_session`` (the node's model, fed in this process), ``pose_matrix``.
"""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import rclpy
from builtin_interfaces.msg import Time
from geometry_msgs.msg import PoseStamped
from rcl_interfaces.msg import Parameter as ParameterMsg, ParameterType, ParameterValue, SetParametersResult
from rcl_interfaces.srv import SetParameters
from rclpy.executors import MultiThreadedExecutor, SingleThreadedExecutor
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile
from rclpy.task import Future
from sensor_msgs.msg import Image
from std_msgs.msg import Header

MAX_DOMAIN_ID = 232  # Fast DDS: the ports of higher domain ids pass 65535
NODE_MODULE = "lingbot_map_ros.ros.main"
LOG_TAIL = 2000  # characters of a node's log quoted in a failure message
REPUBLISH_PERIOD = 1.5  # s between the copies of a first message (GraphClient.publish_until)

_claimed: dict[str, int] = {}  # owner -> the domain id it holds in this process
_lock_files: list = []  # open lock files, one per claimed id: held until the process ends


# ------------------------------------------------------------------ private ROS environment
def loopback_only() -> None:
    """DDS discovery on loopback for every context created in this process from now on (rcl reads it)."""
    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"


def _take(domain_id: int) -> bool:
    """Hold ``domain_id``'s lock file (one per id, in the system temp folder); False when another
    process of this machine, or another owner in this one, holds it."""
    folder = Path(tempfile.gettempdir()) / "lingbot_map_ros_test_domains"
    try:
        folder.mkdir(exist_ok=True)
        handle = open(folder / f"{domain_id}.lock", "w")
    except OSError:  # a temp folder we may not write (another user's lock files): the formula alone
        return True
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return False
    _lock_files.append(handle)
    return True


def private_domain_id(owner: str, first: int, count: int, multiplier: int, offset: int) -> int:
    """The ROS_DOMAIN_ID of test module ``owner``: ``first + (pid * multiplier + offset) % count``
    (the module's own formula), or the next free id of ``[first, first + count)`` (wrapping) when
    another module of this pytest process or another test process of this machine holds that one.

    The id stays claimed (a lock file) until the process ends; a second call by the same owner
    returns it. Raises AssertionError when the range passes MAX_DOMAIN_ID or is all taken.
    """
    if owner in _claimed:
        return _claimed[owner]
    assert 0 <= first and first + count - 1 <= MAX_DOMAIN_ID, f"domain ids {first}..{first + count - 1}: " \
                                                               f"Fast DDS takes 0..{MAX_DOMAIN_ID}"
    start = (os.getpid() * multiplier + offset) % count
    for step in range(count):
        candidate = first + (start + step) % count
        if candidate not in _claimed.values() and _take(candidate):
            _claimed[owner] = candidate
            return candidate
    raise AssertionError(f"{owner}: every domain id in {first}..{first + count - 1} is taken")


def ros_env(domain_id: int) -> dict[str, str]:
    """This process's environment for a child on ``domain_id``: loopback only, unbuffered Python output."""
    return dict(os.environ, ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST", ROS_DOMAIN_ID=str(domain_id),
                PYTHONUNBUFFERED="1")


# ------------------------------------------------------------------ processes
def start_ros_process(module: str, ros_args: Sequence[str], log: Path, domain_id: int) -> subprocess.Popen:
    """``python -m module --ros-args *ros_args`` on ``domain_id`` (see ``ros_env``), stdout and
    stderr written to ``log``, no stdin, in a session of its own."""
    cmd = [sys.executable, "-m", module, "--ros-args", *ros_args]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, env=ros_env(domain_id), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def start_node(name: str, params: Path, log: Path, domain_id: int,
               remaps: Mapping[str, str] | None = None) -> subprocess.Popen:
    """A LingBot-Map node process named ``name`` (no leading slash) with parameters file
    ``params``; ``remaps`` maps topic names to their remapped names (``-r from:=to``)."""
    args = ["--params-file", str(params), "-r", f"__node:={name}"]
    for source, target in (remaps or {}).items():
        args += ["-r", f"{source}:={target}"]
    return start_ros_process(NODE_MODULE, args, log, domain_id)


def stop_processes(*procs: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGINT to each process still running (all at once: they stop in parallel), up to ``grace``
    seconds for each to end, then SIGKILL and up to 10 s to reap it."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        proc.send_signal(signal.SIGINT)
    for proc in running:
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def log_tail(log: Path, chars: int = LOG_TAIL) -> str:
    """The last ``chars`` characters of a process log (empty when it does not exist yet)."""
    return log.read_text(errors="replace")[-chars:] if log.is_file() else ""


# ------------------------------------------------------------------ parameters
def fixture_params(fixtures: Path, params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` plus the tiny fixture model: ``checkpoint`` and ``model_config`` paths."""
    return {**params, "checkpoint": str(fixtures / "weights.safetensors"),
            "model_config": str(fixtures / "config.json")}


def write_node_params(path: Path, fixtures: Path, params: Mapping[str, Any]) -> Path:
    """``fixture_params(fixtures, params)`` written to the ROS parameters file ``path`` (for every node)."""
    from lingbot_map_ros.runtime.params import write_params_file

    return write_params_file(path, fixture_params(fixtures, params))


def parameter_value(value: bool | int | float | str) -> ParameterValue:
    """``value`` as a ParameterValue message of its own type (bool before int: a bool is an int)."""
    if isinstance(value, bool):
        return ParameterValue(type=ParameterType.PARAMETER_BOOL, bool_value=value)
    if isinstance(value, int):
        return ParameterValue(type=ParameterType.PARAMETER_INTEGER, integer_value=value)
    if isinstance(value, float):
        return ParameterValue(type=ParameterType.PARAMETER_DOUBLE, double_value=value)
    return ParameterValue(type=ParameterType.PARAMETER_STRING, string_value=value)


# ------------------------------------------------------------------ inputs
def generated_frames(n: int, seed: int = 0) -> list[np.ndarray]:
    """``n`` rgb8 frames [294, 518, 3] uint8 of one blocky random scene (8 px blocks), panning
    7 px right and 1 px down a frame."""
    rng = np.random.default_rng(seed)
    big = np.kron(rng.integers(0, 256, (40, 120, 3)).astype(np.float32), np.ones((8, 8, 1)))
    return [big[10 + i: 304 + i, 20 + 7 * i: 538 + 7 * i].astype(np.uint8) for i in range(n)]


def image_msg(rgb: np.ndarray, stamp: Time | int, frame_id: str = "cam_optical", encoding: str = "rgb8") -> Image:
    """An Image message of ``rgb`` [H, W, 3] uint8 stamped ``stamp`` (a Time, or whole seconds)."""
    from lingbot_map_ros.ros.conversions import rgb_to_image_msg

    if isinstance(stamp, int):
        stamp = Time(sec=stamp)
    return rgb_to_image_msg(rgb, Header(stamp=stamp, frame_id=frame_id), encoding)


# ------------------------------------------------------------------ test nodes
class GraphClient:
    """A test node in its own context on ``domain_id`` (loopback only), spun by a background
    multi-threaded executor from construction on.

    Subscriptions made with ``record`` / ``record_by_sec`` / ``subscribe`` store messages in
    ``msgs`` under ``cond`` and notify it; ``wait`` blocks on ``cond`` until a predicate holds,
    with a real timeout (``timeout`` seconds unless a call says otherwise). Processes given to
    ``watch`` make a wait fail at once, with their log, when one of them has ended.
    """

    def __init__(self, name: str, domain_id: int, timeout: float) -> None:
        loopback_only()
        self.timeout = timeout
        self.context = rclpy.Context()
        rclpy.init(context=self.context, domain_id=domain_id)
        self.node = rclpy.create_node(name, context=self.context)
        self.cond = threading.Condition()
        self.msgs: dict[str, Any] = {}
        self._watched: list[tuple[subprocess.Popen, Path]] = []
        self.executor = MultiThreadedExecutor(num_threads=2, context=self.context)
        self.executor.add_node(self.node)
        self._thread = threading.Thread(target=self.executor.spin, daemon=True)
        self._thread.start()

    def subscribe(self, msg_type: type, topic: str, on_msg: Callable[[Any], None], depth: int) -> None:
        """Subscribe (reliable, volatile, keep last ``depth``): ``on_msg`` runs under ``cond``, then
        waiters are woken."""
        def callback(msg) -> None:
            with self.cond:
                on_msg(msg)
                self.cond.notify_all()
        self.node.create_subscription(msg_type, topic, callback, QoSProfile(depth=depth))

    def record(self, msg_type: type, topic: str, key: str, depth: int = 200) -> list:
        """Every message on ``topic``, in arrival order, in ``msgs[key]`` (a list, returned)."""
        store = self.msgs.setdefault(key, [])
        self.subscribe(msg_type, topic, store.append, depth)
        return store

    def record_by_sec(self, msg_type: type, topic: str, key: str, depth: int = 50) -> dict:
        """The last message of each header stamp second on ``topic`` in ``msgs[key]`` (a dict, returned)."""
        store = self.msgs.setdefault(key, {})
        self.subscribe(msg_type, topic, lambda msg: store.__setitem__(msg.header.stamp.sec, msg), depth)
        return store

    def count(self, key: str) -> int:
        with self.cond:
            return len(self.msgs[key])

    def watch(self, proc: subprocess.Popen, log: Path) -> None:
        """From now on every ``wait`` fails when ``proc`` has ended, and quotes ``log`` on a timeout."""
        self._watched.append((proc, log))

    def wait(self, predicate: Callable[[], Any], what: str = "a condition", timeout: float | None = None,
             repeat: Callable[[], None] | None = None, period: float = REPUBLISH_PERIOD):
        """The first truthy value of ``predicate()`` (called under ``cond``), checked at every
        notification and at least every 0.1 s; AssertionError naming ``what`` after ``timeout`` s.
        ``repeat``, when given, is called first and again every ``period`` s until it holds."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        next_repeat = time.monotonic()
        with self.cond:
            while True:
                if repeat is not None and time.monotonic() >= next_repeat:
                    repeat()
                    next_repeat = time.monotonic() + period
                value = predicate()
                if value:
                    return value
                for proc, log in self._watched:
                    assert proc.poll() is None, f"{log.stem} ended early (exit {proc.returncode}):\n{log_tail(log)}"
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    logs = "".join(f"\n{log.name}:\n{log_tail(log)}" for _, log in self._watched)
                    raise AssertionError(f"timed out after {timeout} s waiting for {what}{logs}")
                self.cond.wait(min(remaining, 0.1))

    def publish_until(self, publisher, msg, predicate: Callable[[], Any], what: str,
                      timeout: float | None = None, period: float = REPUBLISH_PERIOD):
        """Publish ``msg`` and again every ``period`` s until ``predicate()`` holds (``wait``'s
        value, its timeout and its failure).

        For a writer's first message to a node: ``publisher.get_subscription_count() >= 1`` says
        only that the writer has matched the node's reader; until the reader has matched the writer
        too (DDS discovery runs on each side), a sample is lost, reliable QoS or not. Once one
        sample arrived, the later ones of the same writer do (reliable, in order). A second copy of
        the message can arrive too: the node drops a repeated stamp (a warning, a status and
        ``frames_dropped_stamp``), so use this where that does not change what the test asserts."""
        return self.wait(predicate, what, timeout, repeat=lambda: publisher.publish(msg), period=period)

    def send_for_status(self, publisher, msg, status_key: str, first: bool = False):
        """Publish the image ``msg`` and wait for the node's status about its stamp (from the
        statuses recorded under ``status_key``; not the start-up "ready" one); ``first``: a
        writer's first image, sent with ``publish_until``."""
        stamp = msg.header.stamp
        status = lambda: next((s for s in self.msgs[status_key] if s.header.stamp == stamp  # noqa: E731
                               and not s.state_text.startswith("ready")), None)
        what = f"a status on {status_key} for stamp {stamp.sec}"
        if first:
            return self.publish_until(publisher, msg, status, what)
        publisher.publish(msg)
        return self.wait(status, what=what)

    def call_async(self, srv_type: type, name: str, request) -> Future:
        """Call service ``name`` once it is there (``timeout`` s at most); the future of its answer."""
        client = self.node.create_client(srv_type, name)
        assert client.wait_for_service(timeout_sec=self.timeout), f"service {name} not available"
        return client.call_async(request)

    def call(self, srv_type: type, name: str, request, timeout: float | None = None):
        """Call service ``name`` and return its answer (``timeout`` s for it to be there, as many to answer)."""
        timeout = self.timeout if timeout is None else timeout
        client = self.node.create_client(srv_type, name)
        try:
            assert client.wait_for_service(timeout_sec=max(timeout, self.timeout)), f"service {name} not available"
            future = client.call_async(request)
            deadline = time.monotonic() + timeout
            while not future.done() and time.monotonic() < deadline:
                time.sleep(0.005)
            assert future.done(), f"{name} did not answer within {timeout} s"
            return future.result()
        finally:
            self.node.destroy_client(client)

    def set_parameter(self, node: str, name: str, value: bool | int | float | str) -> SetParametersResult:
        """Set parameter ``name`` of node ``node`` (full name) over its service; the node's result."""
        request = SetParameters.Request(parameters=[ParameterMsg(name=name, value=parameter_value(value))])
        return self.call(SetParameters, f"{node}/set_parameters", request).results[0]

    def close(self) -> None:
        """Stop the executor (its spin thread joined, 5 s at most), then the node and the context."""
        self.executor.shutdown(timeout_sec=2.0)
        self._thread.join(timeout=5.0)
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)


class InProcessNode:
    """LingBotMapNode ``name`` in its own context on ``domain_id`` (loopback only), spun like
    ``main.main``: one executor thread for the node, a multi-threaded executor for its services."""

    def __init__(self, name: str, params: Mapping[str, Any], domain_id: int) -> None:
        from lingbot_map_ros.ros.main import SERVICE_THREADS
        from lingbot_map_ros.ros.node import LingBotMapNode

        loopback_only()
        self.context = rclpy.Context()
        rclpy.init(context=self.context, domain_id=domain_id)
        overrides = [Parameter(k, value=v) for k, v in params.items()]
        self.node = LingBotMapNode(name, context=self.context, parameter_overrides=overrides)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.services = MultiThreadedExecutor(num_threads=SERVICE_THREADS, context=self.context)
        self.services.add_node(self.node.service_node)
        self._threads: list[threading.Thread] = []

    def start(self) -> "InProcessNode":
        """Spin both executors on daemon threads; returns self."""
        self._threads = [threading.Thread(target=ex.spin, daemon=True) for ex in (self.executor, self.services)]
        for thread in self._threads:
            thread.start()
        return self

    def close(self) -> None:
        """Shut the node down, stop both executors (their threads joined, 5 s each at most), destroy it."""
        self.node.shutdown()
        self.services.shutdown(timeout_sec=2.0)
        self.executor.shutdown(timeout_sec=2.0)
        for thread in self._threads:
            thread.join(timeout=5.0)
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)


# ------------------------------------------------------------------ expectations
def replay_session(fixtures: Path, params: Mapping[str, Any]):
    """A fresh LongStreamSession of the fixture model with the stream settings the node resolves from
    ``params`` (CPU, fp32): feed it ``engine.model_input(rgb, width)`` to get the node's results."""
    import json

    from lingbot_map_ros.config import ModelConfig
    from lingbot_map_ros.io.checkpoint import load_model
    from lingbot_map_ros.runtime.params import resolve_settings
    from lingbot_map_ros.stream.long_stream import LongStreamSession
    from lingbot_map_ros.stream.session import StreamingSession

    settings = resolve_settings({**params, "model_config": str(fixtures / "config.json")})
    model = load_model(ModelConfig.from_dict(json.loads((fixtures / "config.json").read_text())),
                       fixtures / "weights.safetensors")
    return LongStreamSession(StreamingSession(model, settings.stream), settings.long_stream)


def pose_matrix(msg: PoseStamped) -> np.ndarray:
    """The [4, 4] float64 rigid transform of a PoseStamped (``T_<header frame>_<pose>``)."""
    from lingbot_map_ros.geometry import quaternion_to_matrix

    p, q = msg.pose.position, msg.pose.orientation
    T = np.eye(4)
    T[:3, :3] = quaternion_to_matrix(np.array([q.x, q.y, q.z, q.w]))
    T[:3, 3] = (p.x, p.y, p.z)
    return T


def holders(obj: Any, depth: int = 16, limit: int = 12) -> str:
    """What keeps ``obj`` alive, for a failure message: chains of referrers (type names, and the key
    where a dict holds it), breadth first from ``obj`` up to a module or a frame, at most ``depth``
    steps. Only used after an assertion about a release has failed."""
    import gc
    import inspect
    import types

    frozen = gc.get_freeze_count()
    gc.unfreeze()  # the collector does not look into frozen objects for referrers
    gc.collect()
    this = inspect.currentframe()
    objs, paths, found = [obj], [[type(obj).__name__]], []
    seen = {id(obj)}
    i = 0
    while i < len(objs) and len(found) < limit and len(objs) < 20000:
        target, path = objs[i], paths[i]
        i += 1
        for r in gc.get_referrers(target):
            if r is this or r is objs or r is paths:
                continue
            if isinstance(r, types.FrameType):
                found.append(" <- ".join(path + [f"frame {r.f_code.co_name} ({r.f_code.co_filename}:{r.f_lineno})"]))
            elif isinstance(r, dict) and "__name__" in r and "__spec__" in r:
                found.append(" <- ".join(path + [f"module {r['__name__']}"]))
            elif len(path) < depth and id(r) not in seen:
                seen.add(id(r))
                label = type(r).__name__
                if isinstance(r, dict):
                    label = next((f"dict[{k!r}]" for k, v in r.items() if v is target), "dict")
                objs.append(r)
                paths.append(path + [label])
    # Running functions' locals are not objects the collector sees: look through every thread's stack.
    holding = {id(o): p for o, p in zip(objs, paths)}
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        while frame is not None and len(found) < limit:
            if frame is not this and frame.f_back is not this:
                for local, value in frame.f_locals.items():
                    if id(value) in holding:
                        code = frame.f_code
                        found.append(" <- ".join(holding[id(value)] + [
                            f"local {local} of {code.co_name} ({code.co_filename}:{frame.f_lineno}) "
                            f"on thread {names.get(ident, ident)}"]))
            frame = frame.f_back
    return "\n".join(found) or (f"no holder within {depth} steps ({frozen} objects were frozen; "
                                f"{sys.getrefcount(obj) - 3} references the collector cannot see)")
