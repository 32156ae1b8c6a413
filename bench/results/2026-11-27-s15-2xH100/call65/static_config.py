"""Write the ds_stpar.json that `ds-stpar plan --max-buckets 1` would write had its static
search picked FORCED (a Strategy.short() among the layouts it times), for llama-3b, 64K,
2 x h100-80g, on the stdlib corpus: the static search (_Planner.static) runs unchanged, lists
its fastest layouts, then the forced one replaces its pick and the bucket search is skipped
(with one bucket it would find the pick again), so the file's DeepSpeed section,
buckets and prediction come from the planner's own writer.
    python static_config.py "dp2-tp1-pp1 mb1 z1 rc-full" OUT_DIR"""

import sys

import ds_stpar.planner.buckets as B
from ds_stpar.cli import main

forced, out = sys.argv[1], sys.argv[2]
search_static = B._Planner.static


def static(self):
    best = search_static(self)
    stats = self.stats(())[0]
    found = []
    for s in self.static_candidates(stats):
        t = B.bucket_timing(self.model, self.cluster, self.train, stats, s.strategy, self.cal)
        found.append((t, s))
    found.sort(key=lambda x: x[0].step_s)
    for t, s in found[:10]:
        print(f"  {t.step_s:8.3f} s  peak {s.peak_memory_gib:5.1f} GiB  {s.strategy.short()}")
    t, s = next((t, s) for t, s in found if s.strategy.short() == forced)
    m = B.bucket_micro_batches(stats.rows, s.strategy)
    plan = B.StaticPlan(
        s.strategy, stats.rows, m, B.executed_ratio(stats), t.step_s, t.update_s, s.peak_memory_gib
    )
    print(
        f"forced {forced}: {t.step_s:.3f} s (the search's pick: {best.strategy.short()}, "
        f"{best.step_s:.3f} s)"
    )
    return plan


def candidates(self, stats):
    import math

    from ds_stpar.planner.search import search

    unit = self.cluster.num_gpus * B.MAX_MICRO_BATCH
    rows = math.ceil(stats.rows / unit) * unit
    found = search(
        self.model,
        self.cluster,
        self.train_at(self.train.seq_len, rows),
        top_k=B.ALL,
        tp_modes=self.tp_modes,
        calibration=self.cal,
        allow_tp_across_nodes=self.allow,
    )
    return [e for e in found.top if B.runnable(e.strategy)]


B._Planner.static = static
B._Planner.best = lambda self, bound: None  # no bucketed plan: the file holds the static one
B._Planner.static_candidates = candidates
main(
    [
        "plan",
        "--model",
        "bench/models/llama-3b.json",
        "--gpu",
        "h100-80g",
        "--gpus",
        "2",
        "--gpus-per-node",
        "2",
        "--seq-len",
        "65536",
        "--global-batch-tokens",
        "524288",
        "--data",
        ".gpu/stdlib.jsonl",
        "--tokenizer",
        ".gpu/stdlib-bpe32k.json",
        "--tp-modes",
        "megatron",
        "ring",
        "--max-buckets",
        "1",
        "--out",
        out,
    ]
)
