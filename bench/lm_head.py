"""The chunked LM head + cross entropy (ds_stpar.layers.cross_entropy) against the unchunked
PyTorch path, one GPU, bf16: forward + backward time, peak memory above the inputs, and how
far the loss and gradients are from a float64 reference.

    python bench/lm_head.py --hidden 3072 --vocab 128256 --tokens 16384 32768 65536

Unchunked: ``logits = x W^T`` (bf16 GEMM), ``F.cross_entropy(logits.float(), y, sum) / N``,
autograd backward: the logits, their fp32 copy and both gradients exist at once (what
megatron-core's output layer and cross entropy hold). Chunked: the same loss with the logits
formed ``chunk_tokens`` at a time. The float64 reference runs on a slice of ``--check-tokens``
tokens (a float64 [T, V] at 64K tokens would take 64 GiB); the error columns are the relative
max-norm errors on that slice of both bf16 paths.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from ds_stpar.layers.cross_entropy import chunk_tokens, vocab_parallel_linear_cross_entropy


def unchunked(x, w, y, n):
    return F.cross_entropy((x @ w.t()).float(), y, ignore_index=-100, reduction="sum") / n


def chunked(x, w, y, n):
    return vocab_parallel_linear_cross_entropy(x[None], w, y[None], n)


def measure(fn, x, w, y, n, reps: int):
    """(ms per forward + backward, peak GiB above the inputs, loss, dx, dw)."""
    for _ in range(2):  # warm-up
        xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
        fn(xr, wr, y, n).backward()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
        loss = fn(xr, wr, y, n)
        loss.backward()
    stop.record()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return start.elapsed_time(stop) / reps, peak, loss.item(), xr.grad, wr.grad


def rel(a, b) -> float:
    return ((a.double() - b).abs().max() / b.abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768, 65536])
    parser.add_argument("--check-tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    h, v = args.hidden, args.vocab
    w = (torch.randn(v, h, device=dev) / h**0.5).to(torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}, h={h}, V={v}, chunk {chunk_tokens(v, 2)} tokens")
    print("| tokens | path | ms fwd+bwd | peak GiB | loss | dx err | dw err |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for tokens in args.tokens:
        x = torch.randn(tokens, h, device=dev).to(torch.bfloat16)
        y = torch.randint(0, v, (tokens,), device=dev)
        y[::97] = -100
        n = float((y != -100).sum())
        k = args.check_tokens
        xr = x[:k].double().requires_grad_()
        wr = w.double().requires_grad_()
        ref = F.cross_entropy(xr @ wr.t(), y[:k], ignore_index=-100, reduction="sum") / n
        ref.backward()
        ref_dx, ref_dw = xr.grad, wr.grad
        del xr, wr, ref
        for name, fn in (("unchunked", unchunked), ("chunked", chunked)):
            try:
                ms, peak, loss, dx, dw = measure(fn, x, w, y, n, args.reps)
            except torch.OutOfMemoryError:
                print(f"| {tokens} | {name} | OOM | | | | |")
                torch.cuda.empty_cache()
                continue
            # the errors on the checked slice: its own run, so dw holds that slice only
            _, _, _, dx_k, dw_k = measure(fn, x[:k].contiguous(), w, y[:k], n, 1)
            print(
                f"| {tokens} | {name} | {ms:.1f} | {peak:.2f} | {loss:.5f} | "
                f"{rel(dx_k, ref_dx):.1e} | {rel(dw_k, ref_dw):.1e} |"
            )
            del dx, dw, dx_k, dw_k
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
