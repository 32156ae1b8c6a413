"""Causal attention over packed rows, kernel against kernel: which variable-length backend
runs a bucket's rows fastest.

Half of a 32K step of the untied llama-4b on 2 x H200 is attention (BENCHMARKS.md,
thirteenth session, call 58). This times, on the rows the training loop would run, the
kernels one could call for ``cu_seqlens``-masked causal attention:

- ``loop``: what the training loop calls (``megatron_modules.varlen_causal``): on torch 2.11,
  whose ``varlen_attn`` has no ``enable_gqa``, K and V repeated to the query heads;
- ``flash-gqa``: ``aten._flash_attention_forward`` / ``_backward`` given K and V with their
  own (fewer) heads: the flash kernel broadcasts the groups itself.

(cuDNN's ``_cudnn_attention_forward`` with the same ``cu_seqlens`` was tried at f3cdc3c and
gave wrong outputs on torch 2.11: BENCHMARKS.md, thirteenth session, call 60.)

Rows: the corpus (``--data`` with ``--tokenizer``, as ``launch/pretrain.py`` reads it) packed
best-fit-decreasing into the buckets of ``--edges`` (``seqbucket.packing.pack_buckets``), the
rows of bucket ``--bucket`` (default the last); ``--rows`` of them, seeded. Per backend:
forward, and forward plus backward, CUDA-event timed over ``--iters`` after ``--warmup``, as
microseconds per token (the rows' tokens). The output of every backend is checked against ``loop`` (bf16: the
largest difference is printed, a few bf16 ulps of |out| <= 1 is agreement), and the gradients
likewise. A backend whose ops this PyTorch lacks, or that fails, prints its error and is
skipped. Shapes per GPU: ``--heads`` query heads, ``--groups`` KV heads, ``--head-dim``
(TP2 of llama-4b: 12, 4, 128).

    python bench/attention.py --data stdlib.jsonl --tokenizer stdlib-bpe32k.json \
        --edges 16384,32768 --bucket 0      # the short bucket's rows
    python bench/attention.py --data stdlib.jsonl --tokenizer stdlib-bpe32k.json --edges 32768
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable

import numpy as np
import torch

Tensor = torch.Tensor


def packed_rows(data: str, tokenizer: str, edges: list[int], bucket: int) -> list[list[int]]:
    """Document lengths of every row of bucket ``bucket`` (an index into ``edges``)."""
    from ds_stpar.seqbucket.data import load_documents
    from ds_stpar.seqbucket.lengths import document_lengths, split_lengths
    from ds_stpar.seqbucket.packing import Piece, pack_buckets
    from ds_stpar.seqbucket.tokenize import load_tokenizer

    docs = load_documents(data, tokenizer=load_tokenizer(tokenizer))
    lengths = document_lengths(docs)
    doc, start, length = split_lengths(lengths, edges[-1])
    pieces = [
        Piece(int(d), int(s), int(n), int(s + n) == int(lengths[d]))
        for d, s, n in zip(doc, start, length)
    ]
    rows = pack_buckets(pieces, edges)[bucket]
    return [[p.length for p in row.pieces] for row in rows]


def loop_path(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, longest: int) -> Tensor:
    """The training loop's own call, ``megatron_modules.varlen_causal``, on [t, heads, d]."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from ds_stpar.layers.megatron_modules import varlen_causal

    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    views = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, t, d]
    return varlen_causal(*views, params, None)[0].transpose(0, 1)


class _FlashGQA(torch.autograd.Function):
    """The flash kernels with K and V at their own head count."""

    @staticmethod
    def forward(ctx, q, k, v, cu, longest):
        scale = q.shape[-1] ** -0.5
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused)
        ctx.longest, ctx.scale = longest, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(),
            q,
            k,
            v,
            out,
            lse,
            cu,
            cu,
            ctx.longest,
            ctx.longest,
            0.0,
            True,
            rng,
            unused,
            scale=ctx.scale,
        )
        return dq, dk, dv, None, None


