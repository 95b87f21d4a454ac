"""Triton state-recurrence kernels for KDA rounds with chunk-boundary states.

These replace the two sequential kernels of fla-core 0.6.0's chunked KDA (the forward state scan
``chunk_gated_delta_rule_fwd_kernel_h_blockdim64`` and the backward dh scan
``chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64``), specialised to KDA (per-key-channel decay
``gk`` in log2 units, [K, V] state layout, varlen only) and extended with boundary states:

* forward: for every requested (sequence n, chunk c) the fp32 state S_start(c) is stored into
  ``hb[slot]`` at the top of iteration c (next to the chunk's h store); c == NT_n (the end state)
  is stored after the loop.
* backward: the incoming gradient dhb[slot] of S_start(c) is added to the running dh at the bottom
  of iteration c (after the decay/update, where the running value is exactly dL/dS_start(c)), so
  it reaches dh[c-1], dv2 of chunk c-1 and everything earlier, and dh0 for c == 0; the end-state
  gradient is added before the loop like dht.

Requests are looked up through ``state_slot`` [NT_total + N] (int32, -1 = not requested), indexed
by the boundary id ``chunk_offsets[n] + n + c``. All other KDA kernels are fla's.
The state block is one [BK, BV] fp32 tile (BK = K rounded up to a power of two).
Interpreter-safe: one autotune config under TRITON_INTERPRET=1, no casts of loop variables, no
Python min/max on runtime values, branch-free masked boundary loads/stores.

Legend: T packed tokens, N sequences, HV heads (k/w/q are already expanded to HV by fla's
recompute_w_u), K key dim, V value dim, BT chunk size, NT_total total chunks, M boundary states.
"""
import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _configs():
    if _INTERPRET:
        return [triton.Config({'BV': 32}, num_warps=4, num_stages=1)]
    return [triton.Config({'BV': bv}, num_warps=w, num_stages=s)
            for bv in (32, 64) for w in (2, 4) for s in (2, 3, 4)]


