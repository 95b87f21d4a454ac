"""Routed experts: SwiGLU per expert, weights stacked [E, F, D] (gate/up) and [E, D, F] (down).

Legend: T tokens, D hidden, F expert width, E experts, K experts per token, M = T*K routed rows,
J output rows that read one source row (the transpose of K in ``gather_sum``).
The reference loops over experts (exact in float64) and weights each slot's D-wide output; the fast
path sorts the M rows by expert, runs three torch._grouped_mm calls with unpadded group offsets (bf16
needs D and F to be multiples of 8) and weights the F-wide activation before the down projection. Its
rows move between token and expert-sorted order with one gather-sum op both ways (``gather_sum``: one
Triton kernel on the GPU, at copy speed; Inductor's gather-then-sum for the combine ran at a fifth of it),
whose gradient is the same op with the indices swapped. Both paths sum a token's K slots in a fixed
order, so results are deterministic.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from harts.ops.backend import resolve


def _combine(y_MD, topk_w_TK, T, K):
    """Weight and sum the K slots of every token in the router dtype (fp32+), then cast back."""
    dt = torch.promote_types(y_MD.dtype, topk_w_TK.dtype)
    return (y_MD.view(T, K, -1).to(dt) * topk_w_TK.to(dt)[..., None]).sum(1).to(y_MD.dtype)


def grouped_experts(x_MD, counts_E: list[int], w_gate_EFD, w_up_EFD, w_down_EDF, backend: str = "auto",
                    offs_E=None):
    """The experts' SwiGLU on expert-major rows, the one expert compute of the model and of expert
    parallelism (which runs it on the rows it receives): expert e takes the ``counts_E[e]`` rows after those
    of the experts before it. The reference loops over the host ``counts_E`` (exact in float64); the fast
    path runs torch._grouped_mm with the group offsets ``offs_E`` (int32 cumsum on the device; from
    ``counts_E`` when not given, a host-to-device copy)."""
    if x_MD.shape[0] == 0:  # no rows: zero gradients, so every expert weight still gets one
        return x_MD.new_zeros(0, w_down_EDF.shape[1]) + 0 * (w_gate_EFD.sum() + w_up_EFD.sum() + w_down_EDF.sum())
    if resolve("moe_experts", backend, x_MD.device, x_MD.dtype) == "fast":
        if offs_E is None:
            offs_E = torch.tensor(counts_E, device=x_MD.device).cumsum(0).to(torch.int32)
        return _grouped_swiglu(x_MD, offs_E, w_gate_EFD, w_up_EFD, w_down_EDF)
    return torch.cat([(F.silu(h @ w_gate_EFD[e].T) * (h @ w_up_EFD[e].T)) @ w_down_EDF[e].T
                      for e, h in enumerate(x_MD.split(counts_E)) if len(h)])


def _grouped_swiglu(x_MD, offs_E, w_gate_EFD, w_up_EFD, w_down_EDF, scale_M=None):
    """``grouped_experts``' fast path; ``scale_M`` (fp32+) scales each row's F-wide activation before the
    (linear) down projection."""
    g = torch._grouped_mm(x_MD, w_gate_EFD.transpose(-2, -1), offs=offs_E)
    h_MF = F.silu(g) * torch._grouped_mm(x_MD, w_up_EFD.transpose(-2, -1), offs=offs_E)
    if scale_M is not None:
        dt = torch.promote_types(h_MF.dtype, scale_M.dtype)
        h_MF = (h_MF.to(dt) * scale_M.to(dt)[:, None]).to(g.dtype)
    return torch._grouped_mm(h_MF, w_down_EDF.transpose(-2, -1), offs=offs_E)


def moe_experts_reference(x_TD, topk_idx_TK, topk_w_TK, w_gate_EFD, w_up_EFD, w_down_EDF):
    """Why one permutation: writing each expert's rows into a full [T*K, D] buffer (index_put) copied the
    whole buffer once per expert, 128 copies per layer, which made the fp32 gradient truth on the GPU
    (benchmarks.gradgap --truth) slow for 41K-token trajectories."""
    T, K = topk_idx_TK.shape
    flat_M = topk_idx_TK.reshape(-1)
    order_M = torch.argsort(flat_M, stable=True)  # slots grouped by expert, in slot order within an expert
    counts = torch.bincount(flat_M, minlength=w_gate_EFD.shape[0]).tolist()
    y_sorted = grouped_experts(x_TD[order_M // K], counts, w_gate_EFD, w_up_EFD, w_down_EDF, "reference")
    if T == 0:
        return y_sorted
    return _combine(y_sorted[torch.argsort(order_M)], topk_w_TK, T, K)  # back to (token, slot) order


def gather_sum_reference(src_MD, idx_TK):
    """out_TD[t] = sum_k src_MD[idx_TK[t, k]] in plain torch, accumulated in fp32 (float64 for float64) in
    k order and cast to ``src_MD``'s dtype."""
    T, K = idx_TK.shape
    rows_TKD = src_MD.index_select(0, idx_TK.reshape(-1))
    if K == 1:  # a row gather: no sum, no cast
        return rows_TKD
    acc = torch.promote_types(src_MD.dtype, torch.float32)
    return rows_TKD.view(T, K, src_MD.shape[1]).sum(1, dtype=acc).to(src_MD.dtype)


