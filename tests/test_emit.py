"""Plan outputs: Megatron-LM arguments, the DeepSpeed JSON, the report, atomic writing.

The Megatron-LM arguments are parsed back with a parser that knows only the flags
Megatron-LM's ``megatron/training/arguments.py`` defines (names and types checked against
NVIDIA/Megatron-LM at d98e8a6), then every rule of planner.md is checked on the parsed values
(one test per rule) for a set of strategies chosen to hit the edge cases, and the parsed
values are fed to megatron-core's own ``TransformerConfig`` validation as an independent
referee. The DeepSpeed JSON is handed to a real ``deepspeed.initialize`` on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from pathlib import Path

import pytest

from ds_stpar.config import (
    MODEL_PRESETS,
    ClusterSpec,
    Layout,
    ModelSpec,
    StparConfig,
    Strategy,
    TrainSpec,
    load_gpu,
)
from ds_stpar.errors import ConfigError, DoesNotFitError
from ds_stpar.planner import emit
from ds_stpar.planner.cost import estimate
from tests.distributed import run_workers

H100 = load_gpu("h100-80g")
GPT = MODEL_PRESETS["gpt3-1.3b"]  # 24 layers, 16 heads (MHA), GeLU, learned positions, biases
LLAMA = MODEL_PRESETS["llama3-8b"]  # 32 layers, 32 heads, 8 KV groups, SwiGLU, RoPE, untied
# GQA with fewer groups (4) than some TP degrees (8) and a head dim that is not h / heads.
GQA4 = ModelSpec(
    "gqa4",
    num_layers=16,
    hidden_size=2048,
    num_attention_heads=16,
    num_query_groups=4,
    kv_channels=96,
    vocab_size=32000,
    ffn_hidden_size=5632,
    activation="swiglu",
    normalization="rmsnorm",
    add_bias_linear=False,
    tied_embeddings=False,
    position_embedding="rope",
    max_position_embeddings=1024,
)


def _case(model, gpus, seq, batch, layout, dtype="bf16", optimizer="adamw", **knobs):
    cluster = ClusterSpec(H100, num_gpus=gpus, gpus_per_node=8)
    train = TrainSpec(seq, batch, dtype=dtype, optimizer=optimizer)
    return model, cluster, train, Strategy(layout, **knobs)


CASES = {
    # data parallel only; ZeRO-1 -> distributed optimizer + both overlaps; SP asked for at
    # t = 1 is dropped (as Megatron-LM itself does)
    "dp8": _case(GPT, 8, 2048, 512, Layout(dp=8), micro_batch=4, zero=1, sequence_parallel=True),
    # TP 8 inside a node, sequence parallel, selective recompute, GQA groups == t
    "tp8-sp-selective": _case(
        LLAMA, 16, 4096, 64, Layout(dp=2, tp=8), zero=1, recompute="selective",
        sequence_parallel=True,
    ),
    # interleaved 1F1B: p = 4 > 2, L/p = 8 layers in chunks of 2, m = 64 micro-batches, dp 1
    "interleaved-full": _case(
        LLAMA, 16, 4096, 64, Layout(dp=1, tp=4, pp=4), zero=1, recompute="full",
        sequence_parallel=True, vpp_layers=2,
    ),
    # interleaving with p = 2: allowed with Megatron's default overlapped P2P; m = 16
    "interleaved-p2": _case(GPT, 8, 2048, 64, Layout(dp=4, pp=2), zero=1, vpp_layers=4),
    # Cannon TP (2 x 2 torus), ZeRO-2, full recompute
    "cannon-z2-full": _case(
        GPT, 16, 2048, 512, Layout(dp=4, tp=4, tp_mode="cannon"), micro_batch=2, zero=2,
        recompute="full", sequence_parallel=True,
    ),
    # ring TP with uneven pipeline stages 5 | 10 | 10 | 7
    "ring-uneven-pp": _case(
        LLAMA, 16, 2048, 256, Layout(dp=2, tp=2, pp=4, tp_mode="ring"), micro_batch=2, zero=1,
        sequence_parallel=True, first_stage_layers=5, last_stage_layers=7,
    ),
    # t = 8 > 4 query groups, head dim 96 != 2048/16, fp16, ZeRO-0 (no distributed optimizer)
    "gqa-t-gt-groups-fp16": _case(
        GQA4, 16, 1024, 32, Layout(dp=2, tp=8), dtype="fp16", zero=0, sequence_parallel=True,
    ),
    # full recompute of 3 of each stage's 16 layers (block method), the others keep all
    "pp2-block-recompute": _case(
        LLAMA, 16, 4096, 64, Layout(dp=2, tp=4, pp=2), zero=1, recompute="full",
        sequence_parallel=True, recompute_layers=3,
    ),
    # pipeline 2 without interleaving, fp32, plain Adam
    "pp2-fp32-adam": _case(
        GPT, 8, 1024, 64, Layout(dp=4, tp=1, pp=2), dtype="fp32", optimizer="adam", zero=0,
    ),
}  # fmt: skip


def megatron_parser() -> argparse.ArgumentParser:
    """The subset of Megatron-LM's flags ds_stpar may emit, with Megatron's types."""
    p = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    ints = (
        "num-layers hidden-size ffn-hidden-size num-attention-heads num-query-groups "
        "kv-channels seq-length max-position-embeddings tensor-model-parallel-size "
        "pipeline-model-parallel-size context-parallel-size micro-batch-size global-batch-size "
        "recompute-num-layers num-layers-per-virtual-pipeline-stage "
        "num-virtual-stages-per-pipeline-rank decoder-first-pipeline-num-layers "
        "decoder-last-pipeline-num-layers train-iters lr-warmup-iters lr-decay-iters"
    )
    for name in ints.split():
        p.add_argument(f"--{name}", type=int)
    floats = (
        "lr min-lr weight-decay clip-grad adam-beta1 adam-beta2 adam-eps hidden-dropout "
        "attention-dropout"
    )
    for name in floats.split():
        p.add_argument(f"--{name}", type=float)
    flags = (
        "group-query-attention swiglu disable-bias-linear untie-embeddings-and-output-weights "
        "sequence-parallel use-distributed-optimizer overlap-grad-reduce overlap-param-gather "
        "bf16 fp16 tp-comm-overlap"
    )
    for name in flags.split():
        p.add_argument(f"--{name}", action="store_true")
    p.add_argument("--no-overlap-p2p-communication", dest="overlap_p2p_comm", action="store_false")
    p.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    p.add_argument(
        "--position-embedding-type",
        choices=["learned_absolute", "rope"],
        default="learned_absolute",
    )
    p.add_argument("--recompute-granularity", choices=["full", "selective"])
    p.add_argument("--recompute-method", choices=["uniform", "block"])
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    p.add_argument(
        "--lr-decay-style",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
        default="linear",
    )
    p.add_argument("--spec", nargs="*")
    p.set_defaults(context_parallel_size=1)
    return p


def parse_args_file(text: str) -> tuple[dict[str, str], argparse.Namespace]:
    """megatron_args.txt -> (environment, parsed flags), as a shell script would read it."""
    env, argv = {}, []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("--"):
            argv += line.split()
        else:
            key, value = line.split("=", 1)
            env[key] = value
    return env, megatron_parser().parse_args(argv)


@pytest.fixture(scope="module")
def emitted():
    out = {}
    for name, (model, cluster, train, strategy) in CASES.items():
        text = emit.megatron_args_text(model, cluster, train, strategy)
        env, ns = parse_args_file(text)
        # the text file and the argv list carry the same flags
        assert (
            megatron_parser().parse_args(emit.megatron_args(model, cluster, train, strategy)) == ns
        )
        out[name] = (cluster.num_gpus, env, ns, CASES[name])
    return out


def _dp(world: int, ns: argparse.Namespace) -> int:
    return world // (
        ns.tensor_model_parallel_size * ns.pipeline_model_parallel_size * ns.context_parallel_size
    )


def test_rule1_world_divisible_and_dp_matches(emitted):
    for world, _, ns, (_, _, _, strategy) in emitted.values():
        tpc = ns.tensor_model_parallel_size * ns.pipeline_model_parallel_size
        assert world % (tpc * ns.context_parallel_size) == 0
        assert _dp(world, ns) == strategy.layout.dp


def test_rule2_layers_divisible_by_pipeline(emitted):
    for _, _, ns, _ in emitted.values():
        p, layers = ns.pipeline_model_parallel_size, ns.num_layers
        first, last = ns.decoder_first_pipeline_num_layers, ns.decoder_last_pipeline_num_layers
        if first is None and last is None:
            assert layers % p == 0
        else:  # uneven: the middle stages share the rest evenly
            middle = p - (first is not None) - (last is not None)
            rest = layers - (first or 0) - (last or 0)
            assert middle > 0 and rest > 0 and rest % middle == 0
    assert any(ns.decoder_first_pipeline_num_layers for _, _, ns, _ in emitted.values())


def test_rule3_one_virtual_pipeline_argument(emitted):
    for _, _, ns, _ in emitted.values():
        given = [ns.num_layers_per_virtual_pipeline_stage, ns.num_virtual_stages_per_pipeline_rank]
        assert sum(v is not None for v in given) <= 1
        n = ns.num_layers_per_virtual_pipeline_stage
        if n is not None:
            assert (ns.num_layers // ns.pipeline_model_parallel_size) % n == 0
    assert any(ns.num_layers_per_virtual_pipeline_stage for _, _, ns, _ in emitted.values())


def test_rule4_interleaving_needs_enough_stages(emitted):
    # p > 2, or p > 1 with overlapped P2P (Megatron-LM's default, never switched off here)
    for _, _, ns, _ in emitted.values():
        if ns.num_layers_per_virtual_pipeline_stage:
            assert ns.pipeline_model_parallel_size > (1 if ns.overlap_p2p_comm else 2)
    assert emitted["interleaved-p2"][2].num_layers_per_virtual_pipeline_stage == 4


def test_rule5_interleaved_microbatches_multiple_of_stages(emitted):
    for world, _, ns, _ in emitted.values():
        if ns.num_layers_per_virtual_pipeline_stage:
            p = ns.pipeline_model_parallel_size
            m = ns.global_batch_size // (ns.micro_batch_size * _dp(world, ns))
            assert m >= p and m % p == 0


def test_rule6_global_batch_divisible(emitted):
    for world, _, ns, (_, _, train, _) in emitted.values():
        assert ns.global_batch_size == train.global_batch
        assert ns.global_batch_size % (ns.micro_batch_size * _dp(world, ns)) == 0


def test_rule7_heads_groups_and_one_half_precision(emitted):
    for _, _, ns, (model, _, train, _) in emitted.values():
        t = ns.tensor_model_parallel_size
        groups = ns.num_query_groups if ns.group_query_attention else ns.num_attention_heads
        assert groups == model.num_query_groups
        assert ns.num_attention_heads % t == 0
        assert groups % t == 0 or t % groups == 0
        assert not (ns.fp16 and ns.bf16)
        assert (ns.bf16, ns.fp16) == (train.dtype == "bf16", train.dtype == "fp16")
    assert any(
        ns.tensor_model_parallel_size > (ns.num_query_groups or 0) and ns.group_query_attention
        for _, _, ns, _ in emitted.values()
    )


def test_rule8_sequence_length(emitted):
    # No context parallelism is planned (c = 1); the sequence length and positions must still
    # be what Megatron-LM asserts: max_position_embeddings >= seq_length.
    for _, _, ns, (_, _, train, _) in emitted.values():
        c = ns.context_parallel_size
        assert c == 1 or ns.seq_length % (2 * c) == 0
        assert ns.seq_length == train.seq_len
        assert ns.max_position_embeddings >= ns.seq_length


def test_rule9_sequence_parallel_only_with_tp(emitted):
    for _, _, ns, (_, _, _, strategy) in emitted.values():
        t = ns.tensor_model_parallel_size
        assert not (ns.sequence_parallel and t == 1)
        assert not ns.tp_comm_overlap or ns.sequence_parallel
        assert ns.sequence_parallel == (strategy.sequence_parallel and t > 1)
        assert (ns.spec is not None) == (t > 1 and strategy.layout.tp_mode != "megatron")
    assert CASES["dp8"][3].sequence_parallel and not emitted["dp8"][2].sequence_parallel
    assert emitted["cannon-z2-full"][2].spec == list(emit.MEGATRON_SPEC)


def test_rule10_recompute_method_and_layers(emitted):
    seen = set()
    for _, _, ns, (_, _, _, strategy) in emitted.values():
        seen.add(ns.recompute_granularity)
        assert ns.recompute_granularity == (
            None if strategy.recompute == "none" else strategy.recompute
        )
        if ns.recompute_granularity == "full":
            # every layer one at a time, or the block method's first k of each stage
            k = strategy.recompute_layers
            assert (ns.recompute_method, ns.recompute_num_layers) == (
                ("block", k) if k else ("uniform", 1)
            )
            assert 1 <= ns.recompute_num_layers <= ns.num_layers // ns.pipeline_model_parallel_size
        else:
            assert ns.recompute_method is None and ns.recompute_num_layers is None
    assert seen == {None, "selective", "full"}


def test_rule11_param_gather_needs_distributed_optimizer_and_grad_overlap(emitted):
    for world, _, ns, (_, _, _, strategy) in emitted.values():
        if ns.overlap_param_gather:
            assert ns.use_distributed_optimizer and ns.overlap_grad_reduce
        # documented mapping: ZeRO >= 1 -> distributed optimizer
        assert ns.use_distributed_optimizer == (strategy.zero >= 1)
        assert ns.overlap_grad_reduce == (_dp(world, ns) > 1)
    assert emitted["dp8"][2].overlap_param_gather


def test_rule12_cuda_device_max_connections(emitted):
    for _, env, ns, (_, _, _, strategy) in emitted.values():
        if ns.tensor_model_parallel_size > 1:
            assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
        else:
            assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env
        if strategy.layout.tp > 1 and strategy.layout.tp_mode != "megatron":
            assert env["DS_STPAR_TP_MODE"] == strategy.layout.tp_mode


def test_learning_rate_schedule_is_the_deepspeed_one(emitted):
    """Both outputs state one schedule: Megatron-LM's --lr/--min-lr/--lr-warmup-iters/
    --train-iters (cosine, decayed over --train-iters: no --lr-decay-iters) are the peak, the
    floor and the step counts of the DeepSpeed file's WarmupCosineLR; and Megatron-LM's own
    argument checks hold (min_lr <= lr, warm-up shorter than the decay)."""
    for _, _, ns, (model, cluster, train, strategy) in emitted.values():
        ds = emit.deepspeed_config(model, cluster, train, strategy)
        sched = ds["scheduler"]
        assert sched["type"] == "WarmupCosineLR" and sched["params"]["warmup_type"] == "linear"
        params = sched["params"]
        assert ns.lr == ds["optimizer"]["params"]["lr"]
        assert ns.lr_decay_style == "cosine" and ns.lr_decay_iters is None
        assert (ns.lr_warmup_iters, ns.train_iters) == (
            params["warmup_num_steps"],
            params["total_num_steps"],
        )
        # cos_min_ratio is min_lr / lr in binary floating point: one rounding each way
        assert params["cos_min_ratio"] * ns.lr == pytest.approx(ns.min_lr, rel=1e-15)
        assert params["warmup_min_ratio"] == 0.0  # Megatron-LM's default --lr-warmup-init
        assert 0 <= ns.min_lr <= ns.lr and 2 <= ns.lr_warmup_iters < ns.train_iters


def test_megatron_core_accepts_the_parsed_arguments(emitted):
    """megatron-core's TransformerConfig re-checks heads/groups vs TP, SP vs TP, recompute
    method/layers, uneven and virtual pipeline stages: an independent referee."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    for _, _, ns, (model, _, _, _) in emitted.values():
        p = ns.pipeline_model_parallel_size
        vpp = None
        if ns.num_layers_per_virtual_pipeline_stage:
            vpp = ns.num_layers // p // ns.num_layers_per_virtual_pipeline_stage
        cfg = TransformerConfig(
            num_layers=ns.num_layers,
            hidden_size=ns.hidden_size,
            ffn_hidden_size=ns.ffn_hidden_size,
            num_attention_heads=ns.num_attention_heads,
            num_query_groups=ns.num_query_groups if ns.group_query_attention else None,
            kv_channels=ns.kv_channels,
            gated_linear_unit=ns.swiglu,
            add_bias_linear=not ns.disable_bias_linear,
            normalization=ns.normalization,
            tensor_model_parallel_size=ns.tensor_model_parallel_size,
            pipeline_model_parallel_size=p,
            virtual_pipeline_model_parallel_size=vpp,
            num_layers_in_first_pipeline_stage=ns.decoder_first_pipeline_num_layers,
            num_layers_in_last_pipeline_stage=ns.decoder_last_pipeline_num_layers,
            pipeline_dtype=torch.bfloat16 if p > 1 else None,
            sequence_parallel=ns.sequence_parallel,
            recompute_granularity=ns.recompute_granularity,
            recompute_method=ns.recompute_method,
            recompute_num_layers=ns.recompute_num_layers,
            bf16=ns.bf16,
            fp16=ns.fp16,
        )
        # the model the arguments describe is the planned one
        assert (cfg.kv_channels, cfg.num_query_groups) == (
            model.kv_channels,
            model.num_query_groups,
        )
        assert cfg.ffn_hidden_size == model.ffn_hidden_size