@triton.heuristics({
    'USE_INITIAL_STATE': lambda a: a['h0'] is not None,
    'STORE_FINAL_STATE': lambda a: a['ht'] is not None,
})
@triton.autotune(configs=_configs(), key=['HV', 'K', 'V', 'BT', 'BK', 'SAVE_BOUNDARY'])
@triton.jit(do_not_specialize=['T'])
def kda_round_fwd_kernel_h(
    k, u, w, v_new, gk, h, h0, ht, hb, state_slot, cu_seqlens, chunk_offsets, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, SAVE_BOUNDARY: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos
    NT = tl.cdiv(T, BT)
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    bid = boh + i_n  # boundary id of (n, c = 0)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]

    # per-(sequence, head) bases; token t of the sequence is at +t*HV*{K,V}
    k += (bos * HV + i_h) * K
    w += (bos * HV + i_h) * K
    gk += (bos * HV + i_h) * K
    u += (bos * HV + i_h) * V
    v_new += (bos * HV + i_h) * V
    h += (boh * HV + i_h) * K * V

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + i_nh.to(tl.int64) * K * V + o_kv, mask=m_kv, other=0.).to(tl.float32)
    s_nx = tl.load(state_slot + bid) if SAVE_BOUNDARY else 0

    for i_t in range(0, NT):
        # S_start(i_t): the chunk's h (input dtype) and, if requested, the fp32 boundary state
        tl.store(h + o_kv, b_h.to(h.dtype.element_ty), mask=m_kv)
        h += HV * K * V  # pointer walk: 64-bit, no cast of the loop variable
        if SAVE_BOUNDARY:
            # the slot of this chunk was fetched one iteration ahead, off the scan's critical path
            s_j = s_nx
            s_nx = tl.load(state_slot + bid + i_t + 1)
            p_hb = hb + (tl.maximum(s_j, 0).to(tl.int64) * HV + i_h) * K * V + o_kv
            tl.store(p_hb, b_h, mask=m_kv & (s_j >= 0))

        o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
        m_t = o_t < T
        b_w = tl.load(w + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.)
        b_u = tl.load(u + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.)
        b_v = b_u.to(tl.float32) - tl.dot(b_w, b_h.to(b_w.dtype))
        tl.store(v_new + o_t[:, None] * (HV * V) + o_v[None, :], b_v.to(v_new.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])

        i_last = (tl.minimum(i_t * BT + BT, T) - 1).to(tl.int64)
        b_gl = tl.load(gk + i_last * HV * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_h *= tl.exp2(b_gl)[:, None]
        b_kt = tl.load(k + o_t[None, :] * (HV * K) + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.)
        b_h = tl.dot(b_kt, b_v.to(b_kt.dtype), b_h)

    if STORE_FINAL_STATE:
        tl.store(ht + i_nh.to(tl.int64) * K * V + o_kv, b_h, mask=m_kv)
    if SAVE_BOUNDARY:
        s_j = s_nx  # slot of chunk NT (the end state)
        p_hb = hb + (tl.maximum(s_j, 0).to(tl.int64) * HV + i_h) * K * V + o_kv
        tl.store(p_hb, b_h, mask=m_kv & (s_j >= 0))


@triton.heuristics({
    'USE_INITIAL_STATE': lambda a: a['dh0'] is not None,
    'USE_FINAL_STATE_GRADIENT': lambda a: a['dht'] is not None,
})
@triton.autotune(configs=_configs(), key=['HV', 'K', 'V', 'BT', 'BK', 'USE_BOUNDARY_GRADIENT'])
@triton.jit(do_not_specialize=['T'])
def kda_round_bwd_kernel_dh(
    qg, k, w, gk, dht, dh0, dhb, state_slot, do, dv, dh, dv2, cu_seqlens, chunk_offsets, scale, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, USE_FINAL_STATE_GRADIENT: tl.constexpr, USE_BOUNDARY_GRADIENT: tl.constexpr,
    INJECT_AT_TOP: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos
    NT = tl.cdiv(T, BT)
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    bid = boh + i_n

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]

    qg += (bos * HV + i_h) * K
    k += (bos * HV + i_h) * K
    w += (bos * HV + i_h) * K
    gk += (bos * HV + i_h) * K
    do += (bos * HV + i_h) * V
    dv += (bos * HV + i_h) * V
    dv2 += (bos * HV + i_h) * V
    dh += (boh * HV + i_h) * K * V

    # running b_dh = dL/dS_end(current chunk); starts as the end-state gradient
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_FINAL_STATE_GRADIENT:
        b_dh += tl.load(dht + i_nh.to(tl.int64) * K * V + o_kv, mask=m_kv, other=0.)
    if USE_BOUNDARY_GRADIENT:
        s_j = tl.load(state_slot + bid + NT)
        p_dhb = dhb + (tl.maximum(s_j, 0).to(tl.int64) * HV + i_h) * K * V + o_kv
        b_dh += tl.load(p_dhb, mask=m_kv & (s_j >= 0), other=0.)
        s_nx = tl.load(state_slot + bid + tl.maximum(NT - 1, 0))
    else:
        s_nx = 0

    for i_r in range(0, NT):
        i_t = NT - 1 - i_r
        if USE_BOUNDARY_GRADIENT:
            # this chunk's request (slot fetched one iteration ahead) and its gradient tile, loaded
            # at the top so the latency overlaps the chunk's products; added at the bottom
            s_j = s_nx
            s_nx = tl.load(state_slot + bid + tl.maximum(i_t - 1, 0))
            p_dhb = dhb + (tl.maximum(s_j, 0).to(tl.int64) * HV + i_h) * K * V + o_kv
            b_inj = tl.load(p_dhb, mask=m_kv & (s_j >= 0), other=0.)
            if INJECT_AT_TOP:  # deliberately wrong placement (gradient of S_end), negative-control test only
                b_dh += b_inj
        tl.store(dh + i_t.to(tl.int64) * HV * K * V + o_kv, b_dh.to(dh.dtype.element_ty), mask=m_kv)

        o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
        m_t = o_t < T
        m_tv = m_t[:, None] & m_v[None, :]
        i_last = (tl.minimum(i_t * BT + BT, T) - 1).to(tl.int64)
        b_gl = tl.load(gk + i_last * HV * K + o_k, mask=m_k, other=0.).to(tl.float32)

        # dv2 = kg dh + dv_local  (gradient of v_new of this chunk)
        b_k = tl.load(k + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.)
        b_dv = tl.dot(b_k, b_dh.to(b_k.dtype))
        b_dv += tl.load(dv + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_tv, other=0.).to(tl.float32)
        tl.store(dv2 + o_t[:, None] * (HV * V) + o_v[None, :], b_dv.to(dv2.dtype.element_ty), mask=m_tv)

        # dS_start = diag(2^gl) dS_end + scale qg^T do - w^T dv2
        b_qt = tl.load(qg + o_t[None, :] * (HV * K) + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.)
        b_wt = tl.load(w + o_t[None, :] * (HV * K) + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.)
        b_do = tl.load(do + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_tv, other=0.)
        b_dh *= tl.exp2(b_gl)[:, None]
        b_dh += tl.dot(b_qt, b_do.to(b_qt.dtype)) * scale - tl.dot(b_wt, b_dv.to(b_wt.dtype))
        if USE_BOUNDARY_GRADIENT:
            if not INJECT_AT_TOP:  # b_dh is now exactly dL/dS_start(i_t): add the request's gradient
                b_dh += b_inj

    if USE_INITIAL_STATE:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + o_kv, b_dh, mask=m_kv)


