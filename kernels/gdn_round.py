"""Triton kernel for the q, k, w and gate gradients of one chunk of a Gated DeltaNet round.

The chunked gated delta rule, per value head and chunk of BT tokens (chunk-local positions i, j, t; g_t the
chunk-local cumulative log decay in log2 units, so token t's decay since the chunk start is 2^g_t; S the state
[K, V] entering the chunk; v_n the corrected values u - w S; M the causal decay mask, M_ij = 2^(g_i - g_j) for
i >= j and 0 above the diagonal)::

    o     = scale * (2^g * (q S) + (M * (q k^T)) v_n)
    S_end = 2^g_L S + (2^(g_L - g) * k)^T v_n                         (L: the chunk's last token)

Given do (the output gradient), dS (the gradient of S_end) and dv (the full gradient of v_n, state path
included, from the reverse state scan), with ds = do v_n^T [BT, BT] and P = scale * M * ds (the intra-chunk
attention gradient, diagonal P_tt = scale * do_t . v_t)::

    dq = scale * 2^g * (do S^T) + P k
    dk = 2^(g_L - g) * (v_n dS^T) + P^T q
    dw = -(dv S^T)                                                    (v_n = u - w S)

The gate: g_t enters as 2^g_t in o_t's state term, as 2^(g_t - g_j) and 2^(g_i - g_t) in the intra terms, and
g_L also as 2^g_L and 2^(g_L - g_j) in S_end. dg is the gradient with respect to the same cumulative decay in
natural-log units, g ln 2 (the decay the caller's cumsum produced, before its 1 / ln 2 scale), so each factor 2^x
contributes itself. With dq_S, dk_S the state-path parts of dq and dk above::

    dg_t = q_t . dq_S,t + sum_{j<t} P_tj (q_t . k_j) - sum_{i>t} P_it (q_i . k_t) - [t != L] k_t . dk_S,t
    dg_L += 2^g_L <S, dS> + sum_{j != L} k_j . dk_S,j

The diagonal P_tt (q_t . k_t) would enter dg_t once with each sign, and so would the chunk-end token's own
state term k_L . dk_S,L; both are left out of the sum rather than added and subtracted. They are O(1) while dg
is O(2^g): at per-token log decays near -20 a float32 sum that includes them leaves only their rounding error
(10-25x the true gate gradient); without them dg is as accurate as the chunk-cumulative log decays' own
rounding (|g| x BT x 2^-24 relative). The reverse cumsum that turns this into the per-token gate gradient and
the w/u (WY) part of dg are the caller's.

Every product whose transpose is needed is formed directly from its operands in the needed orientation (ds from
do and v_n^T, ds^T from v_n and do^T, both loaded from memory in that layout): the kernel has no tl.trans, of an
MMA result or otherwise. fla issue #640 traced a Hopper miscompile of fla's gated dqkwg kernel (3.4 <= Triton <
3.7.1) to ``tl.trans`` of an MMA result at block width BK = 64. This kernel has no such transpose, but whether it
is free of that miscompile has not been measured on a Hopper GPU, so the launcher keeps the refusal of that
configuration (``fla_640_affected``) until a GPU run against a float64 truth (``python -m
benchmarks.gdn_round``) shows it is not needed. Interpreter-safe: one autotune config under TRITON_INTERPRET=1,
no casts of loop variables.

Legend: T packed tokens, N sequences, H key heads, HV value heads (each key head serves G = HV / H of them),
K/V head dims, BT chunk size, NT total chunks, BK/BV key/value block widths, NK key blocks; tile suffixes
_TK [BT, BK], _TT [BT, BT], _VT [BV, BT], _VK [BV, BK], _TV [BT, BV], _T [BT], _K [BK].
"""
import torch
import triton
import triton.language as tl
from packaging.version import Version

from harts.env import ENV
from harts.kernels.kda_round import _cols, _rows
from harts.ops._fla import check_shared_mem

_INTERPRET = ENV.triton_interpret

