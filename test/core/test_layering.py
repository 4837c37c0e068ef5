"""The package's imports run one way: cli -> ros -> runtime -> robot -> stream -> io -> cache/model ->
kernels/geometry -> config; nothing lower imports anything higher, and packages of one
tier do not import each other.

Read from the source with ``ast`` (nothing is imported), lazy imports inside functions
and ``TYPE_CHECKING`` blocks included: a deferred import is still a dependency. Imports
inside one package (ros/node.py -> ros/conversions.py) are that package's business.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lingbot_map_ros"
NAME = PACKAGE.name

# highest first; a package may import only the ones in later tiers (config.py and
# geometry.py count as packages of their own)
TIERS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("ros",),
    ("runtime",),  # the node's logic without ROS: engine, scheduler, queues, map memory, parameters
    # metric scale, tracking health, undistortion: used by the node, uses stream's maths;
    # the keyframe journal: records and rebuilds sessions
    ("robot", "journal", "slam"),
    ("stream",),
    ("io",),
    ("cache", "model"),
    ("kernels", "geometry"),
    ("config",),
)
RANK = {pkg: i for i, tier in enumerate(TIERS) for pkg in tier}

# the ROS interfaces generated from msg/ and srv/ (lingbot_map_ros.msg, .srv) and ROS
# Python packages: only the node's layers (cli, ros) may import them
INTERFACES = ("msg", "srv")
ROS_MODULES = ("rclpy", "rcl_interfaces", "builtin_interfaces", "std_msgs", "std_srvs", "sensor_msgs",
               "geometry_msgs", "nav_msgs", "tf2_ros", "tf2_msgs", "launch", "launch_ros", "rosidl_runtime_py",
               "message_filters", "cv_bridge")
ROS_LAYERS = ("cli", "ros")

# Breaks of the tier order that exist today, as (importing module, imported package),
# each with who removes it. A listed pair that no longer occurs fails the test, so the
# list only shrinks.
ALLOWED: dict[tuple[str, str], str] = {}

# The node's layers reach the model, the cache and the kernels through stream/ and io/
# only (stream/ re-exports the errors they need). Today's exceptions, with who removes them:
THROUGH_STREAM = ("cache", "model", "kernels")
NODE_LOGIC = ROS_LAYERS + ("runtime",)  # they reach the model through stream/ and io/
ALLOWED_DIRECT: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str) -> str | None:
    """'lingbot_map_ros.stream.session' -> 'stream'; None for the root and for other projects."""
    parts = module.split(".")
    return parts[1] if parts[0] == NAME and len(parts) > 1 else None


def imports_in(source: str, module: str, is_package: bool = False) -> list[tuple[str, int]]:
    """(absolute module, line) of every import in ``source``, the text of ``module`` (a
    package's ``__init__`` when ``is_package``); ``from X import name`` also yields
    ``X.name`` (it may be a submodule: ``from .. import kernels``)."""
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((target, node.lineno))
            out += [(f"{target}.{alias.name}", node.lineno) for alias in node.names if alias.name != "*"]
    return out


def imported_modules(path: Path) -> list[tuple[str, int]]:
    return imports_in(path.read_text(), module_name(path), path.name == "__init__.py")


def edges() -> list[tuple[str, str, str]]:
    """(importing module, imported module, 'file:line') for every import of the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for target, line in imported_modules(path):
            found.append((module_name(path), target, f"{path.relative_to(PACKAGE.parent)}:{line}"))
    return found


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(importing module, imported package) -> places, for imports between two packages."""
    out: dict[tuple[str, str], list[str]] = {}
    for importer, target, where in edges():
        src, dst = package_of(importer), package_of(target)
        if src is None or dst is None or src == dst or dst in INTERFACES:
            continue
        if dst not in RANK:  # ``from lingbot_map_ros.io import atomic`` also yields io.atomic: fine
            continue
        places = out.setdefault((importer, dst), [])
        if where not in places:
            places.append(where)
    return out


def test_every_package_has_a_tier():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    packages |= {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    assert packages - set(RANK) == set(), "give the new package a tier in TIERS"


def test_imports_run_down_the_tiers():
    bad, seen = [], set()
    for (importer, dst), places in sorted(package_edges().items()):
        src = package_of(importer)
        if RANK[src] < RANK[dst]:
            continue
        seen.add((importer, dst))
        if (importer, dst) not in ALLOWED:
            kind = "a higher" if RANK[src] > RANK[dst] else "a same-tier"
            bad.append(f"{importer} ({src}) imports {kind} package {dst}: {', '.join(places)}")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)
    assert not set(ALLOWED) - seen, f"fixed, remove from ALLOWED: {sorted(set(ALLOWED) - seen)}"


def test_the_node_layers_reach_the_model_through_stream():
    """ros/, runtime/ and cli/ import nothing from cache/, model/ or kernels/ (the session and
    io.checkpoint are their door), except today's listed imports."""
    direct = {k: v for k, v in package_edges().items() if package_of(k[0]) in NODE_LOGIC and k[1] in THROUGH_STREAM}
    unexpected = [f"{imp} imports {dst}: {', '.join(places)}" for (imp, dst), places in sorted(direct.items())
                  if (imp, dst) not in ALLOWED_DIRECT]
    assert not unexpected, "\n".join(unexpected)
    assert not set(ALLOWED_DIRECT) - set(direct), \
        f"fixed, remove from ALLOWED_DIRECT: {sorted(set(ALLOWED_DIRECT) - set(direct))}"


def test_only_the_node_layers_import_ros():
    bad = []
    for importer, target, where in edges():
        src = package_of(importer)
        if src is None or src in ROS_LAYERS:
            continue
        if target.split(".")[0] in ROS_MODULES or package_of(target) in INTERFACES:
            bad.append(f"{importer} imports {target} ({where})")
    assert not bad, "ROS imports below the node layers:\n" + "\n".join(bad)


ROS_FREE = ("runtime", "robot", "journal", "slam", "stream", "io", "cache", "model", "kernels", "geometry", "config")


def test_the_ros_free_folders_are_named_and_exist():
    """The ROS-free folders are every tier below ros/ (a new package gets a tier, so it is covered)."""
    below = {pkg for pkg, rank in RANK.items() if rank > RANK["ros"]}
    assert below == set(ROS_FREE)
    for pkg in ("runtime", "robot", "journal", "stream", "io", "cache", "model", "kernels"):
        assert (PACKAGE / pkg / "__init__.py").exists(), pkg


def private_imports(source: str, module: str, is_package: bool = False) -> list[tuple[str, int]]:
    """(module.name, line) of every ``from X import _name`` of this package in ``source`` where X is
    another module than ``module`` (dunder names such as ``__version__`` are public). A package's
    private submodule (``kernels/_qk_rope_triton.py``) may be imported by the modules of that package."""
    own_package = module if is_package else module.rpartition(".")[0]
    out = []
    for target, line in imports_in(source, module, is_package):
        head, _, name = target.rpartition(".")
        if package_of(target) is None or not name.startswith("_") or name.startswith("__"):
            continue
        submodule = PACKAGE.parent.joinpath(*target.split(".")).with_suffix(".py").exists()
        if head != module and not (submodule and head == own_package):
            out.append((target, line))
    return out


def test_no_module_imports_another_modules_private_names():
    """A ``_name`` is its module's own business: a module that needs it from outside gets a public
    name (``io.export.ply_content``), so a private helper can change without a search of the tree."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for target, line in private_imports(path.read_text(), module_name(path), path.name == "__init__.py"):
            bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_the_private_import_finder_sees_relative_and_lazy_imports():
    source = "from .export import _ply_content, read_ply\n\ndef f():\n    from ..stream.session import _dtype\n"
    found = {t for t, _ in private_imports(source, "lingbot_map_ros.io.map_save")}
    assert found == {"lingbot_map_ros.io.export._ply_content", "lingbot_map_ros.stream.session._dtype"}
    assert private_imports("from numpy import _x\nimport lingbot_map_ros.io.export\n", "lingbot_map_ros.io.a") == []
    assert private_imports("from . import _qk_rope_triton\n", "lingbot_map_ros.kernels.qk_rope") == []
    assert private_imports("from ..kernels import _qk_rope_triton\n", "lingbot_map_ros.model.layers") != []


def test_the_finder_sees_relative_lazy_and_submodule_imports():
    """The parser itself: the import forms this package uses resolve to the right modules."""
    source = ("from .. import kernels\nfrom ..config import StreamConfig\nfrom .graphs import GraphedStep\n"
              "import lingbot_map_ros.io.atomic\n\ndef f():\n    from ..cache.pages import CacheError\n")
    found = {target for target, _ in imports_in(source, "lingbot_map_ros.stream.session")}
    assert {"lingbot_map_ros.kernels", "lingbot_map_ros.config", "lingbot_map_ros.stream.graphs",
            "lingbot_map_ros.io.atomic", "lingbot_map_ros.cache.pages"} <= found
    assert ("lingbot_map_ros.robot.health", 1) in imports_in("from .health import X\n", "lingbot_map_ros.robot",
                                                             is_package=True)
    assert package_of("lingbot_map_ros.config") == "config" and package_of("numpy.linalg") is None


@pytest.mark.parametrize("statement", [
    "import lingbot_map_ros.config",
    "from lingbot_map_ros.config import LongStreamConfig, KEYFRAME_POLICIES, StreamConfig",
    "from lingbot_map_ros.stream import (Session, FrameResult, SessionError, FrameMismatchError, "
    "InvalidFrameError, CacheError, CacheFullError)",
])
def test_light_modules_import_without_torch(statement):
    """Configuration and the stream's protocol, result type and errors (what runtime/params.py
    and the engine need) load without torch: the node decides when the heavy part is paid for."""
    code = f"import sys\n{statement}\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", f"{statement!r} imports torch"
