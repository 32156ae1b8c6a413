"""Validity rules: one violating strategy per rule (message names the rule and the numbers),
and valid strategies pass."""

import dataclasses

import pytest

from ds_stpar.config import ClusterSpec, Layout, ModelSpec, Strategy, TrainSpec, load_gpu
from ds_stpar.errors import ConfigError
from ds_stpar.planner.rules import RULES, MegatronOptions, check, megatron_options, violations

H100 = load_gpu("h100-80g")
MODEL = ModelSpec("m", num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=32000)
CLUSTER = ClusterSpec(H100, 16, 8)  # two nodes of eight
TRAIN = TrainSpec(2048, 64)
VALID = Strategy(
    Layout(dp=2, tp=4, pp=2),
    micro_batch=2,
    zero=1,
    recompute="full",
    sequence_parallel=True,
)


def only(found: list[str], number: int) -> str:
    """The one message of rule ``number`` (and that it is the only rule broken)."""
    assert len(found) == 1, found
    assert found[0].startswith(f"rule {number}:"), found
    return found[0]


def model(**kw) -> ModelSpec:
    fields = {"name": "m", "num_layers": 24, "hidden_size": 2048, "num_attention_heads": 16}
    return ModelSpec(**{**fields, "vocab_size": 32000, **kw})


def layout(**kw) -> Strategy:
    return dataclasses.replace(VALID, layout=dataclasses.replace(VALID.layout, **kw))


def test_valid_strategies_pass():
    assert violations(MODEL, CLUSTER, TRAIN, VALID) == []
    check(MODEL, CLUSTER, TRAIN, VALID)
    ring = dataclasses.replace(VALID, layout=Layout(dp=2, tp=4, pp=2, tp_mode="ring"))
    cannon = dataclasses.replace(ring, layout=Layout(dp=2, tp=4, pp=2, tp_mode="cannon"))
    interleaved = dataclasses.replace(VALID, vpp_layers=4)
    layer_pieces = dataclasses.replace(ring, interleave=ring.micro_batch)  # rule 17
    for strategy in (ring, cannon, interleaved, layer_pieces):
        assert violations(MODEL, CLUSTER, TRAIN, strategy) == []
    assert len(RULES) == 17


def test_check_lists_every_violation():
    bad = dataclasses.replace(VALID, micro_batch=3, zero=2)  # rules 6 and 13
    with pytest.raises(ConfigError, match=r"rule 6: .*; rule 13: "):
        check(MODEL, CLUSTER, TRAIN, bad)


def test_rule_1_world_and_degrees():
    msg = only(violations(MODEL, CLUSTER, TRAIN, layout(dp=4)), 1)
    assert "dp 4 * tp 4 * pp 2 * cp 1 = 32 != world 16" in msg
    cp3 = MegatronOptions(context_parallel=3)
    msg = violations(MODEL, CLUSTER, TRAIN, VALID, cp3)[0]
    assert msg.startswith("rule 1:") and "world 16 % (tp 4 * pp 2 * cp 3)" in msg


def test_rule_2_layers_over_stages():
    thirty = model(num_layers=30)
    strategy = dataclasses.replace(VALID, layout=Layout(dp=1, tp=4, pp=4), recompute="none")
    msg = only(violations(thirty, CLUSTER, TRAIN, strategy), 2)
    assert "num_layers 30 % pp 4 != 0" in msg and "first/last" in msg
    uneven = dataclasses.replace(strategy, first_stage_layers=6, last_stage_layers=6)
    assert violations(thirty, CLUSTER, TRAIN, uneven) == []
    wrong = dataclasses.replace(strategy, first_stage_layers=5, last_stage_layers=6)
    assert "19 does not split over 2 middle stages" in only(
        violations(thirty, CLUSTER, TRAIN, wrong), 2
    )


def test_rule_3_virtual_pipeline():
    msg = only(violations(MODEL, CLUSTER, TRAIN, dataclasses.replace(VALID, vpp_layers=5)), 3)
    assert "layers per stage 12 % vpp_layers 5 != 0" in msg
    both = MegatronOptions(virtual_stages_per_rank=3)
    interleaved = dataclasses.replace(VALID, vpp_layers=4)
    assert "both set" in only(violations(MODEL, CLUSTER, TRAIN, interleaved, both), 3)


