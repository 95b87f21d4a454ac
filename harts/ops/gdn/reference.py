"""Per-token Gated DeltaNet recurrence in pure torch: exact in float64, the CPU reference path.

Legend: T packed tokens, N sequences, L longest sequence, H query/key heads, HV value heads, K key dim,
V value dim, C tokens of one recomputation block.

All sequences run at once, padded to the longest one; a padded step has decay exp(0) = 1 and beta 0,
which leaves the state exactly unchanged. Computation is in float32, or float64 for float64 inputs.
"""
from __future__ import annotations

import torch

from harts.ops.recompute import recompute_in_backward

L2NORM_EPS = 1e-6  # fla's l2norm epsilon
_BLOCK = 64  # tokens per recomputation block: autograd keeps one state per block, not one per token


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def check_inputs(q, k, v, g, beta, cu_seqlens, initial_state, read_lengths: bool = True) -> list[int] | None:
    """Validate shapes (and, with ``read_lengths``, the offsets: a host read); errors name the argument."""
    if q.dim() != 3:
        raise ValueError(f"gated_delta_rule: q must be [T, H, K], got {tuple(q.shape)}")
    T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"gated_delta_rule: k {tuple(k.shape)} must match q {tuple(q.shape)}")
    if v.dim() != 3 or v.shape[0] != T:
        raise ValueError(f"gated_delta_rule: v must be [T={T}, HV, V], got {tuple(v.shape)}")
    HV = v.shape[1]
    if HV % H:
        raise ValueError(f"gated_delta_rule: value heads HV={HV} must be a multiple of key heads H={H}")
    if g.shape != (T, HV):
        raise ValueError(f"gated_delta_rule: g must be the per-head log decay [T={T}, HV={HV}], got {tuple(g.shape)}")
    if beta.shape != (T, HV):
        raise ValueError(f"gated_delta_rule: beta must be [T={T}, HV={HV}], got {tuple(beta.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"gated_delta_rule: cu_seqlens must be 1-D [N+1], got {tuple(cu_seqlens.shape)}")
    N = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (N, HV, K, v.shape[2]):
        raise ValueError(f"gated_delta_rule: initial_state {tuple(initial_state.shape)} must be "
                         f"[N={N}, HV={HV}, K={K}, V={v.shape[2]}]")
    if not read_lengths:
        return None
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"gated_delta_rule: cu_seqlens must be non-decreasing from 0 to T={T}, "
                         f"got {cu[:4]}...{cu[-2:]}")
    return cu


def _steps(S_NHKV, q_NCHK, k_NCHK, v_NCHV, a_NCH, b_NCH):
    """Token steps of one block for all sequences: (state after the block, outputs [N, C, HV, V])."""
    outs = []
    for t in range(q_NCHK.shape[1]):
        S_NHKV = S_NHKV * a_NCH[:, t, :, None, None]
        k_NHK = k_NCHK[:, t]
        u_NHV = b_NCH[:, t, :, None] * (v_NCHV[:, t] - torch.einsum("nhk,nhkv->nhv", k_NHK, S_NHKV))
        S_NHKV = S_NHKV + k_NHK[..., None] * u_NHV[:, :, None, :]
        outs.append(torch.einsum("nhk,nhkv->nhv", q_NCHK[:, t], S_NHKV))
    return S_NHKV, torch.stack(outs, 1)


def gated_delta_rule_reference(q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens, *, scale: float | None = None,
                               initial_state_NHKV=None, output_final_state: bool = False):
    """Same contract as ``harts.ops.gdn.gated_delta_rule``; differentiable by autograd (each block of
    tokens is recomputed in backward, so the graph holds one [N, HV, K, V] state per block)."""
    cu = check_inputs(q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens, initial_state_NHKV)
    T, H, K = q_THK.shape
    HV, V = v_THV.shape[1], v_THV.shape[2]
    acc = torch.promote_types(q_THK.dtype, torch.float32)
    scale = K ** -0.5 if scale is None else scale
    q = l2norm(q_THK.to(acc)).repeat_interleave(HV // H, dim=1) * scale
    k = l2norm(k_THK.to(acc)).repeat_interleave(HV // H, dim=1)
    v, g, beta = v_THV.to(acc), g_TH.to(acc), beta_TH.to(acc)
    N, dev = len(cu) - 1, q.device
    lens_N = torch.tensor([b - a for a, b in zip(cu, cu[1:])], device=dev)
    L = int(lens_N.max()) if N else 0
    pos_L = torch.arange(L, device=dev)
    valid_NL = pos_L[None, :] < lens_N[:, None]
    idx_NL = torch.where(valid_NL, torch.tensor(cu[:-1], device=dev)[:, None] + pos_L[None, :], 0)

    def pad(x, fill):
        m = valid_NL.view(*valid_NL.shape, *([1] * (x.dim() - 1)))
        return torch.where(m, x[idx_NL], torch.full((), fill, dtype=x.dtype, device=dev))

    q_NLHK, k_NLHK, v_NLHV, b_NLH = pad(q, 0.0), pad(k, 0.0), pad(v, 0.0), pad(beta, 0.0)
    a_NLH = pad(g, 0.0).exp()
    S = (initial_state_NHKV.to(acc) if initial_state_NHKV is not None
         else torch.zeros(N, HV, K, V, dtype=acc, device=dev))
    outs = []
    for t0 in range(0, L, _BLOCK):
        sl = slice(t0, min(t0 + _BLOCK, L))
        S, o = recompute_in_backward(_steps, S, q_NLHK[:, sl], k_NLHK[:, sl], v_NLHV[:, sl], a_NLH[:, sl],
                                     b_NLH[:, sl])
        outs.append(o)
    o_THV = torch.cat(outs, 1)[valid_NL] if outs else v.new_zeros(0, HV, V)
    return o_THV.to(q_THK.dtype), (S if output_final_state else None)
