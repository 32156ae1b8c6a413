"""SDPA's backward on a CUDA GPU per backend and incoming-gradient layout: peak memory and time.

    python bench/sdpa_backward.py [--seq 4096 --batch 2 --heads 32 --head-dim 128]

The defaults are one TP2 rank's attention core at h 8192 with 8K tokens (2 sequences of 4096).
Q, K and V are views of one ``[s, b, n, 3d]`` tensor, as Megatron splits its fused QKV output,
and the gradient arrives either in Megatron's ``[s, b, n, d]`` layout (what the projection's
backward hands the core, ``sbnd``) or in flash's ``[b, s, n, d]`` one (``bsnd``). Printed per
row: the most bytes allocated above the backward's start (the gradient of the QKV tensor
included) and the median of 5 forward and 5 backward times (CUDA events). ``SDPACoreAttention``
takes the cuDNN kernel first (``layers/megatron_modules.sdpa_backends``) from these figures
(BENCHMARKS.md, twenty-sixth session).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)


def _inputs(seq: int, batch: int, heads: int, dim: int):
    qkv = torch.randn(seq, batch, heads, 3 * dim, device="cuda", dtype=torch.bfloat16)
    qkv.requires_grad_()
    q, k, v = (t.permute(1, 2, 0, 3) for t in torch.split(qkv, dim, dim=-1))  # [b, n, s, d]
    return qkv, q, k, v


def _gradient(layout: str, seq: int, batch: int, heads: int, dim: int) -> torch.Tensor:
    if layout == "sbnd":
        return torch.randn(seq, batch, heads, dim, device="cuda", dtype=torch.bfloat16).permute(
            1, 2, 0, 3
        )
    return torch.randn(batch, seq, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)


def _ms(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(backend: SDPBackend, layout: str, seq: int, batch: int, heads: int, dim: int):
    """(backward peak MiB above its start, forward ms, backward ms)."""
    qkv, q, k, v = _inputs(seq, batch, heads, dim)
    grad = _gradient(layout, seq, batch, heads, dim)

    def forward() -> torch.Tensor:
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    out = forward()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.backward(grad)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - start) / 2**20
    qkv.grad = None
    forward_ms = _ms(forward)
    outs = [forward() for _ in range(5)]

    def backward() -> None:
        outs.pop().backward(grad)

    backward_ms = _ms(backward)
    return peak, forward_ms, backward_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    shape = (args.seq, args.batch, args.heads, args.head_dim)
    print(f"## SDPA backward, {torch.cuda.get_device_name()}, bf16, causal, [s, b, n, d] = {shape}")
    print("| backend | gradient layout | backward peak MiB | forward ms | backward ms |")
    print("|---|---|---|---|---|")
    for backend in BACKENDS:
        for layout in ("sbnd", "bsnd"):
            try:
                peak, fwd, bwd = measure(backend, layout, *shape)
            except RuntimeError as err:  # a backend that cannot run the call
                print(f"| {backend.name} | {layout} | n/a ({str(err).splitlines()[0][:80]}) | | |")
                continue
            print(f"| {backend.name} | {layout} | {peak:.0f} | {fwd:.2f} | {bwd:.2f} |")


if __name__ == "__main__":
    main()
