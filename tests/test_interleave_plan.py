"""The planner's interleaved layer (``planner/tensor_parallel.interleaved_block``) against the
layer benchmark, and how the strategy, rules, search, Megatron-LM environment and training
loop treat it.

Measured: ``bench/layers.py`` TransformerLayer fwd + bwd (no bias, GeLU, SDPA, sequences of 4096),
Megatron TP2 + SP, the ring with the fused MLP and the interleaved layer of 2 and 4 pieces, in one
invocation per link: 2 x H100 (sixteenth session, call 76; over the slow link again in the
twenty-fourth and twenty-fifth sessions, calls 144 and 148) and 2 x H200 (nineteenth session, call
99); and a block of 4 such layers (``--layers 4``, 2 x H200, twenty-first session, call 110). Links:
each card's link benchmark (``Profile.from_layers_benchmark``), as ``tests/test_cost.py`` reads
them. Those runs had the layer's first gather and last reduction whole, before its own rows
ran beside them (twenty-seventh session): the tests price them as their code ran
(``edges_whole``); the runs of today's layer (calls 169 and 170, 2 x H100) are priced as it is.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ds_stpar.config import ClusterSpec, Layout, ModelSpec, Strategy, TrainSpec, load_gpu
from ds_stpar.errors import ConfigError
from ds_stpar.planner import cost, emit, rules, tensor_parallel
from ds_stpar.planner import memory as mem
from ds_stpar.planner.profile import Calibration, Profile
from ds_stpar.planner.search import search
from ds_stpar.seqbucket.runner import loop_refusal

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
CARDS = {
    "h100-80g": (
        RESULTS / "2026-11-27-s16-2xH100" / "call76" / "{link}.json",
        RESULTS / "2026-11-26-s4-2xH100" / "layers-{link}-mlp.json",
    ),
    "h200-141g": (
        RESULTS / "2026-11-27-s19-2xH200" / "call99" / "{link}.json",
        RESULTS / "2026-11-26-2xH200" / "layers-{link}.json",
    ),
}
VARIANTS = {"megatron-sp": ("megatron", 0), "ring": ("ring", 0), "ring-interleaved": ("ring", 2)}


def _links(gpu: str, link: str) -> Profile:
    data = json.loads(Path(str(CARDS[gpu][1]).format(link=link)).read_text())
    return Profile.from_layers_benchmark(data, gpu, load_gpu(gpu).intra_latency_us * 1e-6)


def _layer_ms(
    gpu: str,
    links: Profile,
    variant: str,
    h: int,
    tokens: int,
    pieces=None,
    layers: int = 1,
    transfers: str = "nccl",
) -> float:
    """The planner's fwd + bwd milliseconds of one layer, as bench/layers.py times it (in a
    block of ``layers``: the block's per layer). ``transfers``: the interleaved layer's
    transport as the calibration names it; NCCL's, as every run before the thirty-first
    session had it (``CUDA_DEVICE_MAX_CONNECTIONS=1``, under which ``auto`` keeps NCCL)."""
    mode, k = VARIANTS[variant]
    model = ModelSpec("layer", layers, h, h // 128, vocab_size=1024, add_bias_linear=False)
    strategy = Strategy(
        Layout(1, 2, 1, mode),
        micro_batch=tokens // 4096,
        sequence_parallel=True,
        interleave=k if pieces is None else pieces,
    )
    cal = Calibration.load_default(gpu, stack="megatron-core-local")
    cal = dataclasses.replace(cal, transfer_transport=transfers)
    ev = cost.Evaluator(
        model, ClusterSpec(load_gpu(gpu), 2, 2, profile=links), TrainSpec(4096, 8), cal
    )
    block = cost.block_cost(cost._Context(ev, strategy))
    return (block.fwd + block.bwd + block.comm_fwd + block.comm_bwd) * 1e3


@pytest.fixture
def edges_whole(monkeypatch):
    """Price the interleaved layer as the code before the twenty-seventh session ran it: the
    first gather and the last reduction waited for by all of their piece's work (no ``head``
    or ``tail`` in the flow shop)."""
    flow_shop = tensor_parallel._flow_shop
    monkeypatch.setattr(tensor_parallel, "_flow_shop", lambda *args: flow_shop(*args[:7]))


def _interleaved_cases(measured: dict[tuple[str, int, int], float]) -> list[tuple[int, int]]:
    """(hidden, tokens) of every case the 2-piece layer ran, six per card and link."""
    cases = sorted({(h, t) for (v, h, t) in measured if v == "ring-interleaved"})
    assert len(cases) == 6
    return cases


def _measured(gpu: str, link: str, path: Path | None = None) -> dict[tuple[str, int, int], float]:
    data = json.loads((path or Path(str(CARDS[gpu][0]).format(link=link))).read_text())
    return {
        (r["variant"], r["hidden"], r["tokens"]): r["ms"]
        for r in data["rows"]
        if r["block"].startswith("layer") and r["ms"] is not None
    }


# the matrix re-run on 2 x H100 with the code of bf5a3a9 (twenty-fourth session) and
# of 642b37c (twenty-fifth: the fused ring MLP's dW1 after the ring)
CALL_144 = RESULTS / "2026-11-27-s24" / "call144" / "slow.json"
CALL_148 = RESULTS / "2026-11-27-s25" / "call148" / "slow.json"


@pytest.mark.parametrize(
    "gpu, run",
    [("h100-80g", None), ("h200-141g", None), ("h100-80g", CALL_144), ("h100-80g", CALL_148)],
)
def test_slow_link_interleaved_layer_within_ten_percent_and_ranked_first(gpu, run, edges_whole):
    # Over the slow link (NCCL through host memory), where the interleaved layer is the
    # fastest mode: every 2-piece case within 10% (measured -0.2% to +7.3% in calls 76 and
    # 99; +3.5% to +9.0% in call 144, which fitted nothing: every estimate of that run,
    # Megatron's too, is 1.5-9% over, this host's slow link priced slow; +0.9% to +8.8% in
    # call 148, Megatron's -5.3% to +4.5%), and the planner ranks it ahead of Megatron TP2 + SP
    # and the ring with the fused MLP in every case, as measured (1.18-1.42x Megatron on H200,
    # 1.15-1.41x on H100, 1.19-1.43x in call 144, 1.16-1.40x in call 148).
    # 4 pieces: within 10% too, but the model, which does not price a piece's fixed costs,
    # puts them 4-5% ahead of 2 pieces where they ran 0.5-13% behind: the search tries 2
    # pieces only.
    links, measured = _links(gpu, "slow"), _measured(gpu, "slow", run)
    for h, tokens in _interleaved_cases(measured):
        predicted = {v: _layer_ms(gpu, links, v, h, tokens) for v in VARIANTS}
        got = measured[("ring-interleaved", h, tokens)]
        assert predicted["ring-interleaved"] / got - 1 == pytest.approx(0, abs=0.10), (h, tokens)
        assert min(predicted, key=predicted.get) == "ring-interleaved", (h, tokens, predicted)
        assert min(measured[(v, h, tokens)] for v in VARIANTS) == got  # what it must match
        four = measured.get(("ring-interleaved-4", h, tokens))
        if four is not None:
            assert _layer_ms(gpu, links, "ring", h, tokens, pieces=4) / four - 1 == pytest.approx(
                0, abs=0.10
            )


STAGED = RESULTS / "2026-11-28-s31"
FLAGS = RESULTS / "2026-11-28-s32"


def _log_rows(path: Path) -> dict[tuple[str, int, int], float]:
    """(variant, hidden, tokens) -> ms of a bench/layers.py log's JSON rows."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    return {(r["variant"], r["hidden"], r["tokens"]): r["ms"] for r in rows if "variant" in r}


