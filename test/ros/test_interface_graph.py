"""The node's real ROS interface equals the table in ``lingbot_map_ros/ros/interface.py`` (the
source of docs/reference.md): names and types of its publishers, subscriptions and services as
the ROS graph reports them, and the QoS of every publisher and subscription it created.

The node runs in this process (tiny fixture weights, CPU), once with one camera and the default
outputs, once with two cameras whose per-camera parameters differ (compressed input on one,
reliable input QoS on the other, depth input for the metric scale, no depth output), once as a
managed node with the occupancy grid (configured and activated). The graph is
read through the node's own context (its entities are local there: no discovery wait).
"""
from __future__ import annotations

import time

import pytest

rclpy = pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")

from rclpy.qos import DurabilityPolicy, ReliabilityPolicy  # noqa: E402

from graph_helpers import InProcessNode, fixture_params, private_domain_id  # noqa: E402
from lingbot_map_ros.ros.interface import ENDPOINTS, expected  # noqa: E402
from lingbot_map_ros.runtime.params import resolve_camera_settings, resolve_settings  # noqa: E402

pytestmark = [pytest.mark.ros, pytest.mark.slow]

DOMAIN_ID = private_domain_id(__name__, 1, 100, 7, 13 + 17)  # not the other graph modules' offsets
BASE = {"image_width": 98, "num_scale_frames": 2, "sliding_window": 3, "device": "cpu"}
# rclpy's own endpoints on every node (parameter services, rosout, parameter events, type description)
STANDARD_PUBLISHERS = {"/rosout", "/parameter_events"}
STANDARD_SERVICES = {"describe_parameters", "get_parameter_types", "get_parameters", "list_parameters",
                     "set_parameters", "set_parameters_atomically", "get_type_description"}
GRAPH_TIMEOUT = 10.0


def full_name(name: str, node: str) -> str:
    if name.startswith("~/"):
        return f"/{node}/{name[2:]}"
    return name if name.startswith("/") else f"/{name}"


def graph(node) -> dict[str, set[tuple[str, str]]]:
    """{kind: {(name, type)}} of the node and its service helper, rclpy's standard ones left out."""
    n = node.node
    ns = n.get_namespace()

    def named(pairs) -> set[tuple[str, str]]:
        return {(name, t) for name, types in pairs for t in types}

    services = named(n.get_service_names_and_types_by_node(n.service_node.get_name(), ns))
    services |= named(n.get_service_names_and_types_by_node(n.get_name(), ns))
    return {
        "publisher": {x for x in named(n.get_publisher_names_and_types_by_node(n.get_name(), ns))
                      if x[0] not in STANDARD_PUBLISHERS},
        "subscription": named(n.get_subscriber_names_and_types_by_node(n.get_name(), ns)),
        "service": {x for x in services if x[0].rsplit("/", 1)[-1] not in STANDARD_SERVICES},
        "service_node_publishers": {x for x in named(n.get_publisher_names_and_types_by_node(
            n.service_node.get_name(), ns)) if x[0] not in STANDARD_PUBLISHERS},
        "service_node_subscriptions": named(n.get_subscriber_names_and_types_by_node(n.service_node.get_name(), ns)),
    }


def table(node_name: str, settings, cameras=()) -> tuple[dict[str, set[tuple[str, str]]], dict]:
    """({kind: {(name, type)}}, {(kind, name): Qos}) the table says a node with ``settings`` creates."""
    want: dict[str, set[tuple[str, str]]] = {"publisher": set(), "subscription": set(), "service": set()}
    qos = {}
    for entry, name, s in expected(settings, cameras):
        full = full_name(name, node_name)
        want[entry.kind].add((full, entry.type))
        if entry.kind != "service":
            qos[(entry.kind, full)] = entry.qos_for(s)
    return want, qos


