#!/usr/bin/env python3
"""Write docs/reference.md, the interface reference, from the sources of truth in the code.

    .venv/bin/python scripts/gen_reference.py           # (re)write docs/reference.md
    .venv/bin/python scripts/gen_reference.py --check   # exit 1 when it differs from what would be written

Read from:
- the node's parameters: ``PARAMETERS`` and ``CAMERA_PARAMETERS`` of lingbot_map_ros/runtime/param_table.py
  (sections from its ``# -- <title>`` comments);
- its topics and services: ``ENDPOINTS`` of lingbot_map_ros/ros/interface.py (the node's real
  graph is compared with it by test/ros/test_interface_graph.py);
- the launch file's arguments (``ARGUMENTS`` of launch/lingbot_map.launch.py);
- the parameters of keyframe_selector and image_folder_publisher (their ``PARAMS``);
- msg/*.msg and srv/*.srv (fields, constants and their comments).

test/ros/test_reference_doc.py fails when the committed page differs from the output.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "reference.md"
COMMAND = "python scripts/gen_reference.py"


def cell(text: object) -> str:
    """Text for a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def type_name(default: object) -> str:
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, int):
        return "int"
    if isinstance(default, float):
        return "double"
    if isinstance(default, (list, tuple)):
        return "string[]"
    return "string"


def value_text(value: object) -> str:
    return f"`{json.dumps(value)}`"


def number(x: float, integer: bool) -> str:
    if integer:
        return f"{int(x):_}".replace("_", " ") if abs(x) >= 10_000 else str(int(x))
    return f"{x:g}"


def range_text(p) -> str:
    if p.choices is not None:
        return ", ".join(f"`{c}`" for c in p.choices)
    if p.limits is None:
        return ""
    lo, hi, step = p.limits
    integer = isinstance(p.default, int)
    text = f"{number(lo, integer)} .. {number(hi, integer)}"
    if step and step != 1:
        text += f", step {number(step, integer)}"
    return text


def param_sections(source: str) -> dict[str, str]:
    """{parameter: section title} from the ``# -- title`` comments above ``Param("name", ...)``."""
    sections, title = {}, ""
    for line in source.splitlines():
        m = re.match(r"\s*# -- (.+)", line)
        if m:
            title = m.group(1).strip()
            title = title[0].upper() + title[1:]
            continue
        m = re.match(r'\s*Param\("([a-z0-9_]+)"', line)
        if m:
            sections[m.group(1)] = title
    return sections


def node_parameters() -> list[str]:
    from lingbot_map_ros.runtime import param_table as params

    sections = param_sections(Path(params.__file__).read_text())
    out = ["### Parameters", "",
           "Run time = yes: settable while the node runs (`ros2 param set /lingbot_map <name> <value>`, "
           "checked, refused with a reason); no: read once at start (read-only). The same list with defaults "
           "and comments is `config/lingbot_map.yaml` (kept equal to this table by "
           "`test/ros/test_ros_tf_and_files.py`). Lengths are in model units unless a metric scale applies "
           "(see [frames and scale](frames_scale_health.md)).", ""]
    current = None
    for p in params.PARAMETERS:
        section = sections.get(p.name, "")
        if section != current:
            if current is not None:
                out.append("")
            out += [f"#### {section or 'Other'}", "",
                    "| Name | Type | Default | Range / choices | Run time | Description |",
                    "|---|---|---|---|---|---|"]
            current = section
        out.append(f"| `{p.name}` | {type_name(p.default)} | {value_text(p.default)} | {cell(range_text(p))} | "
                   f"{'yes' if p.dynamic else 'no'} | {cell(p.description)} |")
    out += ["", "#### Per camera", "",
            "With `cameras` listed, each camera `c` also has `camera.c.<name>` for the parameters below "
            "(declared for the listed cameras only; default: the global value; same type, range and run-time "
            "rule as the global one). Setting the global name of a run-time one refuses the change while "
            "cameras are listed: set `camera.c.<name>` for each camera.", "",
            ", ".join(f"`{n}`" for n in params.CAMERA_PARAMETERS), ""]
    return out


