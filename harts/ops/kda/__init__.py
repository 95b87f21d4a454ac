"""Kimi Delta Attention core over a packed token stream (KDA's sequence-mixing core).

Inputs are already projected and short-convolved: q, k [T, H, K], v [T, H, V], the raw forget-gate
pre-activation f [T, H, K] (``f_proj(x)``), beta [T, H] (already ``sigmoid(b_proj(x))``), and the gate
parameters A_log [H], dt_bias [H*K]. Inside the core, as in the official model's "gate and l2norm in
kernel" call: g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) (safe gate), q and k L2-normalised
(x / sqrt(sum x^2 + 1e-6)), q scaled by K^-0.5, then per sequence of ``cu_seqlens``

    S <- diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - k_t^T S)^T;  o_t = q_t^T S.

Each sequence may start from ``initial_state[n]`` and can return its final state.
"""
from __future__ import annotations

import torch

from harts.ops.backend import resolve
from harts.ops.kda.reference import kda_chunk_reference, kda_gate_reference

__all__ = ["kda", "kda_chunk_reference", "kda_gate_reference"]


def kda(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, f_THK: torch.Tensor,
        beta_TH: torch.Tensor, A_log_H: torch.Tensor, dt_bias_P: torch.Tensor, cu_seqlens: torch.Tensor, *,
        lower_bound: float = -5.0, chunk_size: int = 64, initial_state_NHKV: torch.Tensor | None = None,
        output_final_state: bool = False, backend: str = "auto", cu_seqlens_cpu: torch.Tensor | None = None):
    """Returns (o [T, H, V] in q's dtype, final_state [N, H, K, V] or None). ``cu_seqlens_cpu``: an optional
    host copy of ``cu_seqlens`` (int64), from which the fast path plans its chunks without a host sync."""
    which = resolve("kda", backend, q_THK.device, q_THK.dtype)
    if which == "fast":
        from harts.ops.kda.fast import kda_fast

        return kda_fast(q_THK, k_THK, v_THV, f_THK, beta_TH, A_log_H, dt_bias_P, cu_seqlens,
                        lower_bound=lower_bound, chunk_size=chunk_size, initial_state_NHKV=initial_state_NHKV,
                        output_final_state=output_final_state, cu_seqlens_cpu=cu_seqlens_cpu)
    return kda_chunk_reference(q_THK, k_THK, v_THV, f_THK, beta_TH, A_log_H, dt_bias_P, cu_seqlens,
                               lower_bound=lower_bound, chunk_size=chunk_size,
                               initial_state_NHKV=initial_state_NHKV, output_final_state=output_final_state)
