"""Planners (numpy + stdlib only): prefix-aware microbatch / DP-replica / slot planning (paper 3.2), the
minimum-call planner (paper 3.3, ``harts.planning.calls``) and the compact execution layout
(``harts.planning.layout``).

Every entry point checks its public inputs the same way (``harts.planning.checks``): integer parameters must
be ints or numpy integers (TypeError otherwise), empty input is a ValueError from the entry point, and every
``validate()`` raises ValueError naming the offending item. Names are resolved lazily so that importing the
package never pulls in a planner that is not needed.
"""
from __future__ import annotations

_LAZY = {
    "plan_microbatches": ("harts.planning.microbatch", "plan_microbatches"),
    "MicrobatchPlan": ("harts.planning.microbatch", "MicrobatchPlan"),
    "PlanningError": ("harts.planning.microbatch", "PlanningError"),
    "plan_calls": ("harts.planning.calls", "plan_calls"),
    "CallPlan": ("harts.planning.calls", "CallPlan"),
    "build_layout": ("harts.planning.layout", "build_layout"),
    "ExecutionLayout": ("harts.planning.layout", "ExecutionLayout"),
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'harts.planning' has no attribute {name!r}")
