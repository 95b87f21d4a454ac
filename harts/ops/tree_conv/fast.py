"""Tree-path short convolution with fla's varlen ``causal_conv1d``.

In the compact physical order every planned sequence's output rows are contiguous, so one varlen
causal convolution over rows [0, C) with the sequences' output blocks as ``cu_seqlens`` computes each
row once; the only rows a block's convolution window needs from outside the block are the w-1 true
ancestors before its first row (``context_QW1``, oldest first, -1 = none). Two implementations, chosen by
``IMPL`` when called:

- ``_TreeConvInitialState`` ("initial_state"): fla's wrappers take the ancestor windows as the per-sequence
  ``initial_state`` (its gradient flows back into those ancestor rows). fla's cache layout:
  ``initial_state[n, :, W - s]`` holds the input s steps before sequence n's first token (s = 1..W-1; column 0
  is unused by a width-W window).
- ``_TreeConvSplitChunks`` ("split_chunks", default): the same kernels and the same initial state, launched
  twice into one output: without an initial state over every chunk but the first of each sequence, with it
  over the first chunks. Why: fla's varlen kernels specialise on ``initial_state`` at compile time
  (``USE_INITIAL_STATE``), and the variant with one carries the extra head-row branches in every program,
  although only chunk 0 of a sequence reads the state; the variant without one is the very kernel that the
  trajectory-wise baseline runs. Here that kernel runs all chunks past the first, and the variant with the
  head-row branches only Q programs per channel block. No new math: every program of fla's kernels writes
  only its own chunk's rows and its own row of the per-chunk dw buffer, so two launches over disjoint chunk
  sets compose exactly.

Under the kernel choice ``conv`` (``harts``, or ``auto`` where HARTS's kernels take the convolution) both
entry points run HARTS's kernels instead (``harts.ops.conv.fused``), so both paths stay on one implementation.
``python -m benchmarks.kernels --only conv`` times all of them against the trajectory-wise convolution at the
workload's shapes.

Legend: C compact rows, P channels, Q sequences, W kernel width, W1 = W - 1 context rows, R chunks of CHUNK
rows past the first of their sequence (``rest``), N = R + Q chunks launched by ``_TreeConvSplitChunks``.
"""
from __future__ import annotations

import functools

import torch

from harts.ops.tuning import tuned

# Which implementation ``tree_short_conv_fast`` runs: "split_chunks" (``_TreeConvSplitChunks``) or
# "initial_state" (``_TreeConvInitialState``). Read at each call, so a benchmark can compare them by setting it.
IMPL = "split_chunks"


class _TreeConvInitialState(torch.autograd.Function):
    """fla's varlen convolution forward and backward kernels, with the ancestor windows gathered inside. Why not
    fla's autograd Function on a gathered initial state: the gather's backward would give x a second, full-size
    zero-filled gradient for a few context rows, summed by autograd into the convolution's (a fill and an add
    over [C, P] per call); here the initial state's gradient is added into those rows of dx in place."""

    @staticmethod
    def forward(ctx, x_CP, weight_PW, seq_cu, context_QW1, activation):
        from harts.ops._fla import causal_conv1d_fwd, prepare_chunk_indices

        init_QPW, rows, valid_QW1 = _initial_state(x_CP, context_QW1)
        cu = seq_cu.to(torch.long)
        chunks = prepare_chunk_indices(cu, CHUNK)
        w = weight_PW.to(x_CP.dtype)
        x = x_CP.unsqueeze(0).contiguous()
        y, _ = causal_conv1d_fwd(x=x, weight=w, bias=None, residual=None, initial_state=init_QPW,
                                 output_final_state=False, activation=activation, cu_seqlens=cu,
                                 chunk_indices=chunks, chunk_size=CHUNK)
        ctx.save_for_backward(x, w, init_QPW, rows, valid_QW1, cu, chunks)
        ctx.activation, ctx.weight_dtype = activation, weight_PW.dtype
        return y.squeeze(0)

    @staticmethod
    def backward(ctx, dy_CP):
        from harts.ops._fla import causal_conv1d_bwd

        x, w, init_QPW, rows, valid_QW1, cu, chunks = ctx.saved_tensors
        dx, dw, _, _, dh0_QPW = causal_conv1d_bwd(x=x, dy=dy_CP.unsqueeze(0).contiguous(), dht=None, weight=w,
                                                   bias=None, residual=None, initial_state=init_QPW,
                                                   activation=ctx.activation, cu_seqlens=cu, chunk_indices=chunks,
                                                   chunk_size=CHUNK)
        dx_CP = dx.view(x.shape[1:])
        _add_context_grad(dx_CP, dh0_QPW, rows, valid_QW1)
        return dx_CP, dw.to(ctx.weight_dtype), None, None, None