def check(node, node_name: str, settings, cameras=()) -> None:
    want, want_qos = table(node_name, settings, cameras)
    deadline = time.monotonic() + GRAPH_TIMEOUT
    while True:  # the graph of the node's own context is local; the services helper may lag a moment
        got = graph(node)
        if all(got[k] == want[k] for k in want) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for kind in want:
        extra, missing = sorted(got[kind] - want[kind]), sorted(want[kind] - got[kind])
        assert not extra and not missing, (
            f"{kind}s of the node differ from lingbot_map_ros/ros/interface.py: not in the table {extra}, "
            f"in the table but not created {missing} (update the table, then python scripts/gen_reference.py)")
    assert not got["service_node_publishers"] and not got["service_node_subscriptions"], got
    # QoS of every endpoint the node object made (depth included: the graph does not report it)
    made = {("publisher", p.topic_name): p.qos_profile for p in node.node.publishers}
    made.update({("subscription", s.topic_name): s.qos_profile for s in node.node.subscriptions})
    for key, q in want_qos.items():
        if key not in made and key[1].endswith("/transition_event"):
            continue  # rcl_lifecycle's own publisher: not one of the node object's
        profile = made[key]
        assert profile.reliability == (ReliabilityPolicy.RELIABLE if q.reliable else ReliabilityPolicy.BEST_EFFORT), \
            (key, profile)
        assert profile.durability == (DurabilityPolicy.TRANSIENT_LOCAL if q.transient_local
                                      else DurabilityPolicy.VOLATILE), (key, profile)
        assert profile.depth == q.depth, (key, profile.depth, q.depth)


def test_one_camera_default_outputs(fixtures):
    params = fixture_params(fixtures, BASE)
    node = InProcessNode("iface_one", params, DOMAIN_ID)
    try:
        check(node, "iface_one", {"": resolve_settings(params)})
    finally:
        node.close()


def test_one_camera_with_every_optional_output_off(fixtures):
    """The conditions hold the other way too: what is turned off is not created."""
    params = fixture_params(fixtures, {**BASE, "publish_tf": False, "publish_pose": False, "publish_odometry": False,
                                       "publish_path": False, "publish_points": False, "publish_map": False,
                                       "publish_depth": False, "input_qos": "reliable"})
    node = InProcessNode("iface_off", params, DOMAIN_ID)
    try:
        settings = resolve_settings(params)
        names = {name for _, name, _ in expected({"": settings})}
        assert names == {"image", "camera_info", "~/status", "~/frame", "/diagnostics", "~/reset",
                         "~/set_deferred_eviction", "~/commit_eviction", "~/rollback_last_frame", "~/save_map",
                         "~/save_session", "~/load_session"}, names
        check(node, "iface_off", {"": settings})
    finally:
        node.close()


def test_two_cameras_with_their_own_input_settings(fixtures):
    params = fixture_params(fixtures, {**BASE, "cameras": ["front", "rear"], "scale_source": "depth",
                                       "publish_depth": False, "publish_points": False})
    own = {"front": {"input_qos": "reliable"}, "rear": {"input_transport": "compressed"}}
    overrides = {f"camera.{c}.{k}": v for c, kv in own.items() for k, v in kv.items()}
    node = InProcessNode("iface_two", {**params, **overrides}, DOMAIN_ID)
    try:
        settings = resolve_camera_settings({k: v for k, v in params.items()}, own)
        check(node, "iface_two", settings, ("front", "rear"))
    finally:
        node.close()


def test_managed_node_with_the_grid_once_active(fixtures):
    """managed:=true adds rclpy's lifecycle services and transition events; grid:=true adds ~/grid;
    loop_closure:=true adds ~/set_pose, ~/pose_prior and ~/loop_closures."""
    from rclpy.lifecycle import TransitionCallbackReturn

    params = fixture_params(fixtures, {**BASE, "managed": True, "grid": True, "scale_source": "fixed",
                                       "base_frame": "base_link", "loop_closure": True})
    node = InProcessNode("iface_managed", params, DOMAIN_ID)
    try:
        assert node.node.trigger_configure() == TransitionCallbackReturn.SUCCESS
        assert node.node.trigger_activate() == TransitionCallbackReturn.SUCCESS
        check(node, "iface_managed", {"": resolve_settings(params)})
    finally:
        node.close()


def test_every_table_entry_is_seen_by_one_of_the_configurations():
    """The two configurations above cover every entry but the ones they turn off on purpose;
    those are named here, so a new entry must be covered or listed."""
    from lingbot_map_ros.runtime.params import PARAMETERS

    defaults = {p.name: p.default for p in PARAMETERS}
    one = resolve_settings({**defaults, **BASE})
    two = resolve_settings({**defaults, **BASE, "scale_source": "depth", "input_transport": "compressed"})
    seen = {(e.kind, e.name, e.type) for e, _, _ in expected({"": one})}
    seen |= {(e.kind, e.name, e.type) for e, _, _ in expected({"a": two}, ("a",))}
    three = resolve_settings({**defaults, **BASE, "managed": True, "grid": True, "loop_closure": True})
    seen |= {(e.kind, e.name, e.type) for e, _, _ in expected({"": three})}
    unseen = sorted((e.kind, e.name) for e in ENDPOINTS if (e.kind, e.name, e.type) not in seen)
    assert unseen == [], unseen
