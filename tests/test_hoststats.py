"""bench/hoststats.py's self / inclusive host time, on a hand-built trace whose answer is
counted by hand (microseconds, exact), and the call counts of a real traced ring layer against
the count its algorithm gives."""

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import hoststats  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CALL92 = ROOT / "bench/results/2026-11-27-s18-2xH100-H200/call92"


def _event(cat, name, tid, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def test_self_time_excludes_nested_events_and_inclusive_counts_recursion_once(tmp_path):
    events = [
        # thread 1: f [0, 100) holds mm [10, 30) and g [40, 90); g holds add [50, 60) and,
        # recursively, g [65, 85)
        _event("python_function", "f", 1, 0, 100),
        _event("cpu_op", "aten::mm", 1, 10, 20),
        _event("python_function", "g", 1, 40, 50),
        _event("cpu_op", "aten::add", 1, 50, 10),
        _event("python_function", "g", 1, 65, 20),
        # thread 2 overlaps thread 1 in time but nests only in itself
        _event("python_function", "h", 2, 5, 50),
        {"ph": "X", "cat": "kernel", "name": "gemm", "tid": 3, "ts": 0, "dur": 7},
        {"ph": "i", "cat": "python_function", "name": "marker", "tid": 1, "ts": 3},
    ]
    path = tmp_path / "host.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": events}, handle)
    times = hoststats.host_time(hoststats.load_events(str(path)))
    assert dict(times.self_us) == {
        "py f": 100 - 20 - 50,
        "op aten::mm": 20,
        "py g": (50 - 10 - 20) + 20,
        "op aten::add": 10,
        "py h": 50,
    }
    assert times.inclusive_us["py g"] == 50  # the inner call lies inside the outer one
    assert times.inclusive_us["py f"] == 100
    assert times.calls["py g"] == 2
    assert "gemm" not in " ".join(times.calls)  # GPU kernels are not host time


def test_ring_layer_trace_issues_one_p2p_batch_per_pass():
    """Call 92 traced 5 steps of a P = 2 ring layer with the two-pass MLP: 8 ring passes per
    step (QKV, projection, fc1, fc2, forward and backward), one hop each, so 40 passes and 40
    P2P batches; the column backwards (QKV, fc1) send two messages per hop (the rotating X
    and the dX partial sum), the others one: 10 sends per step."""
    trace = CALL92 / "host-layer-512-4096-ring-linear-rank-0.json.gz"
    times = hoststats.host_time(hoststats.load_events(str(trace)))
    calls = {name.split(": ")[-1]: n for name, n in times.calls.items() if "ds_stpar" in name}
    assert calls["ring_pass"] == 40
    assert calls["start_p2p"] == 40
    assert times.calls["op c10d::send"] == 50
    # every pass's time includes its batches: inclusive time is ordered
    ring = next(n for n in times.inclusive_us if n.endswith("ring_pass"))
    p2p = next(n for n in times.inclusive_us if n.endswith("start_p2p"))
    assert times.inclusive_us[ring] > times.inclusive_us[p2p] > times.self_us[p2p]
