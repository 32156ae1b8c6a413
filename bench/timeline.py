"""Where a GPU's compute stream idles in a traced step, and why.

    python3 bench/timeline.py RUN/trace-step-3-rank-0.json.gz [more traces...]

The traces come from ``launch/pretrain.py --trace-step N``: the step's kernels, copies and the
CUDA calls that launched them, recorded without operator recording, so the host runs at
nearly its own speed. For each trace this prints one row:

- ``span``: first to last GPU activity on any stream;
- ``busy``: the compute stream's kernels and copies (the stream with the most non-NCCL time);
- its idle time, split three ways, gap by gap: a gap between work ``a`` and the next work ``b``
  on the compute stream is *host-late* for as long as ``b``'s launch call had not been made
  after ``a`` ended (the GPU waited for the host), *comm-wait* for the rest of it while an NCCL
  kernel ran on another stream (the GPU waited for a transfer it depends on), and *other*
  otherwise (launch latency, event waits on other work);
- ``nccl``: NCCL kernel time on the other streams, and ``hidden``: the part of it that ran
  while the compute stream was busy;
- kernels on the compute stream and their mean length (many short kernels make the host
  the limit).

Under each row: the busy time by kind (:func:`kind_of`: matrix products, attention,
communication, copies, other elementwise kernels), the longest-running kernels that are
neither matrix products nor attention (where the rest of the step goes: megatron-core's eager
RoPE showed up there), and the most host-late kernels (the work the GPU waited for the host
to launch). BENCHMARKS.md, twelfth session.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import itertools
import json
from collections import defaultdict
from dataclasses import dataclass

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


KINDS = ("matrix", "attention", "nccl", "copy", "elementwise")


def kind_of(name: str) -> str:
    """A kernel's kind by its name: flash attention kernels (``flash``), NCCL's, copies and
    memsets (``Memcpy``/``Memset``, ``copy_kernel``, ``CatArray``), the matrix products
    (cuBLAS's ``nvjet``/``gemm``/CUTLASS kernels), and the rest elementwise (norms,
    activations, additions, reductions)."""
    lowered = name.lower()
    if "flash" in lowered:
        return "attention"
    if name.startswith("nccl"):
        return "nccl"
    if name.startswith(("Memcpy", "Memset")) or "copy_kernel" in name or "CatArray" in name:
        return "copy"
    if name.startswith("nvjet") or "gemm" in lowered or "cutlass" in lowered:
        return "matrix"
    return "elementwise"


NAME_NOISE = ("void ", "at::native::", "(anonymous namespace)::", "c10::", "std::")


def short_name(name: str, width: int = 100) -> str:
    """A kernel's name without the namespaces that every ATen kernel repeats, cut at
    ``width`` (what tells the kernels apart, e.g. ``direct_copy_kernel`` or ``neg_kernel``
    inside ``elementwise_kernel<...>``, then fits a line)."""
    for noise in NAME_NOISE:
        name = name.replace(noise, "")
    return name[:width]


@dataclass(frozen=True)
class Work:
    """One kernel, copy or memset on a stream (microseconds) and the launch call behind it."""

    name: str
    stream: int
    start: float
    end: float
    launched: float | None  # the launch call's start; None when the trace has no such call

    @property
    def nccl(self) -> bool:
        return self.name.startswith("nccl")


def load_work(path: str) -> list[Work]:
    """Every device activity of a chrome trace (``torch.profiler`` / kineto), with the start
    of the host call that launched it (matched by CUPTI correlation id)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        events = json.load(handle)["traceEvents"]
    launches = {}
    for ev in events:
        if ev.get("cat") in LAUNCH_CATEGORIES and "correlation" in ev.get("args", {}):
            launches[ev["args"]["correlation"]] = float(ev["ts"])
    out = []
    for ev in events:
        if ev.get("cat") not in DEVICE_CATEGORIES or ev.get("ph") != "X":
            continue
        args = ev.get("args", {})
        start = float(ev["ts"])
        out.append(
            Work(
                ev["name"],
                int(args.get("stream", ev.get("tid", 0))),
                start,
                start + float(ev.get("dur", 0.0)),
                launches.get(args.get("correlation")),
            )
        )
    if not out:
        raise SystemExit(f"{path}: no GPU activity (was it traced on a GPU?)")
    return sorted(out, key=lambda w: w.start)


