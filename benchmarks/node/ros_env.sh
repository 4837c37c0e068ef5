# Source me (bash): make the ROS 2 bundle of benchmarks/node/node_latency_bundle.sh usable
# by this shell's python3 (CPython 3.12) without installing ROS.
#
#   source benchmarks/node/ros_env.sh [BUNDLE [DEST]]
#
# BUNDLE defaults to <repo>/.whl/ros312_bundle.tar.xz, DEST to /tmp/lingbot_ros. It is
# unpacked once (DEST/.unpacked marks a complete unpack of that bundle), then this sets
# LD_LIBRARY_PATH (ROS and interface libraries, the wheels' vendored ros_*.libs),
# PYTHONPATH (<repo> first, so the repository's lingbot_map_ros wins; then the bundle's
# site-packages, whose lingbot_map_ros.pkg adds the generated msg/srv packages to it),
# AMENT_PREFIX_PATH, and ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST (DDS stays on this
# machine). ROS_DOMAIN_ID is left to the caller. PYTHON names the interpreter (default python3).
_ros_env_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
_ros_env_bundle="${1:-$_ros_env_repo/.whl/ros312_bundle.tar.xz}"
_ros_env_dest="${2:-/tmp/lingbot_ros}"
if [[ ! -f "$_ros_env_dest/.unpacked" ]] \
    || [[ "$(cat "$_ros_env_dest/.unpacked")" != "$(stat -c %s-%Y "$_ros_env_bundle" 2>/dev/null)" ]]; then
  [[ -f "$_ros_env_bundle" ]] || { echo "ros_env: no bundle $_ros_env_bundle (build it with" \
    "benchmarks/node/node_latency_bundle.sh)" >&2; return 1; }
  rm -rf "$_ros_env_dest" && mkdir -p "$_ros_env_dest"
  "${PYTHON:-python3}" - "$_ros_env_bundle" "$_ros_env_dest" <<'EOF' || return 1
import sys, tarfile
with tarfile.open(sys.argv[1]) as tar:
    tar.extractall(sys.argv[2], filter="tar")
EOF
  stat -c %s-%Y "$_ros_env_bundle" >"$_ros_env_dest/.unpacked"
fi
_ros_env_site="$_ros_env_dest/lib/python3.12/site-packages"
"${PYTHON:-python3}" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' \
  || { echo "ros_env: the bundle is for CPython 3.12; ${PYTHON:-python3} is $("${PYTHON:-python3}" -V 2>&1)" >&2
       return 1; }
echo "$_ros_env_dest/lib/lingbot_map_ros_interfaces/lingbot_map_ros" >"$_ros_env_site/lingbot_map_ros.pkg"
_ros_env_libs="$_ros_env_dest/lib"
for _d in "$_ros_env_site"/ros_*.libs; do _ros_env_libs="$_ros_env_libs:$_d"; done
export LD_LIBRARY_PATH="$_ros_env_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$_ros_env_repo:$_ros_env_site${PYTHONPATH:+:$PYTHONPATH}"
export AMENT_PREFIX_PATH="$_ros_env_dest"
export ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST
# A ros_wheels_bootstrapper .pth in the machine's python would re-exec python; not needed here.
export _ROS_WHEELS_BOOTSTRAP_COMPLETE=1
unset _ros_env_repo _ros_env_bundle _ros_env_dest _ros_env_site _ros_env_libs _d
