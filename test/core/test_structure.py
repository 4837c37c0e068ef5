"""The package's shape, read from the source with ``ast`` (nothing is imported):

1. no module of lingbot_map_ros/ over ``MAX_LINES`` lines;
2. no class with more than ``MAX_METHODS`` methods (``def``/``async def`` in its body, plus
   methods made by assignment: ``x = property(...)``, a lambda, ``push = submit``);
3. the module import graph (every import: lazy ones inside functions and ``TYPE_CHECKING``
   blocks too, parsed by test_layering.py's helpers) has no cycle, and no module imports
   names from its own package's ``__init__`` (an import back up the tree);
4. no environment variable is read in the package except the ROS/RMW ones in
   ``ENVIRONMENT_READS``: what a user may tune is a parameter with a default and a line in
   the reference, and what only a test needs is injected by the test.

``ALLOWED`` lists today's known breaks, each with who removes it; an entry that no longer
occurs fails the test, so the list only shrinks (as ``ALLOWED`` in test_layering.py).
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from test_layering import PACKAGE, edges, module_name

MAX_LINES = 500
MAX_METHODS = 25

RESTRUCTURING = "removed by the engine restructuring (issue 38)"
# (check, where) -> who removes it. where: a file relative to the repository ("lines"), a
# module.Class ("methods"), file:NAME ("environ"), the modules of a cycle joined by " -> "
# from the smallest ("cycle").
ALLOWED: dict[tuple[str, str], str] = {}

# Environment variables the package may read, and why. These are ROS's and the DDS layer's own
# settings, documented by ROS, not switches of this package: the node reads them only to warn
# that raw images over 512 KB need the Fast DDS profile (ros/node.py, README "On the robot").
ENVIRONMENT_READS: dict[str, str] = {
    "RMW_IMPLEMENTATION": "which RMW the process runs on (Fast DDS when unset)",
    "FASTDDS_DEFAULT_PROFILES_FILE": "Fast DDS's XML profile (the large-message profile we ship)",
    "FASTRTPS_DEFAULT_PROFILES_FILE": "the same, its older name",
}
# Writes and whole copies, and why: lingbot-map-demo puts the graph it starts on a private ROS
# domain restricted to this machine (ROS_DOMAIN_ID, ROS_AUTOMATIC_DISCOVERY_RANGE) and hands its
# environment, with those, to the node and publisher processes it starts. Nothing reads them back.
ENVIRONMENT_WRITES: dict[str, tuple[str, ...]] = {
    "lingbot_map_ros/cli/demo.py": ("ROS_DOMAIN_ID", "ROS_AUTOMATIC_DISCOVERY_RANGE"),
    # lingbot-map-fleet's private local Ray instance: Ray's own switch (read when ray is imported)
    # that puts its node on the loopback address; a cluster given with --address is left alone
    "lingbot_map_ros/cli/fleet.py": ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",),
}
ENVIRONMENT_COPIES = ("lingbot_map_ros/cli/demo.py",)  # the child processes' environment


def sources() -> list[tuple[Path, str]]:
    return [(path, path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))]


def relative(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


# ------------------------------------------------------------------ 1, 2: sizes
def long_modules() -> dict[str, int]:
    """{file: lines} of the modules over MAX_LINES lines."""
    counts = {relative(path): len(text.splitlines()) for path, text in sources()}
    return {name: n for name, n in counts.items() if n > MAX_LINES}


ACCESSORS = ("property", "cached_property", "partialmethod", "staticmethod", "classmethod")


def method_count(cls: ast.ClassDef) -> int:
    """Methods of ``cls``: the functions in its body and the methods made by assignment there
    (``x = property(...)``, ``x = lambda ...``, ``push = submit``); constants and fields are not."""
    count = 0
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            count += 1
        elif isinstance(node, ast.Assign):
            value = node.value
            if isinstance(value, ast.Call):
                func = value.func
                count += (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")) in ACCESSORS
            elif isinstance(value, ast.Lambda):
                count += 1
            elif isinstance(value, (ast.Name, ast.Attribute)):  # an alias of another method
                count += not all(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets)
    return count


def large_classes(text: str, module: str) -> dict[str, int]:
    """{module.Class: methods} of the classes in ``text`` over MAX_METHODS methods (nested ones too)."""
    return {f"{module}.{node.name}": method_count(node) for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.ClassDef) and method_count(node) > MAX_METHODS}


# ------------------------------------------------------------------ 3: the import graph
def module_graph() -> dict[str, dict[str, str]]:
    """{module: {imported module: 'file:line'}} over the package's own modules. ``from P import m``
    of a submodule ``m`` is an import of ``m`` (P's ``__init__`` only when a name comes from it)."""
    modules = {module_name(path) for path in PACKAGE.rglob("*.py")}
    by_statement: dict[tuple[str, str], list[str]] = defaultdict(list)
    for importer, target, where in edges():
        by_statement[(importer, where)].append(target)
    graph: dict[str, dict[str, str]] = {m: {} for m in modules}
    for (importer, where), targets in by_statement.items():
        for target in targets:
            if target not in modules or target == importer:
                continue
            names = [t for t in targets if t.rpartition(".")[0] == target]
            if names and all(name in modules for name in names):
                continue  # ``from .. import kernels``: the package is only the way to its submodules
            graph[importer].setdefault(target, where)
    return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one cycle
    through them, from its smallest module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth <= the number of modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(cycle_through(graph, component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def cycle_through(graph: dict[str, dict[str, str]], component: set[str]) -> list[str]:
    """A shortest path of imports inside ``component`` from its smallest module back to it."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v]):
            if w == start:
                return paths[v] + [start]
            if w in component and w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    raise AssertionError(f"no cycle through {sorted(component)}")  # pragma: no cover - a component has one


def imports_back_up(graph: dict[str, dict[str, str]]) -> list[str]:
    """Imports of names from an ``__init__`` of a package the importer belongs to."""
    return [f"{importer} imports its package {target} ({where})" for importer, targets in sorted(graph.items())
            for target, where in sorted(targets.items()) if importer.startswith(target + ".")]


# ------------------------------------------------------------------ 4: the environment
def environment_uses(text: str) -> list[tuple[str, str, int]]:
    """(kind, variable, line) of each use of ``os.environ`` / ``os.getenv`` in ``text``: kind
    'read', 'write' or 'copy' (the whole environment, e.g. ``dict(os.environ)``); the variable is
    '?' where it is not a string constant, and kind 'use' for anything else done with it."""
    tree = ast.parse(text)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def name_of(node: ast.AST | None) -> str:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else "?"

    out = []
    for node in ast.walk(tree):
        is_environ = (isinstance(node, ast.Attribute) and node.attr == "environ") or \
            (isinstance(node, ast.Name) and node.id == "environ")
        is_getenv = (isinstance(node, ast.Attribute) and node.attr == "getenv") or \
            (isinstance(node, ast.Name) and node.id == "getenv")
        if isinstance(parents.get(node), ast.Attribute) and parents[node].attr in ("environ", "getenv"):
            continue  # the ``os`` of ``os.environ``
        parent = parents.get(node)
        if is_getenv and isinstance(parent, ast.Call) and parent.func is node:
            out.append(("read", name_of(parent.args[0] if parent.args else None), node.lineno))
        elif is_environ and isinstance(parent, ast.Attribute):
            call = parents.get(parent)
            if parent.attr in ("get", "setdefault", "pop") and isinstance(call, ast.Call) and call.func is parent:
                kind = "read" if parent.attr == "get" else "write"
                out.append((kind, name_of(call.args[0] if call.args else None), node.lineno))
            elif parent.attr == "copy":
                out.append(("copy", "*", node.lineno))
            else:
                out.append(("use", parent.attr, node.lineno))
        elif is_environ and isinstance(parent, ast.Subscript) and parent.value is node:
            out.append(("write" if isinstance(parent.ctx, (ast.Store, ast.Del)) else "read",
                        name_of(parent.slice), node.lineno))
        elif is_environ and isinstance(parent, ast.Compare) and node in parent.comparators:
            out.append(("read", name_of(parent.left), node.lineno))
        elif is_environ and isinstance(parent, ast.Call) and node in parent.args:
            out.append(("copy", "*", node.lineno))  # dict(os.environ), {**os.environ} is a Dict below
        elif is_environ and isinstance(parent, ast.Dict):
            out.append(("copy", "*", node.lineno))
        elif is_environ or is_getenv:
            out.append(("use", "?", node.lineno))
    return sorted(out, key=lambda use: use[2])


def environment_breaks() -> dict[str, list[str]]:
    """{file:VARIABLE: places} of the environment uses outside the rules above."""
    out: dict[str, list[str]] = defaultdict(list)
    for path, text in sources():
        where = relative(path)
        for kind, name, line in environment_uses(text):
            if kind == "read" and name in ENVIRONMENT_READS:
                continue
            if kind == "write" and name in ENVIRONMENT_WRITES.get(where, ()):
                continue
            if kind == "copy" and where in ENVIRONMENT_COPIES:
                continue
            out[f"{where}:{name}"].append(f"{kind} at line {line}")
    return dict(out)


# ------------------------------------------------------------------ the tests
def found_breaks() -> dict[tuple[str, str], str]:
    """Every break of the four rules in the package today: (check, where) -> what."""
    found = {("lines", name): f"{n} lines" for name, n in long_modules().items()}
    for path, text in sources():
        found.update({("methods", name): f"{n} methods" for name, n in large_classes(text, module_name(path)).items()})
    found.update({("cycle", " -> ".join(c)): "an import cycle" for c in cycles(module_graph())})
    found.update({("environ", name): ", ".join(places) for name, places in environment_breaks().items()})
    return found


def test_the_package_keeps_its_shape():
    found = found_breaks()
    new = [f"{check} {where}: {what}" for (check, where), what in sorted(found.items()) if (check, where) not in ALLOWED]
    assert not new, ("modules over 500 lines, classes over 25 methods, import cycles or environment reads:\n"
                     + "\n".join(new))
    fixed = sorted(set(ALLOWED) - set(found))
    assert not fixed, f"fixed, remove from ALLOWED: {fixed}"


def test_no_module_imports_back_up_its_package():
    assert imports_back_up(module_graph()) == []


# ------------------------------------------------------------------ the checks themselves
def test_method_count_takes_functions_and_methods_made_by_assignment():
    source = ("class A:\n    X = 1\n    LIMIT = other\n    field: int = 0\n    def a(self): pass\n"
              "    async def b(self): pass\n    c = property(lambda self: 1)\n    d = functools.cached_property(f)\n"
              "    e = lambda self: 2\n    push = a\n    def _p(self):\n        def inner(): pass\n")
    cls = ast.parse(source).body[0]
    assert method_count(cls) == 7  # a, b, c, d, e, push, _p; not X, LIMIT, field, inner
    many = "class B:\n" + "".join(f"    def m{i}(self): pass\n" for i in range(MAX_METHODS + 1))
    assert large_classes(many, "pkg.mod") == {"pkg.mod.B": MAX_METHODS + 1}
    assert large_classes(many.replace(f"    def m{MAX_METHODS}(self): pass\n", ""), "pkg.mod") == {}


def test_cycles_are_found_and_named_from_the_smallest_module():
    graph = {"p.a": {"p.b": "a:1"}, "p.b": {"p.c": "b:1"}, "p.c": {"p.a": "c:1", "p.d": "c:2"}, "p.d": {},
             "p.e": {"p.f": "e:1"}, "p.f": {"p.e": "f:1"}}
    assert cycles(graph) == [["p.a", "p.b", "p.c", "p.a"], ["p.e", "p.f", "p.e"]]
    assert cycles({"p.a": {"p.b": "a:1"}, "p.b": {}}) == []


def test_the_graph_sees_lazy_and_type_checking_imports_and_submodules_through_a_package():
    """The package's real graph: a lazy import (inside a function) and a TYPE_CHECKING one are
    edges; ``from .. import kernels`` is an edge to the kernels package, not to the root."""
    graph = module_graph()
    assert "lingbot_map_ros.stream.memory" in graph["lingbot_map_ros.ros.startup"]  # inside check_memory
    assert "lingbot_map_ros.config" in graph["lingbot_map_ros.cli.replay_args"]  # TYPE_CHECKING and lazy
    assert "lingbot_map_ros.kernels" in graph["lingbot_map_ros.stream.session"]
    assert "lingbot_map_ros" not in graph["lingbot_map_ros.stream.session"]
    assert imports_back_up({"p.q.a": {"p.q": "a:1", "p.r": "a:2"}, "p.q": {}}) == ["p.q.a imports its package p.q (a:1)"]


def test_environment_uses_are_classified():
    source = ("import os\nfrom os import environ, getenv\n"
              "a = os.environ.get('A', '1')\nb = os.environ['B']\nc = os.getenv('C')\nd = 'D' in os.environ\n"
              "os.environ['E'] = '1'\nenv = dict(os.environ)\nf = environ.get(name)\ng = getenv('G')\n"
              "os.environ.setdefault('H', '1')\nfor k in os.environ.keys(): pass\nx = {**os.environ}\n")
    assert environment_uses(source) == [
        ("read", "A", 3), ("read", "B", 4), ("read", "C", 5), ("read", "D", 6), ("write", "E", 7), ("copy", "*", 8),
        ("read", "?", 9), ("read", "G", 10), ("write", "H", 11), ("use", "keys", 12), ("copy", "*", 13)]