def test_model_flags_match_published_llama3_8b(emitted):
    # Llama-3-8B config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads, 14336 FFN, SwiGLU,
    # RMSNorm, RoPE, untied embeddings, no linear biases.
    ns = emitted["tp8-sp-selective"][2]
    assert (ns.num_layers, ns.hidden_size, ns.num_attention_heads) == (32, 4096, 32)
    assert (ns.num_query_groups, ns.ffn_hidden_size, ns.kv_channels) == (8, 14336, None)
    assert ns.swiglu and ns.disable_bias_linear and ns.untie_embeddings_and_output_weights
    assert (ns.normalization, ns.position_embedding_type) == ("RMSNorm", "rope")
    gpt = emitted["dp8"][2]
    assert not (gpt.swiglu or gpt.disable_bias_linear or gpt.untie_embeddings_and_output_weights)
    assert (gpt.normalization, gpt.position_embedding_type) == ("LayerNorm", "learned_absolute")
    assert emitted["gqa-t-gt-groups-fp16"][2].kv_channels == 96


@pytest.mark.parametrize(
    "model, layout, knobs, batch, rule",
    [
        (GPT, Layout(dp=8), {"vpp_layers": 4}, 64, "rule 4"),  # interleaving with p = 1
        (GPT, Layout(dp=2, pp=4), {"vpp_layers": 2}, 12, "rule 5"),  # m = 6, not a multiple of 4
        (GPT, Layout(dp=8), {"micro_batch": 3}, 64, "rule 6"),  # 64 % 24
        (MODEL_PRESETS["gpt3-125m"], Layout(tp=8), {}, 8, "rule 7"),  # 12 heads over 8
        (GPT, Layout(dp=4, pp=2), {"zero": 2}, 64, "rule 13"),  # PipelineEngine and ZeRO-2
        (GPT, Layout(tp=8), {"sequence_parallel": True}, 8, None),  # valid, as a control
    ],
)
def test_broken_rules_are_refused_with_the_rule_named(model, layout, knobs, batch, rule):
    cluster = ClusterSpec(H100, num_gpus=8)
    train = TrainSpec(2048, batch)
    strategy = Strategy(layout, **knobs)
    if rule is None:
        assert emit.megatron_args(model, cluster, train, strategy)
        assert emit.deepspeed_config(model, cluster, train, strategy)
        return
    for fn in (emit.megatron_args, emit.deepspeed_config):
        with pytest.raises(ConfigError, match=rule):
            fn(model, cluster, train, strategy)


