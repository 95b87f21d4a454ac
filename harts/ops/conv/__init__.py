"""Causal depthwise short convolution over a packed token stream, reset at every cu_seqlens boundary.

PyTorch cross-correlation convention (as fla's ShortConvolution / nn.Conv1d): weight[:, W-1] multiplies
the current token, weight[:, W-1-s] the token s steps back in the same sequence; tokens of the previous
packed sequence never leak in. Optional SiLU after the convolution.
"""
from __future__ import annotations

import torch

from harts.ops.backend import resolve
from harts.ops.conv.reference import short_conv_reference

__all__ = ["short_conv", "short_conv_reference"]


def short_conv(x_TC: torch.Tensor, weight_CW: torch.Tensor, cu_seqlens: torch.Tensor,
               activation: str | None = "silu", backend: str = "auto",
               cu_seqlens_cpu: torch.Tensor | None = None) -> torch.Tensor:
    """``cu_seqlens_cpu``: an optional host copy of ``cu_seqlens`` (int64), from which the fast path plans its
    chunks without reading the device tensor (a host sync per call otherwise)."""
    which = resolve("conv", backend, x_TC.device, x_TC.dtype)
    if which == "fast":
        from harts.ops.conv.fast import short_conv_fast

        return short_conv_fast(x_TC, weight_CW, cu_seqlens, activation, cu_seqlens_cpu)
    return short_conv_reference(x_TC, weight_CW, cu_seqlens, activation)
