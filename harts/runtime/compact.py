"""Compact execution of Ling-3.0 on a ``CompactBatch`` (paper 3.4, 4.2).

Every layer reads and writes the same physical rows: embeddings, projections, norms, MoE and the LM
head run once per compact row. Only the sequence mixers see other views; the mixers (harts.models.ling
.blocks) compute their projections and call the layout-specific parts here (``kda_tree``,
``mla_tree_attention``):

- KDA: projections once per row; the causal short convolution over each row's true ancestors
  (``conv_pred``); then one packed call per planned round. A round's input is its own rows, cut per
  sequence, with each sequence's replay rows gathered in front (replay positions read their ancestors'
  already computed q/k/v/gate/beta, never recomputed; ``harts.runtime.batch.round_pieces``), starts each
  sequence from a zero state or a boundary state emitted by an earlier round (a differentiable tensor, so
  backward flows into the producer's scan), and writes outputs only for its own rows.
- MLA: q/k/v once per row at the row's original position id; every row attends to its trie ancestors
  and itself (bottom-right causal, Eq. 22). The fast path splits each view into cuDNN pieces that read long
  runs of shared ancestor rows in place (``harts.ops.attention.split``); the reference runs one varlen
  call with packed Q = each branch's own rows and KV = its ancestors + own rows, whose index_select
  backward accumulates gradients into shared ancestors.
- Log-probs: one per distinct (row, target) pair (``harts.runtime.batch.logprob_pairs``), expanded to the
  trajectory positions.
- MoE: routing and experts once per row; multiplicities q_c weight the router statistics.

Legend: P physical rows, D hidden, H heads, G key/value heads (grouped-query attention), K/V head dims, T_r
input positions of round r, E boundary states, S' nonterminal semantic positions.
"""
from __future__ import annotations

import functools

import torch

from harts.ops.attention.tree import TreeMask, tree_attention_views, tree_mask
from harts.ops.backend import resolve
from harts.ops.tree_conv import tree_short_conv
from harts.runtime.batch import CompactBatch

__all__ = ["check_batch", "compact_hidden", "hidden_states", "logprobs", "kda_tree", "kda_rounds",
           "mla_tree_attention", "mla_tree_mask"]


def check_batch(batch: CompactBatch, cfg, device: torch.device | None = None) -> None:
    """Refuse a batch planned for another model: the rounds' chunk grid (replay restores the grid of
    ``batch.chunk_size``) and the convolution's ancestor windows (``batch.conv_width``) must be the
    model's ``layout_geometry``, else log-probs are silently wrong. Trajectory-wise batches use neither
    (the model runs its own chunking on them). ``device`` (the model's): the batch's index tensors must be
    there (``batch.to(device)``)."""
    if not isinstance(batch, CompactBatch):
        raise TypeError(f"layout must be a harts.CompactBatch (from harts.pack), got {type(batch).__name__}")
    if device is not None and batch.input_ids.device != device:
        raise ValueError(f"CompactBatch is on {batch.input_ids.device} but the model is on {device}: move it with "
                         f"batch.to({str(device)!r})")
    if not batch.prefix_sharing:
        return
    for name, have, want in zip(("chunk_size", "conv_width"), (batch.chunk_size, batch.conv_width),
                                cfg.layout_geometry, strict=True):
        if have != want:
            raise ValueError(f"CompactBatch {name}={have} does not match the model's {name}={want}: pack the batch "
                             f"with harts.pack(..., config=model.config) (or {name}={want})")


# ------------------------------------------------------------------------------------------ KDA
def _round_fn(backend: str, device, dtype, scalar_gate: bool = False):
    """(the round op, whether it takes ``out``: writes its output into the caller's rows)."""
    fast = resolve("kda", backend, device, dtype) == "fast"
    if scalar_gate:
        from harts.ops import gdn_round

        return (gdn_round.chunk_gdn_round, True) if fast else (gdn_round.chunk_gdn_round_reference, False)
    if fast:
        from harts.ops.kda_round import chunk_kda_round

        return chunk_kda_round, True
    from harts.ops.kda_round import chunk_kda_round_reference

    return chunk_kda_round_reference, False