def test_learned_positions_shorter_than_sequence_refused():
    cluster = ClusterSpec(H100, num_gpus=8)
    with pytest.raises(ConfigError, match="2048 learned positions"):
        emit.megatron_args(GPT, cluster, TrainSpec(4096, 64), Strategy(Layout(dp=8)))


# --------------------------------------------------------------------------------------
# DeepSpeed JSON
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_deepspeed_batch_algebra_and_sections(name):
    model, cluster, train, strategy = CASES[name]
    cfg = emit.deepspeed_config(model, cluster, train, strategy)
    d = strategy.layout.dp
    # DeepSpeed's check with an mpu: train_batch_size == mbs * GAS * DP size
    assert cfg["train_batch_size"] == train.global_batch
    assert cfg["train_batch_size"] == (
        cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * d
    )
    assert cfg["zero_optimization"]["stage"] == strategy.zero
    assert cfg["optimizer"]["params"]["torch_adam"] is True
    assert set(cfg["scheduler"]["params"]) == {
        "total_num_steps",
        "warmup_num_steps",
        "warmup_min_ratio",
        "cos_min_ratio",
        "warmup_type",
    }
    assert cfg.get("bf16", {}).get("enabled", False) == (train.dtype == "bf16")
    assert cfg.get("fp16", {}).get("enabled", False) == (train.dtype == "fp16")
    assert "auto" not in json.dumps(cfg)
    section = StparConfig.from_dict(cfg["ds_stpar"])
    assert (section.model, section.train) == (model, train)
    assert section.home.layout == strategy.layout
    assert section.home.sequence_parallel == (strategy.sequence_parallel and strategy.layout.tp > 1)
    assert section.extra["gpu_spec"]["peak_tflops"] == cluster.gpu.peak_tflops


