"""The routed experts' SwiGLU between the gate-up and the down grouped GEMMs, scaled by each row's routing
weight: ``h[m] = silu(g[m]) * u[m] * s[m]`` with ``[g | u] = gu[m]`` (gate columns first), and its backward.

Why a kernel: compiled, the backward of this step ran as three memory-bound passes over [M, F] tensors
(Inductor): the pre-activations read again to recompute ``h`` for the down projection's weight gradient, a
pointwise pass for the gate and up gradients (written through a concatenation), and a reduction pass for the
routing-weight gradient ``ds[m] = sum_f silu(g) u dh`` over the same inputs, 11 F-wide row reads and writes
in all. Here one program walks its rows' F columns once: it reads ``gu`` and ``dh`` (3 F) and writes ``dgu``
and ``h`` (3 F), accumulating ``ds`` in registers. Everything is computed in fp32 from the bf16 inputs, each
output rounded once (as Inductor's fused forward does: no rounding between silu(g) * u and the scale).

``moe_swiglu_down`` is the differentiable op ``harts::moe_swiglu_down`` (the SwiGLU and the down grouped
GEMM; registered on first access, ``harts.kernels.lazy_op``): its backward runs the down GEMM's two gradients
around the fused kernel, so no [M, F] activation is saved or recomputed. Interpreter-safe (CPU CI runs it in
float32, eager only).
Legend: M expert-sorted rows, F expert width (2F: gate and up), D hidden, E experts; BM rows and BF columns
per program.
"""
import triton
import triton.language as tl

from harts.kernels import launchable, lazy_op

BM = 16  # rows per program; F = 512 (both model families) is 2 x 256-column steps
BF = 256
NUM_WARPS = 4


@triton.jit
def moe_swiglu_fwd_kernel(gu, s, h, M, F, stride_gu, stride_h, BM: tl.constexpr, BF: tl.constexpr):
    """Program (i_m, i_f): rows [i_m * BM, +BM) x columns [i_f * BF, +BF) of h."""
    i_m, i_f = tl.program_id(0), tl.program_id(1)
    o_m = i_m.to(tl.int64) * BM + tl.arange(0, BM)
    o_f = i_f * BF + tl.arange(0, BF)
    m_m = o_m < M
    m_mf = m_m[:, None] & (o_f < F)[None, :]
    p_g = gu + o_m[:, None] * stride_gu + o_f[None, :]
    b_g = tl.load(p_g, mask=m_mf, other=0.0).to(tl.float32)
    b_u = tl.load(p_g + F, mask=m_mf, other=0.0).to(tl.float32)
    b_s = tl.load(s + o_m, mask=m_m, other=0.0).to(tl.float32)
    b_h = b_g * tl.sigmoid(b_g) * b_u * b_s[:, None]
    tl.store(h + o_m[:, None] * stride_h + o_f[None, :], b_h.to(h.dtype.element_ty), mask=m_mf)


@triton.jit
def moe_swiglu_bwd_kernel(gu, s, dh, dgu, h, ds, M, F, stride_gu, stride_dh, stride_dgu, stride_h,
                          BM: tl.constexpr, BF: tl.constexpr):
    """Program i_m: rows [i_m * BM, +BM), all F columns in steps of BF; ds of its rows at the end."""
    i_m = tl.program_id(0)
    o_m = i_m.to(tl.int64) * BM + tl.arange(0, BM)
    m_m = o_m < M
    b_s = tl.load(s + o_m, mask=m_m, other=0.0).to(tl.float32)
    b_ds = tl.zeros([BM], dtype=tl.float32)
    for f0 in range(0, F, BF):
        o_f = f0 + tl.arange(0, BF)
        m_mf = m_m[:, None] & (o_f < F)[None, :]
        p_g = gu + o_m[:, None] * stride_gu + o_f[None, :]
        b_g = tl.load(p_g, mask=m_mf, other=0.0).to(tl.float32)
        b_u = tl.load(p_g + F, mask=m_mf, other=0.0).to(tl.float32)
        b_dh = tl.load(dh + o_m[:, None] * stride_dh + o_f[None, :], mask=m_mf, other=0.0).to(tl.float32)
        b_sig = tl.sigmoid(b_g)
        b_silu = b_g * b_sig
        b_a = b_silu * b_u  # the unscaled activation
        b_ds += tl.sum(b_a * b_dh, axis=1)
        b_da = b_dh * b_s[:, None]
        p_dg = dgu + o_m[:, None] * stride_dgu + o_f[None, :]
        # d silu(g) / dg = sigmoid(g) (1 + g (1 - sigmoid(g)))
        tl.store(p_dg, (b_da * b_u * b_sig * (1.0 + b_g * (1.0 - b_sig))).to(dgu.dtype.element_ty), mask=m_mf)
        tl.store(p_dg + F, (b_da * b_silu).to(dgu.dtype.element_ty), mask=m_mf)
        tl.store(h + o_m[:, None] * stride_h + o_f[None, :], (b_a * b_s[:, None]).to(h.dtype.element_ty), mask=m_mf)
    tl.store(ds + o_m, b_ds.to(ds.dtype.element_ty), mask=m_m)


