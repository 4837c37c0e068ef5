"""docs/reference.md is what scripts/gen_reference.py writes from the code (parameters table,
interface table, the tools' PARAMS, msg/ and srv/): a change there without regenerating fails here.
(The node's real graph is compared with the interface table by test_interface_graph.py, and
config/lingbot_map.yaml with the parameter table by test_ros_tf_and_files.py.)"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("rclpy", reason="rclpy not importable (run scripts/bootstrap.sh)")

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "docs" / "reference.md"


def generator():
    spec = importlib.util.spec_from_file_location("gen_reference", REPO / "scripts" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_reference_is_current():
    text = generator().render()
    assert REFERENCE.is_file(), f"{REFERENCE} is missing: run python scripts/gen_reference.py"
    current = REFERENCE.read_text()
    if current != text:
        old, new = current.splitlines(), text.splitlines()
        first = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        pytest.fail(f"{REFERENCE.relative_to(REPO)} differs from the code (first at line {first + 1}): "
                    f"run `.venv/bin/python scripts/gen_reference.py` and commit the result\n"
                    f"committed: {old[first] if first < len(old) else '<end>'}\n"
                    f"generated: {new[first] if first < len(new) else '<end>'}")


def test_every_parameter_endpoint_and_field_is_in_the_reference():
    from lingbot_map_ros.ros.interface import ENDPOINTS
    from lingbot_map_ros.runtime.params import CAMERA_PARAMETERS, PARAMETERS

    text = generator().render()
    for p in PARAMETERS:
        assert f"| `{p.name}` |" in text, p.name
    for name in CAMERA_PARAMETERS:
        assert f"`{name}`" in text, name
    for e in ENDPOINTS:
        assert f"| `{e.name}` | `{e.type}` |" in text, e.name
    import ast

    launch = ast.parse((REPO / "launch" / "lingbot_map.launch.py").read_text())
    arguments = next(ast.literal_eval(n.value) for n in launch.body if isinstance(n, ast.Assign)
                     and any(getattr(t, "id", "") == "ARGUMENTS" for t in n.targets))
    for name, _, _ in arguments:
        assert f"| `{name}` |" in text, name
    for path in [*sorted((REPO / "msg").glob("*.msg")), *sorted((REPO / "srv").glob("*.srv"))]:
        assert f"### lingbot_map_ros/{path.parent.name}/{path.stem}" in text
        for line in path.read_text().splitlines():
            m = re.match(r"^([A-Za-z0-9_/\[\]]+)\s+([A-Za-z0-9_]+)", line)
            if m:
                assert f"| `{m.group(2)}`" in text, f"{path.name}: {m.group(2)}"


def test_interface_parser_reads_fields_constants_and_continued_comments():
    blocks = generator().interface_blocks(
        "# Intro line one\n# line two\nuint8 A=1  # the a\n\n# Section.\nbool flag   # first part\n"
        "            # second part\nstring[] names\n")
    text = "\n".join(blocks)
    assert "Intro line one line two" in text
    assert "| `A` = 1 | `uint8` (constant) | the a |" in text
    assert "Section." in text and "| `flag` | `bool` | first part second part |" in text
    assert "| `names` | `string[]` |  |" in text
    with pytest.raises(ValueError, match="cannot read the line"):
        generator().interface_blocks("this is not a field line\n")
