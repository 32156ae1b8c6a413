"""Planner accuracy: predicted vs measured step time and peak memory of real megatron-core
GPT training on the GPUs of one machine.

Measure (2 or 4 GPUs; the cases whose dp x tp x pp is the world size run):
                   torchrun --nproc_per_node 2 bench/planner_accuracy.py --out measured.json
Report (any machine, re-predicts from saved measurements):
                   python bench/planner_accuracy.py --report measured.json
Measuring needs CUDA: megatron-core's schedules allocate on "cuda" unconditionally.

Each configuration builds a megatron-core GPTModel with ds_stpar's layer spec (Megatron's
linears for "megatron" TP, ring linears for "ring"), wraps it in Megatron's
DistributedDataParallel with the distributed optimizer (= ZeRO-1 in the planner), and runs the
canonical megatron-core step: ``get_forward_backward_func()`` (1F1B when PP > 1) then
``optimizer.step()``. Step time is the median of the timed steps after warm-up; peak memory
is ``torch.cuda.max_memory_allocated`` over the timed steps. Rank 0 prints a table of
predicted vs measured with the relative errors and their medians.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Case:
    model: str
    seq_len: int
    global_batch: int
    micro_batch: int
    dp: int
    tp: int
    pp: int
    tp_mode: str = "megatron"
    recompute: str = "none"
    # ring: the MLP as one fused ring pass; False (rows saved before it existed): two linears
    fused_ring_mlp: bool = False
    # ring: k >= 2 runs each layer in k batch pieces (InterleavedTransformerLayer), priced by
    # the planner's interleaved_block (nineteenth session; before, as the plain ring layer)
    interleave: int = 0


GPU_CASES = [
    Case("gpt3-350m", 2048, 32, 4, dp=2, tp=1, pp=1),
    Case("gpt3-1.3b", 2048, 16, 4, dp=2, tp=1, pp=1),
    Case("gpt3-1.3b", 2048, 16, 4, dp=1, tp=2, pp=1),
    Case("gpt3-1.3b", 4096, 16, 2, dp=1, tp=1, pp=2),
    Case("gpt3-760m", 8192, 8, 1, dp=1, tp=2, pp=1),
    Case("gpt3-125m", 4096, 32, 8, dp=2, tp=1, pp=1),
    Case("gpt3-1.3b", 4096, 8, 1, dp=1, tp=2, pp=1),
    Case("gpt3-1.3b", 4096, 8, 1, dp=1, tp=2, pp=1, tp_mode="ring"),
    Case("gpt3-1.3b", 8192, 8, 1, dp=1, tp=2, pp=1, recompute="full"),
    # 4 GPUs (issue 6): DP, TP, DP x TP, TP x PP, PP, the three TP modes at TP 4, and a 7B
    Case("gpt3-1.3b", 2048, 32, 4, dp=4, tp=1, pp=1),
    Case("gpt3-1.3b", 2048, 16, 2, dp=1, tp=4, pp=1),
    Case("gpt3-2.7b", 2048, 16, 2, dp=2, tp=2, pp=1),
    Case("gpt3-2.7b", 2048, 16, 1, dp=1, tp=2, pp=2),
    Case("gpt3-1.3b", 2048, 16, 1, dp=1, tp=1, pp=4),
    Case("llama2-7b", 4096, 8, 1, dp=1, tp=4, pp=1),
    Case("gpt3-2.7b", 8192, 8, 1, dp=1, tp=4, pp=1),
    Case("gpt3-2.7b", 8192, 8, 1, dp=1, tp=4, pp=1, tp_mode="ring"),
    Case("gpt3-2.7b", 8192, 8, 1, dp=1, tp=4, pp=1, tp_mode="cannon"),
    # the static layout of bench/hotswitch.py's 3B model at 32K (attention-heavy rows)
    Case("bench/models/llama-3b.json", 32768, 4, 1, dp=2, tp=2, pp=1),
    # case 7 with the ring's MLP as one fused ring pass
    Case("gpt3-1.3b", 4096, 8, 1, dp=1, tp=2, pp=1, tp_mode="ring", fused_ring_mlp=True),
    # micro-batches of 2 sequences: Megatron TP2+SP, the ring, the ring interleaving 2 pieces
    Case("gpt3-2.7b", 4096, 16, 2, dp=1, tp=2, pp=1),
    Case("gpt3-2.7b", 4096, 16, 2, dp=1, tp=2, pp=1, tp_mode="ring", fused_ring_mlp=True),
    Case(
        "gpt3-2.7b",
        4096,
        16,
        2,
        dp=1,
        tp=2,
        pp=1,
        tp_mode="ring",
        fused_ring_mlp=True,
        interleave=2,
    ),
    # case 20 with the ring's MLP as its two passes in one node (ring_two_pass_mlp)
    Case("gpt3-2.7b", 4096, 16, 2, dp=1, tp=2, pp=1, tp_mode="ring"),
]


def mode_name(case: Case) -> str:
    """The TP mode as the tables print it (``ring+fused-mlp`` for the fused ring MLP)."""
    name = case.tp_mode + ("+fused-mlp" if case.tp_mode == "ring" and case.fused_ring_mlp else "")
    return name + (f"+interleave{case.interleave}" if case.interleave > 1 else "")


def model_spec(name: str):
    # Megatron-LM pads the vocabulary to a multiple of 128 x TP; 50257 -> 50304.
    import dataclasses

    from ds_stpar.config import ModelSpec

    spec = ModelSpec.load(name)  # a preset or a model/HF config JSON
    return dataclasses.replace(spec, vocab_size=-(-spec.vocab_size // 256) * 256)


def predict(case: Case, spec, gpu_name: str, world: int, profile=None):
    """The planner's estimate for the measured setup, on megatron-core's local stack
    (``Calibration.load_default(gpu, stack="megatron-core-local")``: Megatron DDP with fp32
    main grads reduced after backward, unfused PyTorch kernels, host time per layer). The
    learned position table has ``seq_len`` rows (``GPTModel(max_sequence_length=seq_len)``
    in :func:`run_case`). ``profile``: measured link bandwidths (:func:`link_profile`)."""
    import dataclasses

    from ds_stpar.config import ClusterSpec, Layout, Strategy, TrainSpec, load_gpu
    from ds_stpar.planner.cost import estimate
    from ds_stpar.planner.profile import Calibration

    strategy = Strategy(
        Layout(case.dp, case.tp, case.pp, case.tp_mode),
        micro_batch=case.micro_batch,
        zero=1,
        recompute=case.recompute,
        sequence_parallel=case.tp > 1,
        fused_ring_mlp=case.fused_ring_mlp,
        interleave=case.interleave,
    )
    calibration = Calibration.load_default(gpu_name, stack="megatron-core-local")
    spec = dataclasses.replace(spec, max_position_embeddings=case.seq_len)
    cluster = ClusterSpec(load_gpu(gpu_name), num_gpus=world, gpus_per_node=world, profile=profile)
    return estimate(
        spec, cluster, TrainSpec(case.seq_len, case.global_batch), strategy, calibration
    )


def link_profile(path: str, gpu_name: str):
    """Measured link bandwidths from ``bench/layers.py``'s JSON of the same machine
    (:meth:`~ds_stpar.planner.profile.Profile.from_layers_benchmark`); ``None`` when the
    file is missing (the planner then uses the GPU preset)."""
    from ds_stpar.config import load_gpu
    from ds_stpar.planner.profile import Profile

    if not os.path.exists(path):
        return None
    with open(path) as handle:
        data = json.load(handle)
    return Profile.from_layers_benchmark(data, gpu_name, load_gpu(gpu_name).intra_latency_us * 1e-6)


def predicted_allocated_gib(pred) -> float:
    """Peak bytes the caching allocator hands out (what max_memory_allocated sees): the
    planner's peak minus the CUDA context/runtime reserve and the fragmentation headroom."""
    mem = pred.memory_breakdown
    return (
        pred.peak_memory_gib - mem.get("runtime_reserved", 0.0) - mem.get("allocator_headroom", 0.0)
    )


