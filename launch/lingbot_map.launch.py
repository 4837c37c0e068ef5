"""Launch the LingBot-Map node (and optionally RViz).

    ros2 launch lingbot_map_ros lingbot_map.launch.py \\
        checkpoint:=/path/to/lingbot-map.pt image_topic:=/camera/color/image_raw rviz:=true

Arguments:
  params_file        parameters YAML (default: this package's config/lingbot_map.yaml)
  checkpoint         overrides the params file's checkpoint when non-empty
  image_topic        remaps `image` (and `image/compressed` to <image_topic>/compressed)
  camera_info_topic  remaps `camera_info`
  input_transport    raw | compressed; empty = as in the params file
  device             torch device (auto, cpu, cuda, cuda:N); empty = as in the params file (auto there)
  dtype              auto | fp32 | bf16; empty = as in the params file (auto there)
  namespace          namespace of the node (topics become /<namespace>/lingbot_map/...)
  use_sim_time       true when playing a bag with --clock
  rviz               true to start RViz with rviz/lingbot_map.rviz (topics of the empty namespace)
  keyframe_selector  true to also start this package's `keyframe_selector` (same namespace, its
                     parameter target_node = the mapping node's fully qualified name) and give the
                     mapping node keyframe_decision_timeout (next argument), so that each stored
                     frame waits for the selector's keep/drop decision
  keyframe_decision_timeout  seconds a stored frame waits for that decision (default 0.5; only
                     with keyframe_selector:=true)
  cameras            several cameras on one node: names separated by commas (cameras:=front,rear);
                     empty = as in the params file (one camera there). Camera c subscribes
                     c/image and c/camera_info; image_topic and camera_info_topic containing
                     {camera} remap them per camera (image_topic:=/{camera}/color/image_raw),
                     without it they stay /<namespace>/c/image
  camera_batching    true | false: several cameras' waiting frames in one batched step; empty = as in
                     the params file (false there)
  state_directory    folder of the keyframe journal: a restarted node resumes its map from it
                     (docs/sessions.md); empty = as in the params file (off there)
  session            a folder written by ~/save_session: the node starts in that session's map
                     (the parameter load_session); leave it out for a new map
  managed            true: the node is a managed (lifecycle) node that waits for configure and
                     activate (Nav2's lifecycle_manager, docs/nav2.md); empty = as in the params file
  dds_profile        Fast DDS profile of the node (FASTDDS_DEFAULT_PROFILES_FILE): large_messages
                     (default) = config/fastdds_large_messages.xml, 16 MB shared-memory segments so
                     that raw images over 512 KB are not sent as UDP fragments (export the same
                     file for the camera driver); a path to your own XML; or none (environment kept)

An argument given with an empty value (``checkpoint:=``) is rejected by ros2launch's parser
("malformed launch argument"), and ``checkpoint:=''`` passes two quote characters: leave an
argument out to get its empty default. In particular leave ``checkpoint`` out (and out of the
params file) for random weights, e.g. for a plumbing test.
"""
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node
from launch_ros.substitutions import FindPackageShare

PACKAGE = "lingbot_map_ros"
NODE_NAME = "lingbot_map"

ARGUMENTS = (
    ("params_file", "", "Parameters YAML; empty = the package's config/lingbot_map.yaml"),
    ("checkpoint", "", "Checkpoint path or Hugging Face id; overrides the params file when non-empty"),
    ("image_topic", "/camera/image_raw", "Image topic (raw); <image_topic>/compressed for compressed input"),
    ("camera_info_topic", "/camera/camera_info", "CameraInfo topic (optional input)"),
    ("input_transport", "", "raw or compressed; empty = as in the params file"),
    ("device", "", "Torch device: auto, cpu, cuda or cuda:N; empty = as in the params file"),
    ("dtype", "", "auto, fp32 or bf16; empty = as in the params file"),
    ("namespace", "", "Namespace of the node"),
    ("use_sim_time", "false", "Use /clock (bag playback)"),
    ("rviz", "false", "Start RViz with the package's configuration"),
    ("keyframe_selector", "false", "Also start keyframe_selector, which decides keep/drop for each stored "
     "frame of the mapping node"),
    ("keyframe_decision_timeout", "0.5", "With keyframe_selector: seconds a stored frame waits for its "
     "decision (the mapping node's keyframe_decision_timeout)"),
    ("dds_profile", "large_messages", "Fast DDS profile of the node: large_messages (the package's "
     "config/fastdds_large_messages.xml), a path to an XML profile, or none"),
    ("cameras", "", "Several cameras: names separated by commas (front,rear); empty = as in the params file. "
     "image_topic / camera_info_topic with {camera} remap each camera's c/image / c/camera_info"),
    ("camera_batching", "", "Several cameras: true to run their waiting frames in one batched step; empty = as in "
     "the params file"),
    ("state_directory", "", "Folder of the keyframe journal (the map survives a restart); empty = as in the params "
     "file"),
    ("session", "", "A saved session (~/save_session) to start from: the node localizes in its map; empty = none"),
    # -- Nav2 (docs/nav2.md)
    ("managed", "", "true: a managed (lifecycle) node, configured and activated by a lifecycle manager (Nav2's); "
     "empty = as in the params file (false there)"),
)
DDS_PROFILES = {"large_messages": "fastdds_large_messages.xml"}


