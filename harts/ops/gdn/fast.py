"""fla's ``chunk_gated_delta_rule`` (varlen via cu_seqlens, grouped value attention when HV > H, q/k L2
norm inside the kernel), as the model's fast path on CUDA."""
from __future__ import annotations

import torch

from harts.ops.tuning import tuned


@tuned("fla.ops.gated_delta_rule")
def gated_delta_rule_fast(q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens, *, scale=None, initial_state_NHKV=None,
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