def _column_runs(path: Path, label: str, block: str) -> list[dict[tuple[str, int, int], float]]:
    """(variant, hidden, tokens) -> ms of each run labelled ``label`` in a column file of
    ``call210/p4.log``'s form (label, block, variant, hidden, tokens, ms, TFLOP/s, pieces):
    the n-th row of a case belongs to run n."""
    runs: list[dict[tuple[str, int, int], float]] = []
    for line in path.read_text().splitlines():
        name, kind, variant, h, tokens, ms = line.split()[:6]
        if name != label or kind != block:
            continue
        key = (variant, int(h), int(tokens))
        run = next((r for r in runs if key not in r), None)
        if run is None:
            runs.append(run := {})
        run[key] = float(ms)
    return runs


def test_slow_link_staged_interleaved_layer_within_ten_percent():
    # The interleaved layer with its transfers by the copy engines through host memory
    # (layers/host_staged.py) on 2 x H200: the thirty-first session's transport (calls 204
    # and 205, two runs each) and the thirty-second's (calls 207 and 210, 2 pieces, two runs
    # each; calls 210, two runs, and 211, 4 pieces as committed), priced as hiding wholly
    # behind the GEMMs beside them (they take no SMs) at the calibration's staged rate:
    # every run within 10% (-9.5% to +2.8%), and ahead of NCCL's transfers as priced and as
    # measured in the same call where it ran. h 4096 / 8K is left out: there the host sets
    # the pace and the runs spread over 11.25-16.54 ms (BENCHMARKS.md).
    links = _links("h200-141g", "slow")
    runs = [
        (_log_rows(STAGED / call / f"tree{n}.log"), _log_rows(STAGED / call / f"head{n}.log"))
        for call in ("call204", "call205")
        for n in (1, 2)
    ]
    flags_nccl = _log_rows(FLAGS / "call207" / "ref1.log")  # NCCL's transfers, the same call
    runs += [(_log_rows(FLAGS / "call207" / f"tree{n}.log"), flags_nccl) for n in (1, 2)]
    pieces = FLAGS / "call210" / "p4.log"
    runs += [
        (run, None) for label in ("tree", "p4") for run in _column_runs(pieces, label, "layer")
    ]
    runs.append((_log_rows(FLAGS / "call211" / "treelayer.log"), None))
    assert len(runs) == 11
    cases = [(8192, 8192), (8192, 16384), (8192, 32768), (4096, 16384), (4096, 32768)]
    for h, tokens in cases:
        staged = _layer_ms("h200-141g", links, "ring-interleaved", h, tokens, transfers="auto")
        priced_nccl = _layer_ms("h200-141g", links, "ring-interleaved", h, tokens)
        assert staged < priced_nccl, (h, tokens)
        for run, nccl in runs:
            got = run.get(("ring-interleaved", h, tokens))  # call 210: 8K and 16K only
            if got is not None:
                assert staged / got - 1 == pytest.approx(0, abs=0.10), (h, tokens, staged, got)
            assert nccl is None or got < nccl[("ring-interleaved", h, tokens)], (h, tokens)


