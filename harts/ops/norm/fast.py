"""fla-core's fused Triton RMSNorm kernels: one pass over the rows in fp32 registers, where the eager
torch reference makes several fp32 round trips through memory (in the Ling-3.0-tiny profile the
unfused norms were the largest share of elementwise time).

Rounding differs from the reference in one place: the weight multiplies in fp32 before the single cast
back (the reference rounds the normalised row first, as HF does); the gated norm is the same math.
"""
from __future__ import annotations

import torch
from fla.modules.norm.fused_norm_gate import rms_norm_gated
from fla.modules.norm.layernorm import rms_norm


def rms_norm_fast(x_TD: torch.Tensor, w_D: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x_TD, w_D, None, eps=eps)


def gated_rms_norm_fast(x_TD: torch.Tensor, g_TD: torch.Tensor, w_D: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_gated(x_TD, g_TD, w_D, None, activation="sigmoid", eps=eps)
