"""``lingbot-map-fleet``'s inputs: paths and globs from the command line or the rows of a
manifest (CSV or YAML), each resolved to a ``FleetInput`` (what it is, where its outputs
go, the replay flags it runs with).

Checked here, before anything runs: the manifest's syntax and columns, each input's
replay flags (through the replay's own parser), the flags the fleet sets itself (inputs,
outputs, sessions, device), output folder names (one path component, no two inputs
sharing one) and inputs listed twice. These are usage errors (``UsageError``). An input
that is missing or cannot be told apart is not: it fails alone, with its ``problem``.
"""
from __future__ import annotations

import csv
import glob
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = ("images", "bag", "video")
COLUMNS = ("input", "name", "kind", "topic", "flags")  # a manifest row's fields; only input is required
BAG_SUFFIXES = (".bag", ".mcap", ".db3")  # a ROS 1 bag, or a rosbag2's storage file (its folder is read)
SUMMARY_NAME = "fleet-summary.json"
# replay flags the fleet sets for each input (by the replay parser's dest): refused in the flags it passes on
OWNED = {"images": "the input", "bag": "the input", "video": "the input", "out": "--outputs npz",
         "trajectory": "--outputs trajectory", "ply": "--outputs ply", "out_bag": "--outputs bag",
         "save_session": "the fleet's journal", "resume": "the fleet's journal", "overwrite": "the fleet",
         "compare_precision": "lingbot-map-replay", "compare_out": "lingbot-map-replay"}


class UsageError(Exception):
    """A problem with the command line or the manifest, reported as one line (exit status 2)."""


@dataclass(frozen=True)
class FleetInput:
    """One input of the fleet.

    source: the recording (absolute); kind: ``images``, ``bag`` or ``video``; name: its output
    folder under the output root; flags: replay flags (the command's, then the row's);
    origin: where it was listed ("argument 2", "runs.csv line 4"); problem: why it cannot run
    ("" when it can), reported as its failure.
    """

    source: Path
    kind: str
    name: str
    flags: tuple[str, ...]
    origin: str
    problem: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS and not self.problem:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")


@dataclass(frozen=True)
class ReplayFlags:
    """What the fleet reads from an input's replay flags."""

    max_frames: int | None  # --max-frames: frames in all (None: the whole input)
    depth_every: int  # --save-depth: 0 none, 1 all, K every K-th frame
    chunk_frames: int  # --chunk-frames
    has_topic: bool  # --topic given
    threads: int | None  # --threads
    checkpoint: str | None
    model_config: str | None  # --model-config
    path_rate: float  # --bag-path-rate (the node's default when not given): path messages a second of input time
    path_length: int  # --bag-path-length: poses in a path message


@dataclass(frozen=True)
class CommonFlags:
    """The replay flags given after ``--``: ``bag_only`` (--topic, --topic-type) go to bags alone."""

    rest: tuple[str, ...]
    bag_only: tuple[str, ...]

    @classmethod
    def split(cls, flags: list[str]) -> "CommonFlags":
        rest, bag_only = [], []
        tokens = iter(flags)
        for token in tokens:
            if token in ("--topic", "--topic-type"):
                bag_only += [token, next(tokens, "")]
            elif token.startswith(("--topic=", "--topic-type=")):
                bag_only.append(token)
            else:
                rest.append(token)
        return cls(tuple(rest), tuple(bag_only))


def collect(paths: list[str], manifest: Path | None, common: CommonFlags) -> list[FleetInput]:
    """The inputs of positional ``paths`` (globs expanded) and of ``manifest``, each with the
    ``common`` replay flags and its own; refuses duplicates (``UsageError``)."""
    items: list[FleetInput] = []
    for n, text in enumerate(paths, 1):
        items += _from_argument(text, n, common)
    if manifest is not None:
        items += read_manifest(manifest, common)
    if not items:
        raise UsageError("no inputs: give paths or globs of bags, image folders or videos, or --manifest FILE")
    _refuse_duplicates(items)
    return items


def _from_argument(text: str, n: int, common: CommonFlags) -> list[FleetInput]:
    origin = f"argument {n} ({text})"
    if glob.has_magic(text):
        matches = sorted(glob.glob(os.path.expanduser(text)))
        if not matches:
            return [FleetInput(Path(text).absolute(), "", _name_of(Path(text)), common.rest, origin,
                               f"no file or folder matches {text}")]
        return [make_input(Path(m), None, None, common, [], origin) for m in matches]
    return [make_input(Path(os.path.expanduser(text)), None, None, common, [], origin)]


