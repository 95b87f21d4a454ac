"""Fast path of GDN rounds: fla-core 0.6.0's chunked Gated DeltaNet with our two state-recurrence kernels.

Everything except the forward state scan, the backward dh scan and the dq/dk/dw/dg step of the backward is fla's
GDN: the chunk-local cumsum of the gate (log2 units), the fused kkt + solve_tril
(``chunk_gated_delta_rule_fwd_intra``), recompute_w_u, the output kernel (``chunk_fwd_kernel_o``),
``chunk_bwd_dv_local``, ``prepare_wy_repr_bwd``, the reverse cumsum for dg, l2norm. The two scans
(``harts.kernels.kda_round`` with its scalar-gate switch) additionally write the fp32 state at the start of
requested chunks and add those states' incoming gradients at the matching point of the reverse scan, so boundary
states are differentiable outputs that later rounds feed back as ``initial_state``. q and k stay at the key heads
throughout (grouped value attention, as fla's GDN).

The dq/dk/dw/dg step is ``harts.kernels.gdn_round.gdn_round_bwd_dqkwg``, written from the chunked gated delta
rule's backward (its module docstring has the math). It forms the gate gradient without the terms that cancel
exactly (the intra-chunk diagonal and the chunk-end token's own state term): they are O(1) while the true dg is
O(exp(g)), so at per-token log decays near -20 (Qwen3.5's scratch init) a float32 sum that includes them, as
fla's ``chunk_gated_delta_rule`` does, is 10-25x off the true gate gradient (``python -m benchmarks.gdn_gate_grad``);
without them dg is accurate to the chunk-cumulative log decays' rounding (|g| x BT x 2^-24 relative). Its launcher
refuses the one configuration of fla issue #640's Hopper miscompile (``fla_640_affected``: 3.4 <= Triton < 3.7.1,
BK = 64; Qwen3.5's K = 128 gives BK = 128 on Hopper) until a GPU run shows the refusal is not needed; whether the
result is right on a given GPU stack is measured (``python -m benchmarks.gdn_round`` checks outputs and input
gradients against a float64 truth), not assumed.

Legend: T packed tokens, N sequences, H key heads, HV value heads, K/V head dims, M requested boundary
states, BT chunk size, NT total chunks.
"""
from __future__ import annotations

import torch

from harts.kernels.gdn_round import gdn_round_bwd_dqkwg
from harts.kernels.kda_round import kda_round_bwd_dh, kda_round_fwd_h
from harts.ops._fla import (
    RCP_LN2,
    autocast_custom_bwd,
    autocast_custom_fwd,
    chunk_bwd_dv_local,
    chunk_fwd_kernel_o,
    chunk_gated_delta_rule_fwd_intra,
    chunk_local_cumsum,
    input_guard,
    prepare_wy_repr_bwd,
)
from harts.ops._fla import gdn_recompute_w_u_fwd as recompute_w_u_fwd
from harts.ops.gdn_round.naive import check_gdn_round_inputs
from harts.ops.kda_round.chunk import check_out_rows, launch_output_kernel, round_indices
from harts.ops.norm.fast import l2norm_bwd_bucketed, l2norm_fwd_bucketed
from harts.ops.tuning import tuned

SUPPORTED_CHUNK_SIZES = (16, 32, 64)  # fla-core 0.6.0's GDN intra-chunk pieces; the reference takes any size


def chunk_fwd_o(q, k, v, h, g, scale, cu_seqlens, chunk_size, chunk_indices, out=None):
    """fla's ``chunk_fwd_o`` (each chunk's intra-chunk attention plus q against the chunk's state h, the scalar
    gate applied) with the output written into ``out`` when given (as ``launch_output_kernel``'s)."""
    return launch_output_kernel(chunk_fwd_kernel_o, q, v, chunk_indices, out, k=k, h=h, g=g, g_gamma=None,
                                cu_seqlens=cu_seqlens, scale=scale, BT=chunk_size)


class ChunkGDNRoundFunction(torch.autograd.Function):
    @staticmethod
    @input_guard
    @autocast_custom_fwd
    def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, chunk_offsets, state_slot,
                num_states, scale, output_final_state, use_qk_l2norm_in_kernel, chunk_size, inject_at_top, out,
                grad_out):
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
        o = chunk_fwd_o(q, k, v_new, h, g_cum, scale, cu_seqlens, chunk_size, chunk_indices,
                        out=out[0] if out is not None else None)
        del h, v_new
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g_cum, beta, A, initial_state, cu_seqlens, chunk_indices,
                              chunk_offsets, state_slot)
        ctx.num_chunks, ctx.chunk_size, ctx.scale, ctx.inject_at_top = num_chunks, chunk_size, scale, inject_at_top
        ctx.use_l2, ctx.g_dtype, ctx.grad_out = use_qk_l2norm_in_kernel, g.dtype, grad_out
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
        dq, dk, dw, dg = gdn_round_bwd_dqkwg(q, k, v_new, do, h, dh, dv, g_cum, scale, cu_seqlens, chunk_indices, BT)
        del h, dh, v_new, w
        dk2, dv, db, dg2 = prepare_wy_repr_bwd(k=k, v=v, beta=beta, A=A, dw=dw, du=dv, g=g_cum,
                                               cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
        dk.add_(dk2)
        dg.add_(dg2)
        dg = chunk_local_cumsum(dg, chunk_size=BT, reverse=True, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
        if ctx.use_l2:
            q_out, k_out = (f() for f in ctx.grad_out) if ctx.grad_out is not None else (None, None)
            dq = l2norm_bwd_bucketed(q, q_rstd, dq, out=q_out)
            dk = l2norm_bwd_bucketed(k, k_rstd, dk, out=k_out)
        return (dq.to(q), dk.to(k), dv.to(v), dg.to(ctx.g_dtype), db.to(beta), dh0,
                None, None, None, None, None, None, None, None, None, None, None, None)


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
    out: torch.Tensor | None = None,
    grad_out=None,
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
    ``cu_seqlens``, keeps the checks and index building off the device. ``out`` and ``grad_out`` as
    ``chunk_kda_round``'s: the output, and in backward the q and k gradients (at the key heads, [T, H, K]), written
    into the caller's rows. ``_inject_at_top`` is a deliberately wrong backward for negative-control tests only.
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
    out = check_out_rows("chunk_gdn_round", q, v, out, grad_out, use_qk_l2norm_in_kernel)
    return ChunkGDNRoundFunction.apply(
        q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, chunk_offsets, state_slot, len(seq), scale,
        output_final_state, use_qk_l2norm_in_kernel, chunk_size, _inject_at_top, out, grad_out)