def kda_rounds(q, k, v, g, beta, batch: CompactBatch, *, chunk_size: int, backend: str = "auto",
               A_log=None, dt_bias=None, lower_bound: float | None = None) -> torch.Tensor:
    """The gated delta-rule core over the planned rounds: q, k [P, H, K], v [P, HV, V], g [P, HV, K] or
    [P, HV], beta [P, HV] -> o [P, HV, V] (HV a multiple of H: grouped value heads).

    Three gate forms share the rounds: with ``A_log``/``dt_bias`` (KDA), ``g`` [P, HV, K] is the raw gate
    input and the kernel applies KDA's safe gate; without them, a [P, HV, K] ``g`` is the per-channel log
    decay itself, applied as given (``harts.ops.kda_round``), and a [P, HV] ``g`` is Gated DeltaNet's per-head
    scalar log decay with q, k at the key heads (``harts.ops.gdn_round``)."""
    scalar_gate = g.dim() == 2
    if scalar_gate and A_log is not None:
        raise TypeError("kda_rounds: a per-head scalar decay g [P, HV] takes no A_log/dt_bias (KDA's in-kernel gate "
                        "needs g [P, HV, K])")
    run_round, writes_out = _round_fn(backend, q.device, q.dtype, scalar_gate)
    P, H, Kh = q.shape
    HV = v.shape[1]
    states = []  # emitted boundary states, round by round, each [E_r, HV, K, V] fp32+
    outs, sels = [], []  # each round's output and which of its rows are outputs (None: all, in order)
    o_PHV = q.new_empty(batch.num_phys, HV, v.shape[-1])  # the assembled output; rounds may write into it
    state_dtype = torch.promote_types(q.dtype, torch.float32)
    in_kernel = A_log is not None
    if in_kernel != (dt_bias is not None):
        raise TypeError("kda_rounds: pass A_log and dt_bias together (in-kernel KDA gate) or neither (g is the "
                        "log decay)")
    gate_kw = dict(use_gate_in_kernel=True, A_log=A_log.to(state_dtype), dt_bias=dt_bias.to(state_dtype),
                   safe_gate=True, lower_bound=lower_bound) if in_kernel else {}
    # q's and k's gradients: the fast rounds write their own rows' straight into them (allocated in backward)
    grad_rows = (_GradRows(q), _GradRows(k)) if writes_out else (None, None)
    own = _round_inputs((q, k, v, g, beta), batch, grad_rows + (None, None, None))
    for i, r in enumerate(batch.rounds):
        if own is not None:  # the round's own rows, with each sequence's replay rows in front
            qr, kr, vr, gr, br = (x[i] for x in own)
        else:  # the no-replay ablation's segments
            qr, kr, vr, gr, br = (t.index_select(0, r.gather) for t in (q, k, v, g, beta))
        init = None
        if r.has_init:
            zero = q.new_zeros((1, HV, Kh, v.shape[-1]), dtype=state_dtype)
            bank = torch.cat([zero] + states, dim=0)  # id -1 -> row 0
            init = bank.index_select(0, r.init_source + 1)
        # A round without replay reads and writes only its own rows: it writes its output and its q and k
        # gradients where they go.
        out_kw = {}
        if writes_out and own is not None and not r.replay_rows.numel():
            a, b = r.phys_start, r.phys_end
            out_kw = dict(out=o_PHV[a:b], grad_out=tuple(functools.partial(x.rows, a, b) for x in grad_rows))
        # Same dtype conventions as the trajectory-wise fast path (harts.ops.kda.fast): gate input and
        # beta in q's dtype, gate parameters and states in fp32 (fp64 on the float64 reference path); a
        # precomputed log decay stays in its own (fp32+) dtype.
        o, _, boundary = run_round(
            qr.unsqueeze(0), kr.unsqueeze(0), vr.unsqueeze(0), gr.unsqueeze(0).to(q.dtype if in_kernel else gr.dtype),
            br.unsqueeze(0).to(q.dtype), r.cu_seqlens, initial_state=init, output_final_state=False,
            state_seq=r.emit_seq if r.num_states else None, state_chunk=r.emit_chunk if r.num_states else None,
            use_qk_l2norm_in_kernel=True, chunk_size=chunk_size, cu_seqlens_cpu=r.cu_seqlens_cpu, **gate_kw,
            **out_kw)
        if r.num_states:
            states.append(boundary)
        outs.append(o.squeeze(0))
        if own is None:  # the no-replay ablation's segments
            sels.append((r.output_positions, None))
        else:
            sels.append((r.output_positions, r.replay_positions) if r.replay_rows.numel() else None)
    o_PHV = _RoundOutputs.apply((o_PHV,), tuple(sels), *outs)  # alignment padding rows produce zeros
    if batch.kda_output_perm is not None:  # no-replay ablation: segments ran in their own order
        o_PHV = o_PHV.index_select(0, batch.kda_output_perm)
    return o_PHV