class GcTimer:
    """Python's garbage collections while started: runs and total milliseconds per generation,
    read from ``gc.callbacks`` (the collector calls them at each collection's start and stop)."""

    def __init__(self) -> None:
        self.runs = [0, 0, 0]
        self.ms = [0.0, 0.0, 0.0]
        self._began = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.runs[info["generation"]] += 1
            self.ms[info["generation"]] += (time.perf_counter() - self._began) * 1e3

    def start(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def summary(self, steps: int) -> dict:
        """Per timed step: runs and milliseconds of each generation's collections."""
        return {
            "runs_per_step": [n / steps for n in self.runs],
            "ms_per_step": [round(t / steps, 3) for t in self.ms],
        }


def run_case(
    case: Case,
    device: torch.device,
    steps: int,
    warmup: int,
    profile: bool = False,
    memory_trace: bool = False,
    trace_path: str | None = None,
    manual_gc: bool = False,
) -> dict:
    """Measure one case: median step seconds, peak allocated GiB, the allocated GiB when the
    timed steps start (model states, Adam moments included) and, with ``memory_trace``, what
    is alive at the last step's peak (bench/memtrace.py). Memory is counted above what was
    allocated before the case started (``leftover_gib``: tensors an earlier case in the same
    process left behind; counting them made later rows read 4-16 GiB high). With
    ``trace_path``, one more untimed step runs under torch.profiler (CUDA activity only, as
    launch/pretrain.py's --trace-step) and its timeline is written there for bench/timeline.py.
    ``by_rank`` gives every rank's timed step seconds and Python's garbage collections inside
    them (runs and milliseconds per step, by generation): a long collection on one rank stalls
    the other at the next transfer. With ``manual_gc`` (Megatron-LM's --manual-gc) the objects built so far are
    frozen, the collector is off during steps and one collection runs between steps, untimed."""
    gc.collect()
    torch.cuda.empty_cache()
    leftover = torch.cuda.memory_allocated()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    from ds_stpar.config import Layout, Strategy
    from ds_stpar.integrations.megatron import transformer_config
    from ds_stpar.layers.megatron_spec import get_gpt_block_stpar_spec

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=case.tp, pipeline_model_parallel_size=case.pp
    )
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    spec = model_spec(case.model)
    strategy = Strategy(
        Layout(case.dp, case.tp, case.pp, case.tp_mode),
        micro_batch=case.micro_batch,
        recompute=case.recompute,
        sequence_parallel=case.tp > 1,
        fused_ring_mlp=case.fused_ring_mlp,
    )
    config = transformer_config(spec, strategy, "bf16")
    config.finalize_model_grads_func = finalize_model_grads
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_block_stpar_spec(
            config, case.tp_mode, fused_ring_mlp=case.fused_ring_mlp, interleave=case.interleave
        ),
        vocab_size=spec.vocab_size,
        max_sequence_length=case.seq_len,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=spec.tied_embeddings,
    ).to(device)
    gpt = Float16Module(config, gpt)  # bf16 weights/activations, fp32 logits, as Megatron-LM
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt)
    config.no_sync_func = model.no_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-4, bf16=True, use_distributed_optimizer=True, clip_grad=1.0
        ),
        [model],
    )
    num_micro = case.global_batch // (case.micro_batch * case.dp)
    tokens = torch.randint(0, spec.vocab_size, (case.micro_batch, case.seq_len + 1), device=device)
    position_ids = torch.arange(case.seq_len, device=device).expand(case.micro_batch, -1)

    def forward_step(data_iterator, module):
        output = module(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:])

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    forward_backward = get_forward_backward_func()

    def train_step(model, optimizer):
        model.zero_grad_buffer()
        forward_backward(
            forward_step_func=forward_step,
            data_iterator=None,
            model=[model],
            num_microbatches=num_micro,
            seq_length=case.seq_len,
            micro_batch_size=case.micro_batch,
            forward_only=False,
        )
        optimizer.step()
        torch.cuda.synchronize()

    times = []
    profiler = None
    collections = GcTimer()
    if manual_gc:
        gc.collect()
        gc.freeze()
        gc.disable()
    try:
        for step in range(warmup + steps):
            if profile and step == warmup:
                profiler = torch.profiler.profile(
                    activities=[
                        torch.profiler.ProfilerActivity.CPU,
                        torch.profiler.ProfilerActivity.CUDA,
                    ]
                )
                profiler.__enter__()
            if step == warmup:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base_gib = (torch.cuda.memory_allocated() - leftover) / 2**30
            tracing = memory_trace and step == warmup + steps - 1
            if tracing:
                torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
            timed = step >= warmup
            if timed:
                collections.start()
            start = time.perf_counter()
            train_step(model, optimizer)
            if timed:
                times.append(time.perf_counter() - start)
                collections.stop()
            if manual_gc:  # between steps, outside the timer and the counts
                gc.collect()
            if tracing:
                import memtrace

                trace = memtrace.summarize(torch.cuda.memory._snapshot(), device.index)
                torch.cuda.memory._record_memory_history(enabled=None)
    finally:
        collections.stop()
        if manual_gc:
            gc.enable()
            gc.unfreeze()
    if profiler is not None:
        profiler.__exit__(None, None, None)
        if dist.get_rank() == 0:
            averages = profiler.key_averages()
            for order in ("cuda_time_total", "self_cpu_time_total"):
                table = averages.table(sort_by=order, row_limit=30, max_name_column_width=60)
                print(f"profile of {case} over {steps} steps by {order}:\n{table}", flush=True)
    if trace_path:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            train_step(model, optimizer)
        os.makedirs(os.path.dirname(trace_path) or ".", exist_ok=True)
        prof.export_chrome_trace(trace_path)
    peak = (torch.cuda.max_memory_allocated() - leftover) / 2**30
    gc_by_rank = [None] * dist.get_world_size()
    dist.all_gather_object(gc_by_rank, {**collections.summary(steps), "steps_s": times})
    peak_t = torch.tensor([peak], device=device)
    dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
    del model, gpt, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    parallel_state.destroy_model_parallel()
    result = {
        "step_s": statistics.median(times),
        "by_rank": gc_by_rank,
        "peak_gib": peak_t.item(),
        "base_gib": base_gib,
        "leftover_gib": leftover / 2**30,
    }
    if memory_trace:
        result["memory_trace"] = trace
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--only", type=int, nargs="*", help="indices of cases to run")
    parser.add_argument(
        "--gpu", default=None, help="planner GPU preset (default: from the device name)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="print torch.profiler tables per case (by GPU time, then by host time)",
    )
    parser.add_argument(
        "--memory-trace",
        action="store_true",
        help="record the last step's allocations and print what is alive at its peak, by line",
    )
    parser.add_argument(
        "--trace-dir",
        default=None,
        help="after the timed steps, trace one more step per case (CUDA activity only) into "
        "DIR/case-<index>-rank-<rank>.json.gz for bench/timeline.py",
    )
    parser.add_argument(
        "--manual-gc",
        action="store_true",
        help="freeze the objects built before the steps, keep Python's garbage collector off "
        "during steps and collect between them, untimed (Megatron-LM's --manual-gc)",
    )
    parser.add_argument("--out", default=None, help="write the measured rows as JSON here (rank 0)")
    parser.add_argument(
        "--report",
        nargs="+",
        default=None,
        help="print the table for saved measurements (one or more JSON files) and exit; link "
        "bandwidths come from layers-nvlink.json beside the first file when it is there",
    )
    args = parser.parse_args()
    if args.report:
        rows = []
        for path in args.report:
            with open(path) as handle:
                rows.extend(json.load(handle))
        links = os.path.join(os.path.dirname(args.report[0]), "layers-nvlink.json")
        print_table(rows, link_profile(links, rows[0]["gpu"]))
        return

    if not torch.cuda.is_available():
        raise SystemExit("bench/planner_accuracy.py needs CUDA GPUs")
    from ds_stpar.planner.profile import preset_for

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    world = dist.get_world_size()
    props = torch.cuda.get_device_properties(device)
    gpu_name = args.gpu or preset_for(props.name, props.total_memory) or "h100-80g"
    indices = args.only if args.only else range(len(GPU_CASES))

    rows = []
    for index in indices:
        case = GPU_CASES[index]
        if case.dp * case.tp * case.pp != world:
            continue
        trace_path = None
        if args.trace_dir:
            trace_path = os.path.join(
                args.trace_dir, f"case-{index}-rank-{dist.get_rank()}.json.gz"
            )
        try:
            measured = run_case(
                case,
                device,
                args.steps,
                args.warmup,
                args.profile,
                args.memory_trace,
                trace_path,
                args.manual_gc,
            )
        except Exception:  # the peer rank may now hang in a collective: stop the run
            print(f"FAILED {case}:\n{traceback.format_exc()}", flush=True)
            os._exit(1)
        row = {
            **case.__dict__,
            "card": torch.cuda.get_device_name(),
            "gpu": gpu_name,
            "world": world,
            **measured,
        }
        rows.append(row)
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
            trace = row.get("memory_trace")
            if trace:
                print(
                    f"alive at the last step's peak: {trace['peak_above_base_gib']:.2f} GiB above "
                    f"the {row['base_gib']:.2f} GiB allocated at the start of the timed steps"
                )
                for item in trace["sites"]:
                    print(f"  {item['gib']:7.3f} GiB {item['blocks']:5d} blocks  {item['site']}")

    if dist.get_rank() == 0 and rows:
        if args.out:
            with open(args.out, "w") as handle:
                json.dump(rows, handle, indent=1)
        try:
            print_table(rows)
        except ImportError as err:  # measuring does not need the planner; --report re-predicts
            print(f"no prediction table: {err}")
    dist.destroy_process_group()


