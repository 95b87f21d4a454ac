"""Fast path of GDN rounds: fla-core 0.6.0's chunked Gated DeltaNet with our two state-recurrence kernels.

Everything except the forward state scan, the backward dh scan and the gate-gradient part of dqkwg is fla's
GDN: the chunk-local cumsum of the gate (log2 units), the fused kkt + solve_tril
(``chunk_gated_delta_rule_fwd_intra``), recompute_w_u, ``chunk_fwd_o``, ``chunk_bwd_dv_local``,
``prepare_wy_repr_bwd``, the reverse cumsum for dg, l2norm. The two scans (``harts.kernels.kda_round`` with its
scalar-gate switch) additionally write the fp32 state at the start of requested chunks and add those states'
incoming gradients at the matching point of the reverse scan, so boundary states are differentiable outputs
that later rounds feed back as ``initial_state``. q and k stay at the key heads throughout (grouped value
attention, as fla's GDN).

``chunk_gdn_bwd_kernel_dqkwg`` is fla's gated ``chunk_bwd_kernel_dqkwg`` (dq, dk, dw unchanged) with a
better-conditioned dg. fla forms the gradient of the chunk-cumulative log decay as ``q.dq - k.dk`` plus the
chunk-end state terms, an identity in which the intra-chunk diagonal (decay 1) and the chunk-end token's own
state term enter once with each sign. They are O(1) while the true dg is O(exp(g)): at per-token log decays
near -20 (Qwen3.5's scratch init) fla's float32 dg is their rounding error, 10-25x the true gate gradient
(``python -m harts.bench.gdn_gate_grad``; fla's own ``chunk_gated_delta_rule`` has it too). Leaving the
cancelling terms out of the sum makes dg as accurate as the float32 per-token recurrence's, to the
chunk-cumulative log decays' rounding (|g| x BT x 2^-24 relative).

The kernel is launched through ``chunk_bwd_dqkwg_checked``: fla 0.6.0 refuses every gated dqkwg call on Hopper
with 3.4 <= Triton < 3.7.1 (fla issue #640), but the miscompile was bisected to the block width BK = 64 only,
and on Hopper the wrapper's tiling gives BK = 128 for K = 128. The same code here carries the same guard,
narrowed to exactly the affected configuration; whether the result is right on a given GPU stack is measured
(``python -m harts.bench.gdn_round`` checks outputs and input gradients against a float64 truth), not assumed.

Legend: T packed tokens, N sequences, H key heads, HV value heads, K/V head dims, M requested boundary
states, BT chunk size, NT total chunks, NK key blocks of dqkwg.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from fla.ops.common.chunk_o import chunk_bwd_dv_local, chunk_fwd_o
from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd, recompute_w_u_fwd
from fla.ops.utils import chunk_local_cumsum
from fla.ops.utils.constant import RCP_LN2
from fla.ops.utils.op import exp2, unflatten_program_id
from fla.utils import IS_NVIDIA_HOPPER, autocast_custom_bwd, autocast_custom_fwd, check_shared_mem, input_guard
from packaging.version import Version

from harts.kernels.kda_round import kda_round_bwd_dh, kda_round_fwd_h
from harts.ops.gdn_round.naive import check_gdn_round_inputs
from harts.ops.kda_round.chunk import round_indices
from harts.ops.norm.fast import l2norm_bwd_bucketed, l2norm_fwd_bucketed
from harts.ops.tuning import tuned

SUPPORTED_CHUNK_SIZES = (16, 32, 64)  # fla-core 0.6.0's GDN intra-chunk pieces; the reference takes any size


def _dqkwg_tiling(tensors, device) -> int:
    """fla 0.6.0's ``chunk_bwd_dqkwg`` tile cap (its wrapper's CONST_TILING), decided the same way."""
    if check_shared_mem("hopper", device.index):
        return 128
    if check_shared_mem("ampere", device.index):
        return 128 if all(x.element_size() == 2 for x in tensors) else 64
    if check_shared_mem("ada", device.index):
        return 64
    return 32


def fla_640_affected(is_hopper: bool, triton_version: str, BK: int) -> bool:
    """fla issue #640: on Hopper, 3.4 <= Triton < 3.7.1 miscompiles the gated dqkwg kernel at BK = 64."""
    v = Version(triton_version)
    return is_hopper and Version("3.4.0") <= v < Version("3.7.1") and BK == 64


