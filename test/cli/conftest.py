"""Fixtures of the replay tests: frames of ../shared/data/loop and the tiny model's flags."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOOP = (REPO / ".." / "shared" / "data" / "loop").resolve()
LOOP_FRAMES = 8


@pytest.fixture(scope="session")
def loop_frames() -> list[Path]:
    """The first LOOP_FRAMES images of ../shared/data/loop (518x294 JPEG)."""
    frames = sorted(LOOP.glob("*.jpg"))[:LOOP_FRAMES] if LOOP.is_dir() else []
    if len(frames) < LOOP_FRAMES:
        pytest.skip(f"loop frames not found at {LOOP} (the shared data set next to the repository)")
    return frames


@pytest.fixture(scope="session")
def loop_folder(loop_frames, tmp_path_factory) -> Path:
    """A folder holding just those frames."""
    folder = tmp_path_factory.mktemp("loop")
    for f in loop_frames:
        shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture(scope="session")
def tiny(fixtures) -> list[str]:
    """Flags for the fixture's tiny model with its weights (width 98, 2 scale frames), CPU, quiet."""
    return ["--checkpoint", str(fixtures / "weights.safetensors"), "--model-config", str(fixtures / "config.json"),
            "--backend", "sdpa", "-q"]
