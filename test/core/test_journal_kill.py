"""kill -9 of a process that journals a stream: whatever the writer thread had on disk
resumes, and continuing with the input after the last journaled frame gives the
uninterrupted run's results (tiny fixture model, CPU)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from lingbot_map_ros.journal import JOURNAL_NAME
from lingbot_map_ros.journal.format import scan

from test_journal_resume import SCRIPT, assert_same, resume, run_steps  # noqa: F401  (fixtures below)
from test_journal_resume import images, straight  # noqa: F401  pytest fixtures

REPO = Path(__file__).resolve().parents[2]
KILL_AT = 10  # after step 10's results: no service call in steps 6..10

_CHILD = """
import json, os, signal, sys
from pathlib import Path
sys.path.insert(0, {core!r})
import numpy as np
from lingbot_map_ros.config import ModelConfig
from lingbot_map_ros.io.checkpoint import load_model
import test_journal_resume as t
fx = Path({fixtures!r})
cfg = json.loads((fx / "config.json").read_text())
model = load_model(ModelConfig.from_dict(cfg), fx / "weights.safetensors")
images = np.load(fx / "reference_kf1.npz")["images"]
session, writer = t.journaled(t.make(model, cfg), Path({path!r}))
t.run_steps(session, images, range({kill} + 1))
os.kill(os.getpid(), signal.SIGKILL)  # no flush, no close: what the writer thread wrote is what there is
"""


def test_kill_9_while_journaling_resumes(tiny_model, fixture_config, fixtures, images, straight, tmp_path):
    path = tmp_path / JOURNAL_NAME
    code = _CHILD.format(core=str(REPO / "test" / "core"), fixtures=str(fixtures), path=str(path), kill=KILL_AT)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert scan(path).kinds  # something was on disk
    resumed, writer, rebuilt = resume(tiny_model, fixture_config, path)
    assert not rebuilt.corrupt
    last = rebuilt.last_tag["n"]
    assert 0 <= last <= KILL_AT
    steps = range(last + 1, 18)  # through the commit, a rollback and the window restart
    assert_same(straight, run_steps(resumed, images, steps), steps)
    writer.close()
