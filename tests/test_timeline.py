"""bench/timeline.py's split of the compute stream's idle time, on a hand-built trace whose
answer is counted by hand (times in microseconds, exact: no tolerance needed)."""

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import timeline  # noqa: E402


def _kernel(name, stream, ts, dur, corr):
    args = {"stream": stream, "correlation": corr}
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": args}


def _launch(ts, corr, cat="cuda_runtime"):
    args = {"correlation": corr}
    return {"ph": "X", "cat": cat, "name": "cudaLaunchKernel", "ts": ts, "dur": 3, "args": args}


def test_idle_gaps_split_into_host_late_comm_wait_and_other(tmp_path):
    events = [
        # compute stream 7: gemm [0, 10); mul [20, 30) launched at 15; add [40, 50) launched
        # at 1 (early: it waited for the transfer [25, 36) on stream 20, then 4 more)
        _kernel("gemm", 7, 0, 10, 1),
        _launch(0, 1),
        _kernel("mul", 7, 20, 10, 2),
        _launch(15, 2, "cuda_driver"),
        _kernel("add", 7, 40, 10, 3),
        _launch(1, 3),
        _kernel("ncclDevKernel_SendRecv", 20, 25, 11, 4),
        _launch(2, 4),
    ]
    path = tmp_path / "trace-step-1-rank-0.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": events}, handle)
    b = timeline.breakdown(timeline.load_work(str(path)))
    # gap 10-20: launched at 15, so 5 host-late; 15-20 idle with no transfer running: other 5
    # gap 30-40: launched long before; the transfer runs 30-36: comm-wait 6, other 4
    assert (b.span, b.busy, b.kernels) == (50, 30, 3)
    assert (b.host_late, b.comm_wait, b.other, b.idle) == (5, 6, 9, 20)
    assert (b.nccl, b.nccl_hidden) == (11, 5)  # 25-30 under mul
    assert b.late_by_name == {"mul": 5}
    assert b.busy_by_kind == {"matrix": 10, "attention": 0, "nccl": 0, "copy": 0, "elementwise": 20}
    assert b.busy_by_name == {"mul": 10, "add": 10}


def test_kernel_kinds_by_name():
    names = {
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matrix",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, cutlass::": "attention",
        "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": "nccl",
        "Memcpy HtoD (Pinned -> Device)": "copy",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>": "copy",
        "void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda": "copy",
        "triton_poi_fused__to_copy_add_cat_mul_neg_slice_0": "elementwise",
        "void at::native::vectorized_layer_norm_kernel<c10::BFloat16>": "elementwise",
    }
    assert {name: timeline.kind_of(name) for name in names} == names


def test_short_names_drop_the_repeated_namespaces():
    name = "void at::native::(anonymous namespace)::CatArrayBatchedCopy<c10::BFloat16, 4>"
    assert timeline.short_name(name) == "CatArrayBatchedCopy<BFloat16, 4>"
    assert timeline.short_name("x" * 150) == "x" * 100