TINY = ModelSpec("tiny", num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=32)


def _deepspeed_worker(rank, world_size, paths):
    """Initialise DeepSpeed from each emitted file and train three steps of GAS micro-batches:
    DeepSpeed builds the file's scheduler and steps it once per optimizer step, and the LR
    each update uses is the linear warm-up's (hand-computed: DeepSpeed sets step 1's LR from
    iteration -1, i.e. 0, so step k runs at iteration k - 2, emit's docstring)."""
    import os

    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    os.environ["LOCAL_RANK"] = str(rank)  # what a launcher sets; DeepSpeed asserts it
    # cpu-environment.md: skip the shared-memory comm op JIT build (~50 s of g++).
    importlib.import_module("deepspeed.comm.torch")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    import deepspeed

    for path in paths:
        cfg = json.loads(open(path).read())
        plan = StparConfig.from_deepspeed_json(path)
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Embedding(TINY.vocab_size, TINY.hidden_size),
            torch.nn.Linear(TINY.hidden_size, TINY.vocab_size),
        )
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=path
        )
        assert engine.zero_optimization_stage() == plan.home.zero
        assert engine.train_batch_size() == plan.train.global_batch
        assert engine.gradient_accumulation_steps() == cfg["gradient_accumulation_steps"]
        assert engine.config["ds_stpar"] == cfg["ds_stpar"]  # the extra section is kept
        params = cfg["scheduler"]["params"]
        assert isinstance(scheduler, WarmupCosineLR) and engine.lr_scheduler is scheduler
        assert (scheduler.total_num_steps, scheduler.warmup_num_steps, scheduler.warmup_type) == (
            params["total_num_steps"],
            params["warmup_num_steps"],
            "linear",
        )
        peak, warmup = cfg["optimizer"]["params"]["lr"], params["warmup_num_steps"]
        for k in (1, 2, 3):
            lr = engine.get_lr()[0]
            # exact comparison: with W = 4 the ratios (0, 1/4) are powers of two, so any order
            # of multiplying and dividing by W rounds to the same float
            assert lr == (0.0 if k == 1 else peak * (k - 2) / warmup), (k, lr)
            before = [p.detach().float().clone() for p in engine.module.parameters()]
            for _ in range(engine.gradient_accumulation_steps()):
                mb = engine.train_micro_batch_size_per_gpu()
                tokens = torch.randint(0, TINY.vocab_size, (mb, 8))
                logits = engine(tokens).float()
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
                engine.backward(loss)
                engine.step()
            # one optimizer step (and one scheduler step) per GAS micro-batches
            assert engine.global_steps == k and scheduler.last_batch_iteration == k - 1
            after = [p.detach().float() for p in engine.module.parameters()]
            changed = any(not torch.equal(a, b) for a, b in zip(before, after))
            # AdamW at LR 0 moves nothing (decay factor 1 - 0 x wd = 1, step size 0)
            assert changed == (lr > 0), (k, lr)
        engine.destroy()


