"""HARTS's short-convolution kernels (``harts.ops.conv.fused``) or fla's Triton causal_conv1d (varlen via
cu_seqlens), as the kernel choice ``conv`` says (``harts.ops.conv.fused.use_harts``)."""
from __future__ import annotations

import torch

from harts.ops.tuning import tuned


@tuned("fla.modules.causal_conv1d")
def short_conv_fast(x_TC: torch.Tensor, weight_CW: torch.Tensor, cu_seqlens: torch.Tensor,
                    activation: str | None = "silu", cu_seqlens_cpu: torch.Tensor | None = None) -> torch.Tensor:
    from harts.ops.conv.fused import short_conv_harts, use_harts

    if use_harts(weight_CW, activation):
        return short_conv_harts(x_TC, weight_CW, cu_seqlens, activation, cu_seqlens_cpu)
    from harts.ops._fla import causal_conv1d

    y, _ = causal_conv1d(x_TC.unsqueeze(0), weight=weight_CW.to(x_TC.dtype), bias=None, activation=activation,
                         cu_seqlens=cu_seqlens.to(torch.long), cu_seqlens_cpu=cu_seqlens_cpu)
    return y.squeeze(0)