def _initial_state(x_CP: torch.Tensor, context_QW1: torch.Tensor):
    """fla's ``initial_state`` [Q, P, W] of the ancestor windows (column 0 zero, -1 context rows zero), and what
    the backward needs to send its gradient to those rows: the context rows (-1 clamped to 0, flattened [Q W1])
    and valid_QW1 (1 where the context row is not -1, in x's dtype)."""
    P = x_CP.shape[1]
    Q, W1 = context_QW1.shape
    rows = context_QW1.clamp_min(0).flatten()
    valid_QW1 = (context_QW1 >= 0).to(x_CP.dtype)
    ctx_QW1P = x_CP.index_select(0, rows).view(Q, W1, P) * valid_QW1[..., None]
    init_QPW = torch.cat([ctx_QW1P.new_zeros(Q, 1, P), ctx_QW1P], dim=1).transpose(1, 2).contiguous()
    return init_QPW, rows, valid_QW1


def _add_context_grad(dx_CP: torch.Tensor, dh0_QPW: torch.Tensor, rows: torch.Tensor, valid_QW1: torch.Tensor):
    """Adds the initial state's gradient into the context rows of dx in place (the rows that ``_initial_state``
    gathered; a row read by several windows gets each one's share)."""
    dctx_QW1P = dh0_QPW[:, :, 1:].transpose(1, 2) * valid_QW1[..., None]  # column 0 of the window is unused
    dx_CP.index_add_(0, rows, dctx_QW1P.reshape(rows.shape[0], -1).to(dx_CP.dtype))