@pytest.mark.dist
def test_deepspeed_initialize_accepts_emitted_json(tmp_path):
    """World of 1 (one gloo rank): ZeRO 0, 1 and 2 from the emitted files, torch AdamW.

    With tp/pp > 1 ds_stpar passes an mpu adapter whose DP size DeepSpeed uses as its world;
    a single rank exercises the JSON itself, which is what this test is about.
    """
    cluster = ClusterSpec(H100, num_gpus=1)
    train = TrainSpec(seq_len=8, global_batch=4)
    settings = emit.OptimizerSettings(train_steps=20, warmup_steps=4)
    paths = []
    for zero in (0, 1, 2):
        cfg = emit.deepspeed_config(
            TINY, cluster, train, Strategy(Layout(), micro_batch=2, zero=zero), optimizer=settings
        )
        assert cfg["gradient_accumulation_steps"] == 2
        path = tmp_path / f"zero{zero}.json"
        path.write_text(json.dumps(cfg))
        paths.append(str(path))
    run_workers(_deepspeed_worker, 1, paths)


# --------------------------------------------------------------------------------------
# Report and writing
# --------------------------------------------------------------------------------------


def _estimates():
    model, cluster, train, _ = CASES["dp8"]
    strategies = [
        Strategy(Layout(dp=8), micro_batch=4, zero=1),
        Strategy(Layout(dp=4, tp=2), micro_batch=4, zero=1, sequence_parallel=True),
    ]
    return [estimate(model, cluster, train, s) for s in strategies], model, cluster, train