class _GatherSum(torch.autograd.Function):
    """The reference with the kernel op's gradient: the same gather-sum with the indices swapped."""

    @staticmethod
    def forward(ctx, src_MD, idx_TK, inv_MJ):
        ctx.save_for_backward(idx_TK, inv_MJ)
        return gather_sum_reference(src_MD, idx_TK)

    @staticmethod
    def backward(ctx, grad_TD):
        idx_TK, inv_MJ = ctx.saved_tensors
        return _GatherSum.apply(grad_TD, inv_MJ, idx_TK), None, None


def gather_sum(src_MD, idx_TK, inv_MJ, backend: str = "auto"):
    """out_TD[t] = sum_{k<K} src_MD[idx_TK[t, k]], accumulated in fp32 (float64 for float64) in k order and
    cast to ``src_MD``'s dtype; differentiable in ``src_MD``.

    ``inv_MJ`` is the transpose of ``idx_TK``: row m lists the J output rows t with idx_TK[t, k] = m (each
    pair as often as in ``idx_TK``), so the gradient is ``gather_sum(grad_TD, inv_MJ, idx_TK)``: a gather,
    deterministic, with no scatter-add. For a permutation of the M = T*K slots (the combine), J = 1 and
    ``inv_MJ`` is each row's token; the slot gather is the same op the other way round (K = 1, J = K).
    Indices are int32 or int64. The fast path is the Triton op ``harts::moe_gather_sum``
    (``harts.kernels.moe_gather_sum``), which enters torch.compile graphs without a break."""
    if resolve("moe_gather_sum", backend, src_MD.device, src_MD.dtype) == "fast":
        # the first import registers the op harts::moe_gather_sum (under torch.compile too: Dynamo runs
        # imports); reference-only processes never import Triton or Inductor for it
        from harts.kernels.moe_gather_sum import moe_gather_sum

        return moe_gather_sum(src_MD, idx_TK, inv_MJ)
    return _GatherSum.apply(src_MD, idx_TK, inv_MJ)