def make_input(path: Path, kind: str | None, name: str | None, common: CommonFlags, own: list[str],
               origin: str) -> FleetInput:
    """A FleetInput for ``path`` with the ``common`` flags, then its ``own``; ``kind`` and ``name``
    when given, else told from the path."""
    path = path.absolute()
    if name is not None:
        check_name(name, origin)
    name = name or _name_of(path)
    if kind is not None and kind not in KINDS:
        raise UsageError(f"{origin}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    problem = ""
    if not os.path.lexists(path):
        problem = f"no such file or folder: {path}"
    elif kind is None:
        kind, problem = detect_kind(path)
    flags = [*common.rest, *(common.bag_only if kind == "bag" else ()), *own]
    parsed = check_flags(flags, origin)
    if parsed.has_topic and kind in ("images", "video"):
        what = "an image folder" if kind == "images" else "a video"
        raise UsageError(f"{origin}: --topic goes with a bag, and {path} is {what}")
    return FleetInput(path, kind or "", name, tuple(flags), origin, problem)


def detect_kind(path: Path) -> tuple[str, str]:
    """(kind, "") for an existing ``path``, or ("", why it cannot be told)."""
    if path.is_dir():
        if (path / "metadata.yaml").is_file():
            return "bag", ""
        return "images", ""
    if not path.is_file():
        return "", f"{path} is neither a file nor a folder"
    if path.suffix.lower() in BAG_SUFFIXES:
        return "bag", ""
    return "video", ""


def _name_of(path: Path) -> str:
    """The default output folder name: a file's stem, a folder's name (a rosbag2 storage file: its folder's)."""
    if path.suffix.lower() in (".mcap", ".db3") and (path.parent / "metadata.yaml").is_file():
        path = path.parent
    return (path.stem if path.is_file() or path.suffix else path.name) or "input"


def check_name(name: str, origin: str) -> None:
    """Refuse an output folder name that is not one plain path component."""
    if not name or name in (".", "..") or "/" in name or "\0" in name or name.startswith("."):
        raise UsageError(f"{origin}: name {name!r} must be one folder name (no '/', not starting with '.')")
    if name == SUMMARY_NAME or len(name.encode()) > 255:
        raise UsageError(f"{origin}: name {name!r} cannot be used as an output folder name")


def _refuse_duplicates(items: list[FleetInput]) -> None:
    names: dict[str, FleetInput] = {}
    sources: dict[tuple[str, tuple[str, ...]], FleetInput] = {}
    for item in items:
        twin = sources.setdefault((os.path.realpath(item.source), item.flags), item)
        if twin is not item:
            raise UsageError(f"{item.origin} lists {item.source} again with the same flags ({twin.origin})")
        other = names.setdefault(item.name, item)
        if other is not item:
            raise UsageError(f"{other.origin} and {item.origin} would both write into the output folder "
                             f"{item.name!r}; give them different names (a manifest's name column)")


# ----------------------------------------------------------------------------- manifest

def read_manifest(path: Path, common: CommonFlags) -> list[FleetInput]:
    """The rows of a CSV (header row with an ``input`` column) or YAML manifest (a list of paths
    or of mappings, or a mapping with ``inputs``). Paths are relative to the manifest's folder."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read the manifest {path}: {getattr(exc, 'strerror', None) or exc}") from None
    rows = _yaml_rows(path, text) if path.suffix.lower() in (".yaml", ".yml") else _csv_rows(path, text)
    base = path.absolute().parent
    items = []
    for origin, row in rows:
        items.append(_row_input(row, origin, base, common))
    if not items:
        raise UsageError(f"the manifest {path} lists no inputs")
    return items


def _csv_rows(path: Path, text: str) -> list[tuple[str, dict[str, Any]]]:
    reader = csv.DictReader(text.splitlines())
    header = [h.strip() for h in (reader.fieldnames or [])]
    if "input" not in header:
        raise UsageError(f"{path}: the first line must name the columns, with an 'input' column (columns: "
                         f"{', '.join(COLUMNS)}); found {', '.join(header) or 'nothing'}")
    unknown = [h for h in header if h not in COLUMNS]
    if unknown:
        raise UsageError(f"{path}: unknown column {unknown[0]!r} (columns: {', '.join(COLUMNS)})")
    rows = []
    for row in reader:
        origin = f"{path} line {reader.line_num}"
        if None in row:
            raise UsageError(f"{origin}: more cells than columns")
        cells = {k.strip(): (v or "").strip() for k, v in row.items()}
        if not any(cells.values()) or cells["input"].startswith("#"):
            continue
        rows.append((origin, {k: v for k, v in cells.items() if v}))
    return rows


def _yaml_rows(path: Path, text: str) -> list[tuple[str, dict[str, Any]]]:
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if isinstance(data, dict) and set(data) == {"inputs"}:
        data = data["inputs"]
    if not isinstance(data, list):
        raise UsageError(f"{path}: a YAML manifest is a list of inputs (paths, or mappings with input, name, kind, "
                         "topic, flags), or a mapping with the key inputs")
    rows = []
    for n, entry in enumerate(data, 1):
        origin = f"{path} item {n}"
        if isinstance(entry, str):
            entry = {"input": entry}
        if not isinstance(entry, dict):
            raise UsageError(f"{origin}: expected a path or a mapping, got {type(entry).__name__}")
        unknown = [k for k in entry if k not in COLUMNS]
        if unknown:
            raise UsageError(f"{origin}: unknown key {unknown[0]!r} (keys: {', '.join(COLUMNS)})")
        rows.append((origin, {k: v for k, v in entry.items() if v is not None}))
    return rows


def _row_input(row: dict[str, Any], origin: str, base: Path, common: CommonFlags) -> FleetInput:
    source = row.get("input")
    if not isinstance(source, str) or not source.strip():
        raise UsageError(f"{origin}: no input path")
    for key in ("name", "kind", "topic"):
        if key in row and not isinstance(row[key], str):
            raise UsageError(f"{origin}: {key} must be text, got {row[key]!r}")
    own = _row_flags(row.get("flags"), origin)
    if "topic" in row:
        own += ["--topic", row["topic"]]
    path = base / os.path.expanduser(source.strip())
    return make_input(path, row.get("kind"), row.get("name"), common, own, origin)


def _row_flags(value: Any, origin: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise UsageError(f"{origin}: flags {value!r}: {exc}") from None
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
        return [str(v) for v in value]
    raise UsageError(f"{origin}: flags must be a string or a list of strings, got {value!r}")


# ----------------------------------------------------------------------------- replay flags

class _FlagError(Exception):
    """argparse's complaint about replay flags (instead of its exit)."""


def _raise_flag_error(message: str):
    raise _FlagError(message)


def check_flags(flags: list[str], origin: str) -> ReplayFlags:
    """Parse ``flags`` with the replay's parser; refuse bad ones and those the fleet sets itself."""
    from .replay_args import build_parser

    parser = build_parser()
    parser.error = _raise_flag_error  # this parser says what is wrong in one line instead of exiting
    sentinel = "\0fleet-input"
    try:
        args = parser.parse_args(["--images", sentinel, *flags])
    except _FlagError as exc:
        if "not allowed with argument --images" in str(exc):
            raise UsageError(f"{origin}: the input is set by the fleet (a path, or a manifest row); leave --images, "
                             "--bag and --video out of the replay flags") from None
        raise UsageError(f"{origin}: replay flags {' '.join(flags) or '(none)'}: {exc}") from None
    given = vars(args)
    defaults = vars(parser.parse_args(["--images", sentinel]))
    for dest, owner in OWNED.items():
        if given[dest] != defaults[dest]:  # (ours comes first: a later --images replaces it)
            raise UsageError(f"{origin}: --{dest.replace('_', '-')} is set by the fleet ({owner}); leave it out "
                             "of the replay flags")
    if given["device"] != defaults["device"]:
        raise UsageError(f"{origin}: --device is chosen by the fleet (a GPU when --gpus-per-task > 0, else the "
                         "CPU); leave it out of the replay flags")
    if given["loop_closure"]:
        raise UsageError(f"{origin}: --loop-closure is for lingbot-map-replay alone: the fleet replays an input in "
                         "segments, each resumed from a journal that holds no pose graph")
    return _replay_flags(given, origin)


def _replay_flags(given: dict[str, Any], origin: str) -> ReplayFlags:
    from ..io.results import DepthPolicy

    try:
        every = 0 if given["no_depth"] else DepthPolicy.parse(given["save_depth"]).every
    except ValueError as exc:
        raise UsageError(f"{origin}: {exc}") from None
    for flag in ("max_frames", "chunk_frames", "threads"):
        if given[flag] is not None and given[flag] < 1:
            raise UsageError(f"{origin}: --{flag.replace('_', '-')} must be at least 1, got {given[flag]}")
    from .replay_args import or_node_default

    return ReplayFlags(given["max_frames"], every, given["chunk_frames"], given["topic"] is not None,
                       given["threads"], given["checkpoint"],
                       None if given["model_config"] is None else str(given["model_config"]),
                       float(or_node_default(given["bag_path_rate"], "path_publish_rate")),
                       int(or_node_default(given["bag_path_length"], "path_max_length")))


def pick_topic(bag: Path) -> str:
    """The only image topic (``sensor_msgs/Image`` or ``CompressedImage``) of a bag given without --topic.

    Raises:
        ValueError: the bag cannot be read, has no image topic, or has several (the message says which).
    """
    from rosbags.highlevel import AnyReader
    from rosbags.typesys import Stores, get_typestore

    from ..io.image_msgs import is_image_type

    path = bag.parent if bag.is_file() and bag.suffix != ".bag" else bag
    try:
        with AnyReader([path], default_typestore=get_typestore(Stores.LATEST)) as reader:
            topics = {c.topic: c.msgtype for c in reader.connections}
    except Exception as exc:  # rosbags' own errors, YAML, sqlite3 and struct errors of a corrupt bag
        raise ValueError(f"cannot read bag {path}: {' '.join(str(exc).split()) or type(exc).__name__}") from None
    images = sorted(t for t, m in topics.items() if is_image_type(m))
    if len(images) == 1:
        return images[0]
    if not images:
        listed = ", ".join(f"{t} ({m})" for t, m in sorted(topics.items())) or "none"
        raise ValueError(f"bag {path} has no image topic (sensor_msgs/Image or CompressedImage); its topics: "
                         f"{listed}")
    raise ValueError(f"bag {path} has {len(images)} image topics ({', '.join(images)}); choose one with --topic "
                     "(after --, or in a manifest's topic column)")
