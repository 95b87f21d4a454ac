"""RMSNorm and the KDA output's gated RMSNorm as plain torch ops: exact in float64 on CPU.

Legend: T tokens (any leading dims), D normalised width.
"""
from __future__ import annotations

import torch


def _normalized(x_TD: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) in fp32 (fp64 for fp64 input)."""
    xf = x_TD.to(torch.promote_types(x_TD.dtype, torch.float32))
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_reference(x_TD: torch.Tensor, w_D: torch.Tensor, eps: float) -> torch.Tensor:
    """The weight multiplies after the cast back, as in HF."""
    return w_D * _normalized(x_TD, eps).to(x_TD.dtype)


def gated_rms_norm_reference(x_TD: torch.Tensor, g_TD: torch.Tensor, w_D: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * w * sigmoid(g), all in fp32+, cast back once."""
    xf = _normalized(x_TD, eps)
    return (w_D.to(xf.dtype) * xf * torch.sigmoid(g_TD.to(xf.dtype))).to(x_TD.dtype)
