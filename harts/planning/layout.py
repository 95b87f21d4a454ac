"""The compact execution layout of one microbatch: every index the runtime needs, as numpy arrays.

Built once per microbatch from a ``CallPlan`` (paper 3.3) on the CPU; the runtime converts the arrays
to device tensors once and never walks a tree (paper 3.4, 4.2). numpy only, no torch.

Coordinates
-----------
- trie row c in [0, C): a compact row of ``harts.data.trie.CompactTrie`` (DFS preorder).
- physical row p in [0, P): the row order of every hidden-state buffer in the model. Round-major; within a
  round, sequence by sequence; each input sequence's OUTPUT rows contiguous in position order. So the
  sequences' output blocks tile [0, C) in global sequence order, and rows [C, P) are alignment padding
  (``pad_to_multiple``): they map to no trie row (row_of_phys = -1), have position id 0, multiplicity 0
  and token 0, are never gathered by any view, and are never counted as work.
- sequence q in [0, Q): the plan's input sequences, numbered round-major (``CallPlan``).
- state k in [0, E): the boundary states emitted by all rounds, in the order (round, sequence, chunk).
  Round r emits states ``state_offsets[r]:state_offsets[r+1]``; a KDA round returns its requested
  states in exactly this order, and the runtime concatenates them into one list that later rounds index.

Per layer, the intended use (paper 4.2):
- token-wise ops (projections, RoPE with ``position_ids``, MoE, norms) run once over the physical rows;
- causal conv: one varlen call over physical rows [0, C) with ``seq_cu_seqlens``; the initial window of
  sequence q is ``conv_context[q]`` (physical rows, -1 = zero), so the conv sees only true ancestors;
- KDA: for each round r, ``x_round = x_phys[round.gather]`` (replay positions read the ancestors'
  already convolved rows), one packed call with ``round.cu_seqlens``, initial states
  ``states[round.init_source]`` (zero where -1), requested states ``(round.emit_seq, round.emit_chunk)``;
  then ``o_phys[round.output_rows] = o_round[round.output_positions]`` (replay outputs are dropped);
- MLA: one global varlen call, Q = ``x_phys[mla_q_rows]``, KV = ``x_phys[mla_kv_rows]`` with
  ``cu_seqlens_q``/``cu_seqlens_k`` and bottom-right causal alignment: query i of sequence q sees KV
  entries j <= h_q + i, h_q = its start position (Eq. 22); outputs scatter to ``mla_q_rows``.
  The same visibility without the per-sequence copies: trie rows are a DFS preorder, so the subtree of
  row c is the trie-row range [c, end[c]) and physical row k is visible to physical row q iff
  c_k = row_of_phys[k] >= 0 and c_k <= c_q < ``mla_row_end[k]`` (k is an ancestor-or-self of q; positions
  are then causal by construction). ``mla_block_counts`` counts the visible pairs per block of physical
  rows from the views, so a block-sparse kernel knows its empty, partial and full blocks without a dense
  P x P mask;
- log-probs: ``logprob_rows``/``logprob_targets`` in original semantic order.

All index arrays are int64 (the runtime casts cu_seqlens to int32 where a kernel wants it).
Legend: C compact rows, P physical rows (C + padding), Q sequences, R rounds, E emitted states,
N trajectories, S semantic positions, w conv width, W = w - 1 conv window rows.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from harts.data.trie import CompactTrie
from harts.planning.calls import CallPlan
from harts.planning.checks import integer_arg


def later(executor: Executor | None, fn: Callable, *args) -> Callable:
    """``fn(*args)`` started on ``executor`` (run now without one); call the result for its value (or the
    exception it raised)."""
    if executor is None:
        value = fn(*args)
        return lambda: value
    return executor.submit(fn, *args).result


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(starts[k], starts[k] + lengths[k]) over k."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    shift = np.asarray(starts, np.int64) - (np.cumsum(lengths) - lengths)
    out = np.repeat(shift, lengths)
    out += np.arange(total, dtype=np.int64)
    return out


def take_ranges(x: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``x[concat_ranges(starts, lengths)]`` for ranges inside x (IndexError otherwise). Few long ranges (a
    layout's sequences and trajectories) are copied as slices, at memory speed and without an index array as
    long as the result (six times faster for 18 ranges over 660K positions); many short ones go through the
    index."""
    starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
    n = starts.shape[0]
    if n and (starts.min() < 0 or (starts + lengths).max() > x.shape[0] or lengths.min() < 0):
        k = int(np.flatnonzero((starts < 0) | (starts + lengths > x.shape[0]) | (lengths < 0))[0])
        raise IndexError(f"take_ranges: range {k} [{int(starts[k])}, {int(starts[k] + lengths[k])}) is not inside "
                         f"[0, {x.shape[0]})")
    if n and int(lengths.sum()) >= 64 * n:
        return np.concatenate([x[a:a + m] for a, m in zip(starts.tolist(), lengths.tolist())])
    return x[concat_ranges(starts, lengths)]


