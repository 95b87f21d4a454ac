"""Tree-path short convolution with fla's varlen ``causal_conv1d``.

In the compact physical order every planned sequence's output rows are contiguous, so one varlen
causal convolution over rows [0, C) with the sequences' output blocks as ``cu_seqlens`` computes each
row once; the only rows a block's convolution window needs from outside the block are the w-1 true
ancestors before its first row (``context_QW1``, oldest first, -1 = none). Three implementations, chosen by
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
- ``_TreeConvHeadFixup`` ("head_fixup"): fla's kernels without an initial state over all rows, then the first
  min(W-1, length) rows of each sequence that has an ancestor (its head rows) are corrected with small torch
  ops on [Q, W-1, ...] tensors: no kernel with the head-row branches at all, at the cost of a few dozen small
  torch ops per call.

Which is fastest on a GPU is measured by a benchmark (set ``IMPL``), not assumed here.

Legend: C compact rows, P channels, Q sequences, W kernel width, W1 = W - 1 context rows, H = 2 (W - 1)
rows of a sequence's head span (its W - 1 context rows, then its first W - 1 rows), R chunks of CHUNK rows
past the first of their sequence (``rest``), N = R + Q chunks launched by ``_TreeConvSplitChunks``.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from harts.ops.tuning import tuned

# Which implementation ``tree_short_conv_fast`` runs: "split_chunks" (``_TreeConvSplitChunks``), "head_fixup"
# (``_TreeConvHeadFixup``) or "initial_state" (``_TreeConvInitialState``). Read at each call, so a benchmark
# can compare them by setting it.
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
        _conv_bwd(x, y, w, None, dy, dx, dw_NPW[:R], cu, rest_R2, activation)
        _conv_bwd(x, y, w, init_QPW, dy, dx, dw_NPW[R:], cu, first_Q2, activation)
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
    """Forward kernel into y: the rest chunks without, the first chunks with the initial state (empty sets
    skipped)."""
    if rest_R2.shape[0]:
        _launch_fwd(x, y, w, cu, None, rest_R2, activation)
    if first_Q2.shape[0]:
        _launch_fwd(x, y, w, cu, init_QPW, first_Q2, activation)


def _launch_fwd(x, y, w, cu, initial_state, chunks, activation):
    """fla's ``causal_conv1d_fwd_kernel`` over ``chunks`` with the arguments of fla's wrapper
    ``causal_conv1d_fwd`` (no bias, no residual, CHUNK rows per program)."""
    import triton

    from harts.ops._fla import causal_conv1d_fwd_kernel

    B, T, D = x.shape
    W = w.shape[1]
    NT = chunks.shape[0]

    def grid(meta):
        return (triton.cdiv(D, meta["BD"]), NT, B)

    causal_conv1d_fwd_kernel[grid](
        x=x, y=y, weight=w, bias=None, residual=None, cu_seqlens=cu, initial_state=initial_state,
        chunk_indices=chunks, B=B, T=T, stride_x_n=x.stride(0), stride_x_t=x.stride(1), stride_x_d=x.stride(2),
        D=D, W=W, BT=CHUNK, BW=triton.next_power_of_2(W), ACTIVATION=activation)


def _conv_bwd(x, y, w, initial_state, dy, dx, dw, cu, chunks, activation):
    """fla's ``causal_conv1d_bwd_kernel`` over ``chunks`` (skipped when empty) with the arguments of fla's
    wrapper ``causal_conv1d_bwd`` (no bias, no final-state gradient); dw: this launch's [len(chunks), P, W]
    fp32 rows of the per-chunk buffer."""
    if chunks.shape[0] == 0:
        return
    import triton

    from harts.ops._fla import causal_conv1d_bwd_kernel

    B, T, D = x.shape
    W = w.shape[1]
    NT = chunks.shape[0]

    def grid(meta):
        return (triton.cdiv(D, meta["BD"]), NT, B)

    causal_conv1d_bwd_kernel[grid](
        x=x, y=y, weight=w, initial_state=initial_state, dht=None, dy=dy, dx=dx, dw=dw, db=None, cu_seqlens=cu,
        chunk_indices=chunks, B=B, T=T, stride_x_n=x.stride(0), stride_x_t=x.stride(1), stride_x_d=x.stride(2),
        stride_dx_n=dx.stride(0), stride_dx_t=dx.stride(1), stride_dx_d=dx.stride(2), stride_dy_n=dy.stride(0),
        stride_dy_t=dy.stride(1), stride_dy_d=dy.stride(2), D=D, W=W, BT=CHUNK, BW=triton.next_power_of_2(W),
        ACTIVATION=activation)


class _TreeConvHeadFixup(torch.autograd.Function):
    """fla's varlen forward and backward kernels without an initial state, and a head-row fix-up.

    Without an initial state fla treats every sequence as starting from zeros, so exactly the head rows of the
    sequences with an ancestor are wrong: row i < W-1 of sequence q misses the taps on its ancestors. All
    fix-up tensors are [Q, W1, P] or [Q, H, P] (H = 2 W1: q's W1 context rows, then its first W1 rows), with
    the windows of the head rows as W-wide slices of that span; nothing of size [C, P] is copied or filled.

    Forward: the head rows' true pre-activations, in float32, overwrite fla's output rows in place (y is this
    Function's own tensor). Backward: fla's kernel recomputes each head row's pre-activation without the
    ancestors, so it uses the wrong SiLU derivative there and gives the ancestors nothing. With
    g_true = dy * act'(pre_true) and g_seq = dy * act'(pre_seq) (pre_seq: the window without ancestors, what
    fla used), a head row adds (g_true - g_seq) * w[tap] to the in-sequence rows of its window,
    g_true * w[tap] to its ancestor rows, and sum(g_true * x_window - g_seq * x_seq_window) to dw.

    No host sync and no data-dependent shapes: every sequence gets W1 head slots. Slots past a short sequence's
    end (i >= length) are masked in the backward; in the forward they write their sequence's last row again,
    with that row's value (identical duplicates, so the scatter stays deterministic). Sequences without an
    ancestor write fla's own values back (an exact no-op). seq_cu is ``seq_cu_seqlens`` of the layout, whose
    sequences all have at least one row."""

    @staticmethod
    def forward(ctx, x_CP, weight_PW, seq_cu, context_QW1, activation):
        from harts.ops._fla import causal_conv1d_fwd, prepare_chunk_indices

        cu = seq_cu.to(torch.long)
        chunks = prepare_chunk_indices(cu, CHUNK)
        w = weight_PW.to(x_CP.dtype)
        x = x_CP.unsqueeze(0).contiguous()
        y, _ = causal_conv1d_fwd(x=x, weight=w, bias=None, residual=None, initial_state=None,
                                 output_final_state=False, activation=activation, cu_seqlens=cu,
                                 chunk_indices=chunks, chunk_size=CHUNK)
        y_CP = y.squeeze(0)
        ctx.activation, ctx.weight_dtype = activation, weight_PW.dtype
        Q, W1 = context_QW1.shape
        if Q == 0 or W1 == 0:
            ctx.save_for_backward(x, w, cu, chunks)
            return y_CP
        P = x_CP.shape[1]
        span = _head_span(cu, context_QW1)
        rows_QH, keep_QH, slot_QW1, head_QW1 = span
        x_QHP = x_CP.index_select(0, rows_QH.flatten()).view(Q, 2 * W1, P).float() * keep_QH[..., None]
        pre_QW1P = _window_sums(x_QHP, w)
        seq_rows_QW1 = rows_QH[:, W1:]
        fla_QW1P = y_CP.index_select(0, seq_rows_QW1.flatten()).view(Q, W1, P)
        new_QW1P = torch.where(head_QW1[..., None], _act(pre_QW1P, activation).to(y_CP.dtype), fla_QW1P)
        # slots past a sequence's end take the value of its last row, the row they point at
        new_QW1P = new_QW1P.gather(1, slot_QW1[..., None].expand(Q, W1, P))
        y_CP.index_copy_(0, seq_rows_QW1.flatten(), new_QW1P.view(Q * W1, P))
        ctx.save_for_backward(x, w, cu, chunks, x_QHP, *span)
        return y_CP

    @staticmethod
    def backward(ctx, dy_CP):
        from harts.ops._fla import causal_conv1d_bwd

        x, w, cu, chunks, *fix = ctx.saved_tensors
        dx, dw, _, _, _ = causal_conv1d_bwd(x=x, dy=dy_CP.unsqueeze(0).contiguous(), dht=None, weight=w,
                                            bias=None, residual=None, initial_state=None, activation=ctx.activation,
                                            cu_seqlens=cu, chunk_indices=chunks, chunk_size=CHUNK)
        dx_CP = dx.view(x.shape[1:])
        if not fix:
            return dx_CP, dw.to(ctx.weight_dtype), None, None, None
        x_QHP, rows_QH, keep_QH, _, head_QW1 = fix
        Q, H, P = x_QHP.shape
        W1, W = H // 2, w.shape[1]
        seq_QHP = torch.cat([x_QHP.new_zeros(Q, W1, P), x_QHP[:, W1:]], dim=1)  # the span without ancestors
        # fla's backward takes SiLU's derivative at the pre-activation rounded to x's dtype: so do both here
        pre_true_QW1P = _window_sums(x_QHP, w).to(x.dtype).float()
        pre_seq_QW1P = _window_sums(seq_QHP, w).to(x.dtype).float()
        dy_QW1P = dy_CP.index_select(0, rows_QH[:, W1:].flatten()).view(Q, W1, P).float() * head_QW1[..., None]
        g_true_QW1P = dy_QW1P * _act_grad(pre_true_QW1P, ctx.activation)
        g_seq_QW1P = dy_QW1P * _act_grad(pre_seq_QW1P, ctx.activation)
        # head slot i, tap k reads span position i + k: an ancestor (< W1) gets g_true, an in-sequence row the
        # difference to what fla's kernel already gave it
        i_W1, k_W = torch.arange(W1, device=x.device), torch.arange(W, device=x.device)
        pos_W1W = i_W1[:, None] + k_W[None, :]
        coef_QW1WP = torch.where((pos_W1W < W1)[None, :, :, None], g_true_QW1P[:, :, None],
                                 (g_true_QW1P - g_seq_QW1P)[:, :, None])
        tap_QW1WP = coef_QW1WP * w.float().T  # [W, P] broadcast over (Q, W1)
        dspan_QHP = x_QHP.new_zeros(Q, H, P).index_add_(1, pos_W1W.flatten(), tap_QW1WP.view(Q, W1 * W, P))
        dspan_QHP *= keep_QH[..., None]
        dx_CP.index_add_(0, rows_QH.flatten(), dspan_QHP.view(Q * H, P).to(dx_CP.dtype))
        dw_PW = (torch.einsum("qip,qipk->pk", g_true_QW1P, x_QHP.unfold(1, W, 1))
                 - torch.einsum("qip,qipk->pk", g_seq_QW1P, seq_QHP.unfold(1, W, 1)))
        return dx_CP, (dw.float() + dw_PW).to(ctx.weight_dtype), None, None, None


def _head_span(cu: torch.Tensor, context_QW1: torch.Tensor):
    """Indices of each sequence's head span, all on the device: (rows_QH: the W1 context rows then the rows of
    head slots 0..W1-1, slots past the sequence's end clamped to its last row; keep_QH: which span rows are
    real, i.e. a context row that is not -1 or a slot inside the sequence; slot_QW1: head slot i clamped to
    the sequence, min(i, length - 1); head_QW1: slots to fix, inside a sequence with at least one ancestor)."""
    Q, W1 = context_QW1.shape
    start_Q, len_Q = cu[:-1], cu[1:] - cu[:-1]
    i_W1 = torch.arange(W1, device=cu.device)
    slot_QW1 = torch.minimum(i_W1[None, :], len_Q[:, None] - 1)
    in_seq_QW1 = i_W1[None, :] < len_Q[:, None]
    has_ctx_QW1 = context_QW1 >= 0
    head_QW1 = in_seq_QW1 & has_ctx_QW1.any(1, keepdim=True)
    rows_QH = torch.cat([context_QW1.to(torch.long).clamp_min(0), start_Q[:, None] + slot_QW1], dim=1)
    keep_QH = torch.cat([has_ctx_QW1, in_seq_QW1], dim=1).float()
    return rows_QH, keep_QH, slot_QW1, head_QW1


def _window_sums(span_QHP: torch.Tensor, w_PW: torch.Tensor) -> torch.Tensor:
    """[Q, W1, P] float32 pre-activations of the head slots: slot i's window is span positions i .. i + W - 1,
    w[:, W-1] on the last (the row itself)."""
    return (span_QHP.unfold(1, w_PW.shape[1], 1) * w_PW.float()).sum(-1)


def _act(pre: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(pre) if activation in ("silu", "swish") else pre


def _act_grad(pre: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation not in ("silu", "swish"):
        return torch.ones_like(pre)
    s = torch.sigmoid(pre)
    return s * (1 + pre * (1 - s))


# Rows per program of fla's convolution kernels. It must stay fla's default, 64: for SiLU, fla's backward
# recomputes the forward with our chunk indices but its own default chunk size.
CHUNK = 64


@tuned("fla.modules.causal_conv1d")
def tree_short_conv_fast(x_CP: torch.Tensor, weight_PW: torch.Tensor, seq_cu: torch.Tensor,
                         context_QW1: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
    fn = _IMPLS.get(IMPL)
    if fn is None:
        raise ValueError(f"harts.ops.tree_conv.fast.IMPL = {IMPL!r}: expected one of {', '.join(map(repr, _IMPLS))}")
    return fn.apply(x_CP, weight_PW, seq_cu, context_QW1, activation)


_IMPLS = {"split_chunks": _TreeConvSplitChunks, "head_fixup": _TreeConvHeadFixup,
          "initial_state": _TreeConvInitialState}
