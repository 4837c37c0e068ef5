"""Occupancy-grid map files that Nav2's map_server loads: ``map.yaml`` + an 8-bit binary PGM.

No ROS import. Conventions are map_server's (nav2_map_server ``map_io``), trinary mode:

- **Pixels.** Occupied → 0 (black), free → 254, unknown → 205, chosen from the grid values
  as map_saver does: a value below 0 or above 100 is unknown, ``≤ round(100·free_thresh)``
  free, ``≥ round(100·occupied_thresh)`` occupied, anything between unknown.
- **Rows.** The image's top row is the grid's **last** row: grid cell ``(i, j)``
  (``data[i + j·width]``, y up) is pixel ``(x=i, y=height-1-j)`` (rows down).
- **map.yaml.** ``image`` (file name relative to the yaml), ``mode: trinary``,
  ``resolution`` (m/cell), ``origin: [x, y, yaw]`` (the lower-left corner of cell (0, 0)
  in the map frame, m and rad), ``negate: 0``, ``occupied_thresh: 0.65``,
  ``free_thresh: 0.196``. Loading, map_server turns a pixel ``v`` into ``p = (255 − v)/255``:
  ``p > occupied_thresh`` → 100, ``p < free_thresh`` → 0, else −1. Unknown's 205 gives
  ``p = 50/255 ≈ 0.19608``, so ``free_thresh`` must stay ≤ that (map_saver's own ROS 2
  default, 0.25, would load unknown space as free); ``save_map_files`` refuses thresholds
  that would not give back the three classes.

Crash safety: the image gets a new name per save (``<stem>-<save id>.pgm``) and both files
are written through ``io.atomic`` (temp file, fsync, rename), the image first. The yaml's
rename is the single commit point: a save killed at any moment leaves the previous yaml
naming the previous, complete image (or no yaml before the first save), never a yaml
naming a missing, half-written or newer image. The previous image is removed after the
commit; an image orphaned by a killed save is removed by a later save once it is older
than ``atomic.STALE_AFTER_S``. One writer per folder at a time (the node's service thread).

``load_map_files`` reads such a pair back (also map_server files from other tools: PGM
or PNG, trinary, scale or raw mode), parsing the yaml with a small reader of the subset
map files use (``io.map_yaml.parse_map_yaml``): ``key: value`` lines, flow lists
``[a, b, c]``, quoted or plain scalars and ``#`` comments.
"""
from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from lingbot_map_ros.io.atomic import STALE_AFTER_S, GroupWriteError, write_group
from lingbot_map_ros.io.map_save import new_save_id
from lingbot_map_ros.io.map_yaml import MapFilesError, parse_map_yaml, yaml_float

__all__ = ["FREE_PIXEL", "FREE_THRESH", "MapFile", "MapFilesError", "OCCUPIED_PIXEL", "OCCUPIED_THRESH",
           "SavedMapFiles", "UNKNOWN_PIXEL", "grid_to_image", "image_to_grid", "load_map_files",
           "parse_map_yaml", "save_map_files"]

_LOG = logging.getLogger(__name__)

OCCUPIED_PIXEL, FREE_PIXEL, UNKNOWN_PIXEL = 0, 254, 205
OCCUPIED_THRESH, FREE_THRESH = 0.65, 0.196
TAG = "lingbot_map_ros occupancy grid, save"
_UNKNOWN_P = (255 - UNKNOWN_PIXEL) / 255.0
_STEM = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_MODES = ("trinary", "scale", "raw")


@dataclass(frozen=True, eq=False)
class MapFile:
    """A 2-D map as map_server sees it.

    Attributes:
        resolution: m per cell.
        origin: (x, y, yaw) of the lower-left corner of cell (0, 0) in the map frame, m and rad.
        width, height: cells.
        data: [height · width] int8, ``data[i + j·width]``, row 0 at the origin (y up);
            100 occupied, 0 free, -1 unknown (0..100 in scale mode).
        mode, negate, occupied_thresh, free_thresh: the yaml's values (loaded files).
        image: the image file (loaded files); save_id: the id of a save by this module, or None.
    """

    resolution: float
    origin: tuple[float, float, float]
    width: int
    height: int
    data: np.ndarray
    mode: str = "trinary"
    negate: bool = False
    occupied_thresh: float = OCCUPIED_THRESH
    free_thresh: float = FREE_THRESH
    image: Path | None = None
    save_id: str | None = None

    def cells(self) -> np.ndarray:
        """``data`` as [height, width] (row j = y)."""
        return self.data.reshape(self.height, self.width)