class _RoundOutputs(torch.autograd.Function):
    """The rounds' outputs one after the other in the rows of ``buf`` (handed in a tuple, so that autograd sees it
    as this Function's own output), its remaining rows (alignment padding) zero. ``sels[i]``: None when every row of
    round i's output is an output row, in order, else (the positions of its output rows, those of the others or
    None). One gather per round with replay rows, and no copy of a round that wrote its output in its place
    (``chunk_kda_round(out=...)``, ``chunk_gdn_round(out=...)``); in backward each round's gradient is a slice of
    the output's, or its output rows' gradients scattered between zero rows."""

    @staticmethod
    def forward(ctx, buf, sels, *outs):
        (buf,) = buf
        ctx.sels, ctx.shapes = sels, [o.shape for o in outs]
        ctx.sizes = [o.shape[0] if sel is None else sel[0].shape[0] for o, sel in zip(outs, sels)]
        at = 0
        for o, sel, n in zip(outs, sels, ctx.sizes):
            dst = buf[at:at + n]
            if sel is not None:
                torch.index_select(o, 0, sel[0], out=dst)
            elif not _is_rows_of(o, dst):
                dst.copy_(o)
            at += n
        buf[at:].zero_()
        return buf

    @staticmethod
    def backward(ctx, g):
        grads, at = [], 0
        for shape, sel, n in zip(ctx.shapes, ctx.sels, ctx.sizes):
            g_out = g[at:at + n]
            at += n
            if sel is None:
                grads.append(g_out)
                continue
            positions, others = sel
            go = g.new_zeros(shape) if others is None else g.new_empty(shape)
            go.index_copy_(0, positions, g_out)
            if others is not None and others.numel():
                go.index_fill_(0, others, 0)
            grads.append(go)
        return (None, None, *grads)  # the padding rows' gradient goes nowhere


class _GradRows:
    """The gradient of a per-row tensor, allocated when the first round's backward asks for its rows
    (``chunk_kda_round(grad_out=...)``) and handed to ``_RoundInputs``'s backward, which then does not copy the
    rows written in place. Allocated in backward, not forward: held from forward on, one per layer, it would add
    the gradients' size to the peak memory."""

    def __init__(self, like: torch.Tensor):
        self.shape, self.dtype, self.device = like.shape, like.dtype, like.device
        self.buf = None

    def rows(self, a: int, b: int) -> torch.Tensor:
        if self.buf is None:
            self.buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self.buf[a:b]

    def take(self) -> torch.Tensor | None:
        buf, self.buf = self.buf, None
        return buf


def _is_rows_of(x: torch.Tensor, rows: torch.Tensor) -> bool:
    """x is ``rows`` itself (the same elements of the same base), not a copy."""
    return (rows._base is not None and x._base is rows._base and x.storage_offset() == rows.storage_offset()
            and x.stride() == rows.stride())


class _RoundInputs(torch.autograd.Function):
    """The rounds' inputs of one per-row tensor: a round without replay reads its own row range (a slice), a
    round with replay gathers its input rows (``KDARound.gather``: per sequence the replay rows, then its own
    rows). Why one Function for all rounds: the own ranges partition the rows, so the gradient of the tensor is
    written once, each round's own-row gradients copied into their range and the few replay-row gradients added
    after; as separate gathers each replaying round would add a full-size zero-filled gradient (index_select's
    backward) and autograd a full-size sum of it into the others'."""

    @staticmethod
    def forward(ctx, t, rounds, grad_rows):
        ctx.rounds, ctx.shape, ctx.grad_rows = rounds, t.shape, grad_rows
        ctx.set_materialize_grads(False)
        return tuple(t.index_select(0, r.gather) if r.replay_rows.numel() else t[r.phys_start:r.phys_end]
                     for r in rounds)

    @staticmethod
    def backward(ctx, *grads):
        some = next((g for g in grads if g is not None), None)
        if some is None:
            return None, None, None
        g_t = ctx.grad_rows.take() if ctx.grad_rows is not None else None  # rounds wrote into it
        if g_t is None:
            g_t = some.new_empty(ctx.shape)
        for r, g in zip(ctx.rounds, grads):
            own = g_t[r.phys_start:r.phys_end]
            if g is None:
                own.zero_()
            elif r.replay_rows.numel():
                torch.index_select(g, 0, r.output_positions, out=own)
            elif not _is_rows_of(g, own):
                own.copy_(g)
        g_t[ctx.rounds[-1].phys_end:].zero_()  # alignment padding rows
        for r, g in zip(ctx.rounds, grads):
            if g is not None and r.replay_rows.numel():
                g_t.index_add_(0, r.replay_rows, g.index_select(0, r.replay_positions))
        return g_t, None, None


