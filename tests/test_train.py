"""launch/pretrain.py end to end through the real `deepspeed` launcher on CPU (2 processes,
gloo), and its refusals of bad input (one line, non-zero exit, nothing written)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds_stpar.train import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny-cpu.json"
PRETRAIN = ROOT / "launch" / "pretrain.py"
DEEPSPEED = Path(sys.executable).with_name("deepspeed")


def short_docs_jsonl(path: Path) -> Path:
    """~120 standard-library files under 1500 bytes (short pieces: the short bucket is used)."""
    from ds_stpar.seqbucket.corpus import stdlib_documents, write_jsonl

    docs = [d for d in stdlib_documents(max_files=600) if len(d["text"].encode()) < 1500]
    write_jsonl(docs, path)
    return path


def launch_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def deepspeed_cmd(nproc: int, *args: str) -> list[str]:
    return [str(DEEPSPEED), "--num_gpus", str(nproc), str(PRETRAIN), *args]


@pytest.mark.dist
def test_pretrain_through_the_deepspeed_launcher(tmp_path):
    data = short_docs_jsonl(tmp_path / "docs.jsonl")
    out, save = tmp_path / "run", tmp_path / "ckpt"
    args = ["--config", str(TINY), "--data", str(data), "--steps", "4"]
    args += ["--out", str(out), "--save", str(save), "--save-interval", "2", "--seed", "3"]
    args += ["--profile-step", "3"]
    proc = subprocess.run(
        deepspeed_cmd(2, *args), env=launch_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["mini_batch"] for r in rows] == [0, 1, 2, 3]
    for row in rows:
        assert math.isfinite(row["loss"]) and 0 < row["loss"] < 8  # ln(258) = 5.55 at start
        assert row["tokens"] > 0 and row["targets"] <= row["tokens"] <= 2048
        assert row["step_s"] > 0 and row["switch_s"] >= 0 and row["mfu"] is None  # CPU
        assert row["peak_gib"] is None and row["peak_gib_ranks"] is None  # no CUDA allocator
        assert row["peak_reserved_gib"] is None and row["device_gib"] is None
        assert row["alloc_retries"] is None
        assert set(row["bucket_s"]) <= {"128", "256"} and "256" in row["bucket_s"]
        assert row["layouts"][-1] == "dp1-tp2-pp1"
    assert any(row["switches"] for row in rows), "the short bucket ran in a switched layout"
    # "lr": the LR of each step's update. tiny-cpu.json warms up linearly from 0 over W steps
    # (WarmupCosineLR); DeepSpeed sets step 1's LR from iteration -1 (0) and steps the scheduler
    # after each update, so step k runs at lr (k - 2) / W, computed here by hand. A scheduler
    # stepped per micro-batch or per bucket (several per step here), or the LR read after the
    # step, gives other numbers. rel 1e-12: the same product, rounded in another order.
    cfg = json.loads(TINY.read_text())
    sched = cfg["scheduler"]["params"]
    assert cfg["scheduler"]["type"] == "WarmupCosineLR" and sched["warmup_type"] == "linear"
    peak, warmup = cfg["optimizer"]["params"]["lr"], sched["warmup_num_steps"]
    assert sched["warmup_min_ratio"] == 0.0 and warmup >= 3  # steps 1-4 are all warm-up
    assert [r["lr"] for r in rows] == pytest.approx(
        [0.0] + [peak * (k - 2) / warmup for k in (2, 3, 4)], rel=1e-12, abs=0
    )
    assert any(sum(r["micro_batches"].values()) > 1 for r in rows)
    # --profile-step 3: rank 0's op tables of that step alone, the model's GEMMs among them
    assert [p.name for p in out.glob("profile-step-*.txt")] == ["profile-step-3.txt"]
    profile = (out / "profile-step-3.txt").read_text()
    assert "# step 3: ops by cpu_time_total" in profile and "aten::mm" in profile
    resolved = json.loads((out / "config.json").read_text())
    assert resolved["run"]["world_size"] == 2 and resolved["run"]["dtype"] == "fp32"
    assert resolved["deepspeed"]["gradient_accumulation_steps"] == 1
    assert (save / "latest").read_text().strip() == "step-00000004"
    assert (save / "step-00000002" / "metadata.json").is_file()
    assert "step 4/4 loss" in proc.stdout  # plain progress lines when not on a terminal


def test_a_plan_for_another_stack_is_named_at_start(tmp_path):
    from ds_stpar.config import StparConfig
    from ds_stpar.train import stack_warning

    cfg = json.loads(TINY.read_text())
    for stack, warned in (("megatron-core-local", False), ("fused", True), (None, False)):
        predicted = cfg["ds_stpar"].setdefault("extra", {}).setdefault("predicted", {})
        if stack is None:
            predicted.pop("stack", None)
        else:
            predicted["stack"] = stack
        path = tmp_path / "plan.json"
        path.write_text(json.dumps(cfg))
        cfg_obj = StparConfig.from_deepspeed_json(str(path))
        message = stack_warning(cfg_obj, str(path))
        assert (message is not None) == warned, stack
        if warned:
            assert "fused stack" in message and "--stack" in message


def _bad_inputs(tmp_path: Path) -> list[tuple[list[str], str]]:
    malformed = tmp_path / "bad.json"
    malformed.write_text('{"train_batch_size": 4,\n  "ds_stpar": }\n')
    no_section = tmp_path / "plain.json"
    no_section.write_text('{"train_batch_size": 4}')
    zero3 = tmp_path / "zero3.json"
    cfg = json.loads(TINY.read_text())
    cfg["zero_optimization"]["stage"] = 3
    zero3.write_text(json.dumps(cfg))
    uneven = tmp_path / "uneven.json"
    cfg = json.loads(TINY.read_text())
    home = cfg["ds_stpar"]["buckets"][1]["strategy"]
    home["layout"], home["first_stage_layers"] = {"dp": 1, "tp": 1, "pp": 2}, 1
    uneven.write_text(json.dumps(cfg))
    vpp = tmp_path / "vpp.json"
    cfg = json.loads(TINY.read_text())
    short = cfg["ds_stpar"]["buckets"][0]["strategy"]
    short["layout"], short["vpp_layers"] = {"dp": 1, "tp": 1, "pp": 2}, 1
    vpp.write_text(json.dumps(cfg))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text('{"body": "x"}\n')
    tiny = str(TINY)
    return [
        (["--config", str(tmp_path / "missing.json")], "missing.json: no such file"),
        (["--config", str(malformed)], "bad.json:2:15: malformed JSON"),
        (["--config", str(no_section)], 'no "ds_stpar" section'),
        (["--config", str(zero3)], "ZeRO stage 3 is not supported"),
        (["--config", str(uneven)], "evenly over the stages (uneven first/last stages)"),
        (["--config", str(vpp)], "bucket 128: the ds_stpar training loop cannot run"),
        (["--config", str(vpp)], "does not interleave stages (vpp_layers=1)"),
        (["--config", tiny, "--data", str(tmp_path / "nope")], "nope: no such file or folder"),
        (["--config", tiny, "--tokenizer", str(tmp_path / "tok.json")], "no such tokenizer"),
        (["--config", tiny, "--load", str(tmp_path)], "no checkpoint here"),
        (["--config", tiny, "--steps", "0"], "--steps must be >= 1"),
        (["--config", tiny, "--steps", "2", "--profile-step", "3"], "--profile-step must be"),
        (["--config", tiny, "--steps", "2", "--trace-step", "-1"], "--trace-step must be"),
        (
            ["--config", tiny, "--steps", "2", "--trace-step", "2", "--profile-step", "2"],
            "one profiler per step",
        ),
        (["--config", tiny, "--steps", "2", "--trace-step", "2"], "it needs CUDA"),
        (["--config", tiny, "--save", str(empty)], "exists and is not a directory"),
        (["--config", tiny, "--data", str(empty)], "empty file, no documents"),
        (["--config", tiny, "--data", str(no_text)], "no text column 'text'"),
    ]


def test_bad_input_is_one_line_and_nothing_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    world_1 = (
        ["--config", str(TINY)],
        "plan is for 2 processes but 1 were launched; launch 2 "
        "or re-plan with `ds-stpar plan --gpus 1 ",
    )
    for argv, message in [world_1, *_bad_inputs(tmp_path)]:
        # as the launcher would set it: 1 process for the first case, then the plan's 2
        monkeypatch.setenv("WORLD_SIZE", "1" if argv is world_1[0] else "2")
        out = tmp_path / "out"
        assert main([*argv, "--out", str(out)]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()  # HF progress bars may precede it
        ours = [line for line in err if line.startswith("pretrain.py:")]
        assert len(ours) == 1 and ours[0] == err[-1] and ours[0].startswith("pretrain.py: error: ")
        assert message in ours[0], (message, ours[0])
        assert not any("Traceback" in line for line in err)
        assert not out.exists()


def test_demo_buckets_report_and_plots(tmp_path):
    """The demo's fallback buckets (histogram median edge; DP2 short, TP2 home), its summary
    of metrics rows and its three plots, without training (the training path is the one
    tested above)."""
    import numpy as np

    from ds_stpar.config import Layout, TrainSpec
    from ds_stpar.demo import choose_buckets, demo_model, plot_run, quantile_edge, summary_lines

    pieces = np.array([512] * 50 + [100, 150, 200, 300, 310])  # short ones: median 200
    assert quantile_edge(pieces, 512) == 256  # 200 rounded up to a multiple of 64
    assert quantile_edge(np.array([512, 3]), 512) == 64  # at least 64
    assert quantile_edge(np.array([512, 500]), 512) == 256  # at most half the context
    lengths = np.concatenate([np.full(40, 2000), np.arange(20, 500, 24)])
    buckets, note = choose_buckets(lengths, demo_model(512), TrainSpec(512, 8, "fp32"))
    assert [b.max_len for b in buckets][-1] == 512 and len(buckets) == 2
    if note.startswith("buckets from the planner"):
        assert all(b.strategy.layout.pp == 1 and b.strategy.zero <= 2 for b in buckets)
    else:  # the planner kept a static layout: the pinned fallback
        assert "pins edges from the length histogram" in note
        assert [b.strategy.layout for b in buckets] == [Layout(dp=2), Layout(tp=2)]
    rows = [
        {
            "step": k,
            "loss": 5.0 - k,
            "bucket_s": {"256": 0.1, "512": 0.3} if k % 2 else {"512": 0.3},
            "layouts": ["dp2-tp1-pp1", "dp1-tp2-pp1"] if k % 2 else ["dp1-tp2-pp1"],
            "switches": 2 if k % 2 else 0,
            "switch_s": 0.02 if k % 2 else 0.0,
            "step_s": 0.5,
            "optimizer_s": 0.01,
            "tokens_per_s": 1000.0,
        }
        for k in (1, 2, 3)
    ]
    lines = summary_lines(rows)
    assert lines[0] == "3 steps: loss 4.000 -> 2.000"
    assert "bucket <=   256: ran in 2 steps, mean 0.100s (dp2-tp1-pp1)" in lines[1]
    assert "bucket <=   512: ran in 3 steps, mean 0.300s (dp1-tp2-pp1)" in lines[2]
    assert lines[3].startswith("  switches: 4 (0.04s")
    written = plot_run(tmp_path, rows, pieces, [256, 512], 512)
    assert sorted(p.name for p in written) == ["lengths.png", "loss.png", "timeline.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)
