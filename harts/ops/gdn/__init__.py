"""Gated DeltaNet core over a packed token stream (Qwen3.5's linear-attention mixer core).

Legend: T packed tokens, N sequences, H query/key heads, HV value heads (HV a multiple of H: grouped value
attention, each q/k head serves HV / H consecutive value heads), K key dim, V value dim.

Inputs are already projected and short-convolved: q, k [T, H, K], v [T, HV, V], the per-head log decay
g [T, HV] (e.g. -exp(A_log) * softplus(a + dt_bias), a scalar per head and token, <= 0) and beta [T, HV]
(already a sigmoid). Inside the core q and k are L2-normalised (x / sqrt(sum x^2 + 1e-6)) and q is scaled
(default K^-0.5); then per sequence of ``cu_seqlens`` and value head

    S <- exp(g_t) S;  S <- S + beta_t k_t (v_t - k_t^T S)^T;  o_t = q_t^T S.

Each sequence may start from ``initial_state[n]`` [HV, K, V] and can return its final state.

Backends (``harts.ops.backend.resolve``, under the ``"kda"`` op name: both cores need the same Triton kernels
and dtypes): ``fast`` runs the round kernels HARTS uses (``gated_delta_rule_rounds``; ``round_impl`` picks the
KDA round kernels with the decay broadcast over K, or fla's GDN pieces with our boundary-state scans, see
harts.ops.gdn.fast; fla's own ``chunk_gated_delta_rule`` stays available as ``gated_delta_rule_fla``);
``reference`` is the per-token recurrence in float32+ (exact in float64), the CPU path.
"""
from __future__ import annotations

import torch

from harts.ops.backend import resolve
from harts.ops.gdn.reference import gated_delta_rule_reference

__all__ = ["gated_delta_rule", "gated_delta_rule_reference"]


def gated_delta_rule(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
                     beta_TH: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float | None = None,
                     initial_state_NHKV: torch.Tensor | None = None, output_final_state: bool = False,
                     backend: str = "auto", chunk_size: int = 64, round_impl: str = "kda_kernels",
                     cu_seqlens_cpu: torch.Tensor | None = None):
    """Returns (o [T, HV, V] in q's dtype, final_state [N, HV, K, V] or None). ``chunk_size`` and
    ``round_impl`` (``"kda_kernels"`` or ``"fla_pieces"``): the fast path's chunk and round implementation
    (the model's, so that trajectory-wise and HARTS runs chunk and round alike). ``cu_seqlens_cpu``: an
    optional host copy of ``cu_seqlens`` (int64): the fast path reads the sequence bounds from it, not from the
    device."""
    if resolve("kda", backend, q_THK.device, q_THK.dtype) == "fast":
        from harts.ops.gdn.fast import gated_delta_rule_rounds

        return gated_delta_rule_rounds(q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens, scale=scale,
                                       initial_state_NHKV=initial_state_NHKV, output_final_state=output_final_state,
                                       chunk_size=chunk_size, round_impl=round_impl, cu_seqlens_cpu=cu_seqlens_cpu)
    return gated_delta_rule_reference(q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens, scale=scale,
                                      initial_state_NHKV=initial_state_NHKV, output_final_state=output_final_state)
