"""lingbot-map-fleet's command line and manifests, without Ray or a model: inputs from paths,
globs, CSV and YAML; every refusal is one line naming the problem (exit status 2) before
anything runs; a missing input fails alone."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lingbot_map_ros.cli.fleet import main
from lingbot_map_ros.cli.fleet_inputs import CommonFlags, collect, make_input, read_manifest
from lingbot_map_ros.cli.fleet_task import fingerprint

PROG = "lingbot-map-fleet"


@pytest.fixture
def tree(tmp_path) -> Path:
    """Inputs of every kind (contents are not read here): two image folders, a rosbag2, a ROS 1 bag, a video."""
    for folder in ("a/walk", "b/walk", "c/yard"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "0.png").write_bytes(b"")
    (tmp_path / "c/yard/metadata.yaml").write_text("rosbag2_bagfile_information: {}\n")
    (tmp_path / "old.bag").write_bytes(b"")
    (tmp_path / "clip.mp4").write_bytes(b"")
    return tmp_path


def refusal(capsys, *argv) -> str:
    """Run the command, expect exit status 2 and one error line; the line."""
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith(f"{PROG}: error: ")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    return errors[0]


def test_fleet_inputs_from_paths_and_globs_get_kinds_names_and_flags(tree):
    items = collect([str(tree / "a/walk"), str(tree / "c/*"), str(tree / "old.bag"), str(tree / "clip.mp4"),
                     str(tree / "nothing*")], None, CommonFlags.split(["--stride", "2", "--topic", "/cam"]))
    got = [(i.name, i.kind, i.flags, i.problem) for i in items]
    assert got == [("walk", "images", ("--stride", "2"), ""),
                   ("yard", "bag", ("--stride", "2", "--topic", "/cam"), ""),
                   ("old", "bag", ("--stride", "2", "--topic", "/cam"), ""),
                   ("clip", "video", ("--stride", "2"), ""),
                   ("nothing*", "", ("--stride", "2"), f"no file or folder matches {tree / 'nothing*'}")]


def test_fleet_csv_manifest_rows_with_names_kinds_topics_and_flags(tree):
    manifest = tree / "runs.csv"
    manifest.write_text("input,name,kind,topic,flags\n"
                        "a/walk,walk_a,,,--stride 3\n"
                        "\n"
                        "c/yard,,bag,/front/image,\"--start 2 --duration 5\"\n"
                        "# a comment row,,,,\n"
                        "gone/run1.mcap,run1,,,\n")
    items = read_manifest(manifest, CommonFlags.split(["--max-frames", "50"]))
    assert [(i.source, i.name, i.kind, i.flags, i.origin, i.problem) for i in items] == [
        (tree / "a/walk", "walk_a", "images", ("--max-frames", "50", "--stride", "3"), f"{manifest} line 2", ""),
        (tree / "c/yard", "yard", "bag", ("--max-frames", "50", "--start", "2", "--duration", "5", "--topic",
                                          "/front/image"), f"{manifest} line 4", ""),
        (tree / "gone/run1.mcap", "run1", "", ("--max-frames", "50"), f"{manifest} line 6",
         f"no such file or folder: {tree / 'gone/run1.mcap'}")]


def test_fleet_yaml_manifest_paths_and_mappings(tree):
    pytest.importorskip("yaml")
    manifest = tree / "runs.yaml"
    manifest.write_text("inputs:\n"
                        "  - a/walk\n"
                        "  - {input: b/walk, name: walk_b, flags: [--stride, 2]}\n"
                        "  - input: clip.mp4\n"
                        "    kind: video\n")
    items = read_manifest(manifest, CommonFlags.split([]))
    assert [(i.name, i.kind, i.flags) for i in items] == [("walk", "images", ()), ("walk_b", "images",
                                                                                    ("--stride", "2")),
                                                          ("clip", "video", ())]


@pytest.mark.parametrize("name, text, message", [
    ("m.csv", "path,name\na/walk,x\n", "the first line must name the columns, with an 'input' column"),
    ("m.csv", "input,camera\na/walk,front\n", "unknown column 'camera'"),
    ("m.csv", "input,name\na/walk,x,y\n", "line 2: more cells than columns"),
    ("m.csv", "input,name\na/walk,../up\n", "line 2: name '../up' must be one folder name"),
    ("m.csv", "input,kind\na/walk,lidar\n", "line 2: kind must be one of images, bag, video, got 'lidar'"),
    ("m.csv", "input,flags\na/walk,--no-such-flag\n", "line 2: replay flags --no-such-flag: unrecognized arguments"),
    ("m.csv", "input,flags\na/walk,--trajectory t.tum\n", "line 2: --trajectory is set by the fleet"),
    ("m.csv", "input,flags\na/walk,--bag x\n", "line 2: the input is set by the fleet"),
    ("m.csv", "input,flags\na/walk,--device cuda:1\n", "line 2: --device is chosen by the fleet"),
    ("m.csv", "input,flags\na/walk,--save-depth every-0\n", "--save-depth must be none, all or every-K"),
    ("m.csv", "input,topic\na/walk,/cam\n", "line 2: --topic goes with a bag"),
    ("m.csv", "input,flags\na/walk,\"--stride 'x\"\n", "line 2: flags"),
    ("m.csv", "input,name\na/walk,w\nb/walk,w\n", "would both write into the output folder 'w'"),
    ("m.csv", "input\na/walk\na/walk\n", "again with the same flags"),
    ("m.csv", "input\n", "lists no inputs"),
    ("m.yaml", "inputs: [a/walk\n", "not valid YAML"),
    ("m.yaml", "{input: a/walk}\n", "a YAML manifest is a list of inputs"),
    ("m.yaml", "- {input: a/walk, camera: front}\n", "item 1: unknown key 'camera'"),
    ("m.yaml", "- {name: x}\n", "item 1: no input path"),
    ("m.yaml", "- [a/walk]\n", "item 1: expected a path or a mapping, got list"),
    ("m.yaml", "- {input: a/walk, flags: {stride: 2}}\n", "item 1: flags must be a string or a list"),
])
def test_fleet_bad_manifests_are_refused_with_the_row_and_the_reason(tree, capsys, name, text, message):
    if name.endswith(".yaml"):
        pytest.importorskip("yaml")
    manifest = tree / name
    manifest.write_text(text)
    line = refusal(capsys, "--manifest", manifest, "-o", tree / "out")
    assert message in line and str(manifest) in line
    assert not (tree / "out" / "fleet-summary.json").exists()


def test_fleet_usage_errors_are_one_line_before_anything_runs(tree, capsys):
    folder = tree / "a/walk"
    assert "--output-root" in refusal(capsys, folder, "-o", tree / "old.bag" / "sub")
    assert "exists and is not a folder" in refusal(capsys, folder, "-o", tree / "old.bag")
    assert "--outputs 'trajectory,mesh': choose from" in refusal(capsys, folder, "-o", tree / "o",
                                                                 "--outputs", "trajectory,mesh")
    assert "--segment-frames must be at least 1" in refusal(capsys, folder, "-o", tree / "o", "--segment-frames", "0")
    assert "--gpus-per-task 1.5: above 1" in refusal(capsys, folder, "-o", tree / "o", "--gpus-per-task", "1.5")
    assert "--num-cpus and --num-gpus size a local instance" in refusal(capsys, folder, "-o", tree / "o",
                                                                         "--address", "auto", "--num-cpus", "2")
    assert "would both write into the output folder 'walk'" in refusal(capsys, folder, tree / "b/walk", "-o",
                                                                       tree / "o")
    assert "no inputs" in refusal(capsys, "-o", tree / "o")
    assert "--resume is set by the fleet" in refusal(capsys, folder, "-o", tree / "o", "--", "--resume", "x")
    assert "cannot read the manifest" in refusal(capsys, "--manifest", tree / "none.csv", "-o", tree / "o")


def test_fleet_without_ray_says_how_to_install_it(tree, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    line = refusal(capsys, tree / "a/walk", "-o", tree / "o")
    assert "the fleet runs on Ray, which is not installed: pip install 'lingbot_map_ros[fleet]'" in line


def test_fleet_a_missing_input_fails_alone_and_needs_no_ray(tree, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # nothing to run: Ray is not needed
    assert main([str(tree / "gone.mcap"), "-o", str(tree / "o")]) == 1
    out = capsys.readouterr().out
    assert "gone" in out and "failed" in out and f"no such file or folder: {tree / 'gone.mcap'}" in out
    summary = json.loads((tree / "o" / "fleet-summary.json").read_text())
    assert summary["counts"] == {"ok": 0, "skipped": 0, "failed": 1}


def test_fleet_complete_inputs_are_skipped_without_ray_and_checked(tree, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # every input settled: Ray is not needed
    item = make_input(tree / "a/walk", None, None, CommonFlags.split(["--stride", "2"]), [], "test")
    folder = tree / "o" / "walk"
    folder.mkdir(parents=True)
    done = {"status": "ok", "frames": 7, "fps": 3.5, "fingerprint": fingerprint(item, ("trajectory",))}
    (folder / "result.json").write_text(json.dumps(done))
    argv = [str(tree / "a/walk"), "-o", str(tree / "o"), "--outputs", "trajectory", "--", "--stride", "2"]
    assert main(argv) == 1  # its trajectory is gone
    assert f"but {folder / 'trajectory.tum'} is missing" in capsys.readouterr().out
    (folder / "trajectory.tum").write_text("# timestamp tx ty tz qx qy qz qw\n")
    assert main(argv) == 0
    assert json.loads((tree / "o" / "fleet-summary.json").read_text())["inputs"][0]["status"] == "skipped"
    assert main([*argv[:-2], "--stride", "3"]) == 1  # other flags: that folder is another run's
    assert "holds the outputs of another run (flags differ)" in capsys.readouterr().out


def test_fleet_package_imports_without_ray():
    code = ("import sys; sys.modules['ray'] = None; import lingbot_map_ros.cli.fleet, lingbot_map_ros.cli.fleet_task, "
            "lingbot_map_ros.cli.fleet_merge; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_fleet_only_the_fleet_command_imports_ray():
    import ast

    package = Path(__file__).resolve().parents[2] / "lingbot_map_ros"
    importers = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(n == "ray" or n.startswith("ray.") for n in names):
                importers.add(path.relative_to(package).as_posix())
    assert importers == {"cli/fleet.py"}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_fleet_progress_is_bars_on_a_terminal_and_lines_elsewhere(tmp_path):
    from lingbot_map_ros.cli.fleet_progress import Display
    from lingbot_map_ros.cli.fleet_task import InputResult

    done = InputResult("a", "/a", "ok", 10, 2.0, resumed_from=4, attempts=2)
    log, quiet = io.StringIO(), io.StringIO()
    for stream, is_quiet in ((log, False), (quiet, True)):
        display = Display(2, is_quiet, stream)
        display.ended_input(done)
        display.close()
    assert log.getvalue() == f"{PROG}: [1/2] a: ok, 10 frames, 2.0 FPS, resumed at frame 4, 2 attempts\n"
    assert quiet.getvalue() == ""

    for name, frames in (("a", 3), ("b", 5), ("c", 1)):
        (tmp_path / name / ".fleet").mkdir(parents=True)
        progress = {"run_id": "r", "frames": frames, "expected": 10, "stage": "running", "attempt": 1}
        (tmp_path / name / ".fleet" / "progress.json").write_text(json.dumps(progress))
    terminal = _Terminal()
    display = Display(3, False, terminal)
    display.running({"a": tmp_path / "a", "b": tmp_path / "b"}, "r")
    assert {n: (b.n, abs(b.pos)) for n, b in display.bars.items()} == {"a": (3, 1), "b": (5, 2)}
    display.ended_input(done)
    display.running({"b": tmp_path / "b", "c": tmp_path / "c"}, "other run")  # stale progress: no bar
    display.running({"b": tmp_path / "b", "c": tmp_path / "c"}, "r")
    assert {n: (b.n, abs(b.pos)) for n, b in display.bars.items()} == {"b": (5, 2), "c": (1, 1)}
    display.close()
    assert f"{PROG}: [1/3] a: ok" in terminal.getvalue() and "inputs:" in terminal.getvalue()
