"""The learning-rate schedule of ``ds-stpar plan``: its defaults, its refusals, and both
libraries running what the two outputs say.

ds_stpar.json carries DeepSpeed's ``WarmupCosineLR``; megatron_args.txt carries ``--lr
--min-lr --lr-decay-style cosine --lr-warmup-iters --train-iters``. Referees: DeepSpeed's own
``WarmupCosineLR`` class built from the JSON, megatron-core's ``OptimizerParamScheduler``
built from the parsed arguments the way Megatron-LM's ``training.py`` builds it, and the
schedule's formula (linear warm-up from 0, cosine to the floor) written out by hand here.
The engine stepping the scheduler once per optimizer step is tested in test_emit.py (a real
``deepspeed.initialize``) and on the training path in test_train.py (metrics.jsonl).
"""

from __future__ import annotations

import json
import math

import pytest

from ds_stpar import cli
from ds_stpar.config import MODEL_PRESETS, TrainSpec
from ds_stpar.errors import ConfigError
from ds_stpar.planner import emit
from tests.test_emit import parse_args_file

GPT = MODEL_PRESETS["gpt3-1.3b"]


def test_defaults_follow_the_plan_inputs():
    # gpt3-1.3b as ModelSpec counts it: 1,315,723,264 parameters; 2048 x 512 = 1,048,576
    # tokens per step. 20 tokens per parameter: 26,314,465,280 tokens = 25,095.5 steps -> 25,096;
    # warm-up 1%: 250.96 -> 251; floor 10% of 3e-4.
    train = TrainSpec(2048, 512)
    assert GPT.num_params() == 1_315_723_264
    assert emit.lr_schedule(GPT, train) == emit.LRSchedule(
        lr=3e-4, min_lr=3e-5, warmup_steps=251, train_steps=25_096
    )
    # 1% rounds up and never below 2 steps; 700 steps -> 7 (0.01 x 700 is 7.000000000000001
    # in floats, whose ceiling would be 8)
    for steps, warmup in [(150, 2), (200, 2), (201, 3), (700, 7), (100_000, 1000)]:
        settings = emit.OptimizerSettings(train_steps=steps)
        assert emit.lr_schedule(GPT, train, settings).warmup_steps == warmup, steps
    # a batch far larger than the Chinchilla budget still leaves a decay after the warm-up
    huge = TrainSpec(2048, 1 << 24)
    assert emit.lr_schedule(GPT, huge) == emit.LRSchedule(3e-4, 3e-5, 2, 3)
    # what the user says is kept
    given = emit.OptimizerSettings(lr=1e-3, min_lr=0.0, train_steps=10, warmup_steps=9)
    assert emit.lr_schedule(GPT, train, given) == emit.LRSchedule(1e-3, 0.0, 9, 10)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"warmup_steps": 1}, "--warmup-steps must be at least 2"),
        ({"train_steps": 10, "warmup_steps": 10}, "--train-steps 10 leaves no decay"),
        ({"train_steps": 2}, "--train-steps 2 leaves no decay after a 2-step warm-up"),
        ({"min_lr": 1e-3}, "--min-lr must be between 0 and --lr 0.0003"),
        ({"min_lr": -1e-6}, "--min-lr must be between 0"),
        ({"lr": 0.0}, "--lr must be a positive number"),
        ({"lr": math.inf}, "--lr must be a positive number"),
    ],
)
def test_bad_schedules_are_refused_naming_the_flag(settings, message):
    with pytest.raises(ConfigError, match=message):
        emit.lr_schedule(GPT, TrainSpec(2048, 512), emit.OptimizerSettings(**settings))