def print_table(rows: list[dict], profile=None) -> None:
    """Predicted vs measured per row and the median |error| of step time and peak memory;
    ``bound`` says whether the planner finds the host (CPU) or the GPU setting the pace."""
    links = "measured link bandwidths" if profile is not None else "preset link bandwidths"
    print(
        f"\nplanner accuracy on {rows[0]['world']} x {rows[0]['card']} (planner preset "
        f"{rows[0]['gpu']}, stack megatron-core-local, {links})"
    )
    head = (
        "| model | seq | gbs | mbs | dp | tp | pp | mode | recompute | step s meas | pred | err "
        "| bound | peak allocated GiB meas | pred | err |"
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    t_err, m_err = [], []
    for r in rows:
        case = Case(**{k: r[k] for k in Case.__dataclass_fields__ if k in r})
        pred = predict(case, model_spec(case.model), r["gpu"], r["world"], profile)
        te = pred.step_time_s / r["step_s"] - 1
        pred_alloc = predicted_allocated_gib(pred)
        me = pred_alloc / r["peak_gib"] - 1
        t_err.append(abs(te))
        m_err.append(abs(me))
        bound = "host" if pred.time_breakdown.get("host_bound", 0.0) > 0 else "GPU"
        print(
            f"| {r['model']} | {r['seq_len']} | {r['global_batch']} | {r['micro_batch']} "
            f"| {r['dp']} | {r['tp']} | {r['pp']} | {mode_name(case)} | {r['recompute']} "
            f"| {r['step_s']:.3f} | {pred.step_time_s:.3f} | {te:+.1%} | {bound} "
            f"| {r['peak_gib']:.2f} | {pred_alloc:.2f} | {me:+.1%} |"
        )
    print(
        f"median |error| over {len(rows)} rows: step time {statistics.median(t_err):.1%}, "
        f"peak memory {statistics.median(m_err):.1%}"
    )


if __name__ == "__main__":
    main()
