"""The managed node (``managed:=true``, ros/lifecycle.py) driven through its lifecycle services over
a real ROS 2 graph, as Nav2's lifecycle_manager drives it: wrong-order transitions refused by the
state machine; a configure with a bad checkpoint or an impossible memory budget fails with the
reason (on /rosout) and leaves the node unconfigured; configure -> activate -> frames -> poses;
deactivate -> no intake, the map kept (saved while inactive); activate -> poses continue in the
same map; cleanup -> the model and sessions released; shutdown -> finalized.

The node runs in this process (tiny fixture weights, CPU) so that the test can also look at what
the graph cannot show (the engine's counters, a weak reference to the model)."""
from __future__ import annotations

import weakref

import pytest

rclpy = pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")

from geometry_msgs.msg import PoseStamped  # noqa: E402
from lifecycle_msgs.msg import Transition  # noqa: E402
from lifecycle_msgs.srv import ChangeState, GetState  # noqa: E402
from rcl_interfaces.msg import Log  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402

from lingbot_map_ros.msg import Status  # noqa: E402
from lingbot_map_ros.srv import SaveMap  # noqa: E402

from graph_helpers import (GraphClient, InProcessNode, fixture_params, generated_frames, holders,  # noqa: E402
                           image_msg, private_domain_id)

pytestmark = [pytest.mark.ros]

DOMAIN_ID = private_domain_id(__name__, 1, 100, 7, 13 + 25)  # not the other graph modules' offsets
NAME = "lifecycle_map"
NODE = f"/{NAME}"
TIMEOUT = 60.0
BASE = {"image_width": 98, "num_scale_frames": 2, "sliding_window": 3, "device": "cpu", "managed": True,
        "publish_depth": False, "publish_points": False, "conf_threshold": 0.0, "map_publish_rate": 0.0,
        # the grid on (off for want of TF: no base_link here) so that its outputs are released too
        "grid": True, "scale_source": "fixed", "base_frame": "base_link"}


def change(client: GraphClient, transition: int, node: str = NODE) -> bool:
    request = ChangeState.Request(transition=Transition(id=transition))
    return client.call(ChangeState, f"{node}/change_state", request, timeout=TIMEOUT).success


def state(client: GraphClient, node: str = NODE) -> str:
    return client.call(GetState, f"{node}/get_state", GetState.Request()).current_state.label


def first_state(client: GraphClient, node: str, attempts: int = 10) -> str:
    """The state, asked until an answer comes (at most ``attempts`` times, 5 s each): a request sent
    before DDS matched the server's reply writer to the client is answered into the void, and
    asking again is harmless."""
    for _ in range(attempts - 1):
        try:
            return client.call(GetState, f"{node}/get_state", GetState.Request(), timeout=5.0).current_state.label
        except AssertionError:
            continue
    return state(client, node)


def subscribed_topics(node) -> set[str]:
    return {s.topic_name for s in node.subscriptions}


