"""Pure-torch reference for KDA rounds with chunk-boundary states.

The reference is the per-token KDA recurrence, run for all packed sequences at once (sequences are
padded to the longest one; padded steps use decay 0 and beta 0, which leave the state untouched
exactly). It records the state at every multiple of ``chunk_size`` so any (sequence, chunk)
boundary can be returned, and it is differentiable end to end by autograd. It accepts any
chunk size and computes in float64 when given float64 inputs, so it is the exact CPU path used by
the float64 equality tests of the whole system; in float32 it is the oracle for the Triton path.

Legend (shape suffixes are spelled out in the signatures, fla's conventions):
    T  packed tokens (batch is always 1), N sequences, H query/key heads, HV value heads (GVA when
    HV > H), K key dim, V value dim, M requested boundary states, BT chunk size.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from harts.ops.recompute import recompute_in_backward

L2NORM_EPS = 1e-6  # fla.modules.norm.l2norm default


def _int_list(x) -> list:
    """Request ids as Python ints (lists stay on the host; tensors are flattened)."""
    if x is None:
        return []
    if isinstance(x, (list, tuple)) and all(type(v) is int for v in x):
        return list(x)
    return [int(v) for v in torch.as_tensor(x).reshape(-1).tolist()]


@functools.lru_cache(maxsize=256)
def _check_requests(lens: tuple, seq: tuple, chunk: tuple, chunk_size: int) -> None:
    """Range and uniqueness of boundary requests. Cached: every KDA layer of a microbatch (and its
    recomputation) repeats the same layout, and this Python loop would otherwise run before each call."""
    N = len(lens)
    seen = {}
    for j, (n, c) in enumerate(zip(seq, chunk)):
        if not 0 <= n < N:
            raise ValueError(f"boundary request {j}: sequence {n} is out of range [0, {N})")
        nt = -(-lens[n] // chunk_size)
        if not 0 <= c <= nt:
            raise ValueError(f"boundary request {j}: chunk {c} of sequence {n} is out of range [0, {nt}] "
                             f"(length {lens[n]}, chunk_size {chunk_size}; chunk {nt} is the end state)")
        if (n, c) in seen:
            raise ValueError(f"boundary requests {seen[n, c]} and {j} both ask for (sequence {n}, chunk {c}); "
                             "request each boundary once and index the result")
        seen[n, c] = j


def check_round_inputs(q, k, v, g, beta, cu_seqlens, initial_state, state_seq, state_chunk, chunk_size,
                       use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None, safe_gate=False,
                       cu_seqlens_cpu=None):
    """Validate a round call and return (lens [N] python ints, seq [M], chunk [M]) as host lists.

    Errors name the offending argument or request so callers can find a bad plan quickly. The lengths
    are read from ``cu_seqlens_cpu`` when given (a host copy of ``cu_seqlens``): reading a device
    tensor would synchronise the stream on every call.
    """
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q must be [1, T, H, K] (varlen, batch 1), got {tuple(q.shape)}")
    _, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:2] != (1, T):
        raise ValueError(f"v must be [1, T={T}, HV, V], got {tuple(v.shape)}")
    HV = v.shape[2]
    if HV % H != 0:
        raise ValueError(f"value heads HV={HV} must be a multiple of query/key heads H={H}")
    if g.shape != (1, T, HV, K):
        raise ValueError(f"g must be [1, T, HV, K]={[1, T, HV, K]}, got {list(g.shape)}")
    if beta.shape != (1, T, HV):
        raise ValueError(f"beta must be [1, T, HV]={[1, T, HV]}, got {list(beta.shape)}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if cu_seqlens is None or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D tensor [N+1] of packed sequence offsets")
    if cu_seqlens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"cu_seqlens must be an integer (long) tensor, got {cu_seqlens.dtype}")
    if cu_seqlens_cpu is not None:
        if cu_seqlens_cpu.device.type != "cpu" or tuple(cu_seqlens_cpu.shape) != tuple(cu_seqlens.shape):
            raise ValueError(f"cu_seqlens_cpu must be a host tensor shaped like cu_seqlens {tuple(cu_seqlens.shape)}, "
                             f"got {tuple(cu_seqlens_cpu.shape)} on {cu_seqlens_cpu.device}")
    cu = [int(x) for x in (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).tolist()]
    name = "cu_seqlens" if cu_seqlens_cpu is None else "cu_seqlens_cpu (the host copy of cu_seqlens)"
    if cu[0] != 0 or cu[-1] != T:
        raise ValueError(f"{name} must start at 0 and end at T={T}, got {cu[0]}..{cu[-1]}")
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    for n, ln in enumerate(lens):
        if ln < 0:
            raise ValueError(f"{name} is decreasing at sequence {n}: {cu[n]} -> {cu[n + 1]}")
    N = len(lens)
    if initial_state is not None and tuple(initial_state.shape) != (N, HV, K, v.shape[3]):
        raise ValueError(f"initial_state must be [N, HV, K, V]={[N, HV, K, v.shape[3]]}, "
                         f"got {list(initial_state.shape)}")
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise ValueError("A_log must be given when use_gate_in_kernel=True and lower_bound is None")
        if A_log is not None and A_log.numel() != HV:
            raise ValueError(f"A_log must have HV={HV} elements, got {A_log.numel()}")
        if dt_bias is not None and dt_bias.numel() != HV * K:
            raise ValueError(f"dt_bias must have HV*K={HV * K} elements, got {dt_bias.numel()}")
        if safe_gate and (lower_bound is None or not (-5 <= lower_bound < 0)):
            raise ValueError(f"safe_gate with the gate in kernel needs lower_bound in [-5, 0), got {lower_bound}")
    if (state_seq is None) != (state_chunk is None):
        raise ValueError("state_seq and state_chunk must be given together")
    seq, chunk = _int_list(state_seq), _int_list(state_chunk)
    if len(seq) != len(chunk):
        raise ValueError(f"state_seq has {len(seq)} entries but state_chunk has {len(chunk)}")
    _check_requests(tuple(lens), tuple(seq), tuple(chunk), chunk_size)
    return lens, seq, chunk


def kda_gate_reference(g, A_log=None, dt_bias=None, lower_bound=None):
    """fla's in-kernel gate in torch, in g's dtype (the lower-bound form whenever lower_bound is set)."""
    HV, K = g.shape[-2:]
    if dt_bias is not None:
        g = g + dt_bias.to(g.dtype).view(HV, K)
    if lower_bound is not None:
        if A_log is not None:
            g = A_log.to(g.dtype).view(HV, 1).exp() * g
        return lower_bound * torch.sigmoid(g)
    return -A_log.to(g.dtype).view(HV, 1).exp() * F.softplus(g)


def _token_steps(S, q_NLHK, k_NLHK, v_NLHV, a_NLHK, b_NLH):
    """The delta-rule recurrence over L consecutive tokens of every sequence: S_t = a_t S_{t-1} +
    beta_t k_t (v_t - k_t^T a_t S_{t-1})^T, o_t = q_t^T S_t. Returns (S after the last token, o [N, L, HV, V])."""
    outs = []
    for t in range(q_NLHK.shape[1]):
        kt = k_NLHK[:, t]
        S = S * a_NLHK[:, t, :, :, None]
        err_NHV = v_NLHV[:, t] - torch.einsum('nhk,nhkv->nhv', kt, S)
        S = S + torch.einsum('nhk,nhv->nhkv', b_NLH[:, t, :, None] * kt, err_NHV)
        outs.append(torch.einsum('nhk,nhkv->nhv', q_NLHK[:, t], S))
    return S, torch.stack(outs, dim=1)


def chunk_kda_round_reference(
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
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    chunk_size: int = 64,
    cu_seqlens_cpu: torch.Tensor | None = None,
):
    """Same contract as ``chunk_kda_round``; exact per-token recurrence, any chunk_size, float64-capable.

    Computes in float64 for float64 inputs and float32 otherwise. Returns o [1,T,HV,V] in q's dtype,
    final_state [N,HV,K,V] (or None) and boundary_states [M,HV,K,V] (or None) in the compute dtype.
    ``safe_gate`` only selects a kernel in fla; here it is validated and otherwise has no effect.
    """
    lens, seq, chunk = check_round_inputs(q, k, v, g, beta, cu_seqlens, initial_state, state_seq, state_chunk,
                                          chunk_size, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate,
                                          cu_seqlens_cpu=cu_seqlens_cpu)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    _, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N, BT = len(lens), chunk_size
    scale = K ** -0.5 if scale is None else scale

    q_THK, k_THK, v_THV, g_THK, b_TH = (x[0].to(acc) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q_THK = q_THK * torch.rsqrt(q_THK.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)
        k_THK = k_THK * torch.rsqrt(k_THK.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)
    if use_gate_in_kernel:
        g_THK = kda_gate_reference(g_THK, A_log, dt_bias, lower_bound)
    q_THK = q_THK.repeat_interleave(HV // H, dim=1) * scale
    k_THK = k_THK.repeat_interleave(HV // H, dim=1)

    # Pad to [N, Tmax, ...]; padded steps get g = 0 and beta = 0, so S passes through unchanged.
    Tmax = max(lens) if lens else 0
    starts = cu_seqlens[:-1].to(device=q.device, dtype=torch.long)
    lens_N = torch.tensor(lens, device=q.device, dtype=torch.long)
    pos_L = torch.arange(Tmax, device=q.device)
    valid_NL = pos_L[None, :] < lens_N[:, None]
    idx_NL = torch.where(valid_NL, starts[:, None] + pos_L[None, :], torch.zeros_like(valid_NL, dtype=torch.long))

    def pad(x):
        m = valid_NL.view(*valid_NL.shape, *([1] * (x.dim() - 1)))
        return torch.where(m, x[idx_NL], torch.zeros((), dtype=x.dtype, device=x.device))

    q_NLHK, k_NLHK, v_NLHV, g_NLHK, b_NLH = (pad(x) for x in (q_THK, k_THK, v_THV, g_THK, b_TH))
    a_NLHK = g_NLHK.exp()

    if initial_state is not None:
        S = initial_state.to(acc)
    else:
        S = torch.zeros(N, HV, K, V, dtype=acc, device=q.device)
    snaps = []  # snaps[c] = S before local token c*BT (for every sequence at once)
    o_chunks = []
    # Under autograd each chunk's token steps are recomputed in backward: the graph then holds one
    # [N, HV, K, V] state per chunk instead of one per token (GBs at K = V = 128), and the recomputation
    # repeats the same operations, so values and gradients are unchanged.
    for t0 in range(0, Tmax, BT):
        snaps.append(S)
        sl = slice(t0, min(t0 + BT, Tmax))
        args = (S, q_NLHK[:, sl], k_NLHK[:, sl], v_NLHV[:, sl], a_NLHK[:, sl], b_NLH[:, sl])
        S, o_c = recompute_in_backward(_token_steps, *args)
        o_chunks.append(o_c)
    snaps.append(S)  # index ceil(Tmax/BT): the end state of every sequence

    if Tmax > 0:
        o_NLHV = torch.cat(o_chunks, dim=1)
        o_THV = o_NLHV[valid_NL]
    else:
        o_THV = v_THV.new_zeros(0, HV, V)
    o = o_THV.to(q.dtype)[None]
    final_state = S if output_final_state else None
    boundary_states = None
    if seq:
        boundary_states = torch.stack([snaps[min(c, len(snaps) - 1)][n] for n, c in zip(seq, chunk)])
    return o, final_state, boundary_states