def _configs():
    if _INTERPRET:
        return [triton.Config({}, num_warps=4, num_stages=1)]
    return [triton.Config({}, num_warps=w, num_stages=s) for w in (2, 4, 8) for s in (2, 3, 4)]


@triton.autotune(configs=_configs(), key=['H', 'HV', 'K', 'V', 'BT', 'BK', 'BV'])
@triton.jit(do_not_specialize=['T'])
def gdn_round_bwd_kernel_dqkwg(
    q, k, v_new, g, h, do, dh, dv, dq, dk, dw, dg, cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """One (chunk, value head, key block): dq, dk at the value head, dw, and this key block's share of dg."""
    i_c, i_hv, i_kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
    i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T_n = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos

    # bases of token 0 of the sequence at this head; token-major strides H*K (q, k), HV*V, HV*K, HV (g, dg)
    i_hk = i_hv // (HV // H)
    q += (bos * H + i_hk) * K
    k += (bos * H + i_hk) * K
    v_new += (bos * HV + i_hv) * V
    do += (bos * HV + i_hv) * V
    dv += (bos * HV + i_hv) * V
    dq += (bos * HV + i_hv) * K
    dk += (bos * HV + i_hv) * K
    dw += (bos * HV + i_hv) * K
    g += bos * HV + i_hv
    dg += (i_kb.to(tl.int64) * T + bos) * HV + i_hv  # dg holds one [T, HV] partial per key block
    h += (i_c.to(tl.int64) * HV + i_hv) * K * V  # [K, V] states of this chunk
    dh += (i_c.to(tl.int64) * HV + i_hv) * K * V

    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T_n
    o_k = i_kb * BK + tl.arange(0, BK)
    m_k = o_k < K

    b_dqS_TK = tl.zeros([BT, BK], dtype=tl.float32)  # do S^T
    b_dkS_TK = tl.zeros([BT, BK], dtype=tl.float32)  # v_n dS^T
    b_dw_TK = tl.zeros([BT, BK], dtype=tl.float32)  # dv S^T
    b_ds_TT = tl.zeros([BT, BT], dtype=tl.float32)  # do v_n^T
    b_dsT_TT = tl.zeros([BT, BT], dtype=tl.float32)  # v_n do^T, as its own product
    b_dd_T = tl.zeros([BT], dtype=tl.float32)  # do_t . v_n,t (the diagonal of ds)
    b_SdS_K = tl.zeros([BK], dtype=tl.float32)  # <S, dS> over this key block, per key row
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_v_TV = _rows(v_new, o_t, m_t, o_v, m_v, HV * V)
        b_do_TV = _rows(do, o_t, m_t, o_v, m_v, HV * V)
        b_dv_TV = _rows(dv, o_t, m_t, o_v, m_v, HV * V)
        b_vT_VT = _cols(v_new, o_t, m_t, o_v, m_v, HV * V)
        b_doT_VT = _cols(do, o_t, m_t, o_v, m_v, HV * V)
        # S^T and dS^T tiles: element (v, k) of a [K, V] state sits at k * V + v
        b_ST_VK = _cols(h, o_k, m_k, o_v, m_v, V)
        b_dST_VK = _cols(dh, o_k, m_k, o_v, m_v, V)
        b_dqS_TK = tl.dot(b_do_TV, b_ST_VK.to(b_do_TV.dtype), b_dqS_TK)
        b_dkS_TK = tl.dot(b_v_TV, b_dST_VK.to(b_v_TV.dtype), b_dkS_TK)
        b_dw_TK = tl.dot(b_dv_TV, b_ST_VK.to(b_dv_TV.dtype), b_dw_TK)
        b_ds_TT = tl.dot(b_do_TV, b_vT_VT.to(b_do_TV.dtype), b_ds_TT)
        b_dsT_TT = tl.dot(b_v_TV, b_doT_VT.to(b_v_TV.dtype), b_dsT_TT)
        b_dd_T += tl.sum(b_do_TV.to(tl.float32) * b_v_TV.to(tl.float32), axis=1)
        b_SdS_K += tl.sum(b_ST_VK.to(tl.float32) * b_dST_VK.to(tl.float32), axis=0)
    tl.store(dw + o_t[:, None] * (HV * K) + o_k[None, :], (-b_dw_TK).to(dw.dtype.element_ty),
             mask=m_t[:, None] & m_k[None, :])

    b_q_TK = _rows(q, o_t, m_t, o_k, m_k, H * K)
    b_k_TK = _rows(k, o_t, m_t, o_k, m_k, H * K)
    b_g_T = tl.load(g + o_t * HV, mask=m_t, other=0.).to(tl.float32)
    i_L = tl.minimum(i_t * BT + BT, T_n) - 1
    b_gL = tl.load(g + i_L * HV).to(tl.float32)
    m_L = o_t == i_L

    # state paths
    b_dq_TK = b_dqS_TK * (scale * tl.exp2(b_g_T))[:, None]
    b_dkS_TK = b_dkS_TK * tl.where(m_t, tl.exp2(b_gL - b_g_T), 0.)[:, None]
    b_dkSo_TK = tl.where(m_L[:, None], 0., b_dkS_TK)  # without the chunk-end token's own (cancelling) term

    # intra-chunk, strictly causal: P[i, j] (i > j) and P^T[j, i], each with its decay in its own orientation;
    # the exponent is zeroed outside the mask so no overflowing 2^(g_j - g_i), i < j, is ever formed
    m_lo_TT = (o_t[:, None] > o_t[None, :]) & m_t[:, None]
    m_up_TT = (o_t[:, None] < o_t[None, :]) & m_t[None, :]
    b_P_TT = tl.where(m_lo_TT, b_ds_TT * tl.exp2(tl.where(m_lo_TT, b_g_T[:, None] - b_g_T[None, :], 0.)), 0.)
    b_PT_TT = tl.where(m_up_TT, b_dsT_TT * tl.exp2(tl.where(m_up_TT, b_g_T[None, :] - b_g_T[:, None], 0.)), 0.)
    b_dqP_TK = tl.dot((b_P_TT * scale).to(b_k_TK.dtype), b_k_TK)
    b_dkP_TK = tl.dot((b_PT_TT * scale).to(b_q_TK.dtype), b_q_TK)

    b_q32_TK = b_q_TK.to(tl.float32)
    b_k32_TK = b_k_TK.to(tl.float32)
    b_dg_T = tl.sum(b_q32_TK * (b_dq_TK + b_dqP_TK), axis=1) - tl.sum(b_k32_TK * (b_dkP_TK + b_dkSo_TK), axis=1)
    b_dgL = tl.sum(b_SdS_K) * tl.exp2(b_gL) + tl.sum(b_k32_TK * b_dkSo_TK)
    b_dg_T = tl.where(m_L, b_dg_T + b_dgL, b_dg_T)
    tl.store(dg + o_t * HV, b_dg_T.to(dg.dtype.element_ty), mask=m_t)

    # the diagonal of P joins dq and dk (not dg: it cancels there)
    b_dd_T = b_dd_T * scale
    b_dq_TK += b_dqP_TK + b_dd_T[:, None] * b_k32_TK
    b_dk_TK = b_dkS_TK + b_dkP_TK + b_dd_T[:, None] * b_q32_TK
    m_tk = m_t[:, None] & m_k[None, :]
    tl.store(dq + o_t[:, None] * (HV * K) + o_k[None, :], b_dq_TK.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + o_t[:, None] * (HV * K) + o_k[None, :], b_dk_TK.to(dk.dtype.element_ty), mask=m_tk)


def fla_640_affected(is_hopper: bool, triton_version: str, BK: int) -> bool:
    """The configuration fla issue #640 bisected its gated dqkwg miscompile to: Hopper, 3.4 <= Triton < 3.7.1,
    BK = 64."""
    v = Version(triton_version)
    return is_hopper and Version("3.4.0") <= v < Version("3.7.1") and BK == 64


def _tile_cap(device: torch.device, tensors) -> int:
    """Largest BK / BV: the five fp32 [BT, BK|BT] accumulators and the staged tiles must fit the device's shared
    memory and registers. fla's shared-memory classes (``check_shared_mem``), decided as its own dqkwg wrapper
    decides its tiling; 32 off-GPU (interpreter)."""
    if device.type != "cuda":
        return 32
    if check_shared_mem("hopper", device.index):
        return 128
    if check_shared_mem("ampere", device.index):
        return 128 if all(x.element_size() == 2 for x in tensors) else 64
    return 64 if check_shared_mem("ada", device.index) else 32


def gdn_round_bwd_dqkwg(q, k, v_new, do, h, dh, dv, g, scale, cu_seqlens, chunk_indices, chunk_size):
    """dq, dk, dw and the chunk-local gate gradient of a GDN round's backward (module docstring for the math).

    q, k [1, T, H, K]; v_new, do, dv [1, T, HV, V]; h, dh [1, NT, HV, K, V] (the state entering each chunk and
    the gradient of the state leaving it); g [1, T, HV] fp32 chunk-local cumulative log2 decays; cu_seqlens
    long [N+1]; chunk_indices [NT, 2] (sequence, chunk within it). Returns dq, dk [1, T, H, K] (summed over each
    key head's value heads), dw [1, T, HV, K] in k's dtype, dg [1, T, HV] fp32 (before the reverse cumsum).
    Raises ValueError for a batch other than 1 and for the configuration ``fla_640_affected`` names."""
    B, T, H, K = k.shape
    HV, V = v_new.shape[2], v_new.shape[-1]
    if B != 1:
        raise ValueError(f"gdn_round_bwd_dqkwg: packed varlen inputs need batch 1, got k {tuple(k.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"gdn_round_bwd_dqkwg: q {tuple(q.shape)} and k {tuple(k.shape)} differ")
    if HV % H:
        raise ValueError(f"gdn_round_bwd_dqkwg: value heads HV={HV} are not a multiple of key heads H={H}")
    cap = _tile_cap(k.device, (q, k, v_new, do, h, dh, dv))
    BK = min(max(triton.next_power_of_2(K), 16), cap)
    BV = min(max(triton.next_power_of_2(V), 16), cap)
    if k.device.type == "cuda":
        is_hopper = torch.cuda.get_device_capability(k.device)[0] == 9
        if fla_640_affected(is_hopper, triton.__version__, BK):
            raise ValueError(
                f"gdn_round_bwd_dqkwg: Hopper with Triton {triton.__version__} (3.4 <= Triton < 3.7.1) at BK=64, the "
                f"block width K={K} gives here, is the configuration of fla issue #640's dqkwg miscompile and is not "
                f"yet measured for this kernel; use Triton >= 3.7.1 or gdn_round_impl='kda_kernels'")
    NT, NK = chunk_indices.shape[0], triton.cdiv(K, BK)
    dq = q.new_empty(B, T, HV, K)
    dk = k.new_empty(B, T, HV, K)
    dw = k.new_empty(B, T, HV, K)
    dg = torch.empty(NK, B, T, HV, dtype=torch.float32, device=g.device)
    gdn_round_bwd_kernel_dqkwg[(NT, HV, NK)](
        q=q, k=k, v_new=v_new, g=g, h=h, do=do, dh=dh, dv=dv, dq=dq, dk=dk, dw=dw, dg=dg, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, scale=scale, T=T, H=H, HV=HV, K=K, V=V, BT=chunk_size, BK=BK, BV=BV)
    if H != HV:
        dq = dq.view(B, T, H, HV // H, K).sum(3)
        dk = dk.view(B, T, H, HV // H, K).sum(3)
    return dq, dk, dw, dg.sum(0)