def test_the_lifecycle_of_the_managed_node(fixtures, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a checkpoint")
    params = {**fixture_params(fixtures, BASE), "checkpoint": str(bad), "output_directory": str(tmp_path)}
    node = InProcessNode(NAME, params, DOMAIN_ID).start()
    client = GraphClient("lifecycle_client", DOMAIN_ID, TIMEOUT)
    try:
        logs = client.record(Log, "/rosout", "log", depth=500)
        poses = client.record(PoseStamped, f"{NODE}/pose", "pose")
        statuses = client.record(Status, f"{NODE}/status", "status", depth=500)
        images = client.node.create_publisher(Image, "/image", 10)
        n = node.node
        # unconfigured: nothing loaded, nothing subscribed; the state machine refuses what it does not allow
        assert first_state(client, NODE) == "unconfigured" and n.scheduler is None
        assert "/image" not in subscribed_topics(n)
        assert not change(client, Transition.TRANSITION_ACTIVATE) and state(client) == "unconfigured"

        # a bad checkpoint: configure fails with the reason, the node stays unconfigured
        assert not change(client, Transition.TRANSITION_CONFIGURE)
        assert state(client) == "unconfigured" and n.scheduler is None and not n.channels
        assert {p.topic_name for p in n.publishers} <= {"/rosout", "/parameter_events"}  # what it made is gone
        failed = client.wait(lambda: next((m.msg for m in logs if m.name == NAME and "configure failed" in m.msg),
                                          None), "the configure failure on /rosout")
        assert f"cannot read checkpoint {bad}" in failed, failed
        # parameters are writable while unconfigured: the checkpoint fixed, an impossible memory budget
        assert client.set_parameter(NODE, "checkpoint", str(fixtures / "weights.safetensors")).successful
        assert client.set_parameter(NODE, "gpu_memory_budget_gib", 0.6).successful
        assert not change(client, Transition.TRANSITION_CONFIGURE) and state(client) == "unconfigured"
        failed = client.wait(lambda: next((m.msg for m in logs if m.name == NAME and "not enough GPU memory"
                                           in m.msg), None), "the memory refusal on /rosout")
        assert failed.startswith("configure failed: ") and "gpu_memory_budget_gib" in failed, failed
        assert client.set_parameter(NODE, "gpu_memory_budget_gib", 0.0).successful

        # configure: loaded, services up, still nothing subscribed; read-only parameters refused now
        assert change(client, Transition.TRANSITION_CONFIGURE) and state(client) == "inactive"
        assert "/image" not in subscribed_topics(n) and n.scheduler is not None
        refused = client.set_parameter(NODE, "image_width", 112)
        assert not refused.successful and "read at configure" in refused.reason
        refused = client.set_parameter(NODE, "on_lost", "relocalize")  # dynamic, but it needs loop closure
        assert not refused.successful and "set loop_closure true" in refused.reason, refused.reason
        model = weakref.ref(n.sessions.model)

        # activate: frames in, poses out
        assert change(client, Transition.TRANSITION_ACTIVATE) and state(client) == "active"
        assert "/image" in subscribed_topics(n)
        frames = generated_frames(8)
        client.publish_until(images, image_msg(frames[0], 1), lambda: any(s.header.stamp.sec == 1 for s in statuses),
                             "the first frame's status")
        for i in range(2, 5):
            client.send_for_status(images, image_msg(frames[i - 1], i), "status")
        client.wait(lambda: any(p.header.stamp.sec == 4 for p in poses), "the pose of frame 4")
        engine = n.channels[""].engine
        path_before = [e.stamp_s for e in engine.seq.path.entries()]
        last_index = max(s.frame_index for s in statuses)

        # deactivate: no intake, the state and the map kept; services still answer (the map is saved)
        assert change(client, Transition.TRANSITION_DEACTIVATE) and state(client) == "inactive"
        assert "/image" not in subscribed_topics(n)
        client.wait(lambda: images.get_subscription_count() == 0, "the node's image subscription to go")
        received = engine.seq.counter_values().frames_received
        images.publish(image_msg(frames[4], 5))
        saved = client.call(SaveMap, f"{NODE}/save_map", SaveMap.Request(directory="inactive"))
        assert saved.success, saved.message  # a command on the inference thread: it is idle, the map there
        assert engine.seq.counter_values().frames_received == received and engine.seq.path.entries()
        assert [e.stamp_s for e in engine.seq.path.entries()] == path_before

        # activate again: the same sequence goes on
        assert change(client, Transition.TRANSITION_ACTIVATE) and state(client) == "active"
        client.publish_until(images, image_msg(frames[5], 6), lambda: any(s.header.stamp.sec == 6 for s in statuses),
                             "a status after the second activate")
        client.send_for_status(images, image_msg(frames[6], 7), "status")
        after = [s for s in statuses if s.header.stamp.sec in (6, 7) and s.state_text.startswith("tracking")]
        assert after and min(s.frame_index for s in after) > last_index  # numbered on, not restarted
        assert [e.stamp_s for e in engine.seq.path.entries()][:len(path_before)] == path_before

        # deactivate, cleanup: threads stopped, entities gone, the model released by the cleanup itself
        # (its garbage collection; the CUDA cache is emptied after it)
        del engine
        assert change(client, Transition.TRANSITION_DEACTIVATE)
        assert change(client, Transition.TRANSITION_CLEANUP)
        if model() is not None:  # what holds it, named in the failure
            pytest.fail("the model is still referenced after cleanup:\n" + holders(model()))
        assert state(client) == "unconfigured"
        assert n.scheduler is None and not n.channels
        assert not [s.srv_name for s in n.service_node.services if s.srv_name.startswith(NODE + "/")]
        assert {p.topic_name for p in n.publishers} <= {"/rosout", "/parameter_events"}
        assert not change(client, Transition.TRANSITION_ACTIVATE)  # unconfigured again

        # a second configure works; shutdown from inactive finalizes, nothing left running
        assert change(client, Transition.TRANSITION_CONFIGURE) and state(client) == "inactive"
        shutdown = ChangeState.Request(transition=Transition(id=Transition.TRANSITION_INACTIVE_SHUTDOWN))
        assert client.call(ChangeState, f"{NODE}/change_state", shutdown, timeout=TIMEOUT).success
        assert state(client) == "finalized" and n.scheduler is None
    finally:
        client.close()
        node.close()


def test_the_node_process_managed_from_its_command_line(fixtures, tmp_path):
    """``lingbot_map_node --ros-args -p managed:=true``: the process's own executors (ros/main.py) serve
    the transitions; configured and activated it poses frames, and SIGINT ends it with status 0."""
    from graph_helpers import start_ros_process, stop_processes, write_node_params

    params = write_node_params(tmp_path / "p.yaml", fixtures, {**BASE, "managed": False})  # -p below sets it
    name = "lifecycle_process"  # not the in-process node's name: no stale discovery of its services
    log = tmp_path / "node.log"
    proc = start_ros_process("lingbot_map_ros.ros.main", ["--params-file", str(params), "-r", f"__node:={name}",
                                                          "-p", "managed:=true"], log, DOMAIN_ID)
    client = GraphClient("lifecycle_process_client", DOMAIN_ID, TIMEOUT)
    client.watch(proc, log)
    try:
        poses = client.record(PoseStamped, f"/{name}/pose", "pose")
        client.record(Status, f"/{name}/status", "status", depth=500)
        images = client.node.create_publisher(Image, "/image", 10)
        assert first_state(client, f"/{name}") == "unconfigured"
        assert change(client, Transition.TRANSITION_CONFIGURE, f"/{name}")
        assert change(client, Transition.TRANSITION_ACTIVATE, f"/{name}") and state(client, f"/{name}") == "active"
        for i, frame in enumerate(generated_frames(3), 1):
            client.send_for_status(images, image_msg(frame, i), "status", first=i == 1)
        client.wait(lambda: poses, "a pose from the process")
    finally:
        client.close()
        stop_processes(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]
