"""HuggingFace entry points: shard a causal LM by its TP plan, train it with a ds_stpar plan.

- :func:`apply_stpar` / :func:`full_state_dict` (``ds_stpar.layers.hf``): shard an HF model
  over a layout's TP group through ``config.base_model_tp_plan``, and gather it back.
- :class:`StparTrainer` (``ds_stpar.integrations.hf_trainer``): a ``transformers.Trainer``
  driven by the plan in ``TrainingArguments(deepspeed="ds_stpar.json")``, with hot switching.

See docs/hf.md.
"""

from ds_stpar.integrations.hf_trainer import StparTrainer
from ds_stpar.layers.hf import apply_stpar, full_state_dict

__all__ = ["StparTrainer", "apply_stpar", "full_state_dict"]