def endpoint_tables() -> list[str]:
    from lingbot_map_ros.ros.interface import ENDPOINTS

    def when(e) -> str:
        return "always" if e.when == "True" else f"`{e.when}`"

    out = ["### Topics and services", "",
           "`~/x` is `/<namespace>/<node name>/x` (default `/lingbot_map/x`); a relative name (`image`) "
           "resolves in the node's namespace and is usually remapped (the launch file's `image_topic`, "
           "`camera_info_topic`); `/x` is absolute. Scope *camera*: with `cameras` listed, one per camera "
           "`c`, under `~/c/` and `c/` (e.g. `~/front/pose`, `front/image`); *node*: once. *When* is the "
           "condition on the parameters (`several` = `cameras` is not empty). Outputs carry the input "
           "image's stamp.", ""]
    titles = {"subscription": "Subscriptions", "publisher": "Publications", "service": "Services"}
    for kind in ("subscription", "publisher", "service"):
        rows = [e for e in ENDPOINTS if e.kind == kind]
        out += [f"#### {titles[kind]}", ""]
        if kind == "service":
            out += ["Served between frames in arrival order (by the helper node `<node>_services`, under the "
                    "node's names); a call waits at most `service_timeout`.", "",
                    "| Name | Type | Scope | When | Description |", "|---|---|---|---|---|"]
            out += [f"| `{e.name}` | `{e.type}` | {e.scope} | {when(e)} | {cell(e.description)} |" for e in rows]
        else:
            out += ["| Name | Type | QoS | Scope | When | Description |", "|---|---|---|---|---|---|"]
            out += [f"| `{e.name}` | `{e.type}` | {cell(e.qos_text())} | {e.scope} | {when(e)} | "
                    f"{cell(e.description)} |" for e in rows]
        out.append("")
    return out


def lifecycle_states() -> list[str]:
    from lingbot_map_ros.ros.interface import LIFECYCLE_STATES

    out = ["### Lifecycle states (`managed:=true`)", "",
           "A managed node is driven by rclpy's lifecycle state machine (transitions configure, activate, "
           "deactivate, cleanup, shutdown over `~/change_state`; a transition not allowed from the current "
           "state is refused). A failing configure (bad parameter or checkpoint, too little GPU memory) logs "
           "the reason and leaves the node unconfigured. Use with Nav2: [nav2.md](nav2.md).", "",
           "| State | What holds |", "|---|---|"]
    out += [f"| `{state}` | {cell(text)} |" for state, text in LIFECYCLE_STATES]
    return out + [""]


def tool_parameters(title: str, module: str, intro: str) -> list[str]:
    import importlib

    mod = importlib.import_module(module)
    out = [f"## {title}", "", intro, "",
           "| Name | Type | Default | Range | Description |", "|---|---|---|---|---|"]
    for name, (default, desc) in mod.PARAMS.items():
        rng = ""
        if desc.floating_point_range:
            r = desc.floating_point_range[0]
            rng = f"{r.from_value:g} .. {r.to_value:g}"
        elif desc.integer_range:
            r = desc.integer_range[0]
            rng = f"{r.from_value} .. {r.to_value}"
        out.append(f"| `{name}` | {type_name(default)} | {value_text(default)} | {rng} | {cell(desc.description)} |")
    return out + [""]


def launch_arguments() -> list[str]:
    """The launch file's ``ARGUMENTS`` (read with ast: no launch import needed)."""
    import ast

    path = ROOT / "launch" / "lingbot_map.launch.py"
    tree = ast.parse(path.read_text())
    value = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "ARGUMENTS" for t in node.targets))
    out = ["### Launch arguments", "",
           "`ros2 launch lingbot_map_ros lingbot_map.launch.py <name>:=<value> ...` (from "
           "launch/lingbot_map.launch.py). An empty value cannot be given (`name:=` is refused by the launch "
           "parser): leave the argument out to keep its default.", "",
           "| Name | Default | Description |", "|---|---|---|"]
    for name, default, description in value:
        out.append(f"| `{name}` | {value_text(default) if default else '(empty)'} | {cell(description)} |")
    return out + [""]


FIELD = re.compile(r"^([A-Za-z0-9_/]+(?:\[[0-9<=]*\])?)\s+([A-Za-z0-9_]+)(?:\s*=\s*([^#]+?))?\s*(?:#\s?(.*))?$")


