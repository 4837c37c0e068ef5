"""Real small file systems for disk-fault tests: a tmpfs mounted for a block (root only; the
test is skipped, saying why, elsewhere). Not a test module (test/ is on sys.path, conftest.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest


def mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise OSError(f"mount {' '.join(args)}: {done.stderr.strip() or done.returncode}")


@contextmanager
def tmpfs(folder: Path, size: str, read_only: bool = False):
    """A tmpfs of ``size`` mounted on ``folder`` (made here) for the block; skips the test, saying
    why, where this process may not mount (not root, or no mount permission in a container)."""
    if os.geteuid() != 0:
        pytest.skip(f"mounting a tmpfs needs root (this test runs as uid {os.geteuid()})")
    if shutil.which("mount") is None:
        pytest.skip("no mount command on this machine")
    folder.mkdir(parents=True, exist_ok=True)
    try:
        mount("-t", "tmpfs", "-o", f"size={size},mode=0755{',ro' if read_only else ''}", "tmpfs", str(folder))
    except OSError as exc:
        pytest.skip(f"cannot mount a tmpfs here (a container without CAP_SYS_ADMIN?): {exc}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30)
