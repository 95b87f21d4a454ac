"""GDN fast paths on CUDA.

``gated_delta_rule_rounds`` (the model's fast path): the KDA round kernels (harts.ops.kda_round, the kernels
HARTS runs its rounds on) with the per-head scalar decay broadcast over K and q, k repeated to the value heads.
The delta rule with a per-channel decay equal across channels is exactly GDN's, so the trajectory-wise path and
the HARTS rounds of a Qwen3.5 model run one kernel family and round alike.

``gated_delta_rule_fla``: fla's ``chunk_gated_delta_rule`` (varlen via cu_seqlens, grouped value attention when
HV > H, q/k L2 norm inside the kernel), the public kernel the benchmark compares against. fla 0.6.0 refuses its
backward on Hopper GPUs with Triton >= 3.4 and < 3.7.1 (its gated ``chunk_bwd_dqkwg`` gives wrong results
there) unless tilelang is installed, so it cannot be the training path on such a stack.
"""
from __future__ import annotations

import torch

from harts.ops.tuning import tuned


def gated_delta_rule_rounds(q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens, *, scale=None, initial_state_NHKV=None,
                            output_final_state=False, chunk_size: int = 64):
    from harts.ops.gdn.reference import check_inputs
    from harts.ops.kda_round import chunk_kda_round

    check_inputs(q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens, initial_state_NHKV, read_lengths=False)
    T, H, K = q_THK.shape
    HV = v_THV.shape[1]
    if HV != H:
        q_THK, k_THK = (t.repeat_interleave(HV // H, dim=1) for t in (q_THK, k_THK))
    g_THK = g_TH.float()[..., None].expand(T, HV, K).contiguous()
    h0 = initial_state_NHKV.float() if initial_state_NHKV is not None else None
    o, ht, _ = chunk_kda_round(
        q_THK.unsqueeze(0), k_THK.unsqueeze(0), v_THV.unsqueeze(0), g_THK.unsqueeze(0),
        beta_TH.unsqueeze(0).to(q_THK.dtype), cu_seqlens.to(torch.long), initial_state=h0,
        output_final_state=output_final_state, scale=scale, use_qk_l2norm_in_kernel=True, chunk_size=chunk_size)
    return o.squeeze(0), ht


@tuned("fla.ops.gated_delta_rule")
def gated_delta_rule_fla(q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens, *, scale=None, initial_state_NHKV=None,
                         output_final_state=False):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from harts.ops.gdn.reference import check_inputs

    check_inputs(q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens, initial_state_NHKV, read_lengths=False)
    dtype = q_THK.dtype
    h0 = initial_state_NHKV.float() if initial_state_NHKV is not None else None
    o, ht = chunk_gated_delta_rule(
        q=q_THK.unsqueeze(0), k=k_THK.unsqueeze(0), v=v_THV.unsqueeze(0), g=g_TH.unsqueeze(0).float(),
        beta=beta_TH.unsqueeze(0).to(dtype), scale=scale, initial_state=h0, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens.to(torch.long))
    return o.squeeze(0), ht
