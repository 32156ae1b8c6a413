"""What is alive at the peak of a CUDA memory trace, grouped by the Python line that made it.

``torch.cuda.memory._record_memory_history(stacks="python")`` records every allocation and
free of the caching allocator with its Python stack; ``torch.cuda.memory._snapshot()`` returns
them as ``device_traces``. :func:`alive_at_peak` replays one device's trace: the running sum of
allocated bytes (blocks allocated before the recording started are not in the trace and count
as the base), the event where it peaks, and the blocks alive there. :func:`group_by_site`
sums them by the innermost frame outside torch's own files, so a row reads "megatron/core/...
/layers.py:512 forward: 3.2 GiB in 48 blocks". Used by bench/planner_accuracy.py
``--memory-trace`` (the planner's memory model names activations, states and buffers; this
says which of the measured bytes are which) and bench/layers.py ``--memory-trace`` (what a
layer variant holds at its peak). On the CPU, where there is no caching allocator to ask,
:func:`cpu_peak_above_start` reads the peak off a ``profile_memory=True`` torch.profiler
run (bench/layers.py ``--cpu`` rows, bench/cpu_peak.py).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict

INTERNAL = ("/torch/", "<frozen", "/contextlib.py", "/functools.py", "/threading.py")


def alive_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """(peak bytes above the trace's base, the ``alloc`` events alive at that moment)."""
    alive: dict[int, dict] = {}
    total = peak = 0
    peak_index = -1
    for index, event in enumerate(trace):
        action = event["action"]
        if action == "alloc":
            alive[event["addr"]] = event
            total += event["size"]
        elif action == "free_requested" and event["addr"] in alive:
            total -= alive.pop(event["addr"])["size"]
        if total > peak:
            peak, peak_index = total, index
    alive = {}
    for event in trace[: peak_index + 1]:
        if event["action"] == "alloc":
            alive[event["addr"]] = event
        elif event["action"] == "free_requested":
            alive.pop(event["addr"], None)
    return peak, list(alive.values())


def site(event: dict) -> str:
    """The innermost frame outside torch's own files (the caller that asked for the memory)."""
    for frame in event.get("frames", []):
        name = frame.get("filename", "")
        if not any(part in name for part in INTERNAL):
            short = "/".join(name.split("/")[-3:])
            return f"{short}:{frame.get('line')} {frame.get('name')}"
    return "(torch internal)"


def group_by_site(events: list[dict]) -> list[tuple[str, int, int]]:
    """``(site, bytes, blocks)`` sorted by bytes, largest first."""
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for event in events:
        entry = sums[site(event)]
        entry[0] += event["size"]
        entry[1] += 1
    return sorted(((k, v[0], v[1]) for k, v in sums.items()), key=lambda r: -r[1])


def summarize(snapshot: dict, device: int, top: int = 15) -> dict:
    """Peak above base and the ``top`` sites alive there, from a ``_snapshot()`` dict."""
    trace = snapshot["device_traces"][device]
    peak, events = alive_at_peak(trace)
    rows = group_by_site(events)
    return {
        "events": len(trace),
        "peak_above_base_gib": peak / 2**30,
        "sites": [{"site": s, "gib": b / 2**30, "blocks": n} for s, b, n in rows[:top]],
    }


def cpu_peak_above_start(prof) -> int:
    """The most bytes alive at once during a finished ``profile_memory=True`` CPU profile,
    above what was allocated when it started (0 if nothing was allocated)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as handle:
            events = [e for e in json.load(handle)["traceEvents"] if e.get("name") == "[memory]"]
    if not events:
        return 0
    first = events[0]["args"]
    start = first["Total Allocated"] - first["Bytes"]
    return max(0, max(e["args"]["Total Allocated"] for e in events) - start)
