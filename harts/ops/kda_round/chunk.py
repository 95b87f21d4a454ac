"""Fast path of KDA rounds: fla-core 0.6.0's chunked KDA with our two state-recurrence kernels.

Everything except the forward state scan and the backward dh scan is fla's (gate/cumsum, intra-chunk
WY solve, recompute_w_u, output, dAv, wy_dqkg, intra backward, gate backward, l2norm). The two scans
(``harts.kernels.kda_round``) additionally write the fp32 state at the start of requested chunks and
add those states' incoming gradients at the matching point of the reverse scan, so boundary states
are differentiable outputs that later rounds feed back as ``initial_state``.

Legend: T packed tokens, N sequences, H q/k heads, HV value heads, K/V head dims, M requested
boundary states, BT chunk size (fla supports 32 and 64).
"""
from __future__ import annotations

import functools
import logging

import torch
import triton

from harts.kernels.kda_round import kda_round_bwd_dh, kda_round_fwd_h
from harts.ops._fla import (
    RCP_LN2,
    autocast_custom_bwd,
    autocast_custom_fwd,
    chunk_gla_fwd_kernel_o,
    chunk_kda_bwd_dAv,
    chunk_kda_bwd_intra,
    chunk_kda_bwd_wy_dqkg_fused,
    chunk_kda_fwd_intra,
    chunk_local_cumsum,
    input_guard,
    kda_gate_bwd,
    kda_gate_chunk_cumsum,
    prepare_chunk_indices,
    prepare_chunk_offsets,
)
from harts.ops._fla import kda_recompute_w_u_fwd as recompute_w_u_fwd
from harts.ops.kda_round.naive import check_round_inputs
from harts.ops.norm.fast import l2norm_bwd_bucketed, l2norm_fwd_bucketed
from harts.ops.tuning import tuned

log = logging.getLogger(__name__)

SUPPORTED_CHUNK_SIZES = (32, 64)  # fla-core 0.6.0's intra-chunk kernels; the reference takes any size


def round_indices(lens, chunk_size, seq, chunk, device):
    """Cached by layout (fla caches its chunk indices the same way, per cu_seqlens tensor): all KDA
    layers of a microbatch and their recomputation share one round's layout, so the host work and the
    copies happen once per round instead of once per call. The returned tensors are read-only inputs."""
    return _round_indices(tuple(lens), chunk_size, tuple(seq), tuple(chunk), str(torch.device(device)))


@functools.lru_cache(maxsize=64)
def _round_indices(lens, chunk_size, seq, chunk, device):
    """fla's chunk indices and offsets and our boundary slot map, built on the host from the sequence
    lengths and copied up without blocking (reading them from the device would sync the stream).

    state_slot: int32 [NT_total + N], boundary id chunk_offsets[n] + n + c -> request index (-1 = none),
    or None without requests."""
    cu = torch.tensor([0, *lens], dtype=torch.long).cumsum(0)
    chunk_indices = prepare_chunk_indices(cu, chunk_size)
    chunk_offsets = prepare_chunk_offsets(cu, chunk_size)
    state_slot = None
    if seq:
        state_slot = torch.full((int(chunk_offsets[-1]) + len(lens),), -1, dtype=torch.int32)
        seq_M, chunk_M = torch.tensor(seq), torch.tensor(chunk)
        state_slot[chunk_offsets[seq_M] + seq_M + chunk_M] = torch.arange(len(seq), dtype=torch.int32)
    up = [chunk_indices, chunk_offsets] + ([state_slot] if seq else [])
    if torch.device(device).type == "cuda":  # from pageable memory a "non_blocking" copy still blocks the host
        up = [x.pin_memory() for x in up]
    up = [x.to(device, non_blocking=True) for x in up]
    return up[0], up[1], (up[2] if seq else None)