def test_plan_refuses_a_bad_schedule_in_one_line(capsys, tmp_path):
    out = tmp_path / "plan"
    assert cli.main(["plan", "--warmup-steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "ds-stpar: error: --warmup-steps must be at least 2 (DeepSpeed's warm-up schedulers "
        "run at least 2 steps), got 1"
    ]
    assert not out.exists()


def _deepspeed_lrs(ds: dict, steps: int) -> list[float]:
    """LR of steps 1..steps under DeepSpeed: the scheduler is built from the JSON over a torch
    optimizer with the JSON's peak, and stepped after each optimizer step (what
    ``DeepSpeedEngine._take_model_step`` does)."""
    import torch

    from ds_stpar.integrations.deepspeed import prepare_cpu

    prepare_cpu()
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=ds["optimizer"]["params"]["lr"])
    scheduler = WarmupCosineLR(opt, **ds["scheduler"]["params"])
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        scheduler.step()
    return lrs


def _megatron_lrs(ns, steps: int) -> list[float]:
    """LR of steps 1..steps under Megatron-LM: ``get_optimizer_param_scheduler`` of its
    ``training.py`` counts in samples (iterations x global batch B), decays over
    ``--lr-decay-iters`` or else ``--train-iters``, starts the warm-up at ``--lr-warmup-init``
    (default 0.0) and steps by B after each optimizer step."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    b = ns.global_batch_size
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=ns.lr)
    scheduler = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=ns.lr,
        min_lr=ns.min_lr,
        lr_warmup_steps=ns.lr_warmup_iters * b,
        lr_decay_steps=(ns.lr_decay_iters or ns.train_iters) * b,
        lr_decay_style=ns.lr_decay_style,
        start_wd=ns.weight_decay,
        end_wd=ns.weight_decay,
        wd_incr_steps=ns.train_iters * b,
        wd_incr_style="constant",
    )
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        scheduler.step(increment=b)
    return lrs


def test_deepspeed_and_megatron_run_the_planned_schedule(capsys, tmp_path):
    out = tmp_path / "plan"
    argv = ["plan", "--model", "gpt3-125m", "--gpus", "8", "--seq-len", "2048"]
    argv += ["--global-batch", "64", "--lr", "6e-4", "--min-lr", "6e-5", "--train-steps", "60"]
    argv += ["--warmup-steps", "8", "--out", str(out), "--json"]
    assert cli.main(argv) == 0
    capsys.readouterr()
    ds = json.loads((out / "ds_stpar.json").read_text())
    _, ns = parse_args_file((out / "megatron_args.txt").read_text())
    lr, floor, warmup, total = 6e-4, 6e-5, 8, 60
    assert (ns.lr, ns.min_lr, ns.lr_warmup_iters, ns.train_iters) == (lr, floor, warmup, total)
    assert ds["optimizer"]["params"]["lr"] == lr
    assert (
        "learning rate | peak 0.0006, linear warm-up over 8 steps" in (out / "plan.md").read_text()
    )

    def cosine(k: int) -> float:
        progress = min(1.0, (k - 1 - warmup) / (total - warmup))
        return floor + (lr - floor) * (1 + math.cos(math.pi * progress)) / 2

    steps = range(1, total + 4)  # past the end: the floor holds
    # step k: DeepSpeed runs iteration k - 2 (its step 1 is set from iteration -1: 0),
    # Megatron-LM iteration k - 1; the warm-up is linear from 0, the decay the same cosine
    want_ds = [
        0.0 if k == 1 else lr * (k - 2) / warmup if k <= warmup + 1 else cosine(k) for k in steps
    ]
    want_mega = [lr * (k - 1) / warmup if k <= warmup + 1 else cosine(k) for k in steps]
    got_ds, got_mega = _deepspeed_lrs(ds, len(steps)), _megatron_lrs(ns, len(steps))
    # Both libraries evaluate these expressions in another order (ratios of the peak, sample
    # counts): a few roundings of 1.1e-16 relative. 1e-12 is far below the smallest relative
    # change between neighbouring steps here (8e-4, at the top of the cosine), so a schedule
    # one step off fails.
    assert got_ds == pytest.approx(want_ds, rel=1e-12, abs=1e-18)
    assert got_mega == pytest.approx(want_mega, rel=1e-12, abs=1e-18)
    # the documented relation: DeepSpeed's warm-up one step later, the decays identical
    assert got_ds[1 : warmup + 1] == pytest.approx(got_mega[:warmup], rel=1e-12)
    assert got_ds[warmup + 1 :] == pytest.approx(got_mega[warmup + 1 :], rel=1e-12)
    assert max(got_mega) == lr and max(got_ds) < lr and got_ds[-1] == pytest.approx(floor)