def interface_blocks(text: str) -> list[str]:
    """Markdown of one .msg / request or response part: comment paragraphs and field tables."""
    out: list[str] = []
    blocks: list[list[str]] = [[]]
    for line in text.splitlines():
        if not line.strip():
            if blocks[-1]:
                blocks.append([])
        else:
            blocks[-1].append(line)
    for block in blocks:
        if not block:
            continue
        para: list[str] = []
        rows: list[list[str]] = []
        for line in block:
            stripped = line.strip()
            if stripped.startswith("#"):
                comment = stripped.lstrip("#").strip()
                if rows and line.startswith(" "):  # continuation of the field above
                    rows[-1][3] = (rows[-1][3] + " " + comment).strip()
                elif not rows:
                    para.append(comment)
                else:
                    rows.append(["", "", "", comment])  # a comment between fields
                continue
            m = FIELD.match(stripped)
            if not m:
                raise ValueError(f"cannot read the line {line!r}")
            ftype, name, const, comment = m.groups()
            rows.append([ftype, name, (const or "").strip(), (comment or "").strip()])
        if para:
            out += [" ".join(p for p in para if p) or "", ""]
        if rows:
            out += ["| Field | Type | Description |", "|---|---|---|"]
            for ftype, name, const, comment in rows:
                if not name:
                    out.append(f"| | | *{cell(comment)}* |")
                elif const:
                    out.append(f"| `{name}` = {cell(const)} | `{ftype}` (constant) | {cell(comment)} |")
                else:
                    out.append(f"| `{name}` | `{ftype}` | {cell(comment)} |")
            out.append("")
    return out


def interfaces() -> list[str]:
    out = ["## Messages", ""]
    for path in sorted((ROOT / "msg").glob("*.msg")):
        out += [f"### lingbot_map_ros/msg/{path.stem}", ""] + interface_blocks(path.read_text())
    out += ["## Services", ""]
    for path in sorted((ROOT / "srv").glob("*.srv")):
        request, _, response = path.read_text().partition("\n---\n")
        out += [f"### lingbot_map_ros/srv/{path.stem}", "", "Request:", ""] + interface_blocks(request)
        out += ["Response:", ""] + interface_blocks(response)
    return out


def render() -> str:
    sys.path.insert(0, str(ROOT))
    lines = ["# Interface reference", "",
             f"<!-- Generated by `{COMMAND}` from lingbot_map_ros/runtime/param_table.py, lingbot_map_ros/ros/"
             "interface.py, launch/lingbot_map.launch.py, the tools' PARAMS, msg/ and srv/. Do not edit: change those and run the command. -->",
             "",
             "Contents: [lingbot_map_node](#lingbot_map_node) (launch arguments, parameters, topics, services) · "
             "[keyframe_selector](#keyframe_selector) · [image_folder_publisher](#image_folder_publisher) · "
             "[messages](#messages) · [services](#services).", "",
             "## lingbot_map_node", "",
             "The mapping node (default name `lingbot_map`): `ros2 launch lingbot_map_ros lingbot_map.launch.py` "
             "or `ros2 run lingbot_map_ros lingbot_map_node --ros-args --params-file config/lingbot_map.yaml`. "
             "A bad parameter at start ends it with exit status 1 and one error line naming the parameter.", ""]
    lines += launch_arguments()
    lines += node_parameters()
    lines += endpoint_tables()
    lines += lifecycle_states()
    lines += tool_parameters(
        "keyframe_selector", "lingbot_map_ros.ros.keyframe_selector",
        "Reference keyframe client ([keyframes over services](keyframes.md)): subscribes `<target_node>/frame`, "
        "calls `<target_node>/commit_eviction` (keep) or `<target_node>/rollback_last_frame` (drop). "
        "`ros2 run lingbot_map_ros keyframe_selector --help` prints the parameters. All are read at start.")
    lines += tool_parameters(
        "image_folder_publisher", "lingbot_map_ros.ros.image_folder_publisher",
        "Plays a folder of images (or a video) as a camera: publishes `image` (or `image/compressed`) and, "
        "when asked, `camera_info`. All parameters are read at start.")
    lines += interfaces()
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/reference.md is not current")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.is_file() else ""
        if current != text:
            print(f"{args.output} is not current: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
