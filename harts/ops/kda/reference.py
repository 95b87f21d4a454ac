"""Pure-torch chunkwise KDA, exact in float64 (the CPU reference path).

Legend: T packed tokens, N sequences, H heads, K key dim, V value dim, L tokens of one chunk (<= C).
Chunks follow fla's grid: each packed sequence is cut into chunks of C tokens from its own first token,
the last one possibly partial. Within a chunk, with gc = cumsum of g over the chunk and S0 the state at
the chunk start, the delta rule is solved in WY form:

    (I + A_kk) W = diag(beta) (V - (K * exp(gc)) S0)
    O  = (Q * exp(gc)) S0 + A_qk W
    S1 = exp(gc_L) S0 + (K * exp(gc_L - gc))^T W

    with A_kk[i, j] = beta_i sum_d k_i[d] k_j[d] exp(gc_i - gc_j)[d] for j < i,
         A_qk[i, j] = sum_d q_i[d] k_j[d] exp(gc_i - gc_j)[d] for j <= i.

Only exponents <= 0 are ever evaluated (masked entries get -inf before exp), so nothing overflows; the
triangular solve is exact up to rounding. Computation is in float32 or wider (float64 stays float64).
"""
from __future__ import annotations

import torch

from harts.ops.recompute import recompute_in_backward


def kda_gate_reference(f_THK: torch.Tensor, A_log_H: torch.Tensor, dt_bias_P: torch.Tensor,
                       lower_bound: float) -> torch.Tensor:
    """Safe gate in log space: lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), in (lower_bound, 0)."""
    H, K = f_THK.shape[1], f_THK.shape[2]
    dt = torch.promote_types(f_THK.dtype, torch.float32)
    x = f_THK.to(dt) + dt_bias_P.to(dt).view(H, K)
    return lower_bound * torch.sigmoid(A_log_H.to(dt).exp().view(H, 1) * x)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _check(q, k, v, f, beta, A_log, dt_bias, cu_seqlens, initial_state):
    T, H, K = q.shape
    if k.shape != (T, H, K) or f.shape != (T, H, K):
        raise ValueError(f"kda: k {tuple(k.shape)} and f {tuple(f.shape)} must match q {tuple(q.shape)}")
    if v.dim() != 3 or v.shape[:2] != (T, H):
        raise ValueError(f"kda: v {tuple(v.shape)} must be [T={T}, H={H}, V]")
    if beta.shape != (T, H):
        raise ValueError(f"kda: beta {tuple(beta.shape)} must be [T={T}, H={H}]")
    if A_log.shape != (H,) or dt_bias.shape != (H * K,):
        raise ValueError(f"kda: A_log {tuple(A_log.shape)} must be [{H}], dt_bias {tuple(dt_bias.shape)} [{H * K}]")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"kda: cu_seqlens must be non-decreasing from 0 to T={T}, got {cu[:4]}...{cu[-2:]}")
    N = len(cu) - 1
    if initial_state is not None and initial_state.shape != (N, H, K, v.shape[2]):
        raise ValueError(f"kda: initial_state {tuple(initial_state.shape)} "
                         f"must be [N={N}, H={H}, K={K}, V={v.shape[2]}]")
    return cu


def _chunk_step(S, q_LHK, k_LHK, v_LHV, beta_LH, g_LHK):
    """One chunk of the WY form: outputs [L, H, V] and the state after the chunk, from the state before."""
    L = q_LHK.shape[0]
    qc, kc = q_LHK.transpose(0, 1), k_LHK.transpose(0, 1)  # [H, L, K]
    vc, bc = v_LHV.transpose(0, 1), beta_LH.transpose(0, 1)  # [H, L, V], [H, L]
    gc = g_LHK.transpose(0, 1).cumsum(1)  # [H, L, K]
    causal = torch.ones(L, L, dtype=torch.bool, device=qc.device).tril()
    diff = (gc[:, :, None, :] - gc[:, None, :, :]).masked_fill(~causal[None, :, :, None], float("-inf"))
    decay = diff.exp()  # [H, L(i), L(j), K], zero above the diagonal
    A_qk = torch.einsum("hid,hijd,hjd->hij", qc, decay, kc)
    A_kk = torch.einsum("hid,hijd,hjd->hij", kc, decay, kc).tril(-1) * bc[:, :, None]
    eye = torch.eye(L, dtype=qc.dtype, device=qc.device)
    rhs = bc[:, :, None] * (vc - (kc * gc.exp()) @ S)
    W = torch.linalg.solve_triangular(eye + A_kk, rhs, upper=False, unitriangular=True)
    o = ((qc * gc.exp()) @ S + A_qk @ W).transpose(0, 1)
    g_last = gc[:, -1:, :]  # [H, 1, K]
    S = g_last.transpose(1, 2).exp() * S + (kc * (g_last - gc).exp()).transpose(1, 2) @ W
    return o, S


def kda_chunk_reference(q_THK, k_THK, v_THV, f_THK, beta_TH, A_log_H, dt_bias_P, cu_seqlens, *,
                        lower_bound: float = -5.0, chunk_size: int = 64, initial_state_NHKV=None,
                        output_final_state: bool = False, scale: float | None = None):
    cu = _check(q_THK, k_THK, v_THV, f_THK, beta_TH, A_log_H, dt_bias_P, cu_seqlens, initial_state_NHKV)
    T, H, K = q_THK.shape
    V = v_THV.shape[2]
    dt = torch.promote_types(q_THK.dtype, torch.float32)
    scale = K ** -0.5 if scale is None else scale
    g = kda_gate_reference(f_THK, A_log_H, dt_bias_P, lower_bound)  # [T, H, K]
    q = l2norm(q_THK.to(dt)) * scale
    k = l2norm(k_THK.to(dt))
    v, beta = v_THV.to(dt), beta_TH.to(dt)
    outs, finals = [], []
    for n in range(len(cu) - 1):
        S = (initial_state_NHKV[n].to(dt) if initial_state_NHKV is not None
             else q.new_zeros(H, K, V))
        for t0 in range(cu[n], cu[n + 1], chunk_size):
            t1 = min(t0 + chunk_size, cu[n + 1])
            args = (S, q[t0:t1], k[t0:t1], v[t0:t1], beta[t0:t1], g[t0:t1])
            # Recomputed in backward under autograd: the [H, L, L, K] decay tensor of every chunk would
            # otherwise stay in the graph (GBs at K = 128); the backward reruns the same operations.
            o_c, S = recompute_in_backward(_chunk_step, *args)
            outs.append(o_c)
        finals.append(S)
    o = torch.cat(outs, 0) if outs else v.new_zeros(0, H, V)
    final = torch.stack(finals, 0) if output_final_state else None
    return o.to(q_THK.dtype), final