@dataclass(frozen=True)
class SavedMapFiles:
    """What ``save_map_files`` wrote: absolute paths and the save id shared by both files."""

    yaml: Path
    image: Path
    save_id: str


# ----------------------------------------------------------------------------- pixels

def grid_to_image(data: np.ndarray, width: int, height: int, *, occupied_thresh: float = OCCUPIED_THRESH,
                  free_thresh: float = FREE_THRESH) -> np.ndarray:
    """Trinary pixels of grid values, as map_saver draws them (see the module conventions).

    Args:
        data: [height · width] grid values (int), row 0 at the origin.

    Returns:
        [height, width] uint8 image, row 0 at the top (= the grid's last row).
    """
    cells = np.asarray(data).astype(np.int16).reshape(height, width)
    free_max, occupied_min = int(np.rint(free_thresh * 100)), int(np.rint(occupied_thresh * 100))
    known = (cells >= 0) & (cells <= 100)
    pixels = np.full(cells.shape, UNKNOWN_PIXEL, np.uint8)
    pixels[known & (cells <= free_max)] = FREE_PIXEL
    pixels[known & (cells >= occupied_min)] = OCCUPIED_PIXEL
    return np.ascontiguousarray(pixels[::-1])


def image_to_grid(shade: np.ndarray, *, mode: str = "trinary", negate: bool = False,
                  occupied_thresh: float = OCCUPIED_THRESH, free_thresh: float = FREE_THRESH,
                  opaque: np.ndarray | None = None) -> np.ndarray:
    """Grid values of an image, as map_server reads it.

    Args:
        shade: [H, W] brightness in [0, 1] (channel mean, see ``_image_shade``), row 0 at the top.
        mode: ``trinary``, ``scale`` or ``raw``.
        opaque: [H, W] bool, False where the pixel is transparent (scale mode: unknown).

    Returns:
        [H · W] int8, ``data[i + j·W]`` with row 0 at the origin (the image's bottom row).
    """
    shade = np.asarray(shade, dtype=np.float64)[::-1]
    occ = shade if negate else 1.0 - shade
    if mode == "raw":
        value = np.rint(shade * 255.0)
        out = np.where((value >= 0) & (value <= 100), value, -1)
    else:
        between = -1 if mode == "trinary" else np.rint((occ - free_thresh) / (occupied_thresh - free_thresh) * 100)
        out = np.where(occupied_thresh < occ, 100, np.where(occ < free_thresh, 0, between))
        if mode == "scale" and opaque is not None:
            out = np.where(np.asarray(opaque)[::-1], out, -1)
    return np.asarray(out).astype(np.int8).reshape(-1)


def _check_thresholds(occupied_thresh: float, free_thresh: float) -> None:
    """Refuse thresholds under which map_server would not read 0 / 254 / 205 back as the three classes."""
    if not (1.0 / 255.0 < free_thresh <= _UNKNOWN_P <= occupied_thresh < 1.0
            and np.rint(free_thresh * 100) < np.rint(occupied_thresh * 100)):
        raise MapFilesError(f"thresholds free_thresh {free_thresh} / occupied_thresh {occupied_thresh} do not keep "
                            f"free (254), unknown (205) and occupied (0) apart when map_server loads them: need "
                            f"1/255 < free_thresh <= {_UNKNOWN_P:.5f} <= occupied_thresh < 1")


# ----------------------------------------------------------------------------- writing