def offsets_of(lengths: np.ndarray) -> np.ndarray:
    """[n+1] exclusive prefix sums of n lengths (cu_seqlens)."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


@dataclass(frozen=True, eq=False)
class RoundLayout:
    """One KDA execution round: a single packed call over this round's input sequences.

    Input position t of the round is one (sequence, position) pair; sequence n (local index, global id
    ``seq_offset + n``) occupies input positions cu_seqlens[n]:cu_seqlens[n+1], which are its trajectory
    positions [replay_start, end): first the replay positions (state updates only), then its outputs.
    """

    seq_offset: int  # global id of the round's first sequence
    cu_seqlens: np.ndarray  # [n+1] input lengths incl. replay (end - replay_start)
    max_seqlen: int
    gather: np.ndarray  # [T_r] physical row read by every input position (replay -> an ancestor's row)
    is_output: np.ndarray  # [T_r] bool, True where the position produces an output
    output_positions: np.ndarray  # [C_r] input positions with outputs, ascending
    output_rows: np.ndarray  # [C_r] physical rows they write (= gather[output_positions], contiguous)
    phys_start: int  # output_rows == arange(phys_start, phys_end)
    phys_end: int
    init_source: np.ndarray  # [n] state id (index into the flat emitted-state list), -1 = zero state
    emit_seq: np.ndarray  # [E_r] local sequence index of each requested state
    emit_chunk: np.ndarray  # [E_r] sequence-local chunk c: the state before local token c*B (1 <= c < NT_n)
    emit_state: np.ndarray  # [E_r] state id of each request (= state_offsets[r] + arange(E_r))
    emit_global_chunk: np.ndarray  # [E_r] fla-style global chunk id (sum of NT of earlier sequences + c)

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.shape[0] - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def replay_tokens(self) -> int:
        return self.num_tokens - int(self.output_positions.shape[0])


@dataclass(frozen=True, eq=False)
class ExecutionLayout:
    """Index arrays for compact execution of one microbatch (see the module docstring for the contract)."""

    chunk_size: int  # B of the plan (the KDA chunk size)
    conv_width: int  # w
    num_rows: int  # C
    num_phys: int  # P >= C
    # Physical ordering
    row_of_phys: np.ndarray  # [P] trie row of each physical row, -1 for padding
    phys_of_row: np.ndarray  # [C] physical row of each trie row
    tokens: np.ndarray  # [P] input token ids (0 for padding)
    position_ids: np.ndarray  # [P] position in the original trajectory (depth), 0 for padding
    multiplicity: np.ndarray  # [P] q_c, 0 for padding
    # [P] physical row of the trie parent (the row at position - 1 on every path), -1 for roots/padding
    parent_phys: np.ndarray
    # Sequences (global, round-major)
    seq_round: np.ndarray  # [Q]
    seq_trajectory: np.ndarray  # [Q]
    seq_replay_start: np.ndarray  # [Q] a
    seq_start: np.ndarray  # [Q] s
    seq_end: np.ndarray  # [Q] e
    seq_cu_seqlens: np.ndarray  # [Q+1] output blocks in physical rows: sequence q outputs rows [cu[q], cu[q+1])
    round_offsets: np.ndarray  # [R+1] sequences of round r: round_offsets[r]:round_offsets[r+1]
    state_offsets: np.ndarray  # [R+1] states emitted by round r: state_offsets[r]:state_offsets[r+1]
    rounds: tuple  # R x RoundLayout
    # MLA (one global varlen call, bottom-right causal)
    mla_q_rows: np.ndarray  # [C] physical rows of the packed Q (sequence q's outputs)
    mla_kv_rows: np.ndarray  # [sum_q e_q] physical rows of the packed KV (positions [0, e_q) of q's path)
    cu_seqlens_q: np.ndarray  # [Q+1]
    cu_seqlens_k: np.ndarray  # [Q+1]
    max_seqlen_q: int
    max_seqlen_k: int
    # [P] exclusive end of the trie subtree of each physical row's trie row (in trie rows), -1 for padding
    mla_row_end: np.ndarray
    # Causal conv
    conv_context: np.ndarray  # [Q, w-1] physical rows of positions s-w+1 .. s-1 on q's path (oldest first), -1 = zero
    # Log-probs (original semantic order)
    semantic_offsets: np.ndarray  # [N+1] trajectory i's semantic positions (i, 0..L_i-1)
    semantic_rows: np.ndarray  # [S] physical row of every semantic position
    logprob_offsets: np.ndarray  # [N+1] trajectory i's nonterminal positions: logprob_offsets[i]:[i+1]
    logprob_rows: np.ndarray  # [S-N] physical row of (i, t), t < L_i - 1
    logprob_next_rows: np.ndarray  # [S-N] physical row of (i, t + 1), whose token (i, t) predicts
    logprob_targets: np.ndarray  # [S-N] tokens_i[t+1]

    # ------------------------------------------------------------------ sizes
    @property
    def num_rounds(self) -> int:
        return len(self.rounds)

    @property
    def num_sequences(self) -> int:
        return int(self.seq_round.shape[0])

    @property
    def num_states(self) -> int:
        return int(self.state_offsets[-1])

    @property
    def num_trajectories(self) -> int:
        return int(self.semantic_offsets.shape[0] - 1)

    @property
    def replay_tokens(self) -> int:
        return sum(r.replay_tokens for r in self.rounds)

    @property
    def kda_tokens(self) -> int:
        """Positions processed by the KDA core over all rounds (C + replay)."""
        return sum(r.num_tokens for r in self.rounds)

    @property
    def mla_kv_tokens(self) -> int:
        return int(self.mla_kv_rows.shape[0])

    def summary(self) -> dict:
        return {
            "rows": self.num_rows,
            "phys_rows": self.num_phys,
            "rounds": self.num_rounds,
            "sequences": self.num_sequences,
            "states": self.num_states,
            "replay_tokens": self.replay_tokens,
            "kda_tokens": self.kda_tokens,
            "mla_kv_tokens": self.mla_kv_tokens,
        }

    def validate(self, plan: CallPlan | None = None) -> None:
        """Check every guarantee of the layout against the trie (and the plan, when given); raises ValueError
        naming the offending row, sequence, round or state and its values."""
        from harts.planning.layout_validate import validate_layout

        validate_layout(self, plan)


# ---------------------------------------------------------------------------------------------- build
def build_layout(plan: CallPlan, *, conv_width: int = 4, pad_to_multiple: int = 1,
                 executor: Executor | None = None) -> ExecutionLayout:
    """Compact execution layout of a plan made by ``plan_calls`` (the plan must carry its trie).

    ``conv_width`` w >= 1 and ``pad_to_multiple`` >= 1 are ints or numpy integers (TypeError otherwise).
    ``executor`` (a ``concurrent.futures.Executor``, e.g. a thread pool) runs the log-prob views, passes over
    the S trajectory positions that nothing else here reads, beside the sequences' and rounds' indices: numpy
    releases the GIL in them, so on a host with a spare core they cost no wall time. The layout is the same
    with or without it.
    """
    trie = check_layout_args(plan, conv_width, pad_to_multiple)
    w, pad = int(conv_width), int(pad_to_multiple)
    path_base = trie.offsets[plan.seq_trajectory]  # [Q] semantic index of (traj_q, 0)
    phys = physical_order(plan, trie, path_base, pad)
    semantic_rows = phys.phys_of_row[trie.row_of_position]
    views = later(executor, logprob_views, trie, semantic_rows, phys.tokens)
    state_offsets, init_source = state_ids(plan)
    e, n_out = plan.seq_end, plan.seq_end - plan.seq_start
    rounds = tuple(round_layout(plan, r, trie, path_base, phys, state_offsets, init_source)
                   for r in range(plan.num_calls))
    mla_kv_rows = take_ranges(semantic_rows, path_base, e)  # positions [0, e_q) of each sequence's path
    mla_row_end = subtree_end(trie, phys.row_of_phys)
    logprob_offsets, logprob_rows, next_rows, logprob_targets = views()
    return ExecutionLayout(
        chunk_size=plan.chunk_size,
        conv_width=w,
        num_rows=trie.num_rows,
        num_phys=phys.num_phys,
        row_of_phys=phys.row_of_phys,
        phys_of_row=phys.phys_of_row,
        tokens=phys.tokens,
        position_ids=phys.position_ids,
        multiplicity=phys.multiplicity,
        parent_phys=phys.parent_phys,
        seq_round=plan.seq_round.copy(),
        seq_trajectory=plan.seq_trajectory.copy(),
        seq_replay_start=plan.seq_replay_start.copy(),
        seq_start=plan.seq_start.copy(),
        seq_end=e.copy(),
        seq_cu_seqlens=phys.seq_cu_seqlens,
        round_offsets=plan.round_offsets.copy(),
        state_offsets=state_offsets,
        rounds=rounds,
        mla_q_rows=np.arange(trie.num_rows, dtype=np.int64),
        mla_kv_rows=mla_kv_rows,
        cu_seqlens_q=phys.seq_cu_seqlens.copy(),
        cu_seqlens_k=offsets_of(e),
        max_seqlen_q=int(n_out.max()),
        max_seqlen_k=int(e.max()),
        mla_row_end=mla_row_end,
        conv_context=conv_context(trie, path_base, plan.seq_start, phys.phys_of_row, w),
        semantic_offsets=trie.offsets.copy(),
        semantic_rows=semantic_rows,
        logprob_offsets=logprob_offsets,
        logprob_rows=logprob_rows,
        logprob_next_rows=next_rows,
        logprob_targets=logprob_targets,
    )


def check_layout_args(plan: CallPlan, conv_width, pad_to_multiple) -> CompactTrie:
    """The plan's trie, after checking the arguments of ``build_layout``."""
    if not isinstance(plan, CallPlan):
        raise TypeError(f"build_layout: plan must be a CallPlan (from plan_calls), got {type(plan).__name__}")
    integer_arg(conv_width, "conv_width", where="build_layout")
    integer_arg(pad_to_multiple, "pad_to_multiple", where="build_layout")
    if plan.trie is None:
        raise ValueError("build_layout: the plan has no trie (make it with plan_calls / plan_calls_for_trie)")
    C, covered = plan.trie.num_rows, int((plan.seq_end - plan.seq_start).sum())
    if covered != C:
        raise ValueError(f"build_layout: the plan's sequences output {covered} rows, the trie has C = {C}")
    return plan.trie