def launch_output_kernel(kernel, q, v, chunk_indices, out=None, **kwargs):
    """Launch one of fla's per-chunk output kernels (grid: value blocks x chunks, batch x value heads) writing into
    ``out``, a contiguous tensor of v's shape (the rows of a caller's larger output) when it has v's dtype, else
    into a new unfilled one: every row is one of the chunks the kernel writes. ``kwargs``: the kernel's own
    arguments."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[-1]
    o = out if out is not None and out.dtype == v.dtype else torch.empty_like(v)

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]) * chunk_indices.shape[0], B * HV)

    kernel[grid](q=q, v=v, o=o, chunk_indices=chunk_indices, T=T, H=H, HV=HV, K=K, V=V, STATE_V_FIRST=False,
                 **kwargs)
    return o


def chunk_fwd_o(q, v, g, A, h, scale, cu_seqlens, chunk_size, chunk_indices, out=None):
    """fla's ``chunk_gla_fwd_o_gk`` (each chunk's output: its intra-chunk attention A @ v plus q against the chunk's
    state h), launched without the wrapper's zero fill of the output: fla zeroes it for callers that pad v past
    the sequences (vLLM), while here every row is one of the chunks the kernel writes, so the fill was one more
    full-size pass over the output per round and per (re)computed forward. ``out``: as ``launch_output_kernel``'s."""
    return launch_output_kernel(chunk_gla_fwd_kernel_o, q, v, chunk_indices, out, g=g, h=h, A=A,
                                cu_seqlens=cu_seqlens, scale=scale, BT=chunk_size)


def check_out_rows(op: str, q, v, out, grad_out, use_qk_l2norm_in_kernel: bool):
    """The ``out`` / ``grad_out`` contract shared by the round ops: ``out`` a contiguous [T, HV, V] tensor in q's
    dtype, returned wrapped in a tuple (so that the autograd Function does not see it as an input); ``grad_out``
    only with the in-kernel l2norm, whose backward is what writes the q and k gradients into the caller's rows.
    Anything else is refused before a kernel runs, naming what it got."""
    if out is not None:
        want = (q.shape[1], v.shape[2], v.shape[3])
        if out.shape != want or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError(f"{op}: out must be a contiguous {want} {q.dtype} tensor, got {tuple(out.shape)} "
                             f"{out.dtype} (contiguous: {out.is_contiguous()})")
        out = (out.unsqueeze(0),)
    if grad_out is not None and not use_qk_l2norm_in_kernel:
        raise ValueError(f"{op}: grad_out needs use_qk_l2norm_in_kernel=True (the l2norm backward is what writes the "
                         "q and k gradients into the caller's rows)")
    return out