def test_rule_4_interleaving_needs_stages():
    flat = dataclasses.replace(
        VALID, layout=Layout(dp=4, tp=4, pp=1), vpp_layers=4, recompute="none"
    )
    assert "needs pp > 1, got pp 1" in only(violations(MODEL, CLUSTER, TRAIN, flat), 4)
    no_overlap = MegatronOptions(overlap_p2p_comm=False)
    interleaved = dataclasses.replace(VALID, vpp_layers=4)
    assert "needs pp > 2, got pp 2" in only(
        violations(MODEL, CLUSTER, TRAIN, interleaved, no_overlap), 4
    )


def test_rule_5_interleaved_micro_batches():
    train = TrainSpec(2048, 12)  # m = 12 / (2 * 2) = 3 micro-batches
    interleaved = dataclasses.replace(VALID, vpp_layers=4)
    msg = only(violations(MODEL, CLUSTER, train, interleaved), 5)
    assert "m 3 >= pp 2 and m % pp == 0" in msg


def test_rule_6_global_batch():
    msg = only(violations(MODEL, CLUSTER, TrainSpec(2048, 62), VALID), 6)
    assert "global batch 62 % (micro-batch 2 * dp 2) = 2 != 0" in msg


def test_rule_7_heads_groups_precision():
    twelve = model(num_attention_heads=12, kv_channels=128)
    assert "num_attention_heads 12 % tp 8 != 0" in only(
        violations(twelve, CLUSTER, TRAIN, layout(tp=8, pp=1)), 7
    )
    gqa = model(num_attention_heads=24, num_query_groups=6, kv_channels=64)
    assert "num_query_groups 6 and tp 4" in only(violations(gqa, CLUSTER, TRAIN, VALID), 7)
    both = MegatronOptions(fp16=True, bf16=True)
    assert "fp16 and bf16" in only(violations(MODEL, CLUSTER, TRAIN, VALID, both), 7)


def test_rule_8_context_parallel_sequence():
    cp2 = MegatronOptions(context_parallel=2)
    strategy = layout(dp=2, tp=2)
    assert violations(MODEL, CLUSTER, TRAIN, strategy, cp2) == []
    train = TrainSpec(2050, 64)  # 2050 % 4 != 0 while 2050 % tp 2 == 0 (rule 9 holds)
    assert "seq_len 2050 % (2 * cp 2) != 0" in only(
        violations(MODEL, CLUSTER, train, strategy, cp2), 8
    )


def test_rule_9_sequence_parallel():
    no_tp = dataclasses.replace(VALID, layout=Layout(dp=8, tp=1, pp=2))
    assert "tp 1" in only(violations(MODEL, CLUSTER, TRAIN, no_tp), 9)
    odd = TrainSpec(2050, 64)
    assert "seq_len 2050 % tp 4" in only(violations(MODEL, CLUSTER, odd, VALID), 9)
    overlap = MegatronOptions(tp_comm_overlap=True)
    no_sp = dataclasses.replace(VALID, sequence_parallel=False)
    assert "tp_comm_overlap" in only(violations(MODEL, CLUSTER, TRAIN, no_sp, overlap), 9)


def test_rule_10_recompute_arguments():
    too_many = MegatronOptions(recompute_num_layers=13)
    assert "recompute_num_layers 13 not in [1, 12]" in only(
        violations(MODEL, CLUSTER, TRAIN, VALID, too_many), 10
    )
    method = MegatronOptions(recompute_method="chunked")
    assert "uniform or block, got chunked" in only(
        violations(MODEL, CLUSTER, TRAIN, VALID, method), 10
    )
    selective = dataclasses.replace(VALID, recompute="selective")
    with_method = MegatronOptions(recompute_method="uniform")
    assert "selective" in only(violations(MODEL, CLUSTER, TRAIN, selective, with_method), 10)


def test_rule_11_overlap_param_gather():
    opts = MegatronOptions(overlap_param_gather=True, distributed_optimizer=False)
    msg = only(violations(MODEL, CLUSTER, TRAIN, VALID, opts), 11)
    assert "distributed_optimizer=False" in msg


