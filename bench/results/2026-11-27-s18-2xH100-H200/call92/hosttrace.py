"""bench/layers.py with its --trace-dir step traced with host activity and Python stacks."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import layers  # noqa: E402


def trace_step(built, x, dy, rt, name):
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for i in range(3):
        layers.run_step(built, x, dy)
    rt.sync()
    with torch.profiler.profile(activities=acts, with_stack=True) as prof:
        for i in range(5):
            layers.run_step(built, x, dy)
        rt.sync()
    os.makedirs(rt.trace_dir, exist_ok=True)
    prof.export_chrome_trace(os.path.join(rt.trace_dir, f"host-{name}-rank-{rt.rank}.json.gz"))


layers.trace_step = trace_step
layers.main(sys.argv[1:])
