"""The node as a managed (lifecycle) node: ``ManagedNode``, rclpy's ``LifecycleNodeMixin`` over the
node's own phases.

With the parameter ``managed`` (read-only, ``managed:=true`` in the launch file) the node starts
unconfigured and rclpy's state machine drives it (lifecycle services ``~/change_state``,
``~/get_state``, ``~/get_available_states``, ``~/get_available_transitions``,
``~/get_transition_graph`` and the topic ``~/transition_event``, as rclpy provides them; Nav2's
lifecycle_manager calls them). Each transition runs one phase of the node (``ros.node``):

==========  ===============================  =====================================================
transition  phase                            what it does
==========  ===============================  =====================================================
configure   ``configure_node``               parameters read and checked, GPU memory checked, the
                                             checkpoint loaded, journals opened (a resume runs the
                                             model over them), engines, publishers (inactive) and
                                             services made, the TF listener started (the URDF's
                                             transforms fill its buffer), the inference thread
                                             started (idle: no image comes in)
activate    ``activate_node``                publishers enabled, image, camera_info and depth
                                             subscribed, timers started
deactivate  ``deactivate_node``              inputs unsubscribed, timers stopped, the frame in
                                             progress finished, publishers disabled; the model's
                                             state (cache, path, map, grid) is kept and services
                                             still answer (~/save_map, ~/reset)
cleanup     ``cleanup_node``                 threads stopped, journals closed, every entity made at
                                             configure destroyed, the model and sessions dropped,
                                             the GPU's cached memory given back
shutdown    (from any state) the same as deactivate + cleanup: journals and files complete
==========  ===============================  =====================================================

A configure that cannot complete (a bad parameter or checkpoint, too little GPU memory: a
``StartupError``) undoes what it made, logs the reason as an error ("configure failed: ...") and
answers FAILURE: the node stays unconfigured and a later configure (e.g. after ``ros2 param set``:
a managed node's parameters are writable while it is unconfigured) starts again from nothing. A
transition the state machine does not allow from the current state (activate before configure)
is refused by rclpy itself.

Publishers: while the node is managed every publisher it (or tf2_ros's broadcaster) creates is a
``LifecyclePublisher``; they publish only while active. A plain node (``managed`` false) never
initialises the mixin: no state machine, no lifecycle services, the same graph as before.
"""
from __future__ import annotations

from typing import Any

from rclpy.lifecycle import LifecycleNodeMixin, LifecycleState, TransitionCallbackReturn
from rclpy.node import Node

from .startup import StartupError


class ManagedNode(LifecycleNodeMixin):
    """The lifecycle transitions of a node class that also derives from ``rclpy.node.Node`` and
    implements the phases ``configure_node``, ``activate_node``, ``deactivate_node`` and
    ``cleanup_node`` (see the module docstring). ``start_lifecycle`` makes it managed."""

    _lifecycle_on = False  # the mixin is initialised (a managed node)
    _publishing = False  # lifecycle publishers made now are enabled at once (the node is active)
    _configured = False
    _active = False

    def start_lifecycle(self) -> None:
        """Initialise rclpy's lifecycle state machine and services (unconfigured)."""
        LifecycleNodeMixin.__init__(self, enable_communication_interface=True)
        self._lifecycle_on = True

    def create_publisher(self, msg_type, topic, qos_profile, **kwargs) -> Any:
        """A managed node's publishers are lifecycle publishers (enabled while active)."""
        if not self._lifecycle_on:
            return Node.create_publisher(self, msg_type, topic, qos_profile, **kwargs)
        publisher = self.create_lifecycle_publisher(msg_type, topic, qos_profile, **kwargs)
        if self._publishing:  # made while active (e.g. TF switched on at run time)
            publisher.on_activate(None)
        return publisher

    # ------------------------------------------------------------------ transitions
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        log = self.get_logger()
        try:
            self.configure_node()
        except StartupError as exc:
            log.error(f"configure failed: {exc}")
            self._undo("configure")
            return TransitionCallbackReturn.FAILURE
        except Exception as exc:  # anything else: the same, with its type
            log.error(f"configure failed: {type(exc).__name__}: {exc}")
            self._undo("configure")
            return TransitionCallbackReturn.FAILURE
        self._configured = True
        log.info("configured: model loaded, services ready; activate to subscribe and publish")
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        result = LifecycleNodeMixin.on_activate(self, state)  # publishers first: the first frame's outputs go out
        if result != TransitionCallbackReturn.SUCCESS:
            return result
        self._publishing = True
        try:
            self.activate_node()
        except Exception as exc:
            self.get_logger().error(f"activate failed: {type(exc).__name__}: {exc}")
            self._stop_activity()
            return TransitionCallbackReturn.FAILURE
        self._active = True
        return TransitionCallbackReturn.SUCCESS

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop_activity()
        self.get_logger().info("deactivated: inputs and outputs stopped; the map and the model's state are kept")
        return TransitionCallbackReturn.SUCCESS

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._undo("cleanup")
        self.get_logger().info("cleaned up: model and sessions released")
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        if self._active:
            self._stop_activity()
        if self._configured:
            self._undo("shutdown")
        return TransitionCallbackReturn.SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        """A transition raised (rclpy's ErrorProcessing): back to unconfigured, nothing left running."""
        self.get_logger().error(f"lifecycle error during a transition from {state.label}: resetting to unconfigured")
        if self._active:
            self._stop_activity()
        self._undo("error")
        return TransitionCallbackReturn.SUCCESS

    # ------------------------------------------------------------------ helpers
    def _stop_activity(self) -> None:
        """Inputs and timers stopped, the frame in progress finished, then publishers disabled."""
        try:
            self.deactivate_node()
        finally:
            self._active = self._publishing = False
            LifecycleNodeMixin.on_deactivate(self, None)

    def _undo(self, why: str) -> None:
        """Everything ``configure_node`` made is released (also after a partial configure)."""
        try:
            self.cleanup_node()
        except Exception as exc:  # never leave the transition half done for an error in the clean-up
            self.get_logger().error(f"{why}: clean-up incomplete: {type(exc).__name__}: {exc}")
        self._configured = False


__all__ = ["ManagedNode"]
