"""The node's logic without ROS: inference engine, camera scheduler, work queue and threads,
trajectory and map memory, several cameras' map alignment and saving, and the parameter table.

Nothing here imports rclpy or a message package (``test/core/test_layering.py``): it is
tested on the CPU without a ROS graph; ``ros/`` wraps it into the node."""
