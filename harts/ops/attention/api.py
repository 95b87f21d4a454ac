"""Dispatch between the SDPA reference and the GPU varlen kernels (choice logged by harts.ops.backend)."""
from __future__ import annotations

import torch

from harts.ops.backend import resolve


def varlen_attention(q_TqHD: torch.Tensor, k_TkHD: torch.Tensor, v_TkHDv: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, scale: float,
                     backend: str = "auto", max_seqlen_q: int | None = None,
                     max_seqlen_k: int | None = None, cu_seqlens_cpu: torch.Tensor | None = None) -> torch.Tensor:
    """Packed attention, bottom-right causal per sequence; returns [Tq, H, Dv]. Passing the same
    ``cu_seqlens`` tensor for queries and keys says the sequences attend over themselves (Lq == Lk): the
    fast path may then run cuDNN's fused attention (``harts.ops.attention.fast``), one call per sequence,
    whose bounds it reads from ``cu_seqlens_cpu`` (a host copy of that tensor) when given instead of from the
    device (a host sync per call).

    Grouped-query attention: k and v may have G heads, a divisor of q's H; key / value head g serves query heads
    g * H / G ... (g + 1) * H / G - 1. cuDNN reads them as they are; the other kernels get them repeated."""
    check_heads(q_TqHD, k_TkHD, v_TkHDv, "varlen_attention")
    which = resolve("attention", backend, q_TqHD.device, q_TqHD.dtype)
    if which == "fast":
        from harts.ops.attention.fast import varlen_attention_fast

        return varlen_attention_fast(q_TqHD, k_TkHD, v_TkHDv, cu_seqlens_q, cu_seqlens_k, scale,
                                     max_seqlen_q, max_seqlen_k, cu_seqlens_cpu)
    from harts.ops.attention.reference import varlen_attention_reference

    k_TkHD, v_TkHDv = repeat_heads(k_TkHD, q_TqHD.shape[1]), repeat_heads(v_TkHDv, q_TqHD.shape[1])
    return varlen_attention_reference(q_TqHD, k_TkHD, v_TkHDv, cu_seqlens_q, cu_seqlens_k, scale)


def check_heads(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THDv: torch.Tensor, what: str) -> None:
    """k and v have the same number of heads, a divisor of q's (grouped-query attention), or a ValueError."""
    H, G = q_THD.shape[1], k_THD.shape[1]
    if H % G or v_THDv.shape[1] != G:
        raise ValueError(f"{what}: q has {H} heads, k {G} and v {v_THDv.shape[1]}: k and v need the same number "
                         "of heads, a divisor of q's (grouped-query attention)")


def repeat_heads(x_THX: torch.Tensor, H: int) -> torch.Tensor:
    """Key / value heads [T, G, X] repeated to H query heads (x itself when G == H): head g serves H / G
    consecutive query heads."""
    G = x_THX.shape[1]
    return x_THX if G == H else x_THX.repeat_interleave(H // G, dim=1)
