"""The node's parameters over ROS: declared from the table (``runtime.param_table``), read into
``NodeSettings`` (``runtime.params``), checked and applied at run time.

- ``declare_parameters(node)``: every parameter with its descriptor (description, range or
  choices, read-only unless dynamic; a managed node's are writable until configure, see
  ``ros.lifecycle``); returns whether the node is managed.
- ``read_parameters(node)``: the values resolved (each logged) and the per-camera
  ``camera.<c>.<p>`` ones declared for a listed camera; returns the node's settings and each
  camera's ({"": the node's} without ``cameras``).
- ``settings_after(settings, per_camera, params)``: the settings a parameter set would give (a
  ``ConfigError`` names a value the node cannot take at run time); the node refuses the set with
  that reason or applies it.
"""
from __future__ import annotations

from dataclasses import replace

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor, ParameterType
from rclpy.node import Node
from rclpy.parameter import Parameter

from ..runtime.params import (CAMERA_PARAMETERS, CAMERA_PREFIX, PARAMETERS, NodeSettings, Param, apply_camera_dynamic,
                              apply_dynamic, camera_param_name, camera_values, resolve_camera_settings,
                              resolve_settings)

PARAMETER_TABLE = {p.name: p for p in PARAMETERS}


def descriptor(p: Param, writable: bool = False) -> ParameterDescriptor:
    """ParameterDescriptor with the description, range or choices of ``p`` (read-only unless dynamic
    or ``writable``)."""
    d = ParameterDescriptor(description=p.description, read_only=not (p.dynamic or writable))
    if p.choices is not None:
        d.additional_constraints = "one of: " + ", ".join(p.choices)
    if p.limits is not None and not isinstance(p.default, bool):
        lo, hi, step = p.limits
        if isinstance(p.default, int):
            d.integer_range = [IntegerRange(from_value=int(lo), to_value=int(hi), step=int(step))]
        else:
            d.floating_point_range = [FloatingPointRange(from_value=float(lo), to_value=float(hi), step=float(step))]
    return d


def declare_parameters(node: Node) -> bool:
    """Declare every parameter on ``node``; returns ``managed``. A managed node's parameters stay
    writable (its configure reads them; ``managed`` itself is read-only); rclpy's
    ParameterException for a value of the wrong type."""
    managed = PARAMETER_TABLE["managed"]
    node.declare_parameter(managed.name, managed.default, descriptor(managed))
    writable = bool(node.get_parameter(managed.name).value)
    for p in PARAMETERS:
        if p.name == "cameras":
            _declare_string_array(node, p, writable)
        elif p.name != managed.name:
            node.declare_parameter(p.name, p.default, descriptor(p, writable))
    return writable


def read_parameters(node: Node) -> tuple[NodeSettings, dict[str, NodeSettings]]:
    """The declared values resolved (each logged) and the per-camera parameters of a listed camera
    declared and resolved; ConfigError or rclpy's ParameterException for a bad value."""
    values = {p.name: node.get_parameter(p.name).value for p in PARAMETERS}
    settings = resolve_settings(values, log=node.get_logger().info)
    return settings, _declare_camera_parameters(node, values, settings.cameras) or {"": settings}


def _declare_string_array(node: Node, p: Param, writable: bool) -> None:
    """Declare ``p`` as a string array holding [] when not given: a default [] would type it as a
    byte array (a YAML list of names would then be refused), and a params file's ``[]`` has no
    type at all (the parameter would stay uninitialized, and ``ros2 param get`` fail)."""
    final = descriptor(p, writable)
    final.type = ParameterType.PARAMETER_STRING_ARRAY
    first = descriptor(p)
    first.read_only = False  # until it has a value (below); set_descriptor then gives it its own
    node.declare_parameter(p.name, Parameter.Type.STRING_ARRAY, first)
    if node.get_parameter_or(p.name).type_ == Parameter.Type.NOT_SET:  # not given, or given as []
        node.set_parameters([Parameter(p.name, Parameter.Type.STRING_ARRAY, list(p.default))])
    node.set_descriptor(p.name, final)


def _declare_camera_parameters(node: Node, values: dict, cameras: tuple[str, ...]) -> dict[str, NodeSettings]:
    """Declare camera.<c>.<p> for each listed camera and per-camera parameter (default: the global
    value) and resolve each camera's settings; ConfigError for a camera.* override naming an
    unknown camera or parameter, or a bad value."""
    overrides = {name: p.value for name, p in node._parameter_overrides.items() if name.startswith(CAMERA_PREFIX)}
    camera_values(cameras, overrides)  # refuses unknown cameras/parameters and bad values, naming them
    if not cameras:
        return {}
    per_camera = {}
    for camera in cameras:
        per_camera[camera] = {}
        for name in CAMERA_PARAMETERS:
            p = PARAMETER_TABLE[name]
            full = camera_param_name(camera, name)
            own = replace(p, name=full, description=f"camera {camera}: {p.description}")
            if not node.has_parameter(full):  # a managed node configured again keeps its own
                node.declare_parameter(full, values[name], descriptor(own, _writable(node)))
            per_camera[camera][name] = node.get_parameter(full).value
    return resolve_camera_settings(values, per_camera, log=node.get_logger().info)


def _writable(node: Node) -> bool:
    return bool(node.get_parameter("managed").value)


def settings_after(settings: NodeSettings, per_camera: dict[str, NodeSettings], params
                   ) -> tuple[NodeSettings, dict[str, NodeSettings]]:
    """(the node's settings, each camera's) after ``params``; ConfigError for a value the node
    cannot take at run time. Parameters that are not ours (use_sim_time, QoS overrides) pass."""
    listed = bool(settings.cameras)
    for p in params:
        if listed and (p.name in PARAMETER_TABLE or p.name.startswith(CAMERA_PREFIX)):
            per_camera = apply_camera_dynamic(per_camera, p.name, p.value)
        if p.name in PARAMETER_TABLE:
            settings = apply_dynamic(settings, p.name, p.value)
    return settings, per_camera if listed else {"": settings}


__all__ = ["PARAMETER_TABLE", "declare_parameters", "read_parameters", "descriptor", "settings_after"]