def _dqkwg_configs():
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [triton.Config({}, num_warps=4, num_stages=2)]
    return [triton.Config({}, num_warps=w, num_stages=s) for w in (2, 4, 8) for s in (2, 3, 4)]


@triton.autotune(configs=_dqkwg_configs(), key=['H', 'HV', 'K', 'V', 'BT', 'BK', 'BV'])
@triton.jit(do_not_specialize=['T'])
def chunk_gdn_bwd_kernel_dqkwg(q, k, v, g, h, do, dh, dq, dk, dw, dv, dg, cu_seqlens, chunk_indices, scale, T,
                               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                               BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """fla 0.6.0's gated, varlen ``chunk_bwd_kernel_dqkwg`` (state layout [K, V]) with dg formed without the
    terms that cancel exactly: the gate gradient of a chunk-local cumulative log decay is ``q.dq - k.dk``
    plus the chunk-end state terms, and in that identity the intra-chunk diagonal (decay exp2(0) = 1) and the
    chunk-end token's own state term appear once with each sign. At fast decays they are O(1) while dg is
    O(exp(g)), so fla's float32 sum leaves only their rounding error. Here dg sums the strictly-lower intra
    terms and the other tokens' state terms only; dq, dk and dw are fla's."""
    i_k, i_t = unflatten_program_id(tl.cdiv(K, BK))
    i_h = tl.program_id(1).to(tl.int64)
    i_tg = i_t
    i_n, i_t = tl.load(chunk_indices + i_t * 2).to(tl.int32), tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    all = T.to(tl.int64)
    T = eos - bos

    v += (bos * HV + i_h) * V
    do += (bos * HV + i_h) * V
    h += (i_tg * HV + i_h).to(tl.int64) * K * V
    dh += (i_tg * HV + i_h).to(tl.int64) * K * V
    q += (bos * H + i_h // (HV // H)) * K
    k += (bos * H + i_h // (HV // H)) * K
    dq += (bos * HV + i_h) * K
    dk += (bos * HV + i_h) * K
    dw += (bos * HV + i_h) * K
    dv += (bos * HV + i_h) * V
    dg += i_k * all * HV

    b_hdh = tl.zeros([1], dtype=tl.float32)
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)

    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_qk = m_t[:, None] & m_k[None, :]
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_hv = m_t[:, None] & m_v[None, :]
        m_h = m_v[:, None] & m_k[None, :]
        b_v = tl.load(v + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_hv, other=0.0)
        b_do = tl.load(do + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_hv, other=0.0)
        b_h = tl.load(h + o_v[:, None] + o_k[None, :] * V, mask=m_h, other=0.0)
        b_dh = tl.load(dh + o_v[:, None] + o_k[None, :] * V, mask=m_h, other=0.0)
        b_hdh += tl.sum(b_h * b_dh)
        b_ds = tl.dot(b_do, tl.trans(b_v), b_ds)
        b_dq = tl.dot(b_do, b_h.to(b_do.dtype), b_dq)
        b_dk = tl.dot(b_v, b_dh.to(b_v.dtype), b_dk)
        b_dv = tl.load(dv + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_hv, other=0.0)
        b_dw = tl.dot(b_dv.to(b_v.dtype), b_h.to(b_v.dtype), b_dw)
    tl.store(dw + o_t[:, None] * (HV * K) + o_k[None, :], -b_dw.to(dw.dtype.element_ty), mask=m_qk)

    tl.debug_barrier()
    b_q = tl.load(q + o_t[:, None] * (H * K) + o_k[None, :], mask=m_qk, other=0.0)
    b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_qk, other=0.0)
    g += bos * HV + i_h
    dg += bos * HV + i_h
    b_g = tl.load(g + o_t * HV, mask=m_t, other=0.0)
    i_last = min(i_t * BT + BT, T) - 1
    b_g_last = tl.load(g + i_last * HV)
    m_last = o_t == i_last
    b_dq = b_dq * exp2(b_g)[:, None] * scale
    # state-path dk; at the chunk-end token its decay is exp2(0) and its dg terms cancel: kept out of dg
    b_dk = b_dk * tl.where(m_t, exp2(-b_g + b_g_last), 0)[:, None]
    b_dk_self = tl.where(m_last[:, None], b_dk, 0)
    b_dk = b_dk - b_dk_self
    b_dg_last = b_hdh * exp2(b_g_last) + tl.sum(b_dk * b_k)

    m_A = (o_t[:, None] >= o_t[None, :]) & (m_t[:, None] & m_t)
    b_ds = tl.where(m_A, b_ds * exp2(b_g[:, None] - b_g[None, :]), 0) * scale
    m_diag = o_t[:, None] == o_t[None, :]
    b_ds_diag = tl.sum(tl.where(m_diag, b_ds, 0), axis=1)
    b_ds = tl.where(o_t[:, None] > o_t[None, :], b_ds, 0).to(b_k.dtype)
    b_dq = tl.dot(b_ds, b_k, b_dq)
    b_dk = tl.dot(tl.trans(b_ds), b_q, b_dk)
    b_dg = tl.sum(b_dq * b_q, axis=1) - tl.sum(b_dk * b_k, axis=1)
    b_dg = tl.where(m_last, b_dg + b_dg_last, b_dg)
    b_dq += b_ds_diag[:, None] * b_k
    b_dk += b_ds_diag[:, None] * b_q + b_dk_self
    tl.store(dq + o_t[:, None] * (HV * K) + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m_qk)
    tl.store(dk + o_t[:, None] * (HV * K) + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_qk)
    tl.store(dg + o_t * HV, b_dg.to(dg.dtype.element_ty), mask=m_t)


def chunk_bwd_dqkwg_checked(q, k, v, do, h, dh, w, g, dv, scale, cu_seqlens, chunk_size, chunk_indices):
    """``chunk_gdn_bwd_kernel_dqkwg`` with fla 0.6.0's wrapper logic (tiling, GVA head sum, dg over key
    blocks) and a guard narrowed to the configuration fla #640 affects (raises ValueError there).

    q, k [1, T, H, K]; v = v_new, do, dv [1, T, HV, V]; h, dh [1, NT, HV, K, V]; w [1, T, HV, K]; g [1, T, HV]
    fp32 (chunk-local cumsum, log2 units). Returns dq, dk [1, T, H, K], dw [1, T, HV, K], dg [1, T, HV] fp32."""
    B, T, H, K = k.shape
    V, HV = v.shape[-1], v.shape[2]
    if B != 1:
        raise ValueError(f"chunk_bwd_dqkwg_checked: packed varlen inputs need batch 1, got k {tuple(k.shape)}")
    tiling = _dqkwg_tiling((q, k, v, do, h, dh, w, dv), k.device)
    BK = min(max(triton.next_power_of_2(K), 16), tiling)
    BV = min(max(triton.next_power_of_2(V), 16), tiling)
    if k.device.type == "cuda" and fla_640_affected(IS_NVIDIA_HOPPER, triton.__version__, BK):
        raise ValueError(f"chunk_gdn_round: fla's gated chunk_bwd_dqkwg kernel miscompiles on Hopper with Triton "
                         f"{triton.__version__} (3.4 <= Triton < 3.7.1) at BK=64 (fla issue #640), the block width "
                         f"K={K} gives here; use Triton >= 3.7.1 or gdn_round_impl='kda_kernels'")
    NT = len(chunk_indices)
    NK = triton.cdiv(K, BK)
    dq = q.new_empty(B, T, HV, K)
    dk = k.new_empty(B, T, HV, K)
    dg = torch.empty(NK, *g.shape, dtype=torch.float32, device=g.device)
    dw = torch.empty_like(w)
    chunk_gdn_bwd_kernel_dqkwg[(NK * NT, HV)](
        q=q, k=k, v=v, g=g, h=h, do=do, dh=dh, dq=dq, dk=dk, dw=dw, dv=dv, dg=dg, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, scale=scale, T=T, H=H, HV=HV, K=K, V=V, BT=chunk_size, BK=BK, BV=BV)
    if H != HV:
        dq = dq.view(B, T, H, HV // H, K).sum(3)
        dk = dk.view(B, T, H, HV // H, K).sum(3)
    return dq, dk, dw, dg.sum(0)


class ChunkGDNRoundFunction(torch.autograd.Function):
    @staticmethod
    @input_guard
    @autocast_custom_fwd
    def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, chunk_offsets, state_slot,
                num_states, scale, output_final_state, use_qk_l2norm_in_kernel, chunk_size, inject_at_top):
        ctx.set_materialize_grads(False)
        q_rstd = k_rstd = None
        if use_qk_l2norm_in_kernel:
            q, q_rstd = l2norm_fwd_bucketed(q)
            k, k_rstd = l2norm_fwd_bucketed(k)
        num_chunks = chunk_indices.shape[0]
        g_cum = chunk_local_cumsum(g, chunk_size=chunk_size, scale=RCP_LN2, cu_seqlens=cu_seqlens,
                                   chunk_indices=chunk_indices)
        w, u, A = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g_cum, beta=beta, cu_seqlens=cu_seqlens,
                                                   chunk_size=chunk_size, chunk_indices=chunk_indices)
        h, v_new, final_state, boundary_states = kda_round_fwd_h(
            k, w, u, g_cum, initial_state, output_final_state, cu_seqlens, chunk_offsets, num_chunks, chunk_size,
            state_slot=state_slot, num_states=num_states)
        del w, u
        o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g_cum, scale=scale, cu_seqlens=cu_seqlens,
                        chunk_indices=chunk_indices, chunk_size=chunk_size)
        del h, v_new
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g_cum, beta, A, initial_state, cu_seqlens, chunk_indices,
                              chunk_offsets, state_slot)
        ctx.num_chunks, ctx.chunk_size, ctx.scale, ctx.inject_at_top = num_chunks, chunk_size, scale, inject_at_top
        ctx.use_l2, ctx.g_dtype = use_qk_l2norm_in_kernel, g.dtype
        return o.type_as(q), final_state, boundary_states

    @staticmethod
    @input_guard
    @autocast_custom_bwd
    def backward(ctx, do, dht, dhb):
        (q, q_rstd, k, k_rstd, v, g_cum, beta, A, initial_state, cu_seqlens, chunk_indices, chunk_offsets,
         state_slot) = ctx.saved_tensors
        BT, NTT, scale = ctx.chunk_size, ctx.num_chunks, ctx.scale
        if do is None:
            do = torch.zeros_like(v, dtype=q.dtype)
        w, u = recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=g_cum, cu_seqlens=cu_seqlens,
                                 chunk_indices=chunk_indices)
        h, v_new, _, _ = kda_round_fwd_h(k, w, u, g_cum, initial_state, False, cu_seqlens, chunk_offsets, NTT, BT)
        del u
        dv = chunk_bwd_dv_local(q=q, k=k, do=do, g=g_cum, scale=scale, cu_seqlens=cu_seqlens, chunk_size=BT,
                                chunk_indices=chunk_indices)
        dh, dh0, dv = kda_round_bwd_dh(q, k, w, g_cum, initial_state, dht, dhb, state_slot, do, dv, scale,
                                       cu_seqlens, chunk_offsets, NTT, BT, inject_at_top=ctx.inject_at_top)
        dq, dk, dw, dg = chunk_bwd_dqkwg_checked(q, k, v_new, do, h, dh, w, g_cum, dv, scale, cu_seqlens, BT,
                                                 chunk_indices)
        del h, dh, v_new, w
        dk2, dv, db, dg2 = prepare_wy_repr_bwd(k=k, v=v, beta=beta, A=A, dw=dw, du=dv, g=g_cum,
                                               cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
        dk.add_(dk2)
        dg.add_(dg2)
        dg = chunk_local_cumsum(dg, chunk_size=BT, reverse=True, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
        if ctx.use_l2:
            dq = l2norm_bwd_bucketed(q, q_rstd, dq)
            dk = l2norm_bwd_bucketed(k, k_rstd, dk)
        return (dq.to(q), dk.to(k), dv.to(v), dg.to(ctx.g_dtype), db.to(beta), dh0,
                None, None, None, None, None, None, None, None, None, None)


@tuned()
def chunk_gdn_round(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.LongTensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_seq=None,
    state_chunk=None,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = 64,
    cu_seqlens_cpu: torch.Tensor | None = None,
    scale: float | None = None,
    _inject_at_top: bool = False,
):
    """Chunked Gated DeltaNet over packed sequences that also returns requested chunk-boundary states.

    The contract of ``harts.ops.kda_round.chunk_kda_round`` with GDN's shapes: q, k [1, T, H, K] at the key
    heads (each serves HV / H value heads); v [1, T, HV, V]; g [1, T, HV] the per-head natural-log decay
    (<= 0; fp32 recommended, as fla); beta [1, T, HV]; cu_seqlens long [N+1]; initial_state fp32
    [N, HV, K, V]; scale defaults to K**-0.5. Request j asks for the fp32 state before sequence-local token
    ``chunk_size * state_chunk[j]`` of sequence ``state_seq[j]`` (chunk 0: the initial state; chunk
    ``ceil(T_n / chunk_size)``: the end state). Requests must be unique.

    Returns ``(o [1, T, HV, V] in q's dtype, final_state fp32 [N, HV, K, V] | None, boundary_states fp32
    [M, HV, K, V] | None)``, all differentiable (so is ``initial_state``). ``cu_seqlens_cpu``, a host copy of
    ``cu_seqlens``, keeps the checks and index building off the device. ``_inject_at_top`` is a deliberately
    wrong backward for negative-control tests only.
    """
    lens, seq, chunk = check_gdn_round_inputs(q, k, v, g, beta, cu_seqlens, initial_state, state_seq, state_chunk,
                                              chunk_size, cu_seqlens_cpu=cu_seqlens_cpu)
    if chunk_size not in SUPPORTED_CHUNK_SIZES:
        raise ValueError(f"chunk_gdn_round (Triton) supports chunk_size in {SUPPORTED_CHUNK_SIZES} (fla-core 0.6.0's "
                         f"GDN intra-chunk pieces), got {chunk_size}; use chunk_gdn_round_reference for other sizes")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"chunk_gdn_round (Triton) needs fp32/bf16/fp16 inputs, got {q.dtype}; "
                         "use chunk_gdn_round_reference for float64")
    if q.shape[-1] > 256:
        raise ValueError(f"chunk_gdn_round supports K <= 256 (as fla), got K={q.shape[-1]}")
    if g.dtype == torch.float64:
        raise ValueError("chunk_gdn_round (Triton): g is float64; pass it as float32 (or use the reference)")
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise ValueError(f"initial_state must be float32 (as fla), got {initial_state.dtype}")
    cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.long)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    chunk_indices, chunk_offsets, state_slot = round_indices(lens, chunk_size, seq, chunk, q.device)
    return ChunkGDNRoundFunction.apply(
        q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, chunk_offsets, state_slot, len(seq), scale,
        output_final_state, use_qk_l2norm_in_kernel, chunk_size, _inject_at_top)