def save_map_files(directory: str | Path, grid, *, stem: str = "map", occupied_thresh: float = OCCUPIED_THRESH,
                   free_thresh: float = FREE_THRESH, max_tilt_deg: float = 1.0) -> SavedMapFiles:
    """Write ``<stem>.yaml`` and ``<stem>-<save id>.pgm`` into ``directory`` (created if missing).

    Args:
        directory: the folder (absolute, or relative to the working directory; ``~`` expanded).
        grid: a ``GridSnapshot`` (origin from ``planar_origin(max_tilt_deg)``) or a ``MapFile``.
        stem: base name of the files.
        occupied_thresh, free_thresh: written to the yaml and used to draw the pixels.

    Returns:
        The paths written and the save id.

    Raises:
        MapFilesError: an empty grid or one with no known cell, a tilted ground plane, bad
            thresholds or stem, a folder that is missing and cannot be created or is not a
            folder, a symbolic link or folder at ``<stem>.yaml``, an OS error (read-only,
            full). The previous files are then untouched.
    """
    if not _STEM.match(stem or ""):
        raise MapFilesError(f"invalid map file name {stem!r}: letters, digits, '_', '-', '.' only")
    _check_thresholds(occupied_thresh, free_thresh)
    width, height, resolution = int(grid.width), int(grid.height), float(grid.resolution)
    data = np.asarray(grid.data)
    if data.shape != (width * height,):
        raise MapFilesError(f"grid data of shape {data.shape} does not match {width} x {height} cells")
    if width * height == 0:
        raise MapFilesError("the occupancy grid is empty (no frame mapped yet): nothing saved, "
                            "existing map files left as they were")
    if not np.any((data >= 0) & (data <= 100)):
        raise MapFilesError("the occupancy grid has no known cell: nothing saved, existing map files left as they were")
    origin = _origin_of(grid, max_tilt_deg)
    if not (np.isfinite(origin).all() and np.isfinite(resolution) and resolution > 0):
        raise MapFilesError(f"bad map geometry: resolution {resolution}, origin {origin}")
    folder = _prepare_folder(directory)
    save_id = new_save_id()
    yaml_path, image_path = folder / f"{stem}.yaml", folder / f"{stem}-{save_id}.pgm"
    pixels = grid_to_image(data, width, height, occupied_thresh=occupied_thresh, free_thresh=free_thresh)
    header = f"P5\n# {TAG} {save_id}, {resolution} m/pix\n{width} {height}\n255\n".encode("ascii")
    text = _yaml_text(image_path.name, resolution, origin, occupied_thresh, free_thresh, save_id)
    previous = _previous_image(yaml_path)
    _write_pair(image_path, lambda f: (f.write(header), f.write(pixels.tobytes())),
                yaml_path, lambda f: f.write(text.encode("ascii")))
    _remove_old_images(folder, stem, keep=image_path, previous=previous)
    _LOG.info("saved occupancy grid %dx%d at %.3f m to %s (%s)", width, height, resolution, yaml_path, image_path.name)
    return SavedMapFiles(yaml_path, image_path, save_id)


def _origin_of(grid, max_tilt_deg: float) -> tuple[float, float, float]:
    if hasattr(grid, "planar_origin"):
        try:
            return grid.planar_origin(max_tilt_deg)
        except ValueError as exc:
            raise MapFilesError(f"cannot save the grid as map_server files: {exc}") from None
    x, y, yaw = (float(v) for v in grid.origin)
    return x, y, yaw


