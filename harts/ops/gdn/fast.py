"""GDN fast paths on CUDA.

``gated_delta_rule_rounds`` (the model's fast path) runs one of the two round implementations HARTS runs its
rounds on, so the trajectory-wise path and the HARTS rounds of a Qwen3.5 model run one kernel family and round
alike (``round_impl``, the model's ``gdn_round_impl``):

- ``"kda_kernels"``: the KDA round kernels (harts.ops.kda_round) with the per-head scalar decay broadcast over
  K and q, k repeated to the value heads. The delta rule with a per-channel decay equal across channels is
  exactly GDN's, but KDA's intra-chunk pieces do per-channel-gate work a scalar gate does not need, and the
  repeat doubles the key-side work at Qwen3.5's 16 key / 32 value heads.
- ``"fla_pieces"``: fla's Gated DeltaNet pieces with our boundary-state scans (harts.ops.gdn_round): the
  scalar gate and q, k at the key heads, as fla's ``chunk_gated_delta_rule``.

``gated_delta_rule_fla``: fla's ``chunk_gated_delta_rule`` (varlen via cu_seqlens, grouped value attention when
HV > H, q/k L2 norm inside the kernel), the public kernel the benchmark compares against. fla 0.6.0 refuses its
backward on Hopper GPUs with Triton >= 3.4 and < 3.7.1 unless tilelang is installed (its gated
``chunk_bwd_dqkwg`` miscompiles there, fla issue #640, at the block width BK = 64 only); ``"fla_pieces"`` launches
that kernel through a guard narrowed to BK = 64 (harts.ops.gdn_round.chunk).
"""
from __future__ import annotations

import torch

from harts.ops.tuning import tuned

ROUND_IMPLS = ("kda_kernels", "fla_pieces")


def gated_delta_rule_rounds(q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens, *, scale=None, initial_state_NHKV=None,
                            output_final_state=False, chunk_size: int = 64, round_impl: str = "kda_kernels",
                            cu_seqlens_cpu=None):
    from harts.ops.gdn.reference import check_inputs

    if round_impl not in ROUND_IMPLS:
        raise ValueError(f"gated_delta_rule: round_impl={round_impl!r}: expected one of {ROUND_IMPLS}")
    check_inputs(q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens, initial_state_NHKV, read_lengths=False)
    T, H, K = q_THK.shape
    HV = v_THV.shape[1]
    h0 = initial_state_NHKV.float() if initial_state_NHKV is not None else None
    if round_impl == "fla_pieces":
        from harts.ops.gdn_round import chunk_gdn_round

        o, ht, _ = chunk_gdn_round(
            q_THK.unsqueeze(0), k_THK.unsqueeze(0), v_THV.unsqueeze(0), g_TH.float().unsqueeze(0),
            beta_TH.unsqueeze(0).to(q_THK.dtype), cu_seqlens.to(torch.long), initial_state=h0,
            output_final_state=output_final_state, scale=scale, use_qk_l2norm_in_kernel=True, chunk_size=chunk_size,
            cu_seqlens_cpu=cu_seqlens_cpu)
        return o.squeeze(0), ht
    from harts.ops.kda_round import chunk_kda_round

    if HV != H:
        q_THK, k_THK = (t.repeat_interleave(HV // H, dim=1) for t in (q_THK, k_THK))
    g_THK = g_TH.float()[..., None].expand(T, HV, K).contiguous()
    o, ht, _ = chunk_kda_round(
        q_THK.unsqueeze(0), k_THK.unsqueeze(0), v_THV.unsqueeze(0), g_THK.unsqueeze(0),
        beta_TH.unsqueeze(0).to(q_THK.dtype), cu_seqlens.to(torch.long), initial_state=h0,
        output_final_state=output_final_state, scale=scale, use_qk_l2norm_in_kernel=True, chunk_size=chunk_size,
        cu_seqlens_cpu=cu_seqlens_cpu)
    return o.squeeze(0), ht


@tuned("fla.ops.gated_delta_rule")
def gated_delta_rule_fla(q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens, *, scale=None, initial_state_NHKV=None,
                         output_final_state=False):
    from harts.ops._fla import chunk_gated_delta_rule
    from harts.ops.gdn.reference import check_inputs

    check_inputs(q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens, initial_state_NHKV, read_lengths=False)
    dtype = q_THK.dtype
    h0 = initial_state_NHKV.float() if initial_state_NHKV is not None else None
    o, ht = chunk_gated_delta_rule(
        q=q_THK.unsqueeze(0), k=k_THK.unsqueeze(0), v=v_THV.unsqueeze(0), g=g_TH.unsqueeze(0).float(),
        beta=beta_TH.unsqueeze(0).to(dtype), scale=scale, initial_state=h0, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens.to(torch.long))
    return o.squeeze(0), ht
