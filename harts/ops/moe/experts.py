"""Routed experts: SwiGLU per expert, weights stacked [E, F, D] (gate, up; or both as [E, 2F, D]) and [E, D, F]
(down).

Legend: T tokens, D hidden, F expert width (2F: gate and up rows stacked), E experts, K experts per token,
M = T*K routed rows, J output rows that read one source row (the transpose of K in ``gather_sum``).
``routed_experts`` sorts the M rows by expert and hands them, with the rows per expert and their routing
weights, to an experts callable (``grouped_experts``, or a model's experts module, which expert
parallelism wraps from outside). The reference experts loop over the experts (exact in float64) and weight
each row's D-wide output; the fast path runs three torch._grouped_mm calls with unpadded group offsets
(bf16 needs D and F to be multiples of 8) and weights the F-wide activation before the down projection;
with gate and up stacked in one [E, 2F, D] weight (``grouped_experts_stacked``) it runs them as one, and under
the kernel choice ``swiglu="harts"`` (the default) the weighted SwiGLU with the down projection as one op
whose backward is one fused pass over the rows.
Rows move between token and expert-sorted order with one gather-sum op both ways (``gather_sum``: one
Triton kernel on the GPU, at copy speed; Inductor's gather-then-sum for the combine ran at a fifth of it),
whose gradient is the same op with the indices swapped. Both paths sum a token's K slots in a fixed
order, so results are deterministic.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from harts import env
from harts.ops.backend import log_once, resolve
from harts.ops.choices import kernel_choices


def _combine(y_MD, topk_w_TK, T, K):
    """Weight and sum the K slots of every token in the router dtype (fp32+), then cast back."""
    dt = torch.promote_types(y_MD.dtype, topk_w_TK.dtype)
    return (y_MD.view(T, K, -1).to(dt) * topk_w_TK.to(dt)[..., None]).sum(1).to(y_MD.dtype)


def grouped_experts(x_MD, counts_E: torch.Tensor, w_gate_EFD, w_up_EFD, w_down_EDF, backend: str = "auto",
                    weight_M: torch.Tensor | None = None):
    """The experts' SwiGLU on expert-major rows, the one expert compute of the model, with or without expert
    parallelism (which runs it on the rows it receives): expert e takes the ``counts_E[e]`` rows (a device
    tensor) after those of the experts before it; ``weight_M`` (the routing weight of each row, fp32+)
    scales its output. The fast path runs torch._grouped_mm with the group offsets (the counts' cumsum, on
    the device: no host read) and scales the F-wide activation before the (linear) down projection; the
    reference loops over the host counts (exact in float64) and scales the D-wide output; under
    torch.compile the reference enters as the opaque op ``harts::grouped_experts_reference``."""
    if x_MD.shape[0] == 0:  # no rows: zero gradients, so every expert weight still gets one
        out = x_MD.new_zeros(0, w_down_EDF.shape[1]) + 0 * (w_gate_EFD.sum() + w_up_EFD.sum() + w_down_EDF.sum())
        return out if weight_M is None else out + 0 * weight_M.sum().to(out.dtype)
    if resolve("moe_experts", backend, x_MD.device, x_MD.dtype) == "fast":
        offs_E = counts_E.cumsum(0).to(torch.int32)
        return _grouped_swiglu(x_MD, offs_E, w_gate_EFD, w_up_EFD, w_down_EDF, weight_M)
    if weight_M is None:
        weight_M = x_MD.new_ones(x_MD.shape[0], dtype=torch.promote_types(x_MD.dtype, torch.float32))
    if torch.compiler.is_compiling():
        return torch.ops.harts.grouped_experts_reference(x_MD, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, weight_M)
    return _grouped_reference(x_MD, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, weight_M)


def _grouped_reference(x_MD, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, weight_M):
    """The reference of ``grouped_experts``: a host loop over the experts with rows, each row's output scaled
    by its weight in fp32+ and cast back."""
    parts = [(F.silu(h @ w_gate_EFD[e].T) * (h @ w_up_EFD[e].T)) @ w_down_EDF[e].T
             for e, h in enumerate(x_MD.split(counts_E.tolist())) if len(h)]
    y_MD = torch.cat(parts)
    dt = torch.promote_types(y_MD.dtype, weight_M.dtype)
    return (y_MD.to(dt) * weight_M.to(dt)[:, None]).to(y_MD.dtype)


def _grouped_swiglu(x_MD, offs_E, w_gate_EFD, w_up_EFD, w_down_EDF, scale_M=None):
    """``grouped_experts``' fast path; ``scale_M`` (fp32+) scales each row's F-wide activation before the
    (linear) down projection."""
    g_MF = torch._grouped_mm(x_MD, w_gate_EFD.transpose(-2, -1), offs=offs_E)
    u_MF = torch._grouped_mm(x_MD, w_up_EFD.transpose(-2, -1), offs=offs_E)
    return _swiglu_down(g_MF, u_MF, offs_E, w_down_EDF, scale_M)


def _grouped_swiglu_stacked(x_MD, offs_E, w_gate_up_E2FD, w_down_EDF, scale_M=None):
    """``grouped_experts_stacked``' fast path: one grouped GEMM over the stacked gate and up rows (N = 2F). Under
    the kernel choice ``swiglu="harts"`` (``harts.ops.choices``), with routing weights, on a GPU or the Triton
    interpreter, the SwiGLU and the down projection are the op ``harts::moe_swiglu_down``
    (``harts.kernels.moe_swiglu``: the SwiGLU's backward as one fused pass, which also rebuilds the down
    projection's input); otherwise the output is split into the gate and up halves (``split``, whose backward
    is one concatenation; two slices would each fill a zero [M, 2F] gradient and add them, eagerly)."""
    Fw = w_down_EDF.shape[-1]
    gu_M2F = torch._grouped_mm(x_MD, w_gate_up_E2FD.transpose(-2, -1), offs=offs_E)
    choice = kernel_choices().swiglu
    if scale_M is not None and choice == "harts" and (gu_M2F.is_cuda or env.ENV.triton_interpret):
        from harts.kernels.moe_swiglu import moe_swiglu_down

        log_once(("swiglu", "harts"), "harts experts' SwiGLU -> harts::moe_swiglu_down (kernel choice swiglu='harts')")
        return moe_swiglu_down(gu_M2F, scale_M, w_down_EDF, offs_E)
    why = ("kernel choice swiglu='torch'" if choice == "torch" else "no routing weights" if scale_M is None
           else f"{gu_M2F.device.type} without the Triton interpreter")
    log_once(("swiglu", why), "harts experts' SwiGLU -> torch ops (%s)", why)
    g_MF, u_MF = gu_M2F.split(Fw, dim=1)
    return _swiglu_down(g_MF, u_MF, offs_E, w_down_EDF, scale_M)


def _swiglu_down(g_MF, u_MF, offs_E, w_down_EDF, scale_M):
    h_MF = F.silu(g_MF) * u_MF
    if scale_M is not None:
        dt = torch.promote_types(h_MF.dtype, scale_M.dtype)
        h_MF = (h_MF.to(dt) * scale_M.to(dt)[:, None]).to(g_MF.dtype)
    return torch._grouped_mm(h_MF, w_down_EDF.transpose(-2, -1), offs=offs_E)


def grouped_experts_stacked(x_MD, counts_E: torch.Tensor, w_gate_up_E2FD, w_down_EDF, backend: str = "auto",
                            weight_M: torch.Tensor | None = None):
    """``grouped_experts`` with gate and up stacked in one weight [E, 2F, D], gate rows first (Qwen3.5's checkpoint
    layout; Ling-3.0's [E, 2, F, D] flattened), F the down projection's width. The fast path runs gate and up as one
    grouped GEMM with N = 2F: compiled, as the model runs it, the SwiGLU fwd+bwd at Ling-3.0-tiny's expert shapes
    took 0.88x the time of two GEMMs with N = F on an H100 (benchmarks.kernels --only experts). The reference (and
    a call without rows) is ``grouped_experts`` on the two halves, whose gradients land in the stacked weight."""
    Fw = w_down_EDF.shape[-1]
    if w_gate_up_E2FD.dim() != 3 or w_gate_up_E2FD.shape[1] != 2 * Fw:
        raise ValueError(f"grouped_experts_stacked: w_gate_up must be [E, 2F, D] with F = {Fw} (the down "
                         f"projection's width), got {tuple(w_gate_up_E2FD.shape)}")
    if x_MD.shape[0] and resolve("moe_experts", backend, x_MD.device, x_MD.dtype) == "fast":
        offs_E = counts_E.cumsum(0).to(torch.int32)
        return _grouped_swiglu_stacked(x_MD, offs_E, w_gate_up_E2FD, w_down_EDF, weight_M)
    return grouped_experts(x_MD, counts_E, w_gate_up_E2FD[:, :Fw], w_gate_up_E2FD[:, Fw:], w_down_EDF, backend,
                           weight_M)


def moe_experts_reference(x_TD, topk_idx_TK, topk_w_TK, w_gate_EFD, w_up_EFD, w_down_EDF):
    """Why one permutation: writing each expert's rows into a full [T*K, D] buffer (index_put) copied the
    whole buffer once per expert, 128 copies per layer, which made the fp32 gradient truth on the GPU
    (benchmarks.gradgap --truth) slow for 41K-token trajectories."""
    T, K = topk_idx_TK.shape
    flat_M = topk_idx_TK.reshape(-1)
    order_M = torch.argsort(flat_M, stable=True)  # slots grouped by expert, in slot order within an expert
    counts = torch.bincount(flat_M, minlength=w_gate_EFD.shape[0])
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


def routed_experts(x_TD, topk_idx_TK, topk_w_TK, experts, num_experts: int, backend: str = "auto"):
    """y_TD[t] = sum_k w[t, k] * expert_{idx[t, k]}(x_TD[t]), with the experts a callable ``experts(x_MD,
    counts_E, weight_M) -> y_MD`` on expert-major rows (``grouped_experts`` on the model's weights, or an
    experts module, which expert parallelism wraps): its rows are sorted by expert (stable: slot order within
    an expert), ``counts_E`` the rows per expert on the device, ``weight_M`` each row's routing weight.

    Rows move between token order and expert-sorted order by gathers only, both ways (``gather_sum``:
    deterministic, no [T*K, D] copy of the expanded input): the sorted row of every (token, slot), and the
    token of every sorted row. The slot gather's backward sums a token's K slot gradients; the combine's is
    a gather. The group ends come from a search of the sorted expert ids (static shapes: the path traces
    under torch.compile without a host read)."""
    T, K = topk_idx_TK.shape
    flat_M = topk_idx_TK.reshape(-1)
    sorted_M, order_M = torch.sort(flat_M, stable=True)
    ends_E = torch.searchsorted(sorted_M, torch.arange(num_experts, device=flat_M.device), right=True)
    counts_E = torch.diff(ends_E, prepend=ends_E.new_zeros(1))
    inv_M = torch.empty_like(order_M).scatter_(0, order_M, torch.arange(T * K, device=order_M.device))
    slot_TK, token_M1 = inv_M.view(T, K), (order_M // K)[:, None]
    x_MD = gather_sum(x_TD, token_M1, slot_TK, backend)
    y_sorted_MD = experts(x_MD, counts_E, topk_w_TK.reshape(-1)[order_M])
    return gather_sum(y_sorted_MD, slot_TK, token_M1, backend)


def moe_experts_grouped_mm(x_TD, topk_idx_TK, topk_w_TK, w_gate_EFD, w_up_EFD, w_down_EDF):
    """The fast path of ``moe_experts``: ``routed_experts`` on the grouped-GEMM experts. The routing weight
    scales the F-wide activation before the (linear) down projection instead of the D-wide output after it:
    same product, a third of the elementwise traffic at F = D / 3 (Ling-3.0-tiny), and the combine is then a
    plain sum over the K slots, accumulated in fp32 without an fp32 copy."""
    def experts(x_MD, counts_E, weight_M):  # torch._grouped_mm on any device (CPU in float32 for tests)
        if x_MD.shape[0] == 0:
            return grouped_experts(x_MD, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, "reference", weight_M)
        return _grouped_swiglu(x_MD, counts_E.cumsum(0).to(torch.int32), w_gate_EFD, w_up_EFD, w_down_EDF, weight_M)

    return routed_experts(x_TD, topk_idx_TK, topk_w_TK, experts, w_gate_EFD.shape[0])


# The reference loops over the experts present in the batch (a host read of the counts), which
# torch.compile cannot trace without specialising on every batch: inside a compiled region it enters the
# graph as one opaque op, forward = the reference itself, backward = the reference's gradients written out
# (exact, deterministic; the reference is the CPU / float64 path, where memory is not the constraint).
@torch.library.custom_op("harts::grouped_experts_reference", mutates_args=())
def _grouped_reference_op(x_MD: torch.Tensor, counts_E: torch.Tensor, w_gate_EFD: torch.Tensor,
                          w_up_EFD: torch.Tensor, w_down_EDF: torch.Tensor, weight_M: torch.Tensor) -> torch.Tensor:
    return _grouped_reference(x_MD, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, weight_M)


@_grouped_reference_op.register_fake
def _(x_MD, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, weight_M):
    return x_MD.new_empty(x_MD.shape[0], w_down_EDF.shape[1])


@torch.library.custom_op("harts::grouped_experts_reference_backward", mutates_args=())
def _grouped_reference_backward_op(grad_MD: torch.Tensor, x_MD: torch.Tensor, counts_E: torch.Tensor,
                                   w_gate_EFD: torch.Tensor, w_up_EFD: torch.Tensor, w_down_EDF: torch.Tensor,
                                   weight_M: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of ``_grouped_reference`` w.r.t. (x_MD, w_gate_EFD, w_up_EFD, w_down_EDF, weight_M), written
    out (an op's implementation runs below autograd): the forward recomputed expert by expert."""
    dt = torch.promote_types(x_MD.dtype, weight_M.dtype)
    g_MD, w_M = grad_MD.to(dt), weight_M.to(dt)
    gw_gate, gw_up, gw_down = (torch.zeros_like(w) for w in (w_gate_EFD, w_up_EFD, w_down_EDF))
    dx_parts, gw_parts, start = [], [], 0
    for e, n in enumerate(counts_E.tolist()):
        if n == 0:
            continue
        rows = slice(start, start + n)
        start += n
        h = x_MD[rows]
        g, u = h @ w_gate_EFD[e].T, h @ w_up_EFD[e].T
        sg = torch.sigmoid(g)
        a = g * sg * u
        y = a @ w_down_EDF[e].T
        gw_parts.append((y.to(dt) * g_MD[rows]).sum(-1))
        dy = (g_MD[rows] * w_M[rows][:, None]).to(x_MD.dtype)
        da = dy @ w_down_EDF[e]
        gw_down[e] = dy.T @ a
        dg = da * u * (sg * (1 + g * (1 - sg)))  # d silu(g) / dg = s (1 + g (1 - s))
        du = da * g * sg
        dx_parts.append(dg @ w_gate_EFD[e] + du @ w_up_EFD[e])
        gw_gate[e], gw_up[e] = dg.T @ h, du.T @ h
    if not dx_parts:
        return [torch.zeros_like(x_MD), gw_gate, gw_up, gw_down, torch.zeros_like(weight_M)]
    return [torch.cat(dx_parts), gw_gate, gw_up, gw_down, torch.cat(gw_parts).to(weight_M.dtype)]


@_grouped_reference_backward_op.register_fake
def _(grad_MD, x_MD, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, weight_M):
    return [torch.empty_like(t) for t in (x_MD, w_gate_EFD, w_up_EFD, w_down_EDF, weight_M)]


def _grouped_reference_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grouped_reference_backward(ctx, grad_MD):
    x_MD, counts_E, wg, wu, wd, weight_M = ctx.saved_tensors
    gx, gg, gu, gd, gw = torch.ops.harts.grouped_experts_reference_backward(grad_MD, x_MD, counts_E, wg, wu, wd,
                                                                            weight_M)
    return gx, None, gg, gu, gd, gw


_grouped_reference_op.register_autograd(_grouped_reference_backward, setup_context=_grouped_reference_setup)


def moe_experts(x_TD, topk_idx_TK, topk_w_TK, w_gate_EFD, w_up_EFD, w_down_EDF, backend: str = "auto"):
    """Routed experts by the resolved backend: ``routed_experts`` on ``grouped_experts``. Under torch.compile
    the fast path is traced (Inductor lowers the grouped GEMMs and fuses the SwiGLU and weighting) and the
    reference's expert loop enters as the opaque op ``harts::grouped_experts_reference``."""
    def experts(x_MD, counts_E, weight_M):
        return grouped_experts(x_MD, counts_E, w_gate_EFD, w_up_EFD, w_down_EDF, backend, weight_M)

    return routed_experts(x_TD, topk_idx_TK, topk_w_TK, experts, w_gate_EFD.shape[0], backend)
