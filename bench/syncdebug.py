"""Where training makes the host wait for the GPU: ``launch/pretrain.py`` under
``torch.cuda.set_sync_debug_mode("warn")``.

A synchronizing CUDA call (``.item()``, ``.tolist()``, a copy from pageable memory) makes
the host wait for the GPU's queue to drain; the GPU then idles while the host queues the next
work. This runs the training job unchanged, prints each synchronizing call site's Python stack
once (prefixed ``SYNC``), and at the end, on rank 0, how often each site synced
(``SYNCCOUNT``). The warnings cost host time, so its step times are not benchmarks.

    deepspeed --num_gpus 2 bench/syncdebug.py --config ds_stpar.json --data D --steps 2 ...

(every argument is ``launch/pretrain.py``'s). BENCHMARKS.md, eleventh session, calls 47-49.
"""

import os
import runpy
import sys
import traceback
import warnings

import torch

seen: dict[tuple, int] = {}


def show(message, category, filename, lineno, file=None, line=None) -> None:
    """warnings.showwarning: count the site, print its stack the first time."""
    stack = "".join(traceback.format_stack(limit=12)[:-1])
    key = (filename, lineno, stack)
    seen[key] = seen.get(key, 0) + 1
    if seen[key] == 1:
        print(f"SYNC {filename}:{lineno}: {message}\n{stack}", file=sys.stderr, flush=True)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("syncdebug.py watches CUDA synchronizations: run it on a GPU machine")
    torch.cuda.set_sync_debug_mode("warn")
    warnings.showwarning = show
    warnings.simplefilter("always")
    pretrain = os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "launch", "pretrain.py"
    )
    sys.argv = [pretrain] + sys.argv[1:]
    try:
        runpy.run_path(pretrain, run_name="__main__")
    finally:
        if int(os.environ.get("RANK", "0")) == 0:
            for (where, lineno, _), n in sorted(seen.items(), key=lambda kv: -kv[1])[:15]:
                print(f"SYNCCOUNT {n} {where}:{lineno}", file=sys.stderr)


if __name__ == "__main__":
    main()
