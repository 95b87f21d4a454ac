"""Torch reference of the packed causal short convolution (exact in float64).

Legend: T packed tokens, C channels, W kernel width, N sequences.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _check(x_TC, weight_CW, cu_seqlens):
    if x_TC.dim() != 2 or weight_CW.dim() != 2 or x_TC.shape[1] != weight_CW.shape[0]:
        raise ValueError(f"short_conv: x {tuple(x_TC.shape)} must be [T, C] and weight {tuple(weight_CW.shape)} [C, W]")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"short_conv: cu_seqlens must be 1-D with >= 2 entries, got {tuple(cu_seqlens.shape)}")


def seq_start_of_token(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """[T] index of the first token of each token's sequence."""
    cu = cu_seqlens.to(torch.long)
    lens = cu[1:] - cu[:-1]
    return torch.repeat_interleave(cu[:-1], lens, output_size=T)


def short_conv_reference(x_TC: torch.Tensor, weight_CW: torch.Tensor, cu_seqlens: torch.Tensor,
                         activation: str | None = "silu") -> torch.Tensor:
    _check(x_TC, weight_CW, cu_seqlens)
    T, W = x_TC.shape[0], weight_CW.shape[1]
    start_T = seq_start_of_token(cu_seqlens.to(x_TC.device), T)
    t_T = torch.arange(T, device=x_TC.device)
    w = weight_CW.to(x_TC.dtype)
    y_TC = x_TC * w[:, W - 1]
    for s in range(1, W):
        shifted = F.pad(x_TC, (0, 0, s, 0))[:T]  # shifted[t] = x[t - s] (zero before 0)
        keep = (t_T - s >= start_T).to(x_TC.dtype)[:, None]
        y_TC = y_TC + shifted * keep * w[:, W - 1 - s]
    if activation in ("silu", "swish"):
        y_TC = F.silu(y_TC)
    elif activation is not None:
        raise ValueError(f"short_conv: unsupported activation {activation!r}")
    return y_TC