def moe_experts_grouped_mm(x_TD, topk_idx_TK, topk_w_TK, w_gate_EFD, w_up_EFD, w_down_EDF):
    T, K = topk_idx_TK.shape
    E = w_gate_EFD.shape[0]
    flat_M = topk_idx_TK.reshape(-1)
    sorted_M, order_M = torch.sort(flat_M, stable=True)
    # group ends = number of slots with expert <= e; unlike bincount (output length data-dependent) this
    # has a static shape, so the path traces under torch.compile without a host read
    offs_E = torch.searchsorted(sorted_M, torch.arange(E, device=flat_M.device), right=True).to(torch.int32)
    inv_M = torch.empty_like(order_M).scatter_(0, order_M, torch.arange(T * K, device=order_M.device))
    # Rows move between token order and expert-sorted order by gathers only, both ways (deterministic, no
    # [T*K, D] copy of the expanded input): the sorted row of every (token, slot), and the token of every
    # sorted row. The slot gather's backward sums a token's K slot gradients; the combine's is a gather.
    slot_TK, token_M1 = inv_M.view(T, K), (order_M // K)[:, None]
    x_MD = gather_sum(x_TD, token_M1, slot_TK)
    # The routing weight scales the F-wide activation before the (linear) down projection instead of the
    # D-wide output after it: same product, a third of the elementwise traffic at F = D / 3 (Ling-3.0-tiny),
    # and the combine is then a plain sum over the K slots, accumulated in fp32 without an fp32 copy.
    y_sorted_MD = _grouped_swiglu(x_MD, offs_E, w_gate_EFD, w_up_EFD, w_down_EDF, topk_w_TK.reshape(-1)[order_M])
    return gather_sum(y_sorted_MD, slot_TK, token_M1)


# The reference loops over the experts present in the batch (a host read of the counts), which
# torch.compile cannot trace without specialising on every batch: inside a compiled region it enters the
# graph as one opaque op, forward = the reference itself, backward = autograd through a recomputation of
# it (exact, deterministic; the reference is the CPU / float64 path, where memory is not the constraint).
@torch.library.custom_op("harts::moe_experts_reference", mutates_args=())
def _reference_op(x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor, w_gate_EFD: torch.Tensor,
                  w_up_EFD: torch.Tensor, w_down_EDF: torch.Tensor) -> torch.Tensor:
    return moe_experts_reference(x_TD, topk_idx_TK, topk_w_TK, w_gate_EFD, w_up_EFD, w_down_EDF)


@_reference_op.register_fake
def _(x_TD, topk_idx_TK, topk_w_TK, w_gate_EFD, w_up_EFD, w_down_EDF):
    return x_TD.new_empty(x_TD.shape[0], w_down_EDF.shape[1])


@torch.library.custom_op("harts::moe_experts_reference_backward", mutates_args=())
def _reference_backward_op(grad_TD: torch.Tensor, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor,
                           topk_w_TK: torch.Tensor, w_gate_EFD: torch.Tensor, w_up_EFD: torch.Tensor,
                           w_down_EDF: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of ``moe_experts_reference`` w.r.t. (x_TD, topk_w_TK, w_gate_EFD, w_up_EFD, w_down_EDF),
    written out (an op's implementation runs below autograd): the forward recomputed expert by expert,
    the slot gradients summed per token in a fixed order (no scatter-add)."""
    T, K = topk_idx_TK.shape
    D = w_down_EDF.shape[1]
    flat_M = topk_idx_TK.reshape(-1)
    order_M = torch.argsort(flat_M, stable=True)
    counts = torch.bincount(flat_M, minlength=w_gate_EFD.shape[0]).tolist()
    dt = torch.promote_types(x_TD.dtype, topk_w_TK.dtype)
    g_TD = grad_TD.to(dt)
    dx_parts, y_parts = [], []
    gw_gate, gw_up, gw_down = (torch.zeros_like(w) for w in (w_gate_EFD, w_up_EFD, w_down_EDF))
    w_M = topk_w_TK.reshape(-1).to(dt)
    for e, rows in enumerate(order_M.split(counts)):
        if len(rows) == 0:
            continue
        h = x_TD[rows // K]
        g, u = h @ w_gate_EFD[e].T, h @ w_up_EFD[e].T
        sg = torch.sigmoid(g)
        a = g * sg * u
        y_parts.append(a @ w_down_EDF[e].T)
        dy = (g_TD[rows // K] * w_M[rows][:, None]).to(x_TD.dtype)  # the combine's weight on this slot
        da = dy @ w_down_EDF[e]
        gw_down[e] = dy.T @ a
        dg = da * u * (sg * (1 + g * (1 - sg)))  # d silu(g) / dg = s (1 + g (1 - s))
        du = da * g * sg
        dx_parts.append(dg @ w_gate_EFD[e] + du @ w_up_EFD[e])
        gw_gate[e], gw_up[e] = dg.T @ h, du.T @ h
    if not dx_parts:
        return [torch.zeros_like(x_TD), torch.zeros_like(topk_w_TK), gw_gate, gw_up, gw_down]
    inv_M = torch.argsort(order_M)  # back to (token, slot) order
    dx_TD = torch.cat(dx_parts)[inv_M].view(T, K, -1).sum(1)
    y_TKD = torch.cat(y_parts)[inv_M].view(T, K, D)
    gw_TK = (y_TKD.to(dt) * g_TD[:, None, :]).sum(-1).to(topk_w_TK.dtype)
    return [dx_TD, gw_TK, gw_gate, gw_up, gw_down]


@_reference_backward_op.register_fake
def _(grad_TD, x_TD, topk_idx_TK, topk_w_TK, w_gate_EFD, w_up_EFD, w_down_EDF):
    return [torch.empty_like(t) for t in (x_TD, topk_w_TK, w_gate_EFD, w_up_EFD, w_down_EDF)]


def _reference_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _reference_backward(ctx, grad_TD):
    x_TD, idx_TK, w_TK, wg, wu, wd = ctx.saved_tensors
    gx, gw, gg, gu, gd = torch.ops.harts.moe_experts_reference_backward(grad_TD, x_TD, idx_TK, w_TK, wg, wu, wd)
    return gx, None, gw, gg, gu, gd


_reference_op.register_autograd(_reference_backward, setup_context=_reference_setup)


def moe_experts(x_TD, topk_idx_TK, topk_w_TK, w_gate_EFD, w_up_EFD, w_down_EDF, backend: str = "auto"):
    """Routed experts by the resolved backend. Under torch.compile the fast path is traced (Inductor
    lowers the grouped GEMMs and fuses the SwiGLU, weighting and combine) and the reference enters as the
    opaque op ``harts::moe_experts_reference``."""
    which = resolve("moe_experts", backend, x_TD.device, x_TD.dtype)
    if which == "fast":
        fn = moe_experts_grouped_mm
    else:
        fn = torch.ops.harts.moe_experts_reference if torch.compiler.is_compiling() else moe_experts_reference
    return fn(x_TD, topk_idx_TK, topk_w_TK, w_gate_EFD, w_up_EFD, w_down_EDF)
