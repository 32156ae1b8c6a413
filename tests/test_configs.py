"""The ready configs of ``configs/`` are what the planner writes today, and nothing else is there.

Each entry of ``configs/regenerate.py``'s ``READY`` is re-planned through the CLI's ``plan``
command (the code path of ``ds-stpar plan --out``) into a temporary directory and compared,
parsed, with the committed file. Floats are compared with a relative tolerance of 1e-9: the
planner's numbers go through libm (``exp``, ``log``, ``pow``), whose last bit may differ
between platforms (a relative 1e-16 per operation, a few hundred operations deep), while any
real change of the planner, its calibration or a preset moves a prediction by far more than
1e-9. Every other value (layout, batch, ZeRO stage, model fields) must be equal.
A stale file fails with the command that rewrites it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from ds_stpar.config import StparConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
REL_TOL = 1e-9


def _load_regenerate():
    spec = importlib.util.spec_from_file_location("configs_regenerate", CONFIGS / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


regen = _load_regenerate()


def _first_difference(ours, theirs, path: str = "") -> str | None:
    """Where ``ours`` and ``theirs`` (parsed JSON) differ, as a path and both values."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in sorted(set(ours) | set(theirs)):
            if key not in ours or key not in theirs:
                return f"{path}/{key}: only in the {'committed' if key in ours else 'new'} file"
            found = _first_difference(ours[key], theirs[key], f"{path}/{key}")
            if found:
                return found
        return None
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            found = _first_difference(a, b, f"{path}/{i}")
            if found:
                return found
        return None
    if isinstance(ours, float) and isinstance(theirs, float):
        if math.isclose(ours, theirs, rel_tol=REL_TOL):
            return None
    if type(ours) is not type(theirs) or ours != theirs:
        return f"{path}: committed {ours!r}, planner now {theirs!r}"
    return None


def test_difference_finder_sees_changes() -> None:
    """The comparison itself: equal up to float noise passes, any real change is reported."""
    base = {"a": [1, {"b": 0.5}], "c": "ring", "d": 3.0}
    assert _first_difference(base, json.loads(json.dumps(base))) is None
    assert _first_difference(base, {**base, "d": 3.0 * (1 + 1e-12)}) is None
    assert "/d" in _first_difference(base, {**base, "d": 3.0001})
    assert "/a/1/b" in _first_difference(base, {**base, "a": [1, {"b": 0.25}]})
    assert "/c" in _first_difference(base, {**base, "c": "cannon"})
    assert "/e" in _first_difference(base, {**base, "e": 1})
    assert "/a" in _first_difference(base, {**base, "a": [1]})
    assert "/d" in _first_difference(base, {**base, "d": 3})  # int vs float is a change


@pytest.mark.parametrize("entry", regen.READY, ids=lambda e: e.name)
def test_committed_config_is_what_the_planner_writes(entry) -> None:
    committed = json.loads((CONFIGS / entry.name).read_text(encoding="utf-8"))
    fresh = json.loads(regen.plan_config(entry.plan_args))
    difference = _first_difference(committed, fresh)
    assert difference is None, (
        f"configs/{entry.name} is stale ({difference}); rewrite it with "
        f"`python configs/regenerate.py {entry.name}` and review the diff"
    )


@pytest.mark.parametrize("entry", regen.READY, ids=lambda e: e.name)
def test_config_reads_back_with_consistent_batch(entry) -> None:
    """The section parses into a StparConfig that writes back the same dict, and DeepSpeed's
    batch equality train_batch_size = micro-batch x GAS x DP holds for the home layout."""
    path = CONFIGS / entry.name
    data = json.loads(path.read_text(encoding="utf-8"))
    section = StparConfig.from_deepspeed_json(str(path))
    assert section.to_dict() == data["ds_stpar"]
    home = section.home
    assert data["train_micro_batch_size_per_gpu"] == home.micro_batch
    assert data["zero_optimization"]["stage"] == home.zero
    assert (
        data["train_batch_size"]
        == home.micro_batch * data["gradient_accumulation_steps"] * home.layout.dp
        == section.train.global_batch
    )
    assert section.world_size == section.extra["num_gpus"]


def test_every_config_has_a_generator_entry() -> None:
    """No orphan: each configs/*.json is either re-planned above or declared hand-written."""
    on_disk = {p.name for p in CONFIGS.glob("*.json")}
    listed = {e.name for e in regen.READY}
    assert len(listed) == len(regen.READY), "duplicate names in READY"
    assert on_disk - set(regen.HAND_WRITTEN) == listed
