"""Pure-torch reference for Gated DeltaNet rounds with chunk-boundary states.

GDN is the delta rule with a decay that is one scalar per head and token: the same recurrence as KDA's
with the per-channel decay equal across K, and with each key head's q, k shared by HV / H value heads.
So the reference is ``harts.ops.kda_round.chunk_kda_round_reference`` on g broadcast over K and q, k
repeated to the value heads; both steps are exact (copies), and autograd sums their gradients back onto
the key heads and the scalar gate.

Legend: T packed tokens (batch is always 1), N sequences, H key heads, HV value heads (H | HV), K key dim,
V value dim, M requested boundary states.
"""
from __future__ import annotations

import torch

from harts.ops.kda_round.naive import check_round_inputs, chunk_kda_round_reference


def check_gdn_round_inputs(q, k, v, g, beta, cu_seqlens, initial_state, state_seq, state_chunk, chunk_size,
                           cu_seqlens_cpu=None):
    """Validate a GDN round call (q, k [1, T, H, K]; v [1, T, HV, V]; g, beta [1, T, HV]) and return
    (lens [N], seq [M], chunk [M]) as host lists. Errors name the offending argument or request."""
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q must be [1, T, H, K] (varlen, batch 1, key heads), got {tuple(q.shape)}")
    if v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [1, T={q.shape[1]}, HV, V], got {tuple(v.shape)}")
    T, HV = q.shape[1], v.shape[2]
    if g.shape != (1, T, HV):
        raise ValueError(f"g must be the per-head log decay [1, T, HV]={[1, T, HV]}, got {list(g.shape)}")
    return check_round_inputs(q, k, v, g[..., None].expand(1, T, HV, q.shape[3]), beta, cu_seqlens, initial_state,
                              state_seq, state_chunk, chunk_size, cu_seqlens_cpu=cu_seqlens_cpu)


def chunk_gdn_round_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_seq=None,
    state_chunk=None,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = 64,
    cu_seqlens_cpu: torch.Tensor | None = None,
):
    """Same contract as ``harts.ops.gdn_round.chunk_gdn_round``: exact per-token recurrence, any chunk_size,
    float64-capable (computes in float64 for float64 inputs, float32 otherwise). Returns o [1, T, HV, V] in
    q's dtype, final_state [N, HV, K, V] (or None) and boundary_states [M, HV, K, V] (or None)."""
    check_gdn_round_inputs(q, k, v, g, beta, cu_seqlens, initial_state, state_seq, state_chunk, chunk_size,
                           cu_seqlens_cpu=cu_seqlens_cpu)
    H, K, HV = q.shape[2], q.shape[3], v.shape[2]
    # L2 normalisation is per key head, so it commutes with the repeat; the scale default is K**-0.5 either way
    if HV != H:
        q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    return chunk_kda_round_reference(
        q, k, v, g[..., None].expand(*g.shape, K), beta, cu_seqlens, initial_state=initial_state,
        output_final_state=output_final_state, state_seq=state_seq, state_chunk=state_chunk, scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size, cu_seqlens_cpu=cu_seqlens_cpu)
