"""Tree-path short convolution with fla's varlen ``causal_conv1d``.

In the compact physical order every planned sequence's output rows are contiguous, so one varlen
causal convolution over rows [0, C) with the sequences' output blocks as ``cu_seqlens`` computes each
row once; the only rows a block's convolution window needs from outside the block are the w-1 true
ancestors before its first row (``context_QW1``, oldest first, -1 = none). Two implementations, chosen by
``HEAD_FIXUP`` when called:

- ``_TreeConvInitialState``: fla takes the ancestor windows as the per-sequence ``initial_state`` (its
  gradient flows back into those ancestor rows). fla's cache layout: ``initial_state[n, :, W - s]`` holds the
  input s steps before sequence n's first token (s = 1..W-1; column 0 is unused by a width-W window).
- ``_TreeConvHeadFixup`` (default): fla's kernels without an initial state over all rows, then the first
  min(W-1, length) rows of each sequence that has an ancestor (its head rows) are corrected with small torch
  ops on [Q, W-1, ...] tensors. Why: fla's varlen kernels specialise on ``initial_state`` at compile time
  (``USE_INITIAL_STATE``), and the variant with one carries the extra head-row branches in every program,
  while the variant without one is the very kernel that the trajectory-wise baseline runs. This path runs the
  baseline's kernels and pays for the ancestors only where they are read. Which of the two is faster on a GPU
  is measured by a benchmark (flip ``HEAD_FIXUP``), not assumed here.

Legend: C compact rows, P channels, Q sequences, W kernel width, W1 = W - 1 context rows, H = 2 (W - 1)
rows of a sequence's head span (its W - 1 context rows, then its first W - 1 rows).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from harts.ops.tuning import tuned

# True: ``_TreeConvHeadFixup`` (fla's kernels without an initial state, head rows fixed up in torch);
# False: ``_TreeConvInitialState`` (fla's kernels with the ancestor windows as initial states). Read at each
# call, so a benchmark can compare the two by setting it.
HEAD_FIXUP = True


class _TreeConvInitialState(torch.autograd.Function):
    """fla's varlen convolution forward and backward kernels, with the ancestor windows gathered inside. Why not
    fla's autograd Function on a gathered initial state: the gather's backward would give x a second, full-size
    zero-filled gradient for a few context rows, summed by autograd into the convolution's (a fill and an add
    over [C, P] per call); here the initial state's gradient is added into those rows of dx in place."""

    @staticmethod
    def forward(ctx, x_CP, weight_PW, seq_cu, context_QW1, activation):
        from harts.ops._fla import causal_conv1d_fwd, prepare_chunk_indices

        P = x_CP.shape[1]
        Q, W1 = context_QW1.shape
        rows = context_QW1.clamp_min(0).flatten()
        valid_QW1 = (context_QW1 >= 0).to(x_CP.dtype)
        ctx_QW1P = x_CP.index_select(0, rows).view(Q, W1, P) * valid_QW1[..., None]
        init_QPW = torch.cat([ctx_QW1P.new_zeros(Q, 1, P), ctx_QW1P], dim=1).transpose(1, 2).contiguous()
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
        dctx_QW1P = dh0_QPW[:, :, 1:].transpose(1, 2) * valid_QW1[..., None]  # column 0 of the window is unused
        dx_CP.index_add_(0, rows, dctx_QW1P.reshape(rows.shape[0], -1).to(dx_CP.dtype))
        return dx_CP, dw.to(ctx.weight_dtype), None, None, None


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
    fn = _TreeConvHeadFixup if HEAD_FIXUP else _TreeConvInitialState
    return fn.apply(x_CP, weight_PW, seq_cu, context_QW1, activation)