def _prepare_folder(directory: str | Path) -> Path:
    if directory is None or not str(directory).strip():
        raise MapFilesError("no folder given for the map files")
    folder = Path(os.path.expanduser(str(directory))).absolute()
    if folder.exists() and not folder.is_dir():
        raise MapFilesError(f"{folder} exists and is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MapFilesError(f"cannot create folder {folder}: {exc.strerror or exc}") from None
    return folder


def _yaml_text(image: str, resolution: float, origin, occupied_thresh: float, free_thresh: float,
               save_id: str) -> str:
    x, y, yaw = (yaml_float(v) for v in origin)
    return (f"# {TAG} {save_id}\n"
            f"image: {image}\n"
            "mode: trinary\n"
            f"resolution: {yaml_float(resolution)}\n"
            f"origin: [{x}, {y}, {yaw}]\n"
            "negate: 0\n"
            f"occupied_thresh: {yaml_float(occupied_thresh)}\n"
            f"free_thresh: {yaml_float(free_thresh)}\n")


def _write_pair(image: Path, write_image, yaml_path: Path, write_yaml) -> None:
    """Stage both files, rename the image then the yaml (the commit point), fsync the folder
    (``io.atomic.write_group``)."""
    try:  # an image renamed without its yaml was never named by one: it does not stay behind
        write_group([(image, write_image), (yaml_path, write_yaml)], on_partial=lambda _: _unlink_quietly(image))
    except GroupWriteError as exc:
        if yaml_path in exc.committed:
            raise MapFilesError(f"wrote {yaml_path} but could not sync folder {yaml_path.parent}: "
                                f"{exc.strerror or exc.cause}") from None
        raise MapFilesError(f"cannot write map files in {yaml_path.parent}: {exc.strerror or exc.cause}; "
                            "the previous files are unchanged") from None


def _previous_image(yaml_path: Path) -> Path | None:
    """The image the current yaml names, when it is one of ours in the same folder."""
    try:
        name = parse_map_yaml(yaml_path.read_text("utf-8")).get("image")
    except (OSError, UnicodeDecodeError, MapFilesError):
        return None
    return yaml_path.parent / name if isinstance(name, str) and "/" not in name else None


def _remove_old_images(folder: Path, stem: str, keep: Path, previous: Path | None) -> None:
    """Delete the image the previous yaml named, and our images that no yaml names (killed saves)."""
    pattern = re.compile(rf"^{re.escape(stem)}-\d{{8}}T\d{{6}}Z-[0-9a-f]{{8}}\.pgm$")
    now = time.time()
    for path in folder.iterdir():
        if path == keep or not pattern.match(path.name):
            continue
        try:
            if path == previous or now - path.lstat().st_mtime > STALE_AFTER_S:
                path.unlink()
                _LOG.debug("removed old map image %s", path)
        except OSError as exc:
            _LOG.debug("left %s in place: %s", path, exc)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# ----------------------------------------------------------------------------- reading

def load_map_files(yaml_path: str | Path) -> MapFile:
    """Read a map.yaml and its image back into grid values, as map_server would.

    Args:
        yaml_path: the yaml file; a relative ``image`` is relative to its folder.

    Raises:
        MapFilesError: unreadable or invalid yaml (missing or bad field), missing or unreadable image.
    """
    yaml_path = Path(yaml_path)
    try:
        text = yaml_path.read_text("utf-8")
        fields = parse_map_yaml(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise MapFilesError(f"cannot read {yaml_path}: {getattr(exc, 'strerror', None) or exc}") from None
    except MapFilesError as exc:
        raise MapFilesError(f"{yaml_path}: {exc}") from None
    meta = _map_fields(fields, yaml_path)
    image = Path(os.path.expanduser(meta["image"]))
    image = image if image.is_absolute() else yaml_path.parent / image
    shade, opaque = _image_shade(image, with_alpha=meta["mode"] == "trinary")
    data = image_to_grid(shade, mode=meta["mode"], negate=meta["negate"], occupied_thresh=meta["occupied_thresh"],
                         free_thresh=meta["free_thresh"], opaque=opaque)
    tag = re.search(rf"^#\s*{re.escape(TAG)} (\S+)", text, re.M)
    return MapFile(resolution=meta["resolution"], origin=meta["origin"], width=shade.shape[1], height=shade.shape[0],
                   data=data, mode=meta["mode"], negate=meta["negate"], occupied_thresh=meta["occupied_thresh"],
                   free_thresh=meta["free_thresh"], image=image, save_id=tag.group(1) if tag else None)


def _map_fields(fields: dict, yaml_path: Path) -> dict:
    """map_server's required and optional fields, checked and typed."""
    def need(key, kinds):
        if key not in fields:
            raise MapFilesError(f"{yaml_path}: missing field '{key}'")
        value = fields[key]
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            raise MapFilesError(f"{yaml_path}: field '{key}' has a bad value {value!r}")
        return value

    image = need("image", (str,))
    origin = need("origin", (list,))
    if len(origin) != 3 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in origin):
        raise MapFilesError(f"{yaml_path}: 'origin' must be [x, y, yaw], got {origin!r}")
    mode = fields.get("mode", "trinary")
    if mode not in _MODES:
        raise MapFilesError(f"{yaml_path}: 'mode' must be one of {_MODES}, got {mode!r}")
    resolution = float(need("resolution", (int, float)))
    if not resolution > 0:
        raise MapFilesError(f"{yaml_path}: 'resolution' must be > 0, got {resolution}")
    return {"image": image, "origin": tuple(float(v) for v in origin), "mode": mode, "resolution": resolution,
            "negate": bool(need("negate", (int, bool))),
            "occupied_thresh": float(need("occupied_thresh", (int, float))),
            "free_thresh": float(need("free_thresh", (int, float)))}


def _image_shade(path: Path, with_alpha: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Brightness [H, W] in [0, 1] as map_server computes it (mean of R, G, B, and of the
    alpha channel too when ``with_alpha`` and the image has one), and the opaque mask."""
    try:
        with Image.open(path) as img:
            img.load()
            if img.mode in ("I;16", "I;16B", "I;16L", "I"):
                return np.asarray(img, dtype=np.float64) / 65535.0, None
            has_alpha = img.mode in ("LA", "RGBA", "PA") or "transparency" in img.info
            rgba = np.asarray(img.convert("RGBA" if has_alpha else "RGB"), dtype=np.float64)
    except FileNotFoundError:
        raise MapFilesError(f"the map image {path} does not exist") from None
    except (OSError, UnidentifiedImageError) as exc:
        raise MapFilesError(f"cannot read the map image {path}: {exc}") from None
    channels = rgba if has_alpha and with_alpha else rgba[..., :3]
    opaque = rgba[..., 3] == 255 if has_alpha else None
    return channels.mean(axis=-1) / 255.0, opaque
