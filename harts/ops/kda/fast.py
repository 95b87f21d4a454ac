"""fla ``chunk_kda`` with the gate inside the kernel, as the official model calls it.

The q/k L2 norm runs just before it (harts.ops.norm.fast.l2_norm_fast) instead of inside
(``use_qk_l2norm_in_kernel``): the same fla kernels on the same tensors, but launched with the row-count
size class rounded to a power of two. fla's own launch keys its autotuner on the exact class, so every new
sequence length compiled and autotuned both L2-norm kernels again (the trajectory-wise baseline's
microbatches have a new length almost every time)."""
from __future__ import annotations

import torch

from harts.ops.tuning import tuned


@tuned("fla.ops.kda", "harts.ops.norm.fast")
def kda_fast(q_THK, k_THK, v_THV, f_THK, beta_TH, A_log_H, dt_bias_P, cu_seqlens, *, lower_bound=-5.0,
             chunk_size=64, initial_state_NHKV=None, output_final_state=False, cu_seqlens_cpu=None):
    from harts.ops._fla import chunk_kda
    from harts.ops.norm.fast import l2_norm_fast

    if chunk_size not in (32, 64):
        raise ValueError(f"fla chunk_kda supports chunk_size 32 or 64, got {chunk_size}")
    dtype = q_THK.dtype
    h0 = initial_state_NHKV.float() if initial_state_NHKV is not None else None
    q_THK, k_THK = l2_norm_fast(q_THK), l2_norm_fast(k_THK)
    o, ht = chunk_kda(
        q=q_THK.unsqueeze(0), k=k_THK.unsqueeze(0), v=v_THV.unsqueeze(0), g=f_THK.unsqueeze(0).to(dtype),
        beta=beta_TH.unsqueeze(0).to(dtype), initial_state=h0, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=True, safe_gate=True, lower_bound=lower_bound,
        cu_seqlens=cu_seqlens.to(torch.long), cu_seqlens_cpu=cu_seqlens_cpu, A_log=A_log_H.float(),
        dt_bias=dt_bias_P.float(), chunk_size=chunk_size,
    )
    return o.squeeze(0), ht