def _register_ops():
    """``harts::moe_swiglu_down`` (differentiable) and its backward's kernel ``harts::moe_swiglu_bwd``, as
    triton_ops: under torch.compile AOTAutograd decomposes them into their bodies (the Triton launches enter
    Inductor's graph as user-defined kernels beside the grouped GEMMs), with no graph break."""
    import torch

    def activation(gu_M2F, scale_M):
        M, F = gu_M2F.shape[0], gu_M2F.shape[1] // 2
        h_MF = gu_M2F.new_empty(M, F)
        if M > 0 and F > 0:
            launchable(moe_swiglu_fwd_kernel)[(triton.cdiv(M, BM), triton.cdiv(F, BF))](
                gu_M2F, scale_M, h_MF, M, F, gu_M2F.stride(0), h_MF.stride(0), BM=BM, BF=BF, num_warps=NUM_WARPS)
        return h_MF

    @torch.library.triton_op("harts::moe_swiglu_bwd", mutates_args=())
    def moe_swiglu_bwd(gu_M2F: torch.Tensor, scale_M: torch.Tensor,
                       dh_MF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(d gu, d scale, h): the activation's gradients given dh = d(loss) / d h, and h itself (for the down
        projection's weight gradient)."""
        gu_M2F, scale_M, dh_MF = gu_M2F.contiguous(), scale_M.contiguous(), dh_MF.contiguous()
        M, F = dh_MF.shape
        dgu_M2F, h_MF = torch.empty_like(gu_M2F), torch.empty_like(dh_MF)
        ds_M = torch.empty_like(scale_M)
        if M > 0 and F > 0:
            launchable(moe_swiglu_bwd_kernel)[(triton.cdiv(M, BM),)](
                gu_M2F, scale_M, dh_MF, dgu_M2F, h_MF, ds_M, M, F, gu_M2F.stride(0), dh_MF.stride(0),
                dgu_M2F.stride(0), h_MF.stride(0), BM=BM, BF=BF, num_warps=NUM_WARPS)
        elif M > 0:
            ds_M.zero_()
        return dgu_M2F, ds_M, h_MF

    @torch.library.triton_op("harts::moe_swiglu_down", mutates_args=())
    def moe_swiglu_down(gu_M2F: torch.Tensor, scale_M: torch.Tensor, w_down_EDF: torch.Tensor,
                        offs_E: torch.Tensor) -> torch.Tensor:
        """y_MD = (silu(g) * u * scale) @ w_down[e].T for the rows of each expert e (``offs_E``: the groups' ends,
        int32, as torch._grouped_mm takes them)."""
        h_MF = activation(gu_M2F.contiguous(), scale_M.contiguous())
        return torch._grouped_mm(h_MF, w_down_EDF.transpose(-2, -1), offs=offs_E)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, dy_MD):
        gu_M2F, scale_M, w_down_EDF, offs_E = ctx.saved_tensors
        dy_MD = dy_MD.contiguous()
        dh_MF = torch._grouped_mm(dy_MD, w_down_EDF, offs=offs_E)
        dgu_M2F, ds_M, h_MF = torch.ops.harts.moe_swiglu_bwd(gu_M2F, scale_M, dh_MF)
        # frozen experts (the down weight needs no gradient): no weight-gradient GEMM
        dw_EDF = torch._grouped_mm(dy_MD.transpose(0, 1), h_MF, offs=offs_E) if ctx.needs_input_grad[2] else None
        return dgu_M2F, ds_M if ctx.needs_input_grad[1] else None, dw_EDF, None

    moe_swiglu_down.register_autograd(backward, setup_context=setup_context)
    return moe_swiglu_down


__getattr__ = lazy_op(__name__, "moe_swiglu_down", _register_ops)
