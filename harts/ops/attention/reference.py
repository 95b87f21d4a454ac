"""SDPA reference for packed bottom-right-causal attention; exact in float64 on CPU.

Legend: T* packed tokens, H heads, D q/k head dim, Dv value head dim, N sequences.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_SCORE_ELEMS = 1 << 28  # per query block: 1 GiB of fp32 scores


def bottom_right_causal_mask(lq: int, lk: int, device=None, rows: slice | None = None) -> torch.Tensor:
    """[lq, lk] bool (or the ``rows`` of it), True = attend: query i sees keys j <= i + (lk - lq)."""
    i = torch.arange(lq, device=device)[rows if rows is not None else slice(None), None]
    j = torch.arange(lk, device=device)[None, :]
    return j <= i + (lk - lq)


def check_varlen_args(q_TqHD, k_TkHD, v_TkHDv, cu_q_N1, cu_k_N1):
    if q_TqHD.dim() != 3 or k_TkHD.dim() != 3 or v_TkHDv.dim() != 3:
        raise ValueError(f"expected q/k/v of rank 3 [T, H, D], got {tuple(q_TqHD.shape)}, "
                         f"{tuple(k_TkHD.shape)}, {tuple(v_TkHDv.shape)}")
    if cu_q_N1.shape != cu_k_N1.shape:
        raise ValueError(f"cu_seqlens_q {tuple(cu_q_N1.shape)} and cu_seqlens_k {tuple(cu_k_N1.shape)} differ")
    if q_TqHD.shape[1] != k_TkHD.shape[1] or k_TkHD.shape[1] != v_TkHDv.shape[1]:
        raise ValueError("q, k, v must have the same number of heads")
    if q_TqHD.shape[2] != k_TkHD.shape[2]:
        raise ValueError(f"q head dim {q_TqHD.shape[2]} != k head dim {k_TkHD.shape[2]}")
    cq, ck = cu_q_N1.tolist(), cu_k_N1.tolist()
    if cq[0] != 0 or ck[0] != 0 or cq[-1] != q_TqHD.shape[0] or ck[-1] != k_TkHD.shape[0]:
        raise ValueError(f"cu_seqlens must start at 0 and end at the packed length "
                         f"(q: {cq[0]}..{cq[-1]} vs T={q_TqHD.shape[0]}, k: {ck[0]}..{ck[-1]} vs T={k_TkHD.shape[0]})")
    for n in range(len(cq) - 1):
        lq, lk = cq[n + 1] - cq[n], ck[n + 1] - ck[n]
        if lq < 0 or lk < 0:
            raise ValueError(f"cu_seqlens not non-decreasing at sequence {n}")
        if lq > lk:
            raise ValueError(f"sequence {n}: {lq} queries but only {lk} keys; bottom-right causal attention "
                             f"needs Lq <= Lk (queries are the last Lq tokens)")
    return cq, ck


def _block_scores(q_HLD, k_HSD, scale: float, rows: slice) -> torch.Tensor:
    """[H, rows, Lk] bottom-right-causal scaled scores of one query block (-inf where masked)."""
    lq, lk = q_HLD.shape[1], k_HSD.shape[1]
    sc = torch.matmul(q_HLD[:, rows], k_HSD.transpose(1, 2)).mul_(scale)
    return sc.masked_fill_(~bottom_right_causal_mask(lq, lk, q_HLD.device, rows), float("-inf"))


class _BlockedCausalAttention(torch.autograd.Function):
    """Exact softmax attention for one long sequence in query blocks, keeping only the output and the
    row log-sum-exp for backward, which recomputes each block's probabilities. Autograd through per-block
    SDPA would keep every block's [H, block, Lk] probabilities until backward: 107 GB for one 41K-token
    fp32 sequence with 16 heads (the gradgap truth's OOM on the H200). Plain matmuls in the input dtype,
    so it is as exact as the SDPA math path (fp32 on CUDA unless TF32 is switched on for matmuls)."""

    @staticmethod
    def forward(ctx, q_HLD, k_HSD, v_HSDv, scale: float, block: int):
        lq = q_HLD.shape[1]
        o_HLDv = q_HLD.new_empty(*q_HLD.shape[:2], v_HSDv.shape[2])
        lse_HL = q_HLD.new_empty(q_HLD.shape[:2])
        for s in range(0, lq, block):
            rows = slice(s, min(lq, s + block))
            sc = _block_scores(q_HLD, k_HSD, scale, rows)
            lse_HL[:, rows] = torch.logsumexp(sc, -1)
            o_HLDv[:, rows] = torch.matmul(sc.sub_(lse_HL[:, rows, None]).exp_(), v_HSDv)
        ctx.save_for_backward(q_HLD, k_HSD, v_HSDv, o_HLDv, lse_HL)
        ctx.scale, ctx.block = scale, block
        return o_HLDv

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do_HLDv):
        q_HLD, k_HSD, v_HSDv, o_HLDv, lse_HL = ctx.saved_tensors
        lq = q_HLD.shape[1]
        delta_HL = (do_HLDv * o_HLDv).sum(-1)  # sum_j P_ij dP_ij, the softmax backward's row term
        dq, dk, dv = torch.empty_like(q_HLD), torch.zeros_like(k_HSD), torch.zeros_like(v_HSDv)
        for s in range(0, lq, ctx.block):
            rows = slice(s, min(lq, s + ctx.block))
            p = _block_scores(q_HLD, k_HSD, ctx.scale, rows).sub_(lse_HL[:, rows, None]).exp_()
            dv += torch.matmul(p.transpose(1, 2), do_HLDv[:, rows])
            ds = torch.matmul(do_HLDv[:, rows], v_HSDv.transpose(1, 2)).sub_(delta_HL[:, rows, None]).mul_(p)
            ds.mul_(ctx.scale)
            dq[:, rows] = torch.matmul(ds, k_HSD)
            dk += torch.matmul(ds.transpose(1, 2), q_HLD[:, rows])
        return dq, dk, dv, None, None


def varlen_attention_reference(q_TqHD, k_TkHD, v_TkHDv, cu_q_N1, cu_k_N1, scale: float) -> torch.Tensor:
    """Per-sequence SDPA; the mask is explicit whenever Lq != Lk; sequences whose scores exceed one block
    run blocked with recomputation (_BlockedCausalAttention)."""
    cq, ck = check_varlen_args(q_TqHD, k_TkHD, v_TkHDv, cu_q_N1, cu_k_N1)
    outs = []
    for n in range(len(cq) - 1):
        q = q_TqHD[cq[n]:cq[n + 1]].transpose(0, 1)  # [H, Lq, D]
        k = k_TkHD[ck[n]:ck[n + 1]].transpose(0, 1)
        v = v_TkHDv[ck[n]:ck[n + 1]].transpose(0, 1)
        lq, lk = q.shape[1], k.shape[1]
        if lq == 0:
            continue
        # Query blocks bound the [H, block, Lk] score tensor (SDPA's math path materialises it: a 64K-token
        # fp32 sequence would need ~40 GiB at once, and autograd would keep it).
        block = max(1, min(lq, _SCORE_ELEMS // max(1, lk * q.shape[0])))
        if block < lq:
            o = _BlockedCausalAttention.apply(q, k, v, scale, block)
        elif lq == lk:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bottom_right_causal_mask(lq, lk, q.device),
                                               scale=scale)
        outs.append(o.transpose(0, 1))
    if not outs:
        return q_TqHD.new_zeros(0, q_TqHD.shape[1], v_TkHDv.shape[2])
    return torch.cat(outs, 0)