def path_rows(trie: CompactTrie, path_base: np.ndarray, lo: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Trie rows of positions lo[k] .. lo[k]+lengths[k]-1 on the paths starting at semantic index path_base[k]."""
    return take_ranges(trie.row_of_position, path_base + lo, lengths)


@dataclass(frozen=True, eq=False)
class PhysicalOrder:
    """The physical row order: sequence output blocks in global (round-major) sequence order, then padding."""

    num_phys: int  # P
    row_of_phys: np.ndarray  # [P] trie row, -1 for padding
    phys_of_row: np.ndarray  # [C]
    tokens: np.ndarray  # [P]
    position_ids: np.ndarray  # [P]
    multiplicity: np.ndarray  # [P]
    parent_phys: np.ndarray  # [P]
    seq_cu_seqlens: np.ndarray  # [Q+1] output blocks


def physical_order(plan: CallPlan, trie: CompactTrie, path_base: np.ndarray, pad_to_multiple: int) -> PhysicalOrder:
    C = trie.num_rows
    n_out = plan.seq_end - plan.seq_start
    row_of_out = path_rows(trie, path_base, plan.seq_start, n_out)  # [C] in physical order
    P = -(-C // pad_to_multiple) * pad_to_multiple
    phys_of_row = np.empty(C, dtype=np.int64)
    phys_of_row[row_of_out] = np.arange(C, dtype=np.int64)
    tp = trie.parent[row_of_out]

    def padded(values_C: np.ndarray, fill: int) -> np.ndarray:
        out_P = np.full(P, fill, dtype=np.int64)
        out_P[:C] = values_C
        return out_P

    return PhysicalOrder(
        num_phys=P,
        row_of_phys=padded(row_of_out, -1),
        phys_of_row=phys_of_row,
        tokens=padded(trie.tokens[row_of_out], 0),
        position_ids=padded(trie.depth[row_of_out], 0),
        multiplicity=padded(trie.multiplicity[row_of_out], 0),
        parent_phys=padded(np.where(tp >= 0, phys_of_row[np.maximum(tp, 0)], -1), -1),
        seq_cu_seqlens=offsets_of(n_out),
    )


def state_ids(plan: CallPlan) -> tuple[np.ndarray, np.ndarray]:
    """(state_offsets [R+1], init_source [Q]): the plan's emit list is already ordered (round, sequence,
    chunk), so a state's id is its index in it; init_source is each sequence's initial state id (-1 = zero)."""
    eo, ec = plan.emit_offsets, plan.emit_chunks
    Q = plan.num_sequences
    init_source = np.full(Q, -1, dtype=np.int64)
    has = plan.seq_init >= 0
    if has.any():
        # The emit list is sorted by (sequence, chunk): look every initial state up in one searchsorted.
        emit_seq = np.repeat(np.arange(Q, dtype=np.int64), np.diff(eo))
        M = int(ec.max()) + 1
        keys = emit_seq * M + ec
        want = plan.seq_init[has] * M + plan.init_chunk()[has]
        k = np.searchsorted(keys, want)
        ok = (k < keys.shape[0]) & (keys[np.minimum(k, keys.shape[0] - 1)] == want)
        if not ok.all():
            q = int(np.flatnonzero(has)[np.flatnonzero(~ok)[0]])
            raise ValueError(f"build_layout: sequence {q}: its initial state (chunk {int(plan.init_chunk()[q])}) "
                             f"is not emitted by sequence {int(plan.seq_init[q])}")
        init_source[has] = k
    return eo[plan.round_offsets].astype(np.int64), init_source


def round_layout(plan: CallPlan, r: int, trie: CompactTrie, path_base: np.ndarray, phys: PhysicalOrder,
                 state_offsets: np.ndarray, init_source: np.ndarray) -> RoundLayout:
    """KDA round r: its sequences' inputs [replay_start, end) gathered from physical rows, and its states."""
    B = plan.chunk_size
    lo, hi = int(plan.round_offsets[r]), int(plan.round_offsets[r + 1])
    a, s = plan.seq_replay_start[lo:hi], plan.seq_start[lo:hi]
    in_len = plan.seq_end[lo:hi] - a
    cu = offsets_of(in_len)
    gather = phys.phys_of_row[path_rows(trie, path_base[lo:hi], a, in_len)]
    local_pos = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1], in_len)
    is_output = local_pos >= np.repeat(s - a, in_len)
    out_pos = np.flatnonzero(is_output).astype(np.int64)
    e_lo, e_hi = int(state_offsets[r]), int(state_offsets[r + 1])
    emit_seq = np.repeat(np.arange(hi - lo, dtype=np.int64), np.diff(plan.emit_offsets[lo : hi + 1]))
    emit_chunk = plan.emit_chunks[e_lo:e_hi]
    chunk_off = offsets_of(-(-in_len // B))
    return RoundLayout(
        seq_offset=lo,
        cu_seqlens=cu,
        max_seqlen=int(in_len.max()),
        gather=gather,
        is_output=is_output,
        output_positions=out_pos,
        output_rows=gather[out_pos],
        phys_start=int(phys.seq_cu_seqlens[lo]),
        phys_end=int(phys.seq_cu_seqlens[hi]),
        init_source=init_source[lo:hi],
        emit_seq=emit_seq,
        emit_chunk=emit_chunk,
        emit_state=np.arange(e_lo, e_hi, dtype=np.int64),
        emit_global_chunk=chunk_off[emit_seq] + emit_chunk,
    )


def conv_context(trie: CompactTrie, path_base: np.ndarray, seq_start: np.ndarray, phys_of_row: np.ndarray,
                 conv_width: int) -> np.ndarray:
    """[Q, w-1] physical rows of positions s-w+1 .. s-1 on each sequence's path (oldest first), -1 below 0."""
    w1 = conv_width - 1
    if w1 == 0:
        return np.zeros((seq_start.shape[0], 0), dtype=np.int64)
    pos_QW = seq_start[:, None] + np.arange(-w1, 0, dtype=np.int64)[None, :]
    sem_QW = path_base[:, None] + np.maximum(pos_QW, 0)
    return np.where(pos_QW >= 0, phys_of_row[trie.row_of_position[sem_QW]], -1).astype(np.int64)


def subtree_end(trie: CompactTrie, row_of_phys: np.ndarray) -> np.ndarray:
    """[P] exclusive end (in trie rows) of the subtree of each physical row's trie row, -1 for padding.

    Rows of a fork-free segment share their subtree's end: that of the segment's last descendant
    segment (segments are numbered in preorder too, so one reverse pass over them suffices)."""
    sub_end_G = trie.segment_end.copy()
    parent_G = trie.segment_parent
    for g in range(trie.num_segments - 1, 0, -1):
        p = parent_G[g]
        if p >= 0 and sub_end_G[g] > sub_end_G[p]:
            sub_end_G[p] = sub_end_G[g]
    valid = row_of_phys >= 0
    return np.where(valid, sub_end_G[trie.segment_of_row[np.where(valid, row_of_phys, 0)]], -1).astype(np.int64)


def block_weights(starts: np.ndarray, ends: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The blocks of ``block`` rows that each nonempty range [starts[k], ends[k]) overlaps: (range id, block,
    rows of the range in that block), ranges in order, blocks ascending within a range."""
    first, last = starts // block, (ends - 1) // block
    n = last - first + 1
    rid = np.repeat(np.arange(starts.shape[0], dtype=np.int64), n)
    blk = concat_ranges(first, n)
    rows = np.minimum(ends[rid], (blk + 1) * block) - np.maximum(starts[rid], blk * block)
    return rid, blk, rows


def mla_block_counts(lay: "ExecutionLayout", block: int) -> np.ndarray:
    """[nb, nb] (nb = ceil(P / block)) number of visible (query, key) pairs of MLA per (query block, key
    block) of physical rows: ``block``**2 marks a full block, 0 an empty one, anything between a partial
    one (its pairs need the per-element mask). Exact, and O(MLA views + blocks^2) work: no P x P mask.

    Every query row belongs to one sequence q, whose queries are the contiguous output block
    [cu_seqlens_q[q], cu_seqlens_q[q+1]) and see (a) the sequence's prefix (its first start_q KV entries,
    rows of earlier sequences) in full and (b) the own block causally. The two parts are disjoint, so the
    pairs add up per sequence."""
    integer_arg(block, "block", where="mla_block_counts")
    B = int(block)
    nb = -(-lay.num_phys // B)
    counts = np.zeros(nb * nb, dtype=np.int64)
    Q = lay.num_sequences
    a, b = lay.cu_seqlens_q[:-1], lay.cu_seqlens_q[1:]
    sid, qblk, qrows = block_weights(a, b, B)  # query blocks of each sequence
    qoff = offsets_of(np.bincount(sid, minlength=Q))
    # (a) prefix keys: (sequence, key block) histogram, times the sequence's rows in each query block.
    start = lay.seq_start
    kv = lay.mla_kv_rows[concat_ranges(lay.cu_seqlens_k[:-1], start)]
    key = np.repeat(np.arange(Q, dtype=np.int64), start) * nb + kv // B
    uniq, cnt = np.unique(key, return_counts=True)
    us, ublk = uniq // nb, uniq % nb
    nq = np.diff(qoff)[us]
    e = concat_ranges(qoff[us], nq)  # entries of (sid, qblk, qrows)
    counts += np.bincount(qblk[e] * nb + np.repeat(ublk, nq), weights=qrows[e] * np.repeat(cnt, nq),
                          minlength=nb * nb).astype(np.int64)
    # (b) the own block, causal: block pairs (i, j <= i) of the same sequence.
    n = np.diff(qoff)
    tri = n * (n + 1) // 2
    t = np.arange(int(tri.sum()), dtype=np.int64) - np.repeat(offsets_of(tri)[:-1], tri)
    i = ((np.sqrt(8 * t + 1) - 1) // 2).astype(np.int64)
    i += (i + 1) * (i + 2) // 2 <= t  # exact integer triangular root
    i -= i * (i + 1) // 2 > t
    j = t - i * (i + 1) // 2
    base = np.repeat(qoff[:-1], tri)
    mi, mj = qrows[base + i], qrows[base + j]
    pairs = np.where(i == j, mi * (mi + 1) // 2, mi * mj)
    counts += np.bincount(qblk[base + i] * nb + qblk[base + j], weights=pairs, minlength=nb * nb).astype(np.int64)
    return counts.reshape(nb, nb)


def logprob_views(trie: CompactTrie, semantic_rows: np.ndarray, tokens_P: np.ndarray) -> tuple[np.ndarray, ...]:
    """(logprob_offsets [N+1], logprob_rows [S-N], logprob_next_rows [S-N], logprob_targets [S-N]) in original
    order, from each position's physical row ``semantic_rows`` [S]: position t < L_i - 1 of trajectory i reads
    the row of position t and predicts the token of the row of position t + 1, read from the physical tokens
    ``tokens_P`` (a gather from P rows, which stay in cache, instead of one through the trie over S positions)."""
    starts, n = trie.offsets[:-1], trie.lengths - 1
    logprob_rows = take_ranges(semantic_rows, starts, n)  # every position but each trajectory's last reads a row
    next_rows = take_ranges(semantic_rows, starts + 1, n)  # every position but each trajectory's first is a target
    return offsets_of(trie.lengths - 1), logprob_rows, next_rows, tokens_P[next_rows]
