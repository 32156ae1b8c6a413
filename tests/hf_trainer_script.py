"""Worker of tests/test_hf_trainer.py: ``torchrun --nproc_per_node 2 hf_trainer_script.py OUT``.

Trains one tiny random LlamaForCausalLM (same seed each time) for 6 steps, four ways, in one
launch, all under DeepSpeed ZeRO-1 with torch SGD (lr 1, no clipping): "ref" -- a plain
``transformers.Trainer`` fed the rows of the static DP plan in the order accelerate deals them
(4-D block-diagonal mask, ``shift_labels`` = the packed labels); "dp" -- ``StparTrainer`` with the static dp2 plan;
"tp" -- a static tp2 ring plan; "switch" -- buckets 16 (tp2 Megatron) and 32 (dp2, home).
Rank 0 writes ``OUT/results.json`` (per run: logged losses, layouts of the last step, switches)
and every run saves its final model to ``OUT/<run>/final`` (an unsharded HF checkpoint).
"""

from __future__ import annotations

import json
import os
import sys

from ds_stpar.integrations.deepspeed import prepare_cpu

prepare_cpu()  # before transformers imports deepspeed: no JIT build of its CPU comm op

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from ds_stpar.config import Bucket, Layout, ModelSpec, StparConfig, Strategy, TrainSpec  # noqa: E402
from ds_stpar.errors import ConfigError  # noqa: E402
from ds_stpar.hf import StparTrainer  # noqa: E402
from ds_stpar.seqbucket.data import Documents  # noqa: E402
from ds_stpar.seqbucket.packing import collate, token_multiple  # noqa: E402
from ds_stpar.seqbucket.sampler import BucketSampler  # noqa: E402

VOCAB, T, STEPS, ROWS = 64, 32, 6, 4  # vocabulary, context, optimizer steps, rows per step
LR = 1.0
DS = {  # plain SGD, no clipping: weight differences are gradient differences times lr
    "zero_optimization": {"stage": 1},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 1 << 30,
    "optimizer": {"type": "SGD", "params": {"lr": LR, "weight_decay": 0.0}},
}
PLANS = {
    "dp": [(T, Layout(dp=2))],
    "tp": [(T, Layout(tp=2, tp_mode="ring"))],
    "switch": [(T // 2, Layout(tp=2, tp_mode="megatron")), (T, Layout(dp=2))],
    # the switching plan with the home bucket fully recomputed (gradient checkpointing)
    "recompute": [(T // 2, Layout(tp=2, tp_mode="megatron")), (T, Layout(dp=2), "full")],
}


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def documents() -> Dataset:
    """64 arithmetic progressions mod VOCAB, of 16 and 32 tokens (learnable: the loss falls).

    Any mini-batch (<= 4 x 32 tokens, cut before the piece that would overflow) then holds
    112 or 128 tokens and packs into exactly 4 rows of 32: the reference can use a fixed
    gradient accumulation."""
    gen = torch.Generator().manual_seed(7)
    rows = []
    for i in range(64):
        start, step = torch.randint(0, VOCAB, (2,), generator=gen).tolist()
        rows.append([(start + k * (step % 5 + 1)) % VOCAB for k in range(16 * (1 + i % 2))])
    return Dataset.from_dict({"input_ids": rows})


def arguments(out: str, **kw) -> TrainingArguments:
    return TrainingArguments(
        output_dir=out,
        use_cpu=True,
        max_steps=STEPS,
        learning_rate=LR,
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        **kw,
    )


def plan_config(layouts, world: int = 2) -> dict:
    buckets = tuple(
        Bucket(edge, Strategy(layout, micro_batch=1, zero=1, recompute=rest[0] if rest else "none"))
        for edge, layout, *rest in layouts
    )
    spec = ModelSpec("tiny-llama", 2, 32, 4, vocab_size=VOCAB)
    cfg = StparConfig(spec, TrainSpec(T, ROWS, "fp32"), buckets, gpus_per_node=world)
    return {**DS, "ds_stpar": cfg.to_dict()}


def reference_rows() -> list[dict]:
    """The static dp2 plan's rows: step s, micro-batch k, rank r at index (2s + k) * 2 + r,
    which is what accelerate's sequential sharding hands rank r as its (2s + k)-th batch."""
    docs = Documents(documents())
    sampler = BucketSampler(docs.lengths, (Bucket(T, Strategy(Layout(dp=2))),), ROWS * T, seed=0)
    rows = []
    for index in range(STEPS):
        (bucket,) = sampler.plan(index).buckets
        assert bucket.num_micro_batches == 2
        for k in range(2):
            for rank in range(2):
                # as the runner feeds it: the row's pieces, padded to a multiple of 8 tokens
                batch = collate(bucket.ranks[rank][k].rows, docs.__getitem__, 0, token_multiple(1))
                rows.append(
                    {
                        "input_ids": batch.input_ids[0],
                        "position_ids": batch.position_ids[0],
                        "attention_mask": batch.attention_mask()[0],
                        "labels": batch.labels[0],
                        "shift_labels": batch.labels[0],  # already shifted: HF must not shift
                    }
                )
    return rows


def train(name: str, out: str) -> dict:
    run_dir = os.path.join(out, name)
    if name == "ref":
        ds = {
            **DS,
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto",
            "gradient_clipping": "auto",
        }
        args = arguments(
            run_dir,
            deepspeed=ds,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=2,
            train_sampling_strategy="sequential",
            remove_unused_columns=False,
        )
        trainer = Trainer(model(), args, train_dataset=reference_rows())
    else:
        args = arguments(run_dir, deepspeed=plan_config(PLANS[name]))
        trainer = StparTrainer(model(), args, train_dataset=documents())
    trainer.train()
    trainer.save_model(os.path.join(run_dir, "final"))
    stats = getattr(trainer, "stpar_last_stats", None)
    models = getattr(trainer, "stpar_models", {})
    return {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "layouts": stats.layouts if stats else None,
        "switches": stats.switches if stats else None,
        # after the last bucket: which models run with gradient checkpointing
        "checkpointing": {
            k.layout.short(): m.module.is_gradient_checkpointing for k, m in models.items()
        },
    }


def errors(out: str) -> dict:
    """The one-line messages of two bad set-ups."""
    found = {}
    for name, args in (
        ("world", arguments(out, deepspeed=plan_config([(T, Layout(dp=4))], world=4))),
        ("no_plan", arguments(out, deepspeed=DS)),
    ):
        try:
            StparTrainer(model(), args, train_dataset=documents())
        except ConfigError as err:
            found[name] = str(err)
    return found


def main() -> None:
    out = sys.argv[1]
    results = {name: train(name, out) for name in ("ref", "dp", "tp", "switch", "recompute")}
    results["errors"] = errors(out)
    if int(os.environ["RANK"]) == 0:
        with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as handle:
            json.dump(results, handle)


if __name__ == "__main__":
    main()