def _bk(K):
    return max(16, triton.next_power_of_2(K))


def kda_round_fwd_h(kg, w, u, gk, initial_state, output_final_state, cu_seqlens, chunk_offsets, num_chunks,
                    chunk_size, state_slot=None, num_states=0):
    """State scan. Returns h [1, NT_total, HV, K, V] (kg's dtype), v_new (u's dtype),
    final_state [N, HV, K, V] fp32 or None, boundary_states [M, HV, K, V] fp32 or None."""
    _, T, HV, K = kg.shape
    V, N = u.shape[-1], cu_seqlens.numel() - 1
    h = kg.new_empty(1, num_chunks, HV, K, V)
    v_new = torch.empty_like(u)
    ht = kg.new_zeros(N, HV, K, V, dtype=torch.float32) if output_final_state else None
    # every slot is written exactly once (requests are unique and in range, checked by the caller): no memset
    hb = kg.new_empty(num_states, HV, K, V, dtype=torch.float32) if (state_slot is not None and num_states) else None

    def grid(meta):
        return (triton.cdiv(V, meta['BV']), N * HV)
    kda_round_fwd_kernel_h[grid](
        k=kg, u=u, w=w, v_new=v_new, gk=gk, h=h, h0=initial_state, ht=ht, hb=hb, state_slot=state_slot,
        cu_seqlens=cu_seqlens, chunk_offsets=chunk_offsets, T=T, HV=HV, K=K, V=V, BT=chunk_size, BK=_bk(K),
        SAVE_BOUNDARY=hb is not None,
    )
    return h, v_new, ht, hb


def kda_round_bwd_dh(qg, kg, w, gk, h0, dht, dhb, state_slot, do, dv, scale, cu_seqlens, chunk_offsets,
                     num_chunks, chunk_size, inject_at_top=False):
    """Reverse dh scan. Returns dh [1, NT_total, HV, K, V] (qg's dtype), dh0 fp32 or None, dv2 (dv's dtype)."""
    _, T, HV, K = qg.shape
    V, N = do.shape[-1], cu_seqlens.numel() - 1
    dh = qg.new_empty(1, num_chunks, HV, K, V)
    dh0 = torch.empty_like(h0, dtype=torch.float32) if h0 is not None else None
    dv2 = torch.empty_like(dv)
    if dhb is None:
        state_slot = None

    def grid(meta):
        return (triton.cdiv(V, meta['BV']), N * HV)
    kda_round_bwd_kernel_dh[grid](
        qg=qg, k=kg, w=w, gk=gk, dht=dht, dh0=dh0, dhb=dhb, state_slot=state_slot, do=do, dv=dv, dh=dh, dv2=dv2,
        cu_seqlens=cu_seqlens, chunk_offsets=chunk_offsets, scale=scale, T=T, HV=HV, K=K, V=V, BT=chunk_size,
        BK=_bk(K), USE_BOUNDARY_GRADIENT=dhb is not None, INJECT_AT_TOP=inject_at_top,
    )
    return dh, dh0, dv2