def _round_inputs(tensors, batch: CompactBatch, grad_rows):
    """``_RoundInputs`` of each tensor over the batch's rounds, or None where the rounds do not partition the rows
    in order (the no-replay ablation: its segments run in their own order and gather)."""
    rounds = batch.rounds
    if (not rounds or batch.kda_output_perm is not None
            or any(r.own_sizes is None or r.replay_positions is None for r in rounds)):
        return None
    ends = [0] + [r.phys_end for r in rounds[:-1]]
    if [r.phys_start for r in rounds] != ends:
        raise ValueError(f"kda_rounds: the rounds' own rows {[(r.phys_start, r.phys_end) for r in rounds]} do not "
                         "follow each other from row 0")
    return [_RoundInputs.apply(t, rounds, gr) for t, gr in zip(tensors, grad_rows)]


def kda_tree(q, k, v, f, beta, conv_W, A_log, dt_bias, batch: CompactBatch, cfg) -> torch.Tensor:
    """The KDA mixer's layout-specific part on a compact batch: per-row q, k, v (before the short
    convolution), f [p, H, K] and beta [p, H] -> o [p, H, V] (p: this rank's rows); ``conv_W`` the q/k/v
    depthwise weights [H*K, w].

    The short convolution runs on the rows' true ancestors and, like the core, needs whole paths, so
    under context parallelism it runs after the rows-to-heads exchange on the rank's own channels (the
    convolution is depthwise per channel).
    """
    cp = batch.cp
    H, Kh = q.shape[1], q.shape[2]
    heads = slice(0, H)
    if cp is not None:
        q, k, v, f, beta = (cp.rows_to_heads(t) for t in (q, k, v, f, beta[..., None]))
        beta = beta.squeeze(-1)
        heads = cp.head_slice(H)
    h = heads.stop - heads.start
    chans = slice(heads.start * Kh, heads.stop * Kh)
    q, k, v = (tree_short_conv(t.flatten(1), w[chans], batch.conv_pred, "silu", seq_cu=batch.conv_cu_seqlens,
                               context=batch.conv_context, num_rows=batch.num_rows,
                               backend=cfg.op_backend("conv")).view(-1, h, Kh)
               for t, w in zip((q, k, v), conv_W))
    o = kda_rounds(q, k, v, f, beta, batch, chunk_size=cfg.kda_chunk_size, backend=cfg.op_backend("kda"),
                   A_log=A_log[heads], dt_bias=dt_bias.view(H, Kh)[heads].flatten(), lower_bound=cfg.kda_lower_bound)
    return o if cp is None else cp.heads_to_rows(o)


