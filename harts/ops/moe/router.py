"""Ling-3.0 router: sigmoid scores, group-limited top-k on biased scores, weights from unbiased scores.

Legend: T tokens, D hidden, E experts, G groups, K experts per token, N experts per group.
Routing runs in float32 (float64 when the input is float64) regardless of the activation dtype, as the
official model does (router_dtype fp32).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _top2_sum(x_TGN: torch.Tensor) -> torch.Tensor:
    """Sum of the two largest entries along the last axis, equal to ``topk(2).values.sum(-1)`` bit for bit
    (ties included: the first maximum is masked, so an equal second one is still counted). Why not topk:
    it is a sort kernel that torch.compile cannot fuse; max / argmax / max are reductions that Inductor
    fuses into the router's other elementwise work (the top-2 topk was 2.5 % of a Ling-tiny step)."""
    m1_TG, first_TG = x_TGN.max(dim=-1)
    iota_N = torch.arange(x_TGN.shape[-1], device=x_TGN.device)
    m2_TG = x_TGN.masked_fill(iota_N == first_TG[..., None], float("-inf")).amax(dim=-1)
    return m1_TG + m2_TG


def _top_indices(x_TN: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last axis, ties to the lower index: the head of a stable
    descending sort. Why not ``topk``: its choice among equal entries is unspecified, and on CUDA it is
    ATen's radix-select kernel, which torch.compile cannot fuse (the two router top-ks were 7.2 ms in 92
    kernels of a 32,768-token Ling-3.0-tiny step on the H100, 0.9 %); a sort along an axis of at most 512
    entries is lowered by Inductor to one Triton kernel fused with the scores that feed it."""
    return torch.sort(x_TN, dim=-1, descending=True, stable=True).indices[..., :k]


def bf16x3(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three bfloat16 tensors whose sum is the float32 ``t`` exactly (outside the subnormal range): each takes
    the next 8 significant bits of what the ones before it left (a rounding error is exactly representable,
    and 3 x 8 bits hold float32's 24). Products of these with bfloat16 values are exact in float32."""
    hi = t.to(torch.bfloat16)
    r = t - hi.float()
    mid = r.to(torch.bfloat16)
    return hi, mid, (r - mid.float()).to(torch.bfloat16)


class _LowPrecisionRouterLogits(torch.autograd.Function):
    """Router logits from 16-bit activations and weights, fp32 out. The products of two bf16 (fp16) numbers
    are exact in fp32, so a tensor-core GEMM accumulating in fp32 computes the same sums as the fp32 GEMM of
    the upcast operands, up to summation order; the fp32 GEMM runs on FMA units at a fifteenth of the
    tensor-core rate (16.7 ms per Ling-3.0-tiny step of 65,536 tokens on the H200).

    The backward multiplies the fp32 output gradient with the 16-bit operands. For bf16 it runs on tensor cores
    too: the gradient is split into three bf16 parts that sum to it exactly (``bf16x3``), laid side by side
    along the contraction (E -> 3E), so each of dx and dw is one bf16 GEMM with fp32 accumulation whose products
    are exact: the fp32 GEMM's sums again, up to summation order. fp16 keeps the fp32 GEMM (fp16's exponent
    range cannot hold the parts of small gradients)."""

    @staticmethod
    def forward(ctx, x_TD, weight_ED):
        ctx.save_for_backward(x_TD, weight_ED)
        return torch.mm(x_TD, weight_ED.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, dlogits_TE):
        x_TD, weight_ED = ctx.saved_tensors
        if x_TD.dtype == torch.bfloat16:
            E, D = weight_ED.shape
            parts_T3E = torch.cat(bf16x3(dlogits_TE.float()), dim=1)
            dx_TD = (torch.mm(parts_T3E, weight_ED.repeat(3, 1), out_dtype=torch.float32).to(x_TD.dtype)
                     if ctx.needs_input_grad[0] else None)
            dw_ED = (torch.mm(parts_T3E.t(), x_TD, out_dtype=torch.float32).view(3, E, D).sum(0).to(weight_ED.dtype)
                     if ctx.needs_input_grad[1] else None)
            return dx_TD, dw_ED
        dx_TD = (dlogits_TE @ weight_ED.float()).to(x_TD.dtype) if ctx.needs_input_grad[0] else None
        dw_ED = (dlogits_TE.t() @ x_TD.float()).to(weight_ED.dtype) if ctx.needs_input_grad[1] else None
        return dx_TD, dw_ED


