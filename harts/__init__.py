"""HARTS: train hybrid-attention MoE language models on rollout trees, computing every shared prefix once.

Light imports only: ``harts.data`` and ``harts.planning`` need numpy alone; torch-facing names
(``harts.pack``, ``harts.CompactBatch``) are resolved lazily so planners can run in data-loader workers.
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "pack": ("harts.runtime", "pack"),
    "CompactBatch": ("harts.runtime", "CompactBatch"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'harts' has no attribute {name!r}")