def test_report_lists_layouts_and_breakdowns():
    estimates, model, cluster, train = _estimates()
    text = emit.report_markdown(estimates, model, cluster, train)
    for est in estimates:
        assert est.strategy.short() in text
        for component in list(est.time_breakdown) + list(est.memory_breakdown):
            assert f"| {component} |" in text
    assert f"{train.tokens_per_step:,} tokens per step" in text


def test_write_plan_writes_three_files(tmp_path):
    estimates, model, cluster, train = _estimates()
    paths = emit.write_plan(tmp_path / "new" / "plan", estimates, model, cluster, train)
    assert sorted(p.name for p in paths) == sorted(emit.PLAN_FILES)
    plan = StparConfig.from_deepspeed_json(str(tmp_path / "new" / "plan" / "ds_stpar.json"))
    assert plan.home == next(e for e in estimates if e.fits).strategy
    # rewriting into the now existing directory replaces the files
    assert emit.write_plan(tmp_path / "new" / "plan", estimates, model, cluster, train)
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["plan"]


def test_write_plan_is_all_or_nothing(tmp_path):
    estimates, model, cluster, train = _estimates()
    out = tmp_path / "out"
    out.mkdir()
    (out / "plan.md").mkdir()  # the last file cannot replace a directory
    with pytest.raises(ConfigError, match="plan.md: exists and is not a file"):
        emit.write_plan(out, estimates, model, cluster, train)
    assert sorted(p.name for p in out.iterdir()) == ["plan.md"]
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        emit.write_plan(blocker / "plan", estimates, model, cluster, train)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "out"]  # no temp dir left


