"""Fused compact log-probs: blocked LM head with an online log-sum-exp (Triton epilogues, cuBLAS GEMMs).

Forward: for each block of R compact rows and NV vocabulary columns, one fp32 GEMM produces the
logits block and ``logprobs_fwd_kernel_lse`` folds it into a running (max, sum-exp) per row; the
target logits are gathered dot products over the semantic positions. Only the per-row LSE [C] is
saved. Backward recomputes each logits block, turns it into ``P = gsum * softmax`` with
``logprobs_bwd_kernel_p`` (gsum_C sums the upstream gradient of every semantic position of a row:
Eq. 19), and accumulates ``dh -= P W`` and ``dW -= P^T h`` (``_sub_mm_``: in the GEMM's epilogue where
cuBLAS takes an fp32 accumulator beside 16-bit inputs, so no fp32 product is written and read back); the
target terms are index_adds.
The loop runs vocabulary-outer so a [NV, D] fp32 dW block is finished before moving on.
Peak extra memory ~ R*NV logits (fp32) + R*NV P + NV*D + C*D fp32 accumulators.

Legend: C compact rows, D hidden, V vocab, S semantic positions, R / NV block sizes.
"""
from __future__ import annotations

import functools

import torch

from harts.kernels.logprobs import logprobs_bwd_p, logprobs_fwd_lse
from harts.ops.backend import log_once
from harts.ops.logprobs.naive import check_logprobs_inputs

BLOCK_ROWS = 4096
BLOCK_VOCAB = 16384
BLOCK_POSITIONS = 65536


