"""config/profiles/<budget>.yaml: each loads, passes the parameter validation, and the memory estimate
says it fits its budget (the budget less 1 GiB for the CUDA context and what the allocator does not
count, as in benchmarks/stream/memory_budgets.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from lingbot_map_ros.runtime.params import PARAMETERS, check_value, resolve_settings
from lingbot_map_ros.stream.memory import GIB, MemoryBudgetError, check_fits

yaml = pytest.importorskip("yaml")
PROFILES = Path(__file__).resolve().parents[2] / "config" / "profiles"
BUDGETS = (8, 12, 16, 24)
CONTEXT_GIB = 1.0


def load(budget: int) -> dict:
    data = yaml.safe_load((PROFILES / f"{budget}gib.yaml").read_text())
    return data["/**"]["ros__parameters"]


def test_every_budget_has_a_profile():
    assert sorted(p.name for p in PROFILES.glob("*.yaml")) == sorted(f"{b}gib.yaml" for b in BUDGETS)


@pytest.mark.parametrize("budget", BUDGETS)
def test_profile_is_valid_and_fits_its_budget(budget):
    values = load(budget)
    by_name = {p.name: p for p in PARAMETERS}
    for name, value in values.items():
        assert name in by_name, name
        check_value(by_name[name], value)
        assert type(value) is type(by_name[name].default), name
    s = resolve_settings(values, cuda_available=lambda: True)
    assert s.stream.device == "cuda" and s.stream.dtype == "bf16"
    free = (budget - CONTEXT_GIB + 0.5) * GIB  # check_fits keeps 0.5 GiB in reserve itself
    est = check_fits(s.model, s.stream, s.image_width, memory=lambda d: (int(free), budget * GIB))
    assert est is not None and est.total <= (budget - CONTEXT_GIB) * GIB
    if budget > 8:  # the next smaller card refuses it, with the numbers
        smaller = {12: 8, 16: 12, 24: 16}[budget]
        with pytest.raises(MemoryBudgetError, match="not enough GPU memory"):
            check_fits(s.model, s.stream, s.image_width,
                       memory=lambda d: (int((smaller - CONTEXT_GIB + 0.5) * GIB), smaller * GIB))