class Coverage:
    """The union of intervals, for the length it covers inside any window in O(log n) (a
    step holds tens of thousands of kernels and gaps: scanning every interval per gap took
    half a minute per trace)."""

    def __init__(self, intervals: list[tuple[float, float]]) -> None:
        spans: list[tuple[float, float]] = []
        for start, end in sorted(intervals):
            if spans and start <= spans[-1][1]:
                spans[-1] = (spans[-1][0], max(spans[-1][1], end))
            else:
                spans.append((start, end))
        self.spans = spans
        self.starts = [a for a, _ in spans]
        self.before = list(itertools.accumulate((b - a for a, b in spans), initial=0.0))

    @property
    def total(self) -> float:
        return self.before[-1]

    def upto(self, x: float) -> float:
        """Length covered before ``x``."""
        i = bisect.bisect_right(self.starts, x)
        if not i:
            return 0.0
        a, b = self.spans[i - 1]
        return self.before[i - 1] + min(x, b) - a

    def within(self, start: float, end: float) -> float:
        """Length covered inside ``[start, end)``."""
        return self.upto(end) - self.upto(start) if end > start else 0.0


@dataclass(frozen=True)
class Breakdown:
    """A trace's compute-stream accounting, microseconds (module docstring)."""

    span: float
    busy: float
    host_late: float
    comm_wait: float
    other: float
    nccl: float
    nccl_hidden: float
    kernels: int
    late_by_name: dict[str, float]
    busy_by_kind: dict[str, float]
    busy_by_name: dict[str, float]  # kernels of kinds other than matrix and attention

    @property
    def idle(self) -> float:
        return self.host_late + self.comm_wait + self.other


def breakdown(work: list[Work]) -> Breakdown:
    """Split the compute stream's idle time gap by gap (module docstring)."""
    by_stream: dict[int, list[Work]] = defaultdict(list)
    for w in work:
        by_stream[w.stream].append(w)
    compute = max(by_stream, key=lambda s: sum(w.end - w.start for w in by_stream[s] if not w.nccl))
    mine = by_stream[compute]
    nccl = Coverage([(w.start, w.end) for w in work if w.nccl and w.stream != compute])
    busy = Coverage([(w.start, w.end) for w in mine])
    host_late = comm_wait = other = 0.0
    late_by_name: dict[str, float] = defaultdict(float)
    reach = mine[0].end
    for nxt in mine[1:]:
        if nxt.start > reach:
            gap_end = nxt.start
            launched = reach if nxt.launched is None else nxt.launched
            late_until = min(gap_end, max(reach, launched))
            late = late_until - reach
            waited = nccl.within(late_until, gap_end)
            host_late += late
            comm_wait += waited
            other += gap_end - late_until - waited
            if late > 0:
                late_by_name[nxt.name] += late
        reach = max(reach, nxt.end)
    busy_by_kind = dict.fromkeys(KINDS, 0.0)
    busy_by_name: dict[str, float] = defaultdict(float)
    for w in mine:
        kind = kind_of(w.name)
        busy_by_kind[kind] += w.end - w.start
        if kind not in ("matrix", "attention"):
            busy_by_name[w.name] += w.end - w.start
    span = max(w.end for w in work) - min(w.start for w in work)
    hidden = sum(busy.within(a, b) for a, b in nccl.spans)
    return Breakdown(
        span=span,
        busy=busy.total,
        host_late=host_late,
        comm_wait=comm_wait,
        other=other,
        nccl=nccl.total,
        nccl_hidden=hidden,
        kernels=len(mine),
        late_by_name=dict(late_by_name),
        busy_by_kind=busy_by_kind,
        busy_by_name=dict(busy_by_name),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", help="trace-step-N-rank-R.json(.gz) files")
    parser.add_argument(
        "--top", type=int, default=5, help="kernels listed per trace, of each list (default 5)"
    )
    args = parser.parse_args()
    ms = 1e-3
    header = (
        f"{'trace':56s} {'span':>8s} {'busy':>8s} {'host-late':>9s} {'comm-wait':>9s} "
        f"{'other':>8s} {'nccl':>8s} {'hidden':>8s} {'kernels':>8s} {'mean us':>8s}"
    )
    print("milliseconds unless named")
    print(header)
    for path in args.traces:
        b = breakdown(load_work(path))
        name = "/".join(path.split("/")[-2:])  # the run folder and the file
        print(
            f"{name[-56:]:56s} {b.span * ms:8.1f} {b.busy * ms:8.1f} {b.host_late * ms:9.1f} "
            f"{b.comm_wait * ms:9.1f} {b.other * ms:8.1f} {b.nccl * ms:8.1f} "
            f"{b.nccl_hidden * ms:8.1f} {b.kernels:8d} {b.busy / b.kernels:8.1f}"
        )
        kinds = ", ".join(f"{kind} {b.busy_by_kind[kind] * ms:.1f}" for kind in KINDS)
        print(f"    busy by kind: {kinds}")
        for kernel, busy in sorted(b.busy_by_name.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"    busy      {busy * ms:7.1f} ms in {short_name(kernel)}")
        for kernel, late in sorted(b.late_by_name.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"    host-late {late * ms:7.1f} ms before {short_name(kernel)}")


if __name__ == "__main__":
    main()
