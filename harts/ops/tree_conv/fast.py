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


class _TreeConv(torch.autograd.Function):
    """fla's varlen convolution forward and backward kernels, with the ancestor windows gathered inside. Why not
    fla's autograd Function on a gathered initial state: the gather's backward would give x a second, full-size
    zero-filled gradient for a few context rows, summed by autograd into the convolution's (a fill and an add
    over [C, P] per call); here the initial state's gradient is added into those rows of dx in place."""

    @staticmethod
    def forward(ctx, x_CP, weight_PW, seq_cu, context_QW1, activation):
        from harts.ops._fla import causal_conv1d_fwd, prepare_chunk_indices

        P = x_CP.shape[1]
        Q, W1 = context_QW1.shape
        rows = context_QW1.clamp_min(0).flatten()
        valid_QW1 = (context_QW1 >= 0).to(x_CP.dtype)
        ctx_QW1P = x_CP.index_select(0, rows).view(Q, W1, P) * valid_QW1[..., None]
        init_QPW = torch.cat([ctx_QW1P.new_zeros(Q, 1, P), ctx_QW1P], dim=1).transpose(1, 2).contiguous()
        cu = seq_cu.to(torch.long)
        chunks = prepare_chunk_indices(cu, CHUNK)
        w = weight_PW.to(x_CP.dtype)
        x = x_CP.unsqueeze(0).contiguous()
        y, _ = causal_conv1d_fwd(x=x, weight=w, bias=None, residual=None, initial_state=init_QPW,
                                 output_final_state=False, activation=activation, cu_seqlens=cu,
                                 chunk_indices=chunks, chunk_size=CHUNK)
        ctx.save_for_backward(x, w, init_QPW, rows, valid_QW1, cu, chunks)
        ctx.activation, ctx.weight_dtype = activation, weight_PW.dtype
        return y.squeeze(0)

    @staticmethod
    def backward(ctx, dy_CP):
        from harts.ops._fla import causal_conv1d_bwd

        x, w, init_QPW, rows, valid_QW1, cu, chunks = ctx.saved_tensors
        dx, dw, _, _, dh0_QPW = causal_conv1d_bwd(x=x, dy=dy_CP.unsqueeze(0).contiguous(), dht=None, weight=w,
                                                   bias=None, residual=None, initial_state=init_QPW,
                                                   activation=ctx.activation, cu_seqlens=cu, chunk_indices=chunks,
                                                   chunk_size=CHUNK)
        dx_CP = dx.view(x.shape[1:])
        dctx_QW1P = dh0_QPW[:, :, 1:].transpose(1, 2) * valid_QW1[..., None]  # column 0 of the window is unused
        dx_CP.index_add_(0, rows, dctx_QW1P.reshape(rows.shape[0], -1).to(dx_CP.dtype))
        return dx_CP, dw.to(ctx.weight_dtype), None, None, None


# Rows per program of fla's convolution kernels. It must stay fla's default, 64: for SiLU, fla's backward
# recomputes the forward with our chunk indices but its own default chunk size.
CHUNK = 64


@tuned("fla.modules.causal_conv1d")
def tree_short_conv_fast(x_CP: torch.Tensor, weight_PW: torch.Tensor, seq_cu: torch.Tensor,
                         context_QW1: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
    return _TreeConv.apply(x_CP, weight_PW, seq_cu, context_QW1, activation)