def flash_gqa(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, longest: int) -> Tensor:
    return _FlashGQA.apply(q, k, v, cu, longest)


BACKENDS: dict[str, Callable] = {
    "loop": loop_path,
    "flash-gqa": flash_gqa,
}


def timed_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def time_row(row: list[int], args: argparse.Namespace, gen: torch.Generator) -> dict[str, tuple]:
    """Per backend on one row: (forward ms, forward + backward ms, max |diff| against the first
    backend that ran), or (error text,) where it failed."""
    device = gen.device
    t, longest = sum(row), max(row)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(row)]), dtype=torch.int32, device=device)
    q, k, v = (
        torch.randn(
            (t, h, args.head_dim), generator=gen, device=device, dtype=torch.bfloat16
        ).requires_grad_()
        for h in (args.heads, args.groups, args.groups)
    )
    grad = torch.randn_like(q)
    results: dict[str, tuple] = {}
    reference = None
    for name, fn in BACKENDS.items():

        def forward(fn=fn):
            return fn(q, k, v, cu, longest)

        def both(fn=fn):
            return torch.autograd.grad(fn(q, k, v, cu, longest), (q, k, v), grad)

        try:
            out = forward()
            grads = both()
            if reference is None:
                reference, diff = (out.detach(), grads), 0.0
            else:
                pairs = [(out, reference[0]), *zip(grads, reference[1])]
                diff = max((a - b).abs().max().item() for a, b in pairs)
            with torch.no_grad():
                forward_ms = timed_ms(forward, args.warmup, args.iters)
            both_ms = timed_ms(both, args.warmup, args.iters)
        except Exception as err:  # a backend this PyTorch lacks: say why, go on
            results[name] = (f"{type(err).__name__}: {str(err).splitlines()[0][:200]}",)
            continue
        results[name] = (forward_ms, both_ms, diff)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--edges", required=True, help="bucket edges, e.g. 16384 or 16384,32768")
    parser.add_argument(
        "--bucket", type=int, default=-1, help="whose rows: index into --edges (default last)"
    )
    parser.add_argument("--rows", type=int, default=6, help="rows timed (default 6)")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    edges = [int(e) for e in args.edges.split(",")]
    if not -len(edges) <= args.bucket < len(edges):
        parser.error(f"--bucket {args.bucket}: --edges has {len(edges)} buckets")
    if not torch.cuda.is_available():
        raise SystemExit("bench/attention.py times CUDA kernels: no CUDA device here")
    rows = packed_rows(args.data, args.tokenizer, edges, args.bucket)
    chosen = random.Random(args.seed).sample(rows, min(args.rows, len(rows)))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"{len(rows)} rows of bucket <= {edges[args.bucket]}; timing {len(chosen)}:")
    for row in chosen:
        print(f"  {sum(row):,} tokens in {len(row)} documents, longest {max(row):,}")
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    per_row = [time_row(row, args, gen) for row in chosen]
    tokens = sum(sum(row) for row in chosen)
    print()
    print("| backend | fwd us/token | fwd+bwd us/token | fwd+bwd vs loop | max abs diff |")
    print("|---|---:|---:|---:|---:|")
    base = sum(r["loop"][1] for r in per_row if len(r["loop"]) == 3)
    for name in BACKENDS:
        errors = [r[name][0] for r in per_row if len(r[name]) == 1]
        if errors:
            print(f"| {name} | failed: {errors[0]} | | | |")
            continue
        forward = sum(r[name][0] for r in per_row)
        both = sum(r[name][1] for r in per_row)
        diff = max(r[name][2] for r in per_row)
        print(
            f"| {name} | {forward * 1e3 / tokens:.4f} | {both * 1e3 / tokens:.4f} "
            f"| {base / both:.3f}x | {diff:.3g} |"
        )


if __name__ == "__main__":
    main()