def _mm_f32(a, b):
    """a @ b with fp32 output and fp32 accumulation (bf16 inputs stay bf16 on the GPU)."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


@functools.cache
def _epilogue_accumulates(device: torch.device) -> bool:
    """Whether this torch's CUDA ``addmm`` with ``out_dtype=float32`` takes an fp32 ``self`` (the accumulator)
    beside bf16 operands and writes into it: checked once per device on a small product against the product
    and a separate subtraction, and logged. Why a check: older releases require ``self`` in the operands'
    dtype there, and the two ways compute the same fp32 sum, so either may run."""
    g = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(*s, device=device, generator=g).to(torch.bfloat16) for s in ((64, 48), (48, 32)))
    c = torch.randn(64, 32, device=device, generator=g)
    want = c - torch.mm(a, b, out_dtype=torch.float32)
    try:
        got = c.clone()
        torch.addmm(got, a, b, out_dtype=torch.float32, alpha=-1, out=got)
        ok, why = bool(torch.allclose(got, want, rtol=1e-6, atol=1e-5)), "differs from the product minus c"
    except (RuntimeError, TypeError) as e:
        ok, why = False, str(e).splitlines()[0][:160]
    log_once(("logprobs_epilogue", str(device), ok), "harts logprobs backward accumulates %s on %s%s",
             "in the GEMM epilogue (addmm, fp32 accumulator)" if ok else "by a separate fp32 subtraction",
             device, "" if ok else f" (addmm with an fp32 accumulator: {why})")
    return ok


def _sub_mm_(c_f32: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """c -= a @ b in place, fp32 accumulation: one GEMM that reads c in its epilogue where it can (fp32
    operands; 16-bit operands on CUDA when ``_epilogue_accumulates``), else the fp32 product and a subtraction
    kernel (the [R, N] fp32 product written and read back: at C = 32K rows, V = 157K, D = 1536 about 20 GB more
    traffic per backward, and one more kernel per block pair)."""
    if a.dtype == torch.float32:
        return c_f32.addmm_(a, b, alpha=-1)
    if a.is_cuda and _epilogue_accumulates(a.device):
        return torch.addmm(c_f32, a, b, out_dtype=torch.float32, alpha=-1, out=c_f32)
    return c_f32.sub_(_mm_f32(a, b))


def _target_logits(h_CD, w_VD, rows_S, tgts_S):
    out = torch.empty(rows_S.numel(), dtype=torch.float32, device=h_CD.device)
    for s in range(0, rows_S.numel(), BLOCK_POSITIONS):
        r, t = rows_S[s:s + BLOCK_POSITIONS], tgts_S[s:s + BLOCK_POSITIONS]
        out[s:s + BLOCK_POSITIONS] = (h_CD[r].float() * w_VD[t].float()).sum(-1)
    return out


class CompactLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_CD, weight_VD, rows_S, targets_S, block_rows, block_vocab):
        h_CD, w_VD = hidden_CD.contiguous(), weight_VD.contiguous()
        rows_S, targets_S = rows_S.long(), targets_S.long()
        C, V = h_CD.shape[0], w_VD.shape[0]
        lse_C = torch.empty(C, dtype=torch.float32, device=h_CD.device)
        for r0 in range(0, C, block_rows):
            h_RD = h_CD[r0:r0 + block_rows]
            m_R = torch.full((h_RD.shape[0],), float('-inf'), dtype=torch.float32, device=h_CD.device)
            s_R = torch.zeros_like(m_R)
            for v0 in range(0, V, block_vocab):
                logits_RN = _mm_f32(h_RD, w_VD[v0:v0 + block_vocab].T)
                logprobs_fwd_lse(logits_RN, m_R, s_R)
                del logits_RN
            lse_C[r0:r0 + block_rows] = m_R + torch.log(s_R)
        logp_S = _target_logits(h_CD, w_VD, rows_S, targets_S) - lse_C[rows_S]
        ctx.save_for_backward(h_CD, w_VD, rows_S, targets_S, lse_C)
        ctx.blocks = (block_rows, block_vocab)
        return logp_S

    @staticmethod
    def backward(ctx, dlogp_S):
        h_CD, w_VD, rows_S, targets_S, lse_C = ctx.saved_tensors
        block_rows, block_vocab = ctx.blocks
        C, V = h_CD.shape[0], w_VD.shape[0]
        g_S = dlogp_S.float()
        gsum_C = torch.zeros(C, dtype=torch.float32, device=h_CD.device).index_add_(0, rows_S, g_S)
        dh_CD = torch.zeros(C, h_CD.shape[1], dtype=torch.float32, device=h_CD.device)
        dw_VD = torch.empty_like(w_VD)
        for s in range(0, rows_S.numel(), BLOCK_POSITIONS):  # target term of dh: + g_s W_t
            r, t, gs = (x[s:s + BLOCK_POSITIONS] for x in (rows_S, targets_S, g_S))
            dh_CD.index_add_(0, r, gs[:, None] * w_VD[t].float())
        # Positions sorted by target, so each vocabulary block adds its own target terms of dW.
        order_S = torch.argsort(targets_S)
        v_starts = torch.arange(0, V + block_vocab, block_vocab, device=h_CD.device).clamp_(max=V)
        bounds = torch.searchsorted(targets_S[order_S], v_starts).tolist()
        for i_b, v0 in enumerate(range(0, V, block_vocab)):
            w_ND = w_VD[v0:v0 + block_vocab]
            dw_ND = torch.zeros(w_ND.shape, dtype=torch.float32, device=h_CD.device)
            for r0 in range(0, C, block_rows):
                h_RD = h_CD[r0:r0 + block_rows]
                logits_RN = _mm_f32(h_RD, w_ND.T)
                p_RN = torch.empty(logits_RN.shape, dtype=h_CD.dtype, device=h_CD.device)
                logprobs_bwd_p(logits_RN, lse_C[r0:r0 + block_rows], gsum_C[r0:r0 + block_rows], p_RN)
                del logits_RN
                _sub_mm_(dh_CD[r0:r0 + block_rows], p_RN, w_ND)
                _sub_mm_(dw_ND, p_RN.T, h_RD)
                del p_RN
            for a in range(bounds[i_b], bounds[i_b + 1], BLOCK_POSITIONS):
                sel = order_S[a:min(a + BLOCK_POSITIONS, bounds[i_b + 1])]
                dw_ND.index_add_(0, targets_S[sel] - v0, g_S[sel, None] * h_CD[rows_S[sel]].float())
            dw_VD[v0:v0 + block_vocab] = dw_ND
            del dw_ND
        return dh_CD.to(h_CD.dtype), dw_VD, None, None, None, None


def compact_logprobs(hidden_CD, weight_VD, rows_S, targets_S, *, block_rows: int = BLOCK_ROWS,
                     block_vocab: int = BLOCK_VOCAB):
    """Log-probs [S] (fp32) of targets_S under softmax(hidden_CD[rows_S] @ weight_VD^T), never forming C x V.

    Fast path (Triton epilogues + fp32-output GEMMs); fp32 or bf16 inputs on CUDA, fp32 under
    TRITON_INTERPRET=1. Use ``compact_logprobs_reference`` for float64 / plain CPU.
    """
    check_logprobs_inputs(hidden_CD, weight_VD, rows_S, targets_S)
    if hidden_CD.dtype not in (torch.float32, torch.bfloat16, torch.float16) or weight_VD.dtype != hidden_CD.dtype:
        raise ValueError(f"compact_logprobs (Triton) needs fp32/bf16/fp16 hidden and weight of one dtype, got "
                         f"{hidden_CD.dtype} and {weight_VD.dtype}; use compact_logprobs_reference for float64")
    return CompactLogprobsFunction.apply(hidden_CD, weight_VD, rows_S, targets_S, block_rows, block_vocab)
