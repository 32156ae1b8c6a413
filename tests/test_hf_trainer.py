"""StparTrainer under ``torchrun --nproc_per_node 2`` (gloo, CPU) against a plain Trainer.

One launch (tests/hf_trainer_script.py, ~35 s on 2 cores) trains the same random tiny
LlamaForCausalLM for 6 steps five ways: a plain ``transformers.Trainer`` fed the static dp2
plan's rows ("ref"), and StparTrainer with a static dp2 plan, a static tp2 ring plan, a
hot-switching plan (bucket 16 in a tp2 Megatron layout, bucket 32 in dp2) and the same with
the dp2 bucket fully recomputed (gradient checkpointing, which must not change a number). All run DeepSpeed
ZeRO-1 with torch SGD (lr 1, no clipping): SGD keeps the weights linear in the gradients,
whereas Adam normalises each tensor's update and hides a wrong global factor (it hid a 4.8%
gradient clipping that accelerate had slipped in).

Checks: the loss falls; StparTrainer's dp2 run equals the plain Trainer, and so do the tp2
and switching runs (the loss is the mini-batch's mean token loss whatever the layout and
packing, so the gradient is the same). Tolerances, all fp32: every logged loss within 1e-5
relative, final weights within 1e-5 * max |weight| per tensor (measured: <= 1.5e-6). Why: the
runs differ only in summation order (DP all-reduce vs. carried gradients, TP all-reduce of
norm gradients), ~1e-7 relative per step; any real divergence (a lost micro-batch, a wrong
normalisation, a gradient missing a TP sum) changes the weights by >= 1e-3 of their size.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.distributed import free_port

ROOT = Path(__file__).resolve().parent.parent
LOSS_RTOL, WEIGHT_RTOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("hf_trainer")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(ROOT / "tests" / "hf_trainer_script.py"),
        str(out),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return json.loads((out / "results.json").read_text()), out


def _weights(out: Path, run: str) -> dict:
    return load_file(str(out / run / "final" / "model.safetensors"))


def test_loss_falls(results) -> None:
    data, _ = results
    for run in ("dp", "tp", "switch"):
        losses = data[run]["losses"]
        assert len(losses) == 6 and losses[-1] < losses[0] - 0.2, (run, losses)


@pytest.mark.parametrize("run", ["dp", "tp", "switch", "recompute"])
def test_equals_plain_trainer(results, run: str) -> None:
    data, out = results
    for step, (mine, ref) in enumerate(zip(data[run]["losses"], data["ref"]["losses"])):
        assert math.isclose(mine, ref, rel_tol=LOSS_RTOL), (run, step, mine, ref)
    expected, actual = _weights(out, "ref"), _weights(out, run)
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        err = (actual[name] - value).abs().max().item()
        assert err <= WEIGHT_RTOL * value.abs().max().item(), (run, name, err)


def test_switching_ran_both_layouts(results) -> None:
    data, _ = results
    assert data["switch"]["layouts"] == ["dp1-tp2-pp1", "dp2-tp1-pp1"]
    assert data["switch"]["switches"] == 2  # weights in, gradients home
    assert data["tp"]["switches"] == 0
    # the recompute plan: the home (dp2, full) model checkpoints its layers, the tp2 one not
    assert data["recompute"]["checkpointing"] == {"dp2-tp1-pp1": True, "dp1-tp2-pp1": False}
    assert data["switch"]["checkpointing"] == {"dp2-tp1-pp1": False, "dp1-tp2-pp1": False}


def test_bad_setups_are_one_line_errors(results) -> None:
    errors = results[0]["errors"]
    assert "the plan is for 4 processes but 2 were launched" in errors["world"]
    assert 'no "ds_stpar" section' in errors["no_plan"]


def test_planned_scheduler_gives_way_to_training_arguments(tmp_path) -> None:
    # `ds-stpar plan` writes a WarmupCosineLR with its own step counts; transformers refuses a
    # DeepSpeed value that differs from the TrainingArguments one unless it is "auto", so the
    # Trainer's max_steps / warmup_steps must win (single process, no launch)
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    from ds_stpar.config import StparConfig
    from ds_stpar.integrations.deepspeed import engine_config
    from ds_stpar.integrations.hf_trainer import hf_engine_config

    path = ROOT / "configs" / "gpt3-1.3b-2xh100.json"
    ds, cfg = json.loads(path.read_text()), StparConfig.from_deepspeed_json(str(path))
    args = TrainingArguments(  # the plan's micro-batch, which transformers checks as well
        output_dir=str(tmp_path),
        max_steps=1000,
        warmup_steps=10,
        learning_rate=1e-4,
        per_device_train_batch_size=ds["train_micro_batch_size_per_gpu"],
    )

    def finalized(config: dict) -> dict:
        hf = HfTrainerDeepSpeedConfig(config)
        hf.trainer_config_process(args)
        hf.trainer_config_finalize(args, model=None, num_training_steps=1000)
        return hf.config["scheduler"]["params"]

    params = finalized(hf_engine_config(ds, cfg))
    assert (params["total_num_steps"], params["warmup_num_steps"]) == (1000, 10)
    with pytest.raises(ValueError, match="total_num_steps"):  # what the "auto"s prevent
        finalized(engine_config(ds, cfg))


def test_selective_recompute_is_refused_with_one_line() -> None:
    # transformers models recompute whole layers only; a plan asking for megatron-core's
    # selective recompute must be refused before any model is sharded
    from ds_stpar.config import Bucket, Layout, ModelSpec, StparConfig, Strategy, TrainSpec
    from ds_stpar.errors import ConfigError
    from ds_stpar.integrations.hf_trainer import _check_plan

    bucket = Bucket(32, Strategy(Layout(dp=2), recompute="selective"))
    cfg = StparConfig(ModelSpec("m", 2, 32, 4, vocab_size=64), TrainSpec(32, 4), (bucket,))
    with pytest.raises(ConfigError, match="bucket 32: selective recompute is megatron-core's"):
        _check_plan(cfg)


def test_pipeline_layouts_are_refused_with_one_line() -> None:
    # transformers models are not split into pipeline stages here (launch/pretrain.py runs
    # pipelined megatron-core models): refused before any model is sharded
    from ds_stpar.config import Bucket, Layout, ModelSpec, StparConfig, Strategy, TrainSpec
    from ds_stpar.errors import ConfigError
    from ds_stpar.integrations.hf_trainer import _check_plan

    bucket = Bucket(32, Strategy(Layout(pp=2)))
    cfg = StparConfig(ModelSpec("m", 2, 32, 4, vocab_size=64), TrainSpec(32, 4), (bucket,))
    with pytest.raises(ConfigError, match="bucket 32: pp=2; a transformers model runs without"):
        _check_plan(cfg)