class _TreeConvSplitChunks(torch.autograd.Function):
    """fla's varlen forward and backward kernels launched directly, each twice: over the ``rest`` chunks (every
    chunk but a sequence's first) without an initial state, over the ``first`` chunks (chunk 0 of each sequence)
    with the ancestor windows as initial state (``_initial_state``, as ``_TreeConvInitialState``), into one
    output. The launches take the arguments fla's wrappers ``causal_conv1d_fwd`` / ``causal_conv1d_bwd`` pass;
    dw is one fp32 per-chunk buffer [N, P, W] whose first R rows the rest launch writes and whose last Q rows the
    first launch writes, summed once.

    Why this is exact:
    - Every program of fla's varlen kernels reads (sequence n, chunk c) from its entry of ``chunk_indices`` and
      writes only rows [c CHUNK, (c + 1) CHUNK) of sequence n in y or dx, and row ``i_tg`` (its entry's index)
      of the per-chunk dw buffer; nothing is accumulated across programs. So launches over disjoint chunk sets
      write disjoint parts of one buffer, and with a dw view per launch the buffer's sum is fla's.
    - With an initial state fla's kernels take their head-row branch only in chunk 0 of a sequence (the forward
      and backward test ``i_t * BT >= W`` with W <= CHUNK); a chunk c >= 1 runs the same code as without one.
    - The backward of chunk 0 reads dy and, for SiLU, the recomputed pre-activation of rows up to
      CHUNK - 1 + W - 1, i.e. of chunk 1: that recompute comes from the rest launch into the same buffer, and
      is right without the initial state because a row >= CHUNK >= W - 1 has its whole window inside its
      sequence. Both recompute launches run before either backward launch. ``compute_dh0_triton`` reads rows
      t < W - 1 of each sequence, all in chunk 0 (recomputed with the initial state).
    - A sequence shorter than one chunk has only its first chunk, and fla's kernels mask rows past its end
      (also for fewer than W - 1 rows). When every sequence is that short, R = 0 and the rest launches are
      skipped; with Q == 0 (no rows) both are, dw is zeros and there is no initial state to differentiate.

    The chunk lists depend only on ``seq_cu``: ``_chunk_split`` builds them once per seq_cu tensor (fla's
    identity cache), with one device-to-host copy of seq_cu (on the GPU, the one sync that fla's
    ``prepare_chunk_indices`` would also cost) and one non-blocking copy back. The launches go through the same
    autotuned kernel objects as fla's wrappers, so HARTS's tuned table applies as it does to them: the tuning key
    (D, W and the tensor arguments' dtypes) tells the variants with and without an initial state apart."""

    @staticmethod
    def forward(ctx, x_CP, weight_PW, seq_cu, context_QW1, activation):
        W = weight_PW.shape[1]
        if W > CHUNK:
            raise ValueError(f"tree_short_conv_fast: kernel width {W} > CHUNK = {CHUNK}: a chunk past the first "
                             "would read the initial state")
        init_QPW, rows, valid_QW1 = _initial_state(x_CP, context_QW1)
        cu, rest_R2, first_Q2 = _cached_chunk_split()(seq_cu)
        w = weight_PW.to(x_CP.dtype)
        x = x_CP.unsqueeze(0).contiguous()
        y = torch.empty_like(x)
        _conv_fwd(x, y, w, cu, init_QPW, rest_R2, first_Q2, activation)
        ctx.save_for_backward(x, w, init_QPW, rows, valid_QW1, cu, rest_R2, first_Q2)
        ctx.activation, ctx.weight_dtype = activation, weight_PW.dtype
        return y.squeeze(0)

    @staticmethod
    def backward(ctx, dy_CP):
        from harts.ops._fla import compute_dh0_triton

        x, w, init_QPW, rows, valid_QW1, cu, rest_R2, first_Q2 = ctx.saved_tensors
        activation = ctx.activation
        R, Q = rest_R2.shape[0], first_Q2.shape[0]
        dy = dy_CP.unsqueeze(0).contiguous()
        y = None
        if activation is not None:  # fla's backward takes the pre-activation, recomputed as its wrapper does
            y = torch.empty_like(x)
            _conv_fwd(x, y, w, cu, init_QPW, rest_R2, first_Q2, None)
        dx = torch.empty_like(x)
        dw_NPW = w.new_empty(R + Q, *w.shape, dtype=torch.float)
        _conv_bwd(x, y, w, dy, dx, dw_NPW, cu, init_QPW, rest_R2, first_Q2, activation)
        dw = dw_NPW.sum(0).to(w)
        dx_CP = dx.view(x.shape[1:])
        if Q:
            dh0_QPW = compute_dh0_triton(dy=dy, y=y, weight=w, initial_state=init_QPW, activation=activation,
                                         cu_seqlens=cu, dht=None)
            _add_context_grad(dx_CP, dh0_QPW, rows, valid_QW1)
        return dx_CP, dw.to(ctx.weight_dtype), None, None, None