def test_write_plan_refuses_when_nothing_fits(tmp_path):
    _, model, cluster, _ = _estimates()
    train = TrainSpec(2048, 64)
    unfit = estimate(MODEL_PRESETS["gpt3-175b"], cluster, train, Strategy(Layout(dp=8)))
    assert not unfit.fits
    with pytest.raises(DoesNotFitError):
        emit.write_plan(tmp_path / "x", [unfit], model, cluster, train)
    assert not (tmp_path / "x").exists()


def test_megatron_plan_uses_zero1_and_fp32_main_grads():
    model, cluster, train, _ = CASES["dp8"]
    mega = emit.megatron_estimate(model, cluster, train)
    assert mega.fits and mega.strategy.zero <= 1
    if mega.strategy.layout.tp == mega.strategy.layout.pp == 1:
        # Megatron-LM's main grads are fp32: 4 bytes per parameter, unsharded (exact count)
        assert mega.memory_breakdown["grads"] == pytest.approx(4 * model.num_params() / 2**30)
    text = emit.megatron_args_text(model, cluster, train, mega.strategy, prediction=mega)
    assert f"peak {mega.peak_memory_gib:.1f} of" in text


def test_megatron_args_set_the_ring_transport_the_estimate_priced():
    # a TP2 ring on one node: priced with the copy engines, which `auto` takes there; on
    # GPUs without peer copies the estimate priced NCCL's hops, and the file says nccl
    from ds_stpar.planner.profile import Profile

    model = ModelSpec("m", 4, 4096, 32, vocab_size=32000, max_position_embeddings=4096)
    train = TrainSpec(4096, 8)
    ring = Strategy(Layout(1, 2, 1, "ring"), micro_batch=4, sequence_parallel=True)
    megatron = Strategy(Layout(1, 2, 1), micro_batch=4, sequence_parallel=True)
    no_peers = Profile("h100-80g", peer_copies=False)
    expected = [(ring, None, "auto"), (ring, no_peers, "nccl"), (megatron, None, None)]
    for strategy, profile, transport in expected:
        cluster = ClusterSpec(H100, 2, 2, profile=profile)
        est = estimate(model, cluster, train, strategy)
        text = emit.megatron_args_text(model, cluster, train, strategy, prediction=est)
        lines = [line for line in text.splitlines() if line.startswith("DS_STPAR_RING_TRANSPORT=")]
        assert lines == ([f"DS_STPAR_RING_TRANSPORT={transport}"] if transport else []), text


