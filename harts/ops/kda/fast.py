"""fla ``chunk_kda`` with the gate and the q/k L2 norm inside the kernel, as the official model calls it."""
from __future__ import annotations

import torch


def kda_fast(q_THK, k_THK, v_THV, f_THK, beta_TH, A_log_H, dt_bias_P, cu_seqlens, *, lower_bound=-5.0,
             chunk_size=64, initial_state_NHKV=None, output_final_state=False):
    from fla.ops.kda import chunk_kda

    if chunk_size not in (32, 64):
        raise ValueError(f"fla chunk_kda supports chunk_size 32 or 64, got {chunk_size}")
    dtype = q_THK.dtype
    h0 = initial_state_NHKV.float() if initial_state_NHKV is not None else None
    o, ht = chunk_kda(
        q=q_THK.unsqueeze(0), k=k_THK.unsqueeze(0), v=v_THV.unsqueeze(0), g=f_THK.unsqueeze(0).to(dtype),
        beta=beta_TH.unsqueeze(0).to(dtype), initial_state=h0, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, safe_gate=True, lower_bound=lower_bound,
        cu_seqlens=cu_seqlens.to(torch.long), A_log=A_log_H.float(), dt_bias=dt_bias_P.float(),
        chunk_size=chunk_size,
    )
    return o.squeeze(0), ht
