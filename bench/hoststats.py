"""Where the host's time goes, per Python function and operator, in a traced run.

    python3 bench/hoststats.py RUN/host-layer-512-4096-ring-linear-rank-0.json.gz [--top N]

The traces come from ``bench/layers.py --host-trace DIR``: torch.profiler with CPU activity
and Python stacks (``with_stack=True``), whose chrome trace holds one ``python_function``
event per Python call and one ``cpu_op`` event per operator, each with its start and
duration, nested per thread. For every name this prints:

- ``self ms``: time inside it and in none of the events nested in it (the Python of that
  function itself, or an operator's own C++);
- ``incl ms``: its whole duration, counted once where it nests in itself (recursion);
- ``calls``.

Tracing every Python call slows the host two- to threefold, and unevenly (many small calls
cost more), so compare runs traced the same way, not traced with untraced times. A main
thread waiting for the autograd engine's own thread shows the wait as the self time of
``run_backward``; the backward's work is listed under that thread's names. It ran on the CPU
of the machine where the trace is. BENCHMARKS.md, eighteenth session: it found the ring's
P2P plumbing (side-stream waits, per-op Python of ``batch_isend_irecv``) costing more host
time than its GEMMs.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter, defaultdict
from dataclasses import dataclass

CATEGORIES = {"python_function": "py", "cpu_op": "op"}


@dataclass
class HostTime:
    """Microseconds per name (``"py <function>"`` / ``"op <operator>"``)."""

    self_us: Counter
    inclusive_us: Counter
    calls: Counter


def load_events(path: str) -> list[dict]:
    """The trace's complete (``"X"``) Python-function and operator events."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as handle:
        trace = json.load(handle)
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in CATEGORIES]


def _close_until(open_events: list[list], before: float, result: HostTime) -> None:
    """Pop the open events that end at or before ``before``, booking their self time and
    adding their duration to their parent's time in children."""
    while open_events and open_events[-1][1] <= before:
        name, _, duration, children = open_events.pop()
        result.self_us[name] += duration - children
        if open_events:
            open_events[-1][3] += duration


def host_time(events: list[dict]) -> HostTime:
    """Self and inclusive time per name, nesting each thread's events by their intervals (an
    event is inside the last open one that ends at or after its own end)."""
    result = HostTime(Counter(), Counter(), Counter())
    by_thread: dict[object, list[dict]] = defaultdict(list)
    for event in events:
        by_thread[(event.get("pid"), event["tid"])].append(event)
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_events: list[list] = []  # [name, end, duration, time in children]
        for event in thread_events:
            _close_until(open_events, event["ts"], result)
            name = f"{CATEGORIES[event['cat']]} {event['name']}"
            if all(entry[0] != name for entry in open_events):
                result.inclusive_us[name] += event["dur"]
            result.calls[name] += 1
            open_events.append([name, event["ts"] + event["dur"], event["dur"], 0.0])
        _close_until(open_events, float("inf"), result)
    return result


def table(times: HostTime, top: int) -> str:
    """The ``top`` names by self time, as aligned text."""
    lines = [f"{'self ms':>9} {'incl ms':>9} {'calls':>7}  name"]
    for name, self_us in times.self_us.most_common(top):
        lines.append(
            f"{self_us / 1e3:9.2f} {times.inclusive_us[name] / 1e3:9.2f} "
            f"{times.calls[name]:7d}  {name[:120]}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--top", type=int, default=40, help="names per trace (by self time)")
    args = parser.parse_args()
    for path in args.traces:
        print(f"== {path}\n{table(host_time(load_events(path)), args.top)}")


if __name__ == "__main__":
    main()