def test_transfers_by_the_copy_engines_are_priced_but_not_written_for_megatron_lm():
    # the interleaved layer (TP2 ring, 2 pieces) on one node whose GPUs lack peer copies:
    # with transfer_transport auto the estimate prices its transfers by the copy engines
    # through host memory (layers/host_staged.py), faster than NCCL's; they need more than
    # one hardware queue, which Megatron-LM refuses with TP, so megatron_args.txt is refused
    # for that prediction; the default (nccl), and auto with peer copies, write nccl and
    # rule 12's CUDA_DEVICE_MAX_CONNECTIONS=1
    from ds_stpar.planner.comm import staged_transfers
    from ds_stpar.planner.profile import Calibration, Profile

    model = ModelSpec("m", 4, 4096, 32, vocab_size=32000, max_position_embeddings=4096)
    train = TrainSpec(4096, 8)
    interleaved = Strategy(
        Layout(1, 2, 1, "ring"), micro_batch=4, sequence_parallel=True, interleave=2
    )
    no_peers = ClusterSpec(H100, 2, 2, profile=Profile("h100-80g", peer_copies=False))
    peers = ClusterSpec(H100, 2, 2)
    default = Calibration.load_default("h100-80g")
    assert default.transfer_transport == "nccl"
    auto = dataclasses.replace(default, transfer_transport="auto")
    staged = estimate(model, no_peers, train, interleaved, auto)
    assert staged.transfers == "host-staged"
    with pytest.raises(ConfigError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        emit.megatron_args_text(model, no_peers, train, interleaved, prediction=staged)
    for cluster, cal in ((no_peers, default), (peers, auto)):
        est = estimate(model, cluster, train, interleaved, cal)
        assert est.transfers == "nccl"
        assert staged.step_time_s < est.step_time_s or cluster is peers
        text = emit.megatron_args_text(model, cluster, train, interleaved, prediction=est)
        env = dict(line.split("=", 1) for line in text.splitlines() if line[:1].isupper())
        assert env["DS_STPAR_TRANSFER_TRANSPORT"] == "nccl", text
        assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1", text
    # the ring layers' hops (the fused ring MLP's) go the same way: priced as staged, faster
    # than NCCL's hops, and refused for Megatron-LM alike
    ring = Strategy(Layout(1, 2, 1, "ring"), micro_batch=4, sequence_parallel=True)
    ring_staged = estimate(model, no_peers, train, ring, auto)
    assert ring_staged.ring_hops == "host-staged" and ring_staged.transfers == ""
    ring_nccl = estimate(model, no_peers, train, ring, default)
    assert ring_nccl.ring_hops == "nccl"
    assert ring_staged.step_time_s < ring_nccl.step_time_s
    with pytest.raises(ConfigError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        emit.megatron_args_text(model, no_peers, train, ring, prediction=ring_staged)
    # what picks them: a ring layout, its TP group in a node, the setting (Megatron's and
    # Cannon's layouts keep NCCL's)
    megatron = Strategy(Layout(1, 2, 1), micro_batch=4, sequence_parallel=True)
    assert not staged_transfers(megatron, no_peers, "host-staged")
    cannon = Strategy(Layout(1, 4, 1, "cannon"), micro_batch=4, sequence_parallel=True)
    assert not staged_transfers(cannon, ClusterSpec(H100, 4, 4), "host-staged")
    assert staged_transfers(ring, no_peers, "auto")
    assert staged_transfers(interleaved, peers, "host-staged")
    assert not staged_transfers(interleaved, no_peers, "nccl")
    across = ClusterSpec(H100, 4, 1, profile=Profile("h100-80g", peer_copies=False))
    assert not staged_transfers(interleaved, across, "auto")
    with pytest.raises(ConfigError, match="transfer_transport"):
        dataclasses.replace(default, transfer_transport="shm")


# --------------------------------------------------------------------------------------
# ds_stpar.json's layout: what the training loop runs as a home layout
# --------------------------------------------------------------------------------------


def _loop_runs(strategy: Strategy) -> bool:
    """The training loop's rule, spelled out: ZeRO <= 2, no interleaving, even stages."""
    even = not strategy.first_stage_layers and not strategy.last_stage_layers
    return strategy.zero <= 2 and not strategy.vpp_layers and even


def test_loop_estimate_is_the_fastest_layout_the_loop_runs():
    # llama-4b (36 layers, 128K vocabulary) at 32K on 2 GPUs over a 21 GB/s link with 59.25 GiB
    # to spend, on the loop's stack: a 2-stage pipeline is the fastest layout the loop runs
    # for an untied copy of the model; the model file ties the embedding and LM head (0.4 B
    # parameters fewer), and DP2 with ZeRO-2 fits it and beats its pipeline
    from ds_stpar.planner.profile import LOCAL_STACK, Calibration
    from ds_stpar.planner.search import search

    tied = ModelSpec.load(str(Path(__file__).parents[1] / "bench/models/llama-4b.json"))
    untied = dataclasses.replace(tied, tied_embeddings=False)
    cluster = ClusterSpec(dataclasses.replace(H100, nvlink_gbs=21.0, hbm_gib=59.25), 2)
    train = TrainSpec(32768, 8)
    cal = Calibration.load_default("h100-80g", stack=LOCAL_STACK)
    loops = {}
    for model in (untied, tied):
        ranked = search(model, cluster, train, top_k=1 << 30, calibration=cal).top
        loops[model] = emit.loop_estimate(model, cluster, train)
        expected = next(e for e in ranked if _loop_runs(e.strategy))
        assert loops[model].strategy == expected.strategy
        assert loops[model].step_time_s == pytest.approx(expected.step_time_s, rel=1e-12)
    assert loops[untied].strategy.layout == Layout(pp=2)
    assert loops[tied].strategy.layout == Layout(dp=2) and loops[tied].strategy.zero == 2
    pipeline = estimate(tied, cluster, train, loops[untied].strategy, cal)
    assert pipeline.fits and pipeline.step_time_s > loops[tied].step_time_s


def test_plan_files_refuse_an_interleaved_home_by_reason():
    # given only an interleaved pipeline, ds_stpar.json cannot be written (the loop runs
    # non-interleaved 1F1B); the same pipeline without interleaving is written, for a model
    # that ties its embedding and LM head too
    from ds_stpar.seqbucket.runner import LOOP_RULE

    cluster, train = ClusterSpec(H100, 8), TrainSpec(2048, 64)
    pipeline = Strategy(Layout(dp=4, pp=2), micro_batch=2, zero=1)
    interleaved = dataclasses.replace(pipeline, vpp_layers=6)
    est = estimate(GPT, cluster, train, interleaved)
    assert est.fits and GPT.tied_embeddings
    with pytest.raises(DoesNotFitError, match="does not interleave stages"):
        emit.plan_files([est], GPT, cluster, train)
    files = emit.plan_files([estimate(GPT, cluster, train, pipeline)], GPT, cluster, train)
    section = json.loads(files["ds_stpar.json"])["ds_stpar"]
    assert StparConfig.from_dict(section).home == pipeline
    assert LOOP_RULE in files["plan.md"]
