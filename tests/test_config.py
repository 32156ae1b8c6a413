"""Inputs: presets against published parameter counts, HF configs, layouts, bad input."""

import json

import pytest

from ds_stpar.config import (
    MODEL_PRESETS,
    ClusterSpec,
    Layout,
    ModelSpec,
    Strategy,
    TrainSpec,
    load_gpu,
    stage_layers,
)
from ds_stpar.errors import ConfigError


@pytest.mark.parametrize(
    "name, published",
    [
        ("gpt3-175b", 174.6e9),
        ("llama3-8b", 8.03e9),
        ("llama3-70b", 70.55e9),
        ("llama3-405b", 405.85e9),
    ],
)
def test_preset_parameter_counts_match_published(name, published):
    # planner.md: GPT-3 175B -> 174.6B; Llama-3 8B/70B/405B -> 8.03B / 70.55B / 405.85B.
    # The published figures are rounded to 4 significant digits: 0.05% tolerance.
    assert MODEL_PRESETS[name].num_params() == pytest.approx(published, rel=5e-4)


def test_gpt_closed_form_matches_count():
    # planner.md: 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)) for GPT with biases, tied embeddings.
    m = MODEL_PRESETS["gpt3-1.3b"]
    h, l, V, s = m.hidden_size, m.num_layers, m.vocab_size, m.max_position_embeddings
    closed = 12 * l * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))
    # the closed form omits the final norm (2h): exact after adding it
    assert m.num_params() == round(closed) + 2 * h


def test_hf_llama_config(tmp_path):
    cfg = {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert ModelSpec.load(str(path)).num_params() == MODEL_PRESETS["llama3-8b"].num_params()


def test_hf_config_names(tmp_path):
    """A model folder's config.json is named by its folder, a loose file by its stem, and
    ``_name_or_path`` wins over both."""
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128}
    cfg |= {"num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256}
    folder = tmp_path / "Llama-tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "llama-small.json").write_text(json.dumps(cfg))
    (tmp_path / "named.json").write_text(json.dumps(cfg | {"_name_or_path": "org/model"}))
    assert ModelSpec.load(str(folder / "config.json")).name == "Llama-tiny"
    assert ModelSpec.load(str(tmp_path / "llama-small.json")).name == "llama-small"
    assert ModelSpec.load(str(tmp_path / "named.json")).name == "org/model"


def test_hf_gpt2_config():
    cfg = {
        "model_type": "gpt2",
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "vocab_size": 50257,
        "n_positions": 1024,
    }
    # GPT-2 small: 124.44M parameters (the published HF count)
    assert ModelSpec.load(cfg).num_params() == 124_439_808


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError, match="llama3-8b"):
        ModelSpec.load("llama9-1t")


def test_malformed_json_names_line_and_column(tmp_path):
    path = tmp_path / "m.json"
    path.write_text('{\n  "num_layers": 2,\n  "hidden_size": ,\n}')
    with pytest.raises(ConfigError, match=r"m\.json:3:18"):
        ModelSpec.load(str(path))


def test_unsupported_hf_type():
    with pytest.raises(ConfigError, match="unsupported HF model_type 'bert'"):
        ModelSpec.load({"model_type": "bert"})


def test_layout_rank_grid_tp_innermost():
    layout = Layout(dp=2, tp=2, pp=2)
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.pp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for rank in range(8):
        assert layout.rank_of(*layout.coords(rank)) == rank


def test_cannon_needs_square_tp():
    with pytest.raises(ConfigError, match="square"):
        Layout(tp=2, tp_mode="cannon")
    assert Layout(tp=4, tp_mode="cannon").world_size == 4


def test_bad_values_rejected():
    with pytest.raises(ConfigError, match="ZeRO"):
        Strategy(Layout(), zero=4)
    with pytest.raises(ConfigError, match="seq_len"):
        TrainSpec(seq_len=0, global_batch=8)
    with pytest.raises(ConfigError, match="whole number of nodes"):
        ClusterSpec(load_gpu("h100-80g"), num_gpus=12, gpus_per_node=8)
    with pytest.raises(ConfigError, match="unknown GPU"):
        load_gpu("rtx-9090")


def test_uneven_stages():
    s = Strategy(Layout(pp=4), first_stage_layers=5, last_stage_layers=5)
    assert stage_layers(30, s) == [5, 10, 10, 5]
    with pytest.raises(ConfigError, match="not divisible"):
        stage_layers(31, s)
