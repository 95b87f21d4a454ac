"""Routed experts: SwiGLU per expert, weights stacked [E, F, D] (gate/up) and [E, D, F] (down).

Legend: T tokens, D hidden, F expert width, E experts, K experts per token, M = T*K routed rows.
The reference loops over experts (exact in float64) and weights each slot's D-wide output; the fast
path sorts the M rows by expert (row gathers both ways, deterministic), runs three torch._grouped_mm
calls with unpadded group offsets (bf16 needs D and F to be multiples of 8) and weights the F-wide
activation before the down projection. Both sum a token's K slots in a fixed order, so results are
deterministic.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from harts.ops.backend import resolve


def _combine(y_MD, topk_w_TK, T, K):
    """Weight and sum the K slots of every token in the router dtype (fp32+), then cast back."""
    dt = torch.promote_types(y_MD.dtype, topk_w_TK.dtype)
    return (y_MD.view(T, K, -1).to(dt) * topk_w_TK.to(dt)[..., None]).sum(1).to(y_MD.dtype)


def moe_experts_reference(x_TD, topk_idx_TK, topk_w_TK, w_gate_EFD, w_up_EFD, w_down_EDF):
    """Why one permutation: writing each expert's rows into a full [T*K, D] buffer (index_put) copied the
    whole buffer once per expert, 128 copies per layer, which made the fp32 gradient truth on the GPU
    (harts.bench.gradgap --truth) slow for 41K-token trajectories."""
    T, K = topk_idx_TK.shape
    flat_M = topk_idx_TK.reshape(-1)
    order_M = torch.argsort(flat_M, stable=True)  # slots grouped by expert, in slot order within an expert
    counts = torch.bincount(flat_M, minlength=w_gate_EFD.shape[0]).tolist()
    outs = []
    for e, rows in enumerate(order_M.split(counts)):
        if len(rows) == 0:
            continue
        h = x_TD[rows // K]
        h = F.silu(h @ w_gate_EFD[e].T) * (h @ w_up_EFD[e].T)
        outs.append(h @ w_down_EDF[e].T)
    if not outs:  # no tokens
        return x_TD.new_zeros(T, w_down_EDF.shape[1])
    y_MD = torch.cat(outs)[torch.argsort(order_M)]  # back to (token, slot) order
    return _combine(y_MD, topk_w_TK, T, K)


class _SlotGather(torch.autograd.Function):
    """x_MD[i] = x_TD[order_M[i] // K]: every routed slot's token row, in expert-sorted order.

    Backward: the slot gradients back in (token, slot) order by the inverse permutation, then summed over
    the K slots in a fixed order. Gathers only: no atomic or sort-based scatter-add, so deterministic,
    and no [T*K, D] copy of the expanded input in the forward."""

    @staticmethod
    def forward(ctx, x_TD, order_M, inv_M, K):
        ctx.save_for_backward(inv_M)
        ctx.T, ctx.K = x_TD.shape[0], K
        return x_TD.index_select(0, order_M // K)

    @staticmethod
    def backward(ctx, g_MD):
        (inv_M,) = ctx.saved_tensors
        return g_MD.index_select(0, inv_M).view(ctx.T, ctx.K, -1).sum(1), None, None, None


class _RowPermute(torch.autograd.Function):
    """y[i] = x[perm[i]] for a permutation; the backward gathers by the inverse permutation."""

    @staticmethod
    def forward(ctx, x_MD, perm_M, inv_M):
        ctx.save_for_backward(inv_M)
        return x_MD.index_select(0, perm_M)

    @staticmethod
    def backward(ctx, g_MD):
        (inv_M,) = ctx.saved_tensors
        return g_MD.index_select(0, inv_M), None, None


def moe_experts_grouped_mm(x_TD, topk_idx_TK, topk_w_TK, w_gate_EFD, w_up_EFD, w_down_EDF):
    T, K = topk_idx_TK.shape
    E = w_gate_EFD.shape[0]
    flat_M = topk_idx_TK.reshape(-1)
    order_M = torch.sort(flat_M, stable=True).indices
    counts_E = torch.bincount(flat_M, minlength=E)
    offs_E = torch.cumsum(counts_E, 0).to(torch.int32)
    inv_M = torch.empty_like(order_M).scatter_(0, order_M, torch.arange(T * K, device=order_M.device))
    x_MD = _SlotGather.apply(x_TD, order_M, inv_M, K)
    g = torch._grouped_mm(x_MD, w_gate_EFD.transpose(-2, -1), offs=offs_E)
    u = torch._grouped_mm(x_MD, w_up_EFD.transpose(-2, -1), offs=offs_E)
    # The routing weight scales the F-wide activation before the (linear) down projection instead of the
    # D-wide output after it: same product, a third of the elementwise traffic at F = D / 3 (Ling-3.0-tiny),
    # and the combine is then a plain sum over the K slots, accumulated in fp32 without an fp32 copy.
    dt = torch.promote_types(g.dtype, topk_w_TK.dtype)
    h_MF = (F.silu(g) * u).to(dt) * topk_w_TK.reshape(-1)[order_M].to(dt)[:, None]
    y_sorted = torch._grouped_mm(h_MF.to(g.dtype), w_down_EDF.transpose(-2, -1), offs=offs_E)
    y_MD = _RowPermute.apply(y_sorted, inv_M, order_M)  # back to (token, slot) order
    return y_MD.view(T, K, -1).sum(1, dtype=dt).to(y_MD.dtype)


def moe_experts(x_TD, topk_idx_TK, topk_w_TK, w_gate_EFD, w_up_EFD, w_down_EDF, backend: str = "auto"):
    which = resolve("moe_experts", backend, x_TD.device, x_TD.dtype)
    fn = moe_experts_grouped_mm if which == "fast" else moe_experts_reference
    return fn(x_TD, topk_idx_TK, topk_w_TK, w_gate_EFD, w_up_EFD, w_down_EDF)
