"""Shared test set-up: markers, fixture discovery, the tiny reference model.

Reference fixtures and data are never committed; they are read from
``<repo>/../shared`` (or ``<repo>/.fixtures`` on the GPU machine, or the
directory named by ``LINGBOT_FIXTURES``) and tests that need them skip with a
message naming the path they looked for.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures_path import fixture_dir

REPO = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    return (REPO / ".." / "shared").resolve()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (run through the device tool)")
    config.addinivalue_line("markers", "ros: starts a real ROS 2 graph on loopback")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="gpu test: no CUDA device here (run `pytest -m gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def fixtures() -> Path:
    root = fixture_dir()
    if root is None:
        pytest.skip(f"reference fixtures not found at {shared_dir() / 'fixtures' / 'upstream_tiny'} "
                    "(set LINGBOT_FIXTURES to their directory)")
    return root


@pytest.fixture(scope="session")
def fixture_config(fixtures: Path) -> dict:
    return json.loads((fixtures / "config.json").read_text())


@pytest.fixture(scope="session")
def tiny_model(fixtures: Path, fixture_config: dict):
    """The fixture's tiny model with its reference weights, fp32 on CPU (do not mutate)."""
    from lingbot_map_ros.config import ModelConfig
    from lingbot_map_ros.io.checkpoint import load_model

    return load_model(ModelConfig.from_dict(fixture_config), fixtures / "weights.safetensors")
