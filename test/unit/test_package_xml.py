"""package.xml lists what the package needs: every module that lingbot_map_ros/ or launch/ imports
(read with ast, lazy imports included) has its rosdep key among the run-time dependencies, or is
named below with the reason it is not; every run-time dependency is imported by them, or named
below with what needs it (checked where it can be)."""
from __future__ import annotations

import ast
import re
import sys
import xml.etree.ElementTree as ET
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# import name -> rosdep key (ROS packages by their own name; Python libraries by rosdep/python.yaml's key)
ROSDEP_KEY = {
    "rclpy": "rclpy", "builtin_interfaces": "builtin_interfaces", "rcl_interfaces": "rcl_interfaces",
    "std_msgs": "std_msgs", "std_srvs": "std_srvs", "sensor_msgs": "sensor_msgs", "geometry_msgs": "geometry_msgs",
    "nav_msgs": "nav_msgs", "diagnostic_msgs": "diagnostic_msgs", "visualization_msgs": "visualization_msgs",
    "tf2_ros": "tf2_ros", "tf2_msgs": "tf2_msgs", "cv_bridge": "cv_bridge", "launch": "launch",
    "launch_ros": "launch_ros", "numpy": "python3-numpy", "PIL": "python3-pil", "tqdm": "python3-tqdm",
    "yaml": "python3-yaml", "cv2": "python3-opencv", "lz4": "python3-lz4",
}
# imported, deliberately not in package.xml (pip-installed; setup.py names each pip package)
NOT_LISTED = {
    "torch": ("torch", "no rosdep key (rosdep's python3-pytorch-pip was retired): pip, setup.py install_requires"),
    "safetensors": ("safetensors", "no rosdep key: pip, setup.py install_requires"),
    "flashinfer": ("flashinfer-python", "optional GPU attention: setup.py extra gpu"),
    "triton": (None, "comes with torch's CUDA wheels; the Triton kernels are optional (PyTorch twins)"),
    "rosbags": ("rosbags", "offline replay only: setup.py extra offline"),
    "av": ("av", "offline replay of videos only: setup.py extra offline"),
    "huggingface_hub": ("huggingface_hub", "optional checkpoint ids: setup.py extra hub"),
    "ray": ("ray", "lingbot-map-fleet only (many recordings on a Ray cluster): setup.py extra fleet"),
    "cv2": (None, "optional: video files in image_folder_publisher (it says so when missing)"),
    "gtsam": ("gtsam", "loop-closure pose graph (lingbot_map_ros/slam, imported lazily): pip wheel, setup.py "
                       "extra slam; rosdep's gtsam key is the C++ library without the Python wrapper"),
}
# in package.xml without a Python import in lingbot_map_ros/ or launch/: what needs each
NOT_IMPORTED = {
    "ament_cmake": "CMakeLists.txt builds the package",
    "ament_cmake_python": "CMakeLists.txt installs the Python library",
    "rosidl_default_generators": "CMakeLists.txt generates msg/ and srv/",
    "rosidl_default_runtime": "the generated interfaces at run time",
    "rviz2": "launch/lingbot_map.launch.py starts it with rviz:=true",
    "python3-pytest": "the tests",
    "lifecycle_msgs": "rclpy.lifecycle's services and transition events (managed:=true, ros/lifecycle.py)",
}


@lru_cache(maxsize=None)
def imported_modules(*folders: Path) -> dict[str, set[str]]:
    """{top-level module: {files}} of every absolute import under ``folders`` (not stdlib, not ours)."""
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in ("lingbot_map_ros", "__future__"):
                        found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def package_dependencies() -> dict[str, set[str]]:
    root = ET.parse(REPO / "package.xml").getroot()
    deps: dict[str, set[str]] = {}
    for tag in ("depend", "exec_depend", "build_depend", "buildtool_depend", "test_depend"):
        for element in root.findall(tag):
            deps.setdefault(element.text.strip(), set()).add(tag)
    return deps


def test_every_import_is_a_run_time_dependency_or_named_with_its_reason():
    deps = package_dependencies()
    run_time = {name for name, tags in deps.items() if tags & {"depend", "exec_depend"}}
    imports = imported_modules(REPO / "lingbot_map_ros", REPO / "launch")
    problems = []
    for module, files in sorted(imports.items()):
        if module in NOT_LISTED:
            continue
        key = ROSDEP_KEY.get(module)
        if key is None:
            problems.append(f"{module} (imported by {', '.join(sorted(files))}) has no rosdep key in this test: "
                            "add it to ROSDEP_KEY and package.xml, or to NOT_LISTED with the reason")
        elif key not in run_time:
            problems.append(f"{module} is imported by {', '.join(sorted(files))} but package.xml has no "
                            f"<exec_depend>{key}</exec_depend>")
    assert not problems, "\n".join(problems)


def test_every_dependency_is_imported_or_needed_for_a_named_reason():
    deps = package_dependencies()
    imports = imported_modules(REPO / "lingbot_map_ros", REPO / "launch")
    imported_keys = {ROSDEP_KEY[m] for m in imports if m in ROSDEP_KEY}
    unused = sorted(name for name in deps if name not in imported_keys and name not in NOT_IMPORTED)
    assert not unused, f"package.xml lists {unused}, which nothing in lingbot_map_ros/ or launch/ imports: remove " \
                       "them (or name what needs them in NOT_IMPORTED)"
    listed_but_imported = sorted(name for name in NOT_LISTED if name in imports and ROSDEP_KEY.get(name) in deps)
    assert not listed_but_imported, listed_but_imported


def test_the_reasons_still_hold():
    imports = imported_modules(REPO / "lingbot_map_ros", REPO / "launch")
    stale = sorted(m for m in NOT_LISTED if m not in imports)
    assert not stale, f"NOT_LISTED names modules nothing imports any more: {stale}"
    setup = (REPO / "setup.py").read_text()
    for module, (pip_name, _) in NOT_LISTED.items():
        if pip_name is not None:
            assert re.search(rf'"{re.escape(pip_name)}(?:[<>=!~][^"]*)?"', setup, re.I), \
                f"{module}: setup.py does not name the pip package {pip_name}"
    launch_text = (REPO / "launch" / "lingbot_map.launch.py").read_text()
    assert 'executable="rviz2"' in launch_text  # rviz2's reason
    assert "import pytest" in (REPO / "test" / "conftest.py").read_text()  # python3-pytest's reason
    cmake = (REPO / "CMakeLists.txt").read_text()
    for name in ("ament_cmake", "ament_cmake_python", "rosidl_default_generators"):
        assert f"find_package({name} REQUIRED)" in cmake, name
    assert "rosidl_generate_interfaces" in cmake and "rosidl_interface_packages" in \
        (REPO / "package.xml").read_text()  # rosidl_default_runtime's reason
    deps = package_dependencies()
    for name in ("std_msgs", "geometry_msgs"):  # msg/ uses them: build and run time
        assert deps.get(name) == {"depend"}, (name, deps.get(name))
