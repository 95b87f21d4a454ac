"""Planners (numpy + stdlib only): prefix-aware microbatch / DP-replica / slot planning (paper 3.2) and
the minimum-call planner (paper 3.3, ``harts.planning.calls``).

Names are resolved lazily so that importing the package never pulls in a planner that is not needed
(or, while it is being written, not yet there).
"""
from __future__ import annotations

_LAZY = {
    "plan_microbatches": ("harts.planning.microbatch", "plan_microbatches"),
    "MicrobatchPlan": ("harts.planning.microbatch", "MicrobatchPlan"),
    "PlanningError": ("harts.planning.microbatch", "PlanningError"),
    "plan_calls": ("harts.planning.calls", "plan_calls"),
    "CallPlan": ("harts.planning.calls", "CallPlan"),
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'harts.planning' has no attribute {name!r}")
