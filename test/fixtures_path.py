"""Where the reference fixtures are: they are never committed, and the GPU machine
only sees what travels with the repository.

Looked up in order: ``$LINGBOT_FIXTURES`` (a fixture set itself, or a folder holding
sets), ``<repo>/../shared/fixtures`` (the developer checkout), ``<repo>/.fixtures``
(an ignored copy carried to the GPU machine).
"""
from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def fixture_dir(name: str = "upstream_tiny") -> Path | None:
    """The folder of fixture set ``name`` (holding its config.json), or None when absent."""
    candidates = [REPO.parent / "shared" / "fixtures" / name, REPO / ".fixtures" / name]
    env = os.environ.get("LINGBOT_FIXTURES")
    if env:
        candidates[:0] = [Path(env) / name, Path(env)]
    for candidate in candidates:
        if (candidate / "config.json").is_file():
            return candidate
    return None
