"""Runs launch/pretrain.py with CUDA sync debugging: prints the stack of each synchronizing
call site once, and (rank 0) how often each site synced."""

import os
import runpy
import sys
import traceback
import warnings

import torch

torch.cuda.set_sync_debug_mode("warn")
seen = {}


def show(message, category, filename, lineno, file=None, line=None):
    stack = "".join(traceback.format_stack(limit=12)[:-1])
    key = (filename, lineno, stack)
    seen[key] = seen.get(key, 0) + 1
    if seen[key] == 1:
        print(f"SYNC {filename}:{lineno}: {message}\n{stack}", file=sys.stderr, flush=True)


warnings.showwarning = show
warnings.simplefilter("always")
sys.argv = ["launch/pretrain.py"] + sys.argv[1:]
try:
    runpy.run_path("launch/pretrain.py", run_name="__main__")
finally:
    if int(os.environ.get("RANK", "0")) == 0:
        for (where, lineno, _), n in sorted(seen.items(), key=lambda kv: -kv[1])[:15]:
            print(f"SYNCCOUNT {n} {where}:{lineno}", file=sys.stderr)
