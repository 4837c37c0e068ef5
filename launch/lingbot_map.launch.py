"""Launch the LingBot-Map node (and optionally RViz).

    ros2 launch lingbot_map_ros lingbot_map.launch.py \\
        checkpoint:=/path/to/lingbot-map.pt image_topic:=/camera/color/image_raw rviz:=true

Arguments:
  params_file        parameters YAML (default: this package's config/lingbot_map.yaml)
  checkpoint         overrides the params file's checkpoint when non-empty
  image_topic        remaps `image` (and `image/compressed` to <image_topic>/compressed)
  camera_info_topic  remaps `camera_info`
  input_transport    raw | compressed; empty = as in the params file
  namespace          namespace of the node (topics become /<namespace>/lingbot_map/...)
  use_sim_time       true when playing a bag with --clock
  rviz               true to start RViz with rviz/lingbot_map.rviz (topics of the empty namespace)
  dds_profile        Fast DDS profile of the node (FASTDDS_DEFAULT_PROFILES_FILE): large_messages
                     (default) = config/fastdds_large_messages.xml, 16 MB shared-memory segments so
                     that raw images over 512 KB are not sent as UDP fragments (export the same
                     file for the camera driver); a path to your own XML; or none (environment kept)
"""
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node
from launch_ros.substitutions import FindPackageShare

PACKAGE = "lingbot_map_ros"

ARGUMENTS = (
    ("params_file", "", "Parameters YAML; empty = the package's config/lingbot_map.yaml"),
    ("checkpoint", "", "Checkpoint path or Hugging Face id; overrides the params file when non-empty"),
    ("image_topic", "/camera/image_raw", "Image topic (raw); <image_topic>/compressed for compressed input"),
    ("camera_info_topic", "/camera/camera_info", "CameraInfo topic (optional input)"),
    ("input_transport", "", "raw or compressed; empty = as in the params file"),
    ("namespace", "", "Namespace of the node"),
    ("use_sim_time", "false", "Use /clock (bag playback)"),
    ("rviz", "false", "Start RViz with the package's configuration"),
    ("dds_profile", "large_messages", "Fast DDS profile of the node: large_messages (the package's "
     "config/fastdds_large_messages.xml), a path to an XML profile, or none"),
)
DDS_PROFILES = {"large_messages": "fastdds_large_messages.xml"}


def _is_true(text: str) -> bool:
    return text.strip().lower() in ("true", "1", "yes", "on")


def _setup(context, *args, **kwargs):
    value = {name: LaunchConfiguration(name).perform(context) for name, _, _ in ARGUMENTS}
    share = FindPackageShare(PACKAGE).perform(context)
    params_file = value["params_file"] or f"{share}/config/lingbot_map.yaml"
    overrides = {"use_sim_time": _is_true(value["use_sim_time"])}
    if value["checkpoint"]:
        overrides["checkpoint"] = value["checkpoint"]
    if value["input_transport"]:
        overrides["input_transport"] = value["input_transport"]
    image_topic = value["image_topic"]
    profile = value["dds_profile"].strip()
    env = {}
    if profile and profile.lower() != "none":
        env["FASTDDS_DEFAULT_PROFILES_FILE"] = f"{share}/config/{DDS_PROFILES[profile]}" \
            if profile in DDS_PROFILES else profile
    actions = [Node(
        package=PACKAGE, executable="lingbot_map_node", name="lingbot_map", namespace=value["namespace"],
        output="screen", emulate_tty=True, additional_env=env,
        parameters=[params_file, overrides],
        remappings=[("image", image_topic), ("image/compressed", f"{image_topic.rstrip('/')}/compressed"),
                    ("camera_info", value["camera_info_topic"])],
    )]
    if _is_true(value["rviz"]):
        actions.append(Node(package="rviz2", executable="rviz2", name="rviz2", output="screen",
                            arguments=["-d", f"{share}/rviz/lingbot_map.rviz"],
                            parameters=[{"use_sim_time": overrides["use_sim_time"]}]))
    return actions


def generate_launch_description() -> LaunchDescription:
    declared = [DeclareLaunchArgument(name, default_value=default, description=text)
                for name, default, text in ARGUMENTS]
    return LaunchDescription(declared + [OpaqueFunction(function=_setup)])
