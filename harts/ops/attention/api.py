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
    device (a host sync per call)."""
    which = resolve("attention", backend, q_TqHD.device, q_TqHD.dtype)
    if which == "fast":
        from harts.ops.attention.fast import varlen_attention_fast

        return varlen_attention_fast(q_TqHD, k_TkHD, v_TkHDv, cu_seqlens_q, cu_seqlens_k, scale,
                                     max_seqlen_q, max_seqlen_k, cu_seqlens_cpu)
    from harts.ops.attention.reference import varlen_attention_reference

    return varlen_attention_reference(q_TqHD, k_TkHD, v_TkHDv, cu_seqlens_q, cu_seqlens_k, scale)
