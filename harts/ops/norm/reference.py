"""RMSNorm and the KDA output's gated RMSNorm as plain torch ops: exact in float64 on CPU.

Legend: T tokens (any leading dims), D normalised width.
"""
from __future__ import annotations

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def rms_norm_reference(x_TD: torch.Tensor, w_D: torch.Tensor, eps: float) -> torch.Tensor:
    """Variance in fp32 (fp64 for fp64 input); the weight multiplies after the cast back, as in HF."""
    xf = x_TD.to(_compute_dtype(x_TD.dtype))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w_D * xf.to(x_TD.dtype)


def gated_rms_norm_reference(x_TD: torch.Tensor, g_TD: torch.Tensor, w_D: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * w * sigmoid(g), all in fp32+, cast back once."""
    dt = _compute_dtype(x_TD.dtype)
    xf = x_TD.to(dt)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (w_D.to(dt) * xf * torch.sigmoid(g_TD.to(dt))).to(x_TD.dtype)
