"""Tree-path short convolution with fla's varlen ``causal_conv1d``.

In the compact physical order every planned sequence's output rows are contiguous, so one varlen
causal convolution over rows [0, C) with the sequences' output blocks as ``cu_seqlens`` computes each
row once; the only rows a block's convolution window needs from outside the block are the w-1 true
ancestors before its first row, which fla takes as the per-sequence ``initial_state`` (its gradient
flows back into those ancestor rows). fla's cache layout: ``initial_state[n, :, W - s]`` holds the input
s steps before sequence n's first token (s = 1..W-1; column 0 is unused by a width-W window).

Legend: C compact rows, P channels, Q sequences, W kernel width.
"""
from __future__ import annotations

import torch

from harts.ops.tuning import tuned


@tuned("fla.modules.causal_conv1d")
def tree_short_conv_fast(x_CP: torch.Tensor, weight_PW: torch.Tensor, seq_cu: torch.Tensor,
                         context_QW1: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
    from fla.modules.causal_conv1d import causal_conv1d

    C, P = x_CP.shape
    Q, W1 = context_QW1.shape
    valid = (context_QW1 >= 0).to(x_CP.dtype)  # [Q, W-1]
    ctx_QW1P = x_CP.index_select(0, context_QW1.clamp_min(0).flatten()).view(Q, W1, P) * valid[..., None]
    init_QPW = torch.cat([ctx_QW1P.new_zeros(Q, 1, P), ctx_QW1P], dim=1).transpose(1, 2).contiguous()
    y, _ = causal_conv1d(x_CP.unsqueeze(0), weight=weight_PW.to(x_CP.dtype), bias=None,
                         initial_state=init_QPW, activation=activation, cu_seqlens=seq_cu.to(torch.long))
    return y.squeeze(0)