def _is_true(text: str) -> bool:
    return text.strip().lower() in ("true", "1", "yes", "on")


def _flag(name: str, text: str) -> bool:
    """``true``/``false`` (any case; also 1/0, yes/no, on/off); ValueError naming the argument otherwise."""
    word = text.strip().lower()
    if word in ("true", "1", "yes", "on"):
        return True
    if word in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"launch argument {name} must be true or false, got {text!r}")


def _seconds(name: str, text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0:  # not a number, negative or NaN
        raise ValueError(f"launch argument {name} must be a number of seconds >= 0, got {text!r}")
    return seconds


def fully_qualified_name(namespace: str, name: str) -> str:
    """``/<namespace>/<name>`` (``/<name>`` for the empty namespace), slashes normalised."""
    parts = [p for p in namespace.split("/") if p]
    return "/" + "/".join(parts + [name])


def camera_names(text: str) -> list[str]:
    """``front, rear`` -> ["front", "rear"] (empty items dropped; the node checks the names)."""
    return [name.strip() for name in text.split(",") if name.strip()]


def remappings(image_topic: str, camera_info_topic: str, cameras: list[str]) -> list[tuple[str, str]]:
    """The node's input remappings: one camera's ``image``, ``image/compressed`` and ``camera_info``;
    with ``cameras``, each camera's ``c/...`` when the topics contain ``{camera}`` (else none: the
    node's own ``c/image``, ``c/camera_info`` in its namespace)."""
    if not cameras:
        return [("image", image_topic), ("image/compressed", f"{image_topic.rstrip('/')}/compressed"),
                ("camera_info", camera_info_topic)]
    out = []
    for c in cameras:
        if "{camera}" in image_topic:
            image = image_topic.replace("{camera}", c)
            out += [(f"{c}/image", image), (f"{c}/image/compressed", f"{image.rstrip('/')}/compressed")]
        if "{camera}" in camera_info_topic:
            out.append((f"{c}/camera_info", camera_info_topic.replace("{camera}", c)))
    return out


def _setup(context, *args, **kwargs):
    value = {name: LaunchConfiguration(name).perform(context) for name, _, _ in ARGUMENTS}
    share = FindPackageShare(PACKAGE).perform(context)
    params_file = value["params_file"] or f"{share}/config/lingbot_map.yaml"
    overrides = {"use_sim_time": _is_true(value["use_sim_time"])}
    for name in ("checkpoint", "input_transport", "device", "dtype"):  # empty = as in the params file
        if value[name]:
            overrides[name] = value[name]
    selector = _is_true(value["keyframe_selector"])
    cameras = camera_names(value["cameras"])
    if cameras:
        overrides["cameras"] = cameras
    if value["state_directory"].strip():
        overrides["state_directory"] = value["state_directory"].strip()
    if value["session"].strip():
        overrides["load_session"] = value["session"].strip()
    if value["camera_batching"].strip():
        overrides["camera_batching"] = _flag("camera_batching", value["camera_batching"])
    if value["managed"].strip():
        overrides["managed"] = _flag("managed", value["managed"])
    if selector:
        overrides["keyframe_decision_timeout"] = _seconds("keyframe_decision_timeout",
                                                          value["keyframe_decision_timeout"])
    image_topic = value["image_topic"]
    profile = value["dds_profile"].strip()
    env = {}
    if profile and profile.lower() != "none":
        env["FASTDDS_DEFAULT_PROFILES_FILE"] = f"{share}/config/{DDS_PROFILES[profile]}" \
            if profile in DDS_PROFILES else profile
    actions = [Node(
        package=PACKAGE, executable="lingbot_map_node", name=NODE_NAME, namespace=value["namespace"],
        output="screen", emulate_tty=True, additional_env=env,
        parameters=[params_file, overrides],
        remappings=remappings(image_topic, value["camera_info_topic"], cameras),
    )]
    if selector:
        actions.append(Node(
            package=PACKAGE, executable="keyframe_selector", name="keyframe_selector",
            namespace=value["namespace"], output="screen", emulate_tty=True,
            parameters=[{"target_node": fully_qualified_name(value["namespace"], NODE_NAME),
                         "use_sim_time": overrides["use_sim_time"]}]))
    if _is_true(value["rviz"]):
        actions.append(Node(package="rviz2", executable="rviz2", name="rviz2", output="screen",
                            arguments=["-d", f"{share}/rviz/lingbot_map.rviz"],
                            parameters=[{"use_sim_time": overrides["use_sim_time"]}]))
    return actions


def generate_launch_description() -> LaunchDescription:
    declared = [DeclareLaunchArgument(name, default_value=default, description=text)
                for name, default, text in ARGUMENTS]
    return LaunchDescription(declared + [OpaqueFunction(function=_setup)])
