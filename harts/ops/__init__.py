"""HARTS ops: each op has its own folder with the autograd Function, the fast path and a naive
reference side by side (fla's layout). Names resolve lazily so importing harts.ops stays cheap.

Kernel variants (which of two valid fast kernels an op runs) are configuration, not arguments:
``kernel_choices()``, ``set_kernel_choices(...)`` and the scoped ``use_kernel_choices(...)``
(``harts.ops.choices``; the defaults come from the environment, docs/environment.md).
"""
from __future__ import annotations

from harts.ops.choices import KernelChoices, kernel_choices, set_kernel_choices, use_kernel_choices

__all__ = ["KernelChoices", "kernel_choices", "set_kernel_choices", "use_kernel_choices", "chunk_kda_round",
           "compact_logprobs"]

_LAZY = {
    # KDA rounds with differentiable chunk-boundary states (Triton, kernels/).
    "chunk_kda_round": ("harts.ops.kda_round", "chunk_kda_round"),
    # Fused compact log-probs through the LM head.
    "compact_logprobs": ("harts.ops.logprobs", "compact_logprobs"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'harts.ops' has no attribute {name!r}")
