"""MoE routing (fp32 grouped sigmoid router with aux-loss-free expert bias) and the routed-expert SwiGLU.

Deterministic and without token dropping: every token is processed by exactly its top-k experts, and the
k expert outputs of a token are summed in a fixed order (no atomics in the combine).
"""
from harts.ops.moe.experts import (
    grouped_experts,
    grouped_experts_stacked,
    moe_experts,
    moe_experts_grouped_mm,
    moe_experts_reference,
    routed_experts,
)
from harts.ops.moe.router import RouterStats, route, router_logits, router_stats

__all__ = ["RouterStats", "route", "router_logits", "router_stats", "moe_experts", "moe_experts_grouped_mm",
           "moe_experts_reference", "routed_experts", "grouped_experts",
           "grouped_experts_stacked"]