def _fused_mlp_ms(links: Profile, h: int, tokens: int, transfers: str) -> float:
    """The planner's fwd + bwd milliseconds of the fused ring MLP block at TP2, as
    bench/layers.py --cases mlp times it, over the hops ``block_tp`` gives the fused pass."""
    model = ModelSpec("layer", 1, h, h // 128, vocab_size=1024, add_bias_linear=False)
    strategy = Strategy(Layout(1, 2, 1, "ring"), micro_batch=tokens // 4096, sequence_parallel=True)
    cal = Calibration.load_default("h200-141g", stack="megatron-core-local")
    cal = dataclasses.replace(cal, transfer_transport=transfers)
    ev = cost.Evaluator(
        model, ClusterSpec(load_gpu("h200-141g"), 2, 2, profile=links), TrainSpec(4096, 8), cal
    )
    ctx = cost._Context(ev, strategy)
    link, overlap = cost.fused_mlp_hops(ctx)
    gemm, comm, _hop = tensor_parallel.fused_ring_mlp(model, tokens, 2, link, ctx.speed, overlap)
    return (gemm.fwd + gemm.bwd + comm.fwd + comm.bwd) * 1e3


def test_slow_link_staged_fused_ring_mlp_within_eleven_percent():
    # The fused ring MLP's hops by the copy engines through host memory (comm.start_ring_hop;
    # thirty-second session on 2 x H200: calls 208 and 210, 2 pieces, two runs each; calls
    # 210, two runs, and 211, 4 pieces as committed), priced as the copy engines' hops are
    # (hidden wholly) at the calibration's staged rate: every run within 11% (-8.4% to
    # +10.5%; the model does not price the copies' pieces, and 4 pieces ran the h 4096 blocks
    # 6-8% faster than 2, call 210), and ahead of NCCL's hops as priced and as measured in
    # call 208. h 4096 / 8K is left out (+4% to +17%: a 6 ms step, where the host's launches
    # show).
    links = _links("h200-141g", "slow")
    nccl = [_log_rows(FLAGS / "call208" / f"ref{n}.log") for n in (1, 2)]
    runs = [_log_rows(FLAGS / "call208" / f"tree{n}.log") for n in (1, 2)]
    pieces = FLAGS / "call210" / "p4.log"
    runs += [run for label in ("tree", "p4") for run in _column_runs(pieces, label, "mlp")]
    runs.append(_log_rows(FLAGS / "call211" / "treemlp.log"))
    assert len(runs) == 7
    cases = [(8192, 8192), (8192, 16384), (8192, 32768), (4096, 16384), (4096, 32768)]
    for h, tokens in cases:
        staged = _fused_mlp_ms(links, h, tokens, "auto")
        assert staged < _fused_mlp_ms(links, h, tokens, "nccl"), (h, tokens)
        for run in runs:
            got = run.get(("ring", h, tokens))  # call 210: 8K and 16K only
            if got is not None:
                assert staged / got - 1 == pytest.approx(0, abs=0.11), (h, tokens, staged, got)
                assert all(got < ref[("ring", h, tokens)] for ref in nccl), (h, tokens)


BLOCK_OF_FOUR = RESULTS / "2026-11-27-s21" / "call110" / "{link}-x4.json"


def test_slow_link_interleaved_block_of_four_within_ten_percent(edges_whole):
    # bench/layers.py --layers 4 (twenty-first session, call 110, 2 x H200): a block of 4
    # layers handing their pieces on. The planner prices a layer of the block (the ends'
    # gather and reduction over 4 layers, all-reduces between): measured -4.0% to +8.6%;
    # priced as 4 layers alone it was up to 16% over. Megatron's block is 4 layers alone.
    gpu, links = "h200-141g", _links("h200-141g", "slow")
    measured = _measured(gpu, "slow", Path(str(BLOCK_OF_FOUR).format(link="slow")))
    for h, tokens in _interleaved_cases(measured):
        for variant, pieces in (("ring-interleaved", 2), ("ring-interleaved-4", 4)):
            got = measured.get((variant, h, tokens))
            if got is None:  # 4 pieces of a batch of 2
                continue
            block = _layer_ms(gpu, links, "ring-interleaved", h, tokens, pieces, layers=4)
            alone = _layer_ms(gpu, links, "ring-interleaved", h, tokens, pieces)
            assert block / (got / 4) - 1 == pytest.approx(0, abs=0.10), (variant, h, tokens)
            assert block < alone, (variant, h, tokens)
        megatron = _layer_ms(gpu, links, "megatron-sp", h, tokens, layers=4)
        assert megatron / (measured[("megatron-sp", h, tokens)] / 4) - 1 == pytest.approx(
            0, abs=0.05
        )


@pytest.mark.parametrize("gpu", sorted(CARDS))
def test_nvlink_interleaved_layer_ranked_behind_megatron(gpu, edges_whole):
    # Over NVLink the interleaved layer ran 0.84-0.99x Megatron TP2 + SP: the planner must
    # not prefer it there, and it does not in any case.
    links, measured = _links(gpu, "nvlink"), _measured(gpu, "nvlink")
    for h, tokens in _interleaved_cases(measured):
        # what it must match, then the planner's ranking
        assert measured[("ring-interleaved", h, tokens)] > measured[("megatron-sp", h, tokens)]
        interleaved = _layer_ms(gpu, links, "ring-interleaved", h, tokens)
        assert interleaved > _layer_ms(gpu, links, "megatron-sp", h, tokens), (h, tokens)


def test_nvlink_interleaved_block_ranked_behind_megatron(edges_whole):
    # In a block of 4 layers handing on (call 110) the interleaved layer still ran behind
    # Megatron's block over NVLink (0.97-1.00x); the planner's block price keeps it behind.
    gpu, links = "h200-141g", _links("h200-141g", "nvlink")
    measured = _measured(gpu, "nvlink", Path(str(BLOCK_OF_FOUR).format(link="nvlink")))
    for h, tokens in _interleaved_cases(measured):
        assert measured[("ring-interleaved", h, tokens)] > measured[("megatron-sp", h, tokens)]
        interleaved = _layer_ms(gpu, links, "ring-interleaved", h, tokens, layers=4)
        assert interleaved > _layer_ms(gpu, links, "megatron-sp", h, tokens, layers=4)


def test_flow_shop_runs_the_own_rows_beside_the_first_and_last_transfers():
    # 2 pieces, halves of 2 s, transfers of 1 s, worked by hand: the compute stream runs the
    # halves at 1-3, 3-5, 5-7, 7-9 behind the gathers (ends 1, 2), the link the middle
    # transfers at 3-4, 5-6 and the reductions at 7-8, 9-10. With 0.5 s of the first half
    # needing no gather and the last reduction starting 1 s before the last half ends: halves
    # at 0-0.5 and 1-2.5, 2.5-4.5, 4.5-6.5, 6.5-8.5; reductions at 6.5-7.5 and 7.5-8.5.
    assert tensor_parallel._flow_shop(2, 2, 1, 1, 1, 2) == 10
    assert tensor_parallel._flow_shop(2, 2, 1, 1, 1, 2, 1, 0.5, 1.0) == 8.5


OWN_ROWS_FIRST = RESULTS / "2026-11-28-s27"  # calls 169 (slow link) and 170 (NVLink), 2 x H100


def test_todays_interleaved_layer_within_ten_percent_ranked_first_over_the_slow_link_only():
    # The layer whose first gather and last reduction run beside its own rows: over the slow
    # link measured +1.5% to +6.4% with 2 pieces, -4.8% to +2.5% with 4, and ranked ahead of
    # Megatron TP2 + SP (measured 1.242-1.475x) and of the ring with the fused MLP (1.07-1.12x
    # in call 156); over NVLink, where it ran 0.89-0.98x Megatron, ranked behind it
    # (predicted 4-9% fast, 0.8-1.7% behind Megatron's price, least at h 8192 / 32K).
    gpu = "h100-80g"
    links, measured = (
        _links(gpu, "slow"),
        _measured(gpu, "slow", OWN_ROWS_FIRST / "call169/slow.json"),
    )
    for h, tokens in _interleaved_cases(measured):
        predicted = {v: _layer_ms(gpu, links, v, h, tokens) for v in VARIANTS}
        for variant, pieces in (("ring-interleaved", 2), ("ring-interleaved-4", 4)):
            got = measured.get((variant, h, tokens))
            if got is not None:  # 4 pieces of a batch of 2: not run
                mine = _layer_ms(gpu, links, "ring", h, tokens, pieces=pieces)
                assert mine / got - 1 == pytest.approx(0, abs=0.10), (variant, h, tokens)
        assert min(predicted, key=predicted.get) == "ring-interleaved", (h, tokens, predicted)
        assert measured[("ring-interleaved", h, tokens)] < measured[("megatron-sp", h, tokens)]
    links = _links(gpu, "nvlink")
    measured = _measured(gpu, "nvlink", OWN_ROWS_FIRST / "call170/nvlink.json")
    for h, tokens in _interleaved_cases(measured):
        assert measured[("ring-interleaved", h, tokens)] > measured[("megatron-sp", h, tokens)]
        interleaved = _layer_ms(gpu, links, "ring-interleaved", h, tokens)
        assert interleaved > _layer_ms(gpu, links, "megatron-sp", h, tokens), (h, tokens)


def test_interleaved_activations_move_the_norm_inputs_to_every_token():
    model = ModelSpec("m", 2, 1024, 8, vocab_size=1024)
    acts = mem.layer_activations(model, 4096, 2, flash=True, local=True)
    moved = mem.interleaved_activations(acts, model, 2, local=True)
    stats = 2 * mem.norm_stat_bytes(model)
    assert moved.residual == acts.residual - 4 * 2 * 1024 - stats
    assert moved.whole == acts.whole + 2 * 2 * 1024 + stats  # the norms run on every token
    assert moved.parallel == acts.parallel


def test_strategy_and_rule_17():
    with pytest.raises(ConfigError, match="interleave"):
        Strategy(Layout(1, 2, 1, "ring"), interleave=1)
    model = ModelSpec("m", 2, 1024, 8, vocab_size=1024)
    cluster, train = ClusterSpec(load_gpu("h100-80g"), 2, 2), TrainSpec(4096, 8)
    ok = Strategy(Layout(1, 2, 1, "ring"), micro_batch=2, sequence_parallel=True, interleave=2)
    assert ok.runs_interleaved and not ok.runs_fused_ring_mlp
    assert ok.short().endswith("interleave2")
    assert rules.violations(model, cluster, train, ok) == []
    odd = Strategy(Layout(1, 2, 1, "ring"), micro_batch=3, sequence_parallel=True, interleave=2)
    megatron = Strategy(Layout(1, 2, 1), micro_batch=2, sequence_parallel=True, interleave=2)
    dropout = ModelSpec("m", 2, 1024, 8, vocab_size=1024, dropout=0.1)
    assert rules.violations(model, cluster, TrainSpec(4096, 6), odd) == [
        "rule 17: interleave 2 cuts the micro-batch's sequences into 2 pieces; "
        "micro-batch 3 % 2 != 0"
    ]
    assert (
        "rule 17: interleave 2 needs ring TP"
        in rules.violations(model, cluster, train, megatron)[0]
    )
    assert rules.violations(dropout, cluster, train, ok) == [
        "rule 17: interleave needs dropout 0 (the model has 0.1)"
    ]
    assert emit.megatron_env(train, ok)["DS_STPAR_INTERLEAVE"] == "2"
    assert "DS_STPAR_INTERLEAVE" not in emit.megatron_env(
        train, Strategy(Layout(1, 2, 1, "ring"), micro_batch=2, sequence_parallel=True)
    )
    assert "packs documents into rows" in loop_refusal(ok)


def test_search_takes_the_interleaved_layer_over_a_slow_link_only_when_asked():
    # A 4096-wide 4-layer model on 2 x H200 with the slow link's measured bandwidth. Among
    # the TP2 layouts (DP and PP, with no TP traffic, rank first at this size), asked, the
    # search ranks an interleaved ring layout first (the layer benchmark's h 4096 rows measured
    # it 1.34-1.42x Megatron there); not asked, it never proposes one.
    model = ModelSpec("m", 4, 4096, 32, vocab_size=32000, max_position_embeddings=4096)
    cluster = ClusterSpec(load_gpu("h200-141g"), 2, 2, profile=_links("h200-141g", "slow"))
    train = TrainSpec(4096, 8)
    cal = Calibration.load_default("h200-141g", stack="megatron-core-local")
    asked = search(model, cluster, train, top_k=200, calibration=cal, interleave=True)
    tp2 = [est.strategy for est in asked.top if est.strategy.layout.tp == 2]
    assert tp2 and tp2[0].runs_interleaved, [s.short() for s in tp2[:5]]
    for strategy in tp2:
        assert rules.violations(model, cluster, train, strategy) == []
    plain = search(model, cluster, train, top_k=200, calibration=cal)
    assert not any(est.strategy.interleave for est in plain.top)


def test_plan_files_write_the_interleaved_layer_for_megatron_lm_when_asked():
    # A short step (2 layers of h 8192, a global batch of 2 sequences) on 2 x H200 over the
    # slow link: asked (plan --interleave), Megatron-LM's fastest layout is the interleaved
    # TP2 ring, and megatron_args.txt carries it with NCCL's transfers under rule 12's one
    # hardware queue; not asked, the plain TP2 ring.
    model = ModelSpec("m", 2, 8192, 64, vocab_size=1024, max_position_embeddings=4096)
    cluster = ClusterSpec(load_gpu("h200-141g"), 2, 2, profile=_links("h200-141g", "slow"))
    train = TrainSpec(4096, 2)
    for asked in (True, False):
        result = search(model, cluster, train, top_k=20, interleave=asked)
        files = emit.plan_files(result, model, cluster, train, interleave=asked)
        lines = files["megatron_args.txt"].splitlines()
        env = dict(line.split("=", 1) for line in lines if line[:1].isupper())
        assert ("DS_STPAR_INTERLEAVE" in env) == asked, files["megatron_args.txt"]
        assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
        assert env.get("DS_STPAR_TRANSFER_TRANSPORT") == ("nccl" if asked else None)
        assert "--tensor-model-parallel-size 2" in lines


def test_host_per_piece_reproduces_the_whole_model_runs(edges_whole):
    # bench/planner_accuracy.py cases 20 and 22 (gpt3-2.7b, TP2, micro-batches of 2 x 4096,
    # the interleaved layer handing on; twenty-first session): on 2 x H200 (call 118) over
    # NVLink the interleaved layer's step (2.185 s) is host-bound: the shipped host per piece
    # is fitted to it (within 1%). Over the slow link (2.332 s on 2 x H200, call 118; 2.369 s
    # on 2 x H100, call 111) the prediction must come within 10% (-6.3%, -4.6%) and the
    # ranking must hold: interleaved ahead of Megatron (3.208 s, 3.295 s) there, behind it
    # over NVLink (1.588 s).
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import planner_accuracy

    calls = RESULTS / "2026-11-27-s21"
    runs = {
        ("h200-141g", "nvlink"): calls / "call118" / "accuracy-nvlink.json",
        ("h200-141g", "slow"): calls / "call118" / "accuracy-slow.json",
        ("h100-80g", "slow"): calls / "call111" / "accuracy-slow.json",
    }
    for (gpu, link), path in runs.items():
        measured = {r["interleave"]: r["step_s"] for r in json.loads(path.read_text())}
        assert sorted(measured) == [0, 2] and all(
            r["gpu"] == gpu for r in json.loads(path.read_text())
        )
        predicted = {}
        for index in (20, 22):
            case = planner_accuracy.GPU_CASES[index]
            spec = planner_accuracy.model_spec(case.model)
            estimate = planner_accuracy.predict(case, spec, gpu, 2, _links(gpu, link))
            predicted[case.interleave] = estimate
        step = {k: est.step_time_s for k, est in predicted.items()}
        if link == "nvlink":
            assert step[2] == pytest.approx(measured[2], rel=0.01)
            assert predicted[2].time_breakdown.get("host_bound", 0) > 0
            assert step[2] > step[0] and measured[2] > measured[0]
        else:
            assert step[2] == pytest.approx(measured[2], rel=0.10), (gpu, step, measured)
            assert step[2] < step[0] and measured[2] < measured[0]


def test_one_evaluator_prices_each_layer_mode_as_a_fresh_one():
    # The evaluator caches block costs per layer configuration: the interleaved layer, the
    # ring with two passes and with the fused MLP must each keep their own, in either order
    # (the interleaved strategy once took the two-pass ring's entry, and back).
    model = ModelSpec("m", 4, 4096, 32, vocab_size=32000, max_position_embeddings=4096)
    cluster = ClusterSpec(load_gpu("h100-80g"), 2, 2, profile=_links("h100-80g", "slow"))
    train = TrainSpec(4096, 8)
    cal = Calibration.load_default("h100-80g", stack="megatron-core-local")
    ring = Layout(1, 2, 1, "ring")
    strategies = [
        Strategy(ring, micro_batch=2, sequence_parallel=True, fused_ring_mlp=fused, interleave=k)
        for fused, k in ((True, 2), (False, 0), (True, 0), (True, 4))
    ]
    fresh = [cost.estimate(model, cluster, train, s, cal).step_time_s for s in strategies]
    assert len(set(fresh)) == len(fresh), fresh
    for order in (strategies, strategies[::-1]):
        ev = cost.Evaluator(model, cluster, train, cal)
        shared = {s: ev.estimate(s).step_time_s for s in order}
        assert [shared[s] for s in strategies] == fresh


def test_interleaved_host_time_grows_with_recompute_and_ignores_non_ring_layouts():
    # Full recompute issues each piece's forward collectives again: more host time per layer.
    model = ModelSpec("m", 4, 1024, 8, vocab_size=32000, max_position_embeddings=4096)
    cluster, train = ClusterSpec(load_gpu("h100-80g"), 2, 2), TrainSpec(4096, 8)
    cal = Calibration.load_default("h100-80g", stack="megatron-core-local")
    hosts = {}
    for recompute in ("none", "full"):
        strategy = Strategy(
            Layout(1, 2, 1, "ring"),
            micro_batch=2,
            recompute=recompute,
            sequence_parallel=True,
            interleave=2,
        )
        ctx = cost._Context(cost.Evaluator(model, cluster, train, cal), strategy)
        hosts[recompute] = cost.stage_host(ctx, 4, True, True)
    assert hosts["full"] - hosts["none"] == pytest.approx(4 * 3 * 2 * cal.host_collective_s)
    # a Megatron layout does not run the interleaved layer: the loop has nothing to refuse
    megatron = Strategy(Layout(1, 2, 1), micro_batch=2, sequence_parallel=True, interleave=2)
    assert not megatron.runs_interleaved and loop_refusal(megatron) == ""