def router_logits(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """``x_TD @ weight_ED.T`` in fp32 (float64 for float64 input). On CUDA with both operands in the same
    16-bit dtype the forward runs on tensor cores with fp32 accumulation (``_LowPrecisionRouterLogits``);
    otherwise both operands are upcast."""
    if x_TD.is_cuda and x_TD.dtype == weight_ED.dtype and x_TD.dtype in (torch.bfloat16, torch.float16):
        return _LowPrecisionRouterLogits.apply(x_TD, weight_ED)
    dt = torch.promote_types(x_TD.dtype, torch.float32)
    return F.linear(x_TD.to(dt), weight_ED.to(dt))


def route(x_TD: torch.Tensor, weight_ED: torch.Tensor, expert_bias_E: torch.Tensor, *, n_group: int,
          topk_group: int, top_k: int, routed_scaling_factor: float, norm_topk_prob: bool = True):
    """Returns (logits_TE, scores_TE, topk_idx_TK, topk_w_TK), all in the router dtype except the index."""
    dt = torch.promote_types(x_TD.dtype, torch.float32)
    logits_TE = router_logits(x_TD, weight_ED)
    scores_TE = logits_TE.sigmoid()
    with torch.no_grad():  # selection is discrete; the bias is not trained by gradient
        T, E = scores_TE.shape
        biased_TE = scores_TE + expert_bias_E.to(dt)
        group_TG = _top2_sum(biased_TE.view(T, n_group, E // n_group))
        keep_TG = torch.zeros_like(group_TG, dtype=torch.bool)
        keep_TG.scatter_(1, _top_indices(group_TG, topk_group), True)
        keep_TE = keep_TG.repeat_interleave(E // n_group, dim=1)
        topk_idx_TK = _top_indices(biased_TE.masked_fill(~keep_TE, float("-inf")), top_k)
        # a fixed order of the k slots (ascending expert id): the combine sums them in expert order
        topk_idx_TK = topk_idx_TK.sort(dim=-1).values
    topk_w_TK = scores_TE.gather(1, topk_idx_TK)
    if norm_topk_prob:
        topk_w_TK = topk_w_TK / (topk_w_TK.sum(-1, keepdim=True) + 1e-20)
    return logits_TE, scores_TE, topk_idx_TK, topk_w_TK * routed_scaling_factor


@dataclass
class RouterStats:
    """Per-layer router statistics, weighted by a per-token multiplicity q_T (ones by default).

    counts_E:  sum_t q_t 1[e in topk_t]                          (detached; drives the expert-bias update)
    z_loss:    sum_t q_t logsumexp(logits_t)^2 / sum_t q_t       (differentiable)
    f_E:       E / (K sum_t q_t) * counts_E                      (detached load fraction, DeepSeek-V3 f_i)
    P_E:       sum_t q_t s_te / sum_j s_tj / sum_t q_t           (differentiable, DeepSeek-V3 P_i)
    aux_loss = (f_E * P_E).sum() is the batch-wise balance loss; its coefficient is the trainer's choice.
    """

    counts_E: torch.Tensor
    z_loss: torch.Tensor
    f_E: torch.Tensor
    P_E: torch.Tensor
    weight_sum: torch.Tensor

    @property
    def aux_loss(self) -> torch.Tensor:
        return (self.f_E * self.P_E).sum()


def router_stats(logits_TE: torch.Tensor, scores_TE: torch.Tensor, topk_idx_TK: torch.Tensor,
                 token_weight_T: torch.Tensor | None = None) -> RouterStats:
    T, E = logits_TE.shape
    K = topk_idx_TK.shape[1]
    q_T = (torch.ones(T, dtype=logits_TE.dtype, device=logits_TE.device) if token_weight_T is None
           else token_weight_T.to(logits_TE.dtype))
    wsum = q_T.sum()
    denom = wsum.clamp_min(torch.finfo(logits_TE.dtype).tiny)
    with torch.no_grad():
        counts_E = torch.zeros(E, dtype=logits_TE.dtype, device=logits_TE.device)
        counts_E.index_add_(0, topk_idx_TK.reshape(-1), q_T.repeat_interleave(K))
        f_E = counts_E * (E / (K * denom))
    z_loss = (q_T * torch.logsumexp(logits_TE, dim=-1).square()).sum() / denom
    P_E = (q_T[:, None] * scores_TE / scores_TE.sum(-1, keepdim=True)).sum(0) / denom
    return RouterStats(counts_E=counts_E, z_loss=z_loss, f_E=f_E, P_E=P_E, weight_sum=wsum.detach())