def _chunk_split(seq_cu: torch.Tensor):
    """(cu: seq_cu as int64; rest_R2: the (sequence, chunk) pairs of chunks 1.. of every sequence, in fla's
    order; first_Q2: (q, 0) for every sequence q), the index lists of ``_TreeConvSplitChunks``. Built on the host
    from one copy of seq_cu and sent to seq_cu's device in one non-blocking copy (pinned on CUDA, as
    ``harts.ops.kda_round.chunk`` does), so no device sync beyond that read. first_Q2 lists every sequence,
    also an empty one: its program masks all rows and writes a zero dw row (a layout has none anyway)."""
    cu = seq_cu.to(torch.long)
    cu_host = cu.cpu()
    Q = cu_host.shape[0] - 1
    extra_Q = ((cu_host[1:] - cu_host[:-1] + CHUNK - 1) // CHUNK - 1).clamp_min(0)  # chunks past the first
    seq_R = torch.repeat_interleave(torch.arange(Q), extra_Q)
    start_Q = extra_Q.cumsum(0) - extra_Q  # where sequence q's rest chunks start in the list
    chunk_R = torch.arange(seq_R.shape[0]) - start_Q[seq_R] + 1
    seq_N = torch.cat([seq_R, torch.arange(Q)])
    pairs_N2 = torch.stack([seq_N, torch.cat([chunk_R, torch.zeros(Q, dtype=torch.long)])], 1)
    if cu.device.type == "cuda":  # from pageable memory a "non_blocking" copy still blocks the host
        pairs_N2 = pairs_N2.pin_memory()
    pairs_N2 = pairs_N2.to(cu.device, non_blocking=True)
    R = seq_R.shape[0]
    return cu, pairs_N2[:R], pairs_N2[R:]


@functools.cache
def _cached_chunk_split():
    """``_chunk_split`` behind fla's ``tensor_cache`` (its last few distinct arguments, by identity: the three
    convolutions of a layer and all layers of a batch share one seq_cu tensor), wrapped at first use so that
    importing this module does not import fla."""
    from harts.ops._fla import tensor_cache

    return tensor_cache(_chunk_split)


def _conv_fwd(x, y, w, cu, init_QPW, rest_R2, first_Q2, activation):
    """Forward kernel into y: the rest chunks without, the first chunks with the initial state."""
    from harts.ops._fla import causal_conv1d_fwd_kernel

    for init, chunks in ((None, rest_R2), (init_QPW, first_Q2)):
        _launch(causal_conv1d_fwd_kernel, x, w, cu, chunks, activation, y=y, bias=None, residual=None,
                initial_state=init)


def _conv_bwd(x, y, w, dy, dx, dw_NPW, cu, init_QPW, rest_R2, first_Q2, activation):
    """Backward kernel into dx and the per-chunk dw buffer (its first R rows for the rest chunks, without the
    initial state; its last Q rows for the first chunks, with it); no bias, no final-state gradient."""
    from harts.ops._fla import causal_conv1d_bwd_kernel

    R = rest_R2.shape[0]
    for init, chunks, dw in ((None, rest_R2, dw_NPW[:R]), (init_QPW, first_Q2, dw_NPW[R:])):
        _launch(causal_conv1d_bwd_kernel, x, w, cu, chunks, activation, y=y, initial_state=init, dht=None, dy=dy,
                dx=dx, dw=dw, db=None, stride_dx_n=dx.stride(0), stride_dx_t=dx.stride(1),
                stride_dx_d=dx.stride(2), stride_dy_n=dy.stride(0), stride_dy_t=dy.stride(1),
                stride_dy_d=dy.stride(2))


def _launch(kernel, x, w, cu, chunks, activation, **kwargs):
    """One of fla's varlen convolution kernels over ``chunks`` (skipped when empty), with the grid and the
    arguments its wrapper (``causal_conv1d_fwd`` / ``causal_conv1d_bwd``) passes; ``kwargs``: the kernel's own."""
    if chunks.shape[0] == 0:
        return
    import triton

    B, T, D = x.shape
    W = w.shape[1]

    def grid(meta):
        return (triton.cdiv(D, meta["BD"]), chunks.shape[0], B)

    kernel[grid](x=x, weight=w, cu_seqlens=cu, chunk_indices=chunks, B=B, T=T, stride_x_n=x.stride(0),
                 stride_x_t=x.stride(1), stride_x_d=x.stride(2), D=D, W=W, BT=CHUNK, BW=triton.next_power_of_2(W),
                 ACTIVATION=activation, **kwargs)


# Rows per program of fla's convolution kernels. It must stay fla's default, 64: for SiLU, fla's backward
# recomputes the forward with our chunk indices but its own default chunk size.
CHUNK = 64


@tuned("fla.modules.causal_conv1d")
def tree_short_conv_fast(x_CP: torch.Tensor, weight_PW: torch.Tensor, seq_cu: torch.Tensor,
                         context_QW1: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
    from harts.ops.conv.fused import tree_short_conv_harts, use_harts

    if use_harts(weight_PW, activation):  # both paths on one implementation (harts.ops.choices)
        return tree_short_conv_harts(x_CP, weight_PW, seq_cu, context_QW1, activation)
    fn = _IMPLS.get(IMPL)
    if fn is None:
        raise ValueError(f"harts.ops.tree_conv.fast.IMPL = {IMPL!r}: expected one of {', '.join(map(repr, _IMPLS))}")
    return fn.apply(x_CP, weight_PW, seq_cu, context_QW1, activation)


_IMPLS = {"split_chunks": _TreeConvSplitChunks, "initial_state": _TreeConvInitialState}
