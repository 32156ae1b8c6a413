"""bench/layers.py refuses option combinations it cannot honour, before it starts."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import layers  # noqa: E402


def _refusal(capsys, argv: list[str]) -> str:
    """What parse_args writes to stderr when it refuses ``argv`` (exit code 2, argparse's)."""
    with pytest.raises(SystemExit) as exit_info:
        layers.parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_memory_trace_needs_a_gpu(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "--memory-trace reads the CUDA allocator's history: not with --cpu" in _refusal(
        capsys, ["--cpu", "--memory-trace"]
    )
    assert layers.parse_args(
        ["--cpu", "--hidden", "64", "--head-dim", "16", "--tokens", "64", "--seq", "32"]
    ).cpu


def test_trace_dir_needs_a_gpu(capsys, monkeypatch):
    # before: every variant failed mid-run with torch.profiler's "No activities specified"
    monkeypatch.setenv("WORLD_SIZE", "2")
    refusal = _refusal(capsys, ["--cpu", "--trace-dir", "/tmp/t"])
    assert "--trace-dir records GPU activity: not with --cpu" in refusal
    assert layers.parse_args(["--cpu", "--host-trace", "/tmp/t"]).host_trace == "/tmp/t"


def test_trace_steps_must_be_positive(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "--trace-steps must be >= 1" in _refusal(capsys, ["--trace-steps", "0"])
    assert layers.parse_args(["--trace-dir", "/tmp/t", "--trace-steps", "4"]).trace_steps == 4
    assert "give --trace-dir" in _refusal(capsys, ["--trace-steps", "4"])  # else ignored


def test_layers_must_be_positive(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "--layers must be >= 1" in _refusal(capsys, ["--cpu", "--layers", "0"])
    cases = layers.parse_args(["--cpu", "--layers", "4", "--cases", "mlp,layer"]).case_list
    assert {(c.block, c.layers, c.name) for c in cases} == {
        ("mlp", 1, "mlp"),
        ("layer", 4, "layer x4"),
    }


def test_sm_carveout_needs_a_gpu_and_a_count(capsys, monkeypatch):
    # torch._C._set_sm_carveout_experimental(-1) is accepted as is (checked on torch 2.13)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for argv in (["--cpu", "--sm-carveout", "8"], ["--sm-carveout", "-1"]):
        assert "--sm-carveout leaves N >= 0" in _refusal(capsys, argv)
    assert layers.parse_args(["--sm-carveout", "8"]).sm_carveout == 8