class ChunkKDARoundFunction(torch.autograd.Function):
    @staticmethod
    @input_guard
    @autocast_custom_fwd
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, chunk_indices, chunk_offsets,
                state_slot, num_states, scale, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                safe_gate, lower_bound, chunk_size, inject_at_top, out, grad_out):
        ctx.set_materialize_grads(False)
        q_rstd = k_rstd = None
        if use_qk_l2norm_in_kernel:
            q, q_rstd = l2norm_fwd_bucketed(q)
            k, k_rstd = l2norm_fwd_bucketed(k)
        num_chunks = chunk_indices.shape[0]
        if use_gate_in_kernel:
            g_cum = kda_gate_chunk_cumsum(g=g, A_log=A_log, dt_bias=dt_bias, scale=RCP_LN2, chunk_size=chunk_size,
                                          cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, lower_bound=lower_bound)
        else:
            g_cum = chunk_local_cumsum(g=g, scale=RCP_LN2, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                                       chunk_indices=chunk_indices)
        w, u, _, kg, Aqk, Akk = chunk_kda_fwd_intra(q=q, k=k, v=v, gk=g_cum, beta=beta, scale=scale,
                                                    cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                                                    chunk_indices=chunk_indices, safe_gate=safe_gate)
        h, v_new, final_state, boundary_states = kda_round_fwd_h(
            kg, w, u, g_cum, initial_state, output_final_state, cu_seqlens, chunk_offsets, num_chunks, chunk_size,
            state_slot=state_slot, num_states=num_states)
        del w, u, kg
        o = chunk_fwd_o(q, v_new, g_cum, Aqk, h, scale, cu_seqlens, chunk_size, chunk_indices,
                        out=out[0] if out is not None else None)
        del h, v_new
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, None if use_gate_in_kernel else g_cum, g, beta, A_log,
                              dt_bias, Aqk, Akk, initial_state, cu_seqlens, chunk_indices, chunk_offsets, state_slot)
        ctx.num_chunks, ctx.chunk_size, ctx.scale = num_chunks, chunk_size, scale
        ctx.flags = (use_qk_l2norm_in_kernel, use_gate_in_kernel, safe_gate, lower_bound, inject_at_top)
        ctx.grad_out = grad_out
        return o.type_as(q), final_state, boundary_states

    @staticmethod
    @input_guard
    @autocast_custom_bwd
    def backward(ctx, do, dht, dhb):
        (q, q_rstd, k, k_rstd, v, g_cum, g_in, beta, A_log, dt_bias, Aqk, Akk, initial_state, cu_seqlens,
         chunk_indices, chunk_offsets, state_slot) = ctx.saved_tensors
        use_l2, use_gate, safe_gate, lower_bound, inject_at_top = ctx.flags
        BT, NTT, scale = ctx.chunk_size, ctx.num_chunks, ctx.scale
        H, HV = q.shape[2], v.shape[2]
        if do is None:
            do = torch.zeros_like(v, dtype=q.dtype)
        if use_gate:
            g_cum = kda_gate_chunk_cumsum(g=g_in, A_log=A_log, dt_bias=dt_bias, scale=RCP_LN2, chunk_size=BT,
                                          cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, lower_bound=lower_bound)
        w, u, qg, kg = recompute_w_u_fwd(q=q, k=k, v=v, beta=beta, A=Akk, gk=g_cum, cu_seqlens=cu_seqlens,
                                         chunk_indices=chunk_indices)
        h, v_new, _, _ = kda_round_fwd_h(kg, w, u, g_cum, initial_state, False, cu_seqlens, chunk_offsets, NTT, BT)
        dAqk, dv = chunk_kda_bwd_dAv(q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, cu_seqlens=cu_seqlens,
                                     chunk_size=BT, chunk_indices=chunk_indices)
        dh, dh0, dv = kda_round_bwd_dh(qg, kg, w, g_cum, initial_state, dht, dhb, state_slot, do, dv, scale,
                                       cu_seqlens, chunk_offsets, NTT, BT, inject_at_top=inject_at_top)
        dq, dk, dv, db, dg, dAkk = chunk_kda_bwd_wy_dqkg_fused(
            q=q, k=k, v=v, v_new=v_new, g=g_cum, beta=beta, A=Akk, h=h, do=do, dh=dh, dv=dv, scale=scale,
            cu_seqlens=cu_seqlens, chunk_size=BT, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets)
        dq, dk, db, dg = chunk_kda_bwd_intra(q=q, k=k, g=g_cum, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk,
                                             db=db, dg=dg, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
                                             chunk_size=BT, safe_gate=safe_gate)
        if HV > H:  # GVA: the wy/intra kernels produce per-value-head dq, dk
            dq = dq.view(*dq.shape[:2], H, HV // H, dq.shape[-1]).sum(3)
            dk = dk.view(*dk.shape[:2], H, HV // H, dk.shape[-1]).sum(3)
        dg = chunk_local_cumsum(dg, chunk_size=BT, reverse=True, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
        dA_log = ddt_bias = None
        if use_gate:
            dg, dA_log, ddt_bias = kda_gate_bwd(g=g_in, A_log=A_log, dt_bias=dt_bias, dyg=dg, lower_bound=lower_bound)
        if use_l2:
            q_out, k_out = (f() for f in ctx.grad_out) if ctx.grad_out is not None else (None, None)
            dq = l2norm_bwd_bucketed(q, q_rstd, dq, out=q_out)
            dk = l2norm_bwd_bucketed(k, k_rstd, dk, out=k_out)
        return (dq.to(q), dk.to(k), dv.to(v), dg.to(g_in), db.to(beta), dA_log, ddt_bias, dh0,
                None, None, None, None, None, None, None, None, None, None, None, None, None, None, None)


@tuned()
def chunk_kda_round(
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
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    chunk_size: int = 64,
    cu_seqlens_cpu: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    grad_out=None,
    _inject_at_top: bool = False,
):
    """Chunked KDA over packed sequences that also returns requested chunk-boundary states.

    Args follow fla's ``chunk_kda`` (q, k [1,T,H,K]; v [1,T,HV,V]; g [1,T,HV,K] natural-log decay, or
    the raw gate input with ``use_gate_in_kernel``; beta [1,T,HV]; cu_seqlens long [N+1]; initial_state
    fp32 [N,HV,K,V]; scale defaults to K**-0.5). Request j asks for the fp32 state before
    sequence-local token ``chunk_size * state_chunk[j]`` of sequence ``state_seq[j]``; chunk 0 is the
    initial state, chunk ``ceil(T_n / chunk_size)`` the end state. Requests must be unique.

    Returns ``(o [1,T,HV,V] in q's dtype, final_state fp32 [N,HV,K,V] | None,
    boundary_states fp32 [M,HV,K,V] | None)``. All three are differentiable; a consumer feeds
    ``boundary_states[idx]`` as the ``initial_state`` of a later round and autograd sums the
    gradients of shared boundaries. ``cu_seqlens_cpu``, a host copy of ``cu_seqlens``, keeps the
    argument checks and index building off the device: without it each call synchronises the stream
    once to read the lengths. ``_inject_at_top`` is a deliberately wrong backward used only by the
    negative-control test.

    ``out``: a contiguous [T, HV, V] tensor in q's dtype (the rows of a caller's larger output) that the output is
    written into, so that the caller need not copy it there; the returned o is then a view of it. It is handed to
    the autograd Function outside its tensor arguments: autograd sees o as the Function's own output.
    ``grad_out``: two callables, called in backward, that return where the q and k gradients go ([T, H, K]
    contiguous rows of the caller's gradient, allocated when the backward needs them), with
    ``use_qk_l2norm_in_kernel`` (whose backward writes them last); the q and k gradients returned are views of
    them.
    """
    lens, seq, chunk = check_round_inputs(q, k, v, g, beta, cu_seqlens, initial_state, state_seq, state_chunk,
                                          chunk_size, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate,
                                          cu_seqlens_cpu=cu_seqlens_cpu)
    if chunk_size not in SUPPORTED_CHUNK_SIZES:
        raise ValueError(f"chunk_kda_round (Triton) supports chunk_size in {SUPPORTED_CHUNK_SIZES} (fla-core 0.6.0's "
                         f"intra-chunk kernels), got {chunk_size}; use chunk_kda_round_reference for other sizes")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"chunk_kda_round (Triton) needs fp32/bf16/fp16 inputs, got {q.dtype}; "
                         "use chunk_kda_round_reference for float64")
    if q.shape[-1] > 256:
        raise ValueError(f"chunk_kda_round supports K <= 256 (as fla), got K={q.shape[-1]}")
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise ValueError(f"initial_state must be float32 (as fla), got {initial_state.dtype}")
    if not use_gate_in_kernel:
        A_log = dt_bias = None  # fla ignores them without the in-kernel gate; so do we, visibly
    cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.long)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    chunk_indices, chunk_offsets, state_slot = round_indices(lens, chunk_size, seq, chunk, q.device)
    out = check_out_rows("chunk_kda_round", q, v, out, grad_out, use_qk_l2norm_in_kernel)
    o, final_state, boundary_states = ChunkKDARoundFunction.apply(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, chunk_indices, chunk_offsets, state_slot,
        len(seq), scale, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, safe_gate, lower_bound,
        chunk_size, _inject_at_top, out, grad_out)
    return o, final_state, boundary_states
