"""Shims that let megatron-core build and train a GPTModel on a CPU-only machine (gloo).

Megatron allocates with ``device=torch.cuda.current_device()`` and forks a CUDA RNG tracker
(checked in ../shared/design/cpu-environment.md); its dist_checkpointing also calls
``torch.cuda.synchronize()``, and a pipelined GPTModel with tied embeddings moves the LM
head's copy with ``Tensor.cuda()`` before summing it over the first and last stage.
:func:`apply` redirects all four to the CPU.
It refuses to run where CUDA is available: these shims must never touch a GPU run.
"""

from __future__ import annotations

import torch

_applied = False


def apply() -> None:
    """Patch torch.cuda/megatron RNG helpers for CPU use (idempotent; CPU-only)."""
    global _applied
    if _applied:
        return
    if torch.cuda.is_available():
        raise RuntimeError("megatron_cpu.apply() is for CPU-only machines; CUDA is available here")
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    torch.cuda.synchronize = lambda *a, **k: None  # dist_checkpointing syncs before saving
    torch.Tensor.cuda = lambda self, *a, **k: self  # LanguageModule's tied head, pp > 1
    _applied = True