def test_rule_12_device_max_connections():
    bare = MegatronOptions(env={})
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1, got None" in only(
        violations(MODEL, CLUSTER, TRAIN, VALID, bare), 12
    )
    assert megatron_options(TRAIN, VALID).env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def test_rule_13_pipeline_engine_refuses_zero_2_3():
    for zero in (2, 3):
        msg = only(violations(MODEL, CLUSTER, TRAIN, dataclasses.replace(VALID, zero=zero)), 13)
        assert f"ZeRO-{zero} with pp 2" in msg
    assert violations(MODEL, CLUSTER, TRAIN, dataclasses.replace(VALID, zero=0)) == []


def test_rule_14_ring_needs_sequence_parallel_boundary():
    ring = dataclasses.replace(VALID, layout=Layout(dp=2, tp=4, pp=2, tp_mode="ring"))
    no_sp = dataclasses.replace(ring, sequence_parallel=False)
    assert "set sequence_parallel" in only(violations(MODEL, CLUSTER, TRAIN, no_sp), 14)


CANNON = dataclasses.replace(VALID, layout=Layout(dp=2, tp=4, pp=2, tp_mode="cannon"))


def test_rule_15_cannon_needs_what_the_layer_needs():
    # layers/cannon.py keeps whole sequences (the batch is never split): any micro-batch works
    for b in (1, 2, 4):
        assert violations(MODEL, CLUSTER, TRAIN, dataclasses.replace(CANNON, micro_batch=b)) == []
    # token blocks are SP chunks: s % P (rule 9 says the same for SP in general)
    odd_seq = violations(MODEL, CLUSTER, TrainSpec(2046, 64), CANNON)
    assert [msg[:8] for msg in odd_seq] == ["rule 9: ", "rule 15:"]
    assert "seq_len 2046 % tp 4 == 0" in odd_seq[1]
    no_sp = dataclasses.replace(CANNON, sequence_parallel=False)
    assert "set sequence_parallel" in only(violations(MODEL, CLUSTER, TRAIN, no_sp), 15)
    # hidden (every linear's unsharded dim) is cut into q blocks; heads x kv_channels need not
    # equal it
    hidden = model(hidden_size=2049, kv_channels=128, ffn_hidden_size=8192)
    assert "hidden_size 2049 % q == 0" in only(violations(hidden, CLUSTER, TRAIN, CANNON), 15)
    # FFN (fc1 out, fc2 in) is cut into P Megatron shards: % P, not only % q
    ffn = model(ffn_hidden_size=8194)
    assert "ffn_hidden_size 8194 % tp 4 == 0" in only(violations(ffn, CLUSTER, TRAIN, CANNON), 15)
    # QKV width with fewer query groups than ranks: (16 + 2) x 2 = 36 % 4 == 0 passes,
    # (16 + 2) x 1 with a 1-wide head does not
    narrow = model(num_attention_heads=16, num_query_groups=1, kv_channels=1)
    assert "QKV width 18 (q + 2 kv) % tp 4 == 0" in only(
        violations(narrow, CLUSTER, TRAIN, CANNON), 15
    )
    assert violations(model(num_query_groups=1, kv_channels=2), CLUSTER, TRAIN, CANNON) == []


def test_rule_7_applies_to_cannon():
    # Megatron's attention splits heads and query groups over all P ranks, not over q
    six = model(num_attention_heads=6, kv_channels=256, hidden_size=1536)
    assert "num_attention_heads 6 % tp 4 != 0" in only(violations(six, CLUSTER, TRAIN, CANNON), 7)
    gqa = model(num_attention_heads=24, num_query_groups=6, kv_channels=64)
    assert "num_query_groups 6 and tp 4" in only(violations(gqa, CLUSTER, TRAIN, CANNON), 7)


def test_rule_16_tp_inside_a_node():
    wide = dataclasses.replace(VALID, layout=Layout(dp=1, tp=16, pp=1), recompute="none")
    msg = only(violations(MODEL, CLUSTER, TRAIN, wide), 16)
    assert "tp 16 does not fit inside a node of 8 GPUs" in msg
    assert violations(MODEL, CLUSTER, TRAIN, wide, allow_tp_across_nodes=True) == []