# ------------------------------------------------------------------------------------------ MLA
def mla_tree_attention(q, k, v, batch: CompactBatch, scale: float, backend: str = "auto") -> torch.Tensor:
    """The MLA mixer's layout-specific part on a compact batch: per-row q [p, H, Dqk], k [p, G, Dqk], v [p, G, Dv]
    -> o [p, H, Dv]; every row attends to its ancestors and itself (bottom-right causal, Eq. 22).

    G = H for MLA; G < H (a divisor) is grouped-query attention: the G key/value heads cross the
    context-parallel exchange unrepeated (so G must split over cp too, with the query heads of each rank's
    key/value heads on the same rank), and the attention reads them unrepeated (the split's cuDNN pieces take
    G < H; kernels that need H heads get them repeated).

    Each sequence's view (its ancestors' keys and values) runs with ``backend``
    (harts.ops.attention.tree_attention_views): on the fast path as cuDNN calls per view merged by log-sum-exp,
    reading long runs of shared ancestor rows in place (the split, ``batch.mla_split_plan``;
    ``view_attention_impl`` says where it applies) or one packed bottom-right causal varlen call on gathered keys
    and values; the exact reference otherwise. The alternative that reads every shared key in place, one
    FlexAttention call over all rows with the ancestry block mask (``tree_attention_flex`` with
    ``mla_tree_mask``), is exact too but measured slower on an H200 (python -m benchmarks.tree_attention,
    ling3-tiny, a 65K-row microbatch of seed 9001, fwd+bwd: split 164 ms, varlen views 289 ms, flex 534 ms plus
    4.2 s to build the block mask on the device), so it is not the default."""
    from harts.ops.attention.api import check_heads

    cp = batch.cp
    check_heads(q, k, v, "mla_tree_attention")
    if cp is not None:  # all rows, own heads: both paths see every row after the exchange
        q, k, v = (cp.rows_to_heads(t) for t in (q, k, v))
    o = tree_attention_views(q, k, v, batch.mla_q_rows, batch.mla_q_is_identity, batch.mla_kv_rows,
                             batch.cu_seqlens_q, batch.cu_seqlens_k, scale, backend=backend,
                             max_seqlen_q=batch.max_seqlen_q, max_seqlen_k=batch.max_seqlen_k,
                             plan=lambda: batch.mla_split_plan)
    return o if cp is None else cp.heads_to_rows(o)


def mla_tree_mask(batch: CompactBatch, device) -> TreeMask:
    """The batch's ancestry block mask on ``device``, built on first use and kept in ``batch.derived``."""
    device = torch.device(device)
    key = ("mla_tree_mask", device.type, device.index, batch.mla_block_size)
    mask = batch.derived.get(key)
    if mask is None:
        if batch.mla_row is None or batch.mla_block_counts is None:
            raise ValueError("mla_tree_mask: the batch has no MLA ancestry fields (pack it with harts.pack)")
        mask = tree_mask(batch.mla_row.to(device), batch.mla_row_end.to(device), batch.mla_block_counts.to(device),
                         batch.mla_block_size)
        batch.derived[key] = mask
    return mask


# ------------------------------------------------------------------------------------------ model
def compact_hidden(model, batch: CompactBatch) -> torch.Tensor:
    """Final-normed hidden states of the physical rows [P, D] (own rows under CP) on the compact path."""
    return model(layout=batch)


def hidden_states(model, batch: CompactBatch, router: tuple | None = None) -> torch.Tensor:
    """Final-normed hidden states of the batch's rows [P, D]: the model's one forward, which runs the
    compact views for a HARTS batch and the packed path for a trajectory-wise one."""
    return model(layout=batch, router=router)


def logprobs(model, batch: CompactBatch, hidden_PD: torch.Tensor | None = None,
             router: tuple | None = None) -> torch.Tensor:
    """log softmax(z_{m(s)})[y_s] for every nonterminal semantic position in original order [S'].

    Row max / sum-exp are computed once per compact row; no S' x V tensor exists (Eq. 19 backward
    accumulates each row's gradient from all its semantic positions).
    """
    h = hidden_states(model, batch, router) if hidden_PD is None else hidden_PD
    pair_of = batch.logprob_pair_of
    if pair_of is None:  # trajectory-wise: every position its own row
        rows, targets = batch.logprob_rows, batch.logprob_targets
    else:  # one log-prob per distinct (row, target), expanded to the positions (harts.runtime.batch.logprob_pairs)
        rows, targets = batch.logprob_pair_rows, batch.logprob_pair_targets
    cp = batch.cp
    if cp is not None:  # own rows only; other ranks' positions are zero (sum over the CP group)
        lo, hi = cp.row_range
        own = (rows >= lo) & (rows < hi)
        idx = own.nonzero().squeeze(1)
        lp_own = model.token_logprobs(h, targets[idx], rows[idx] - lo)
        lp = torch.zeros(rows.shape[0], dtype=lp_own.dtype, device=lp_own.device).index_copy(0, idx, lp_own)
    else:
        lp = model.token_logprobs(h, targets, rows)
    return lp if pair_of is None else lp.index_select(0, pair_of)
