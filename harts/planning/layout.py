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
  entries j <= h_q + i, h_q = its start position (Eq. 22); outputs scatter to ``mla_q_rows``;
- log-probs: ``logprob_rows``/``logprob_targets`` in original semantic order.

All index arrays are int64 (the runtime casts cu_seqlens to int32 where a kernel wants it).
Legend: C compact rows, P physical rows (C + padding), Q sequences, R rounds, E emitted states,
N trajectories, S semantic positions, w conv width.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.planning.calls import CallPlan


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(starts[k], starts[k] + lengths[k]) over k."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    shift = np.asarray(starts, np.int64) - (np.cumsum(lengths) - lengths)
    out = np.repeat(shift, lengths)
    out += np.arange(total, dtype=np.int64)
    return out


def _cu(lengths: np.ndarray) -> np.ndarray:
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
    parent_phys: np.ndarray  # [P] physical row of the trie parent (the row at position - 1 on every path), -1 for roots/padding
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
    # Causal conv
    conv_context: np.ndarray  # [Q, w-1] physical rows of positions s-w+1 .. s-1 on q's path (oldest first), -1 = zero
    # Log-probs (original semantic order)
    semantic_offsets: np.ndarray  # [N+1] trajectory i's semantic positions (i, 0..L_i-1)
    semantic_rows: np.ndarray  # [S] physical row of every semantic position
    logprob_offsets: np.ndarray  # [N+1] trajectory i's nonterminal positions: logprob_offsets[i]:[i+1]
    logprob_rows: np.ndarray  # [S-N] physical row of (i, t), t < L_i - 1
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
        """Check every guarantee of the layout against the trie (and the plan, when given)."""
        _validate_layout(self, plan)


# ---------------------------------------------------------------------------------------------- build
def build_layout(plan: CallPlan, *, conv_width: int = 4, pad_to_multiple: int = 1) -> ExecutionLayout:
    """Compact execution layout of a plan made by ``plan_calls`` (the plan must carry its trie)."""
    trie = plan.trie
    if trie is None:
        raise ValueError("build_layout: the plan has no trie (make it with plan_calls / plan_calls_for_trie)")
    if conv_width < 1:
        raise ValueError(f"build_layout: conv_width must be >= 1, got {conv_width}")
    if pad_to_multiple < 1:
        raise ValueError(f"build_layout: pad_to_multiple must be >= 1, got {pad_to_multiple}")
    B = plan.chunk_size
    C = trie.num_rows
    Q = plan.num_sequences
    traj = plan.seq_trajectory
    a, s, e = plan.seq_replay_start, plan.seq_start, plan.seq_end
    path_base = trie.offsets[traj]  # semantic index of (traj_q, 0)

    def path_rows(lo: np.ndarray, lengths: np.ndarray, seqs: np.ndarray | None = None) -> np.ndarray:
        """Trie rows of positions lo[k] .. lo[k]+lengths[k]-1 on the paths of sequences ``seqs``."""
        base = path_base if seqs is None else path_base[seqs]
        return trie.row_of_position[_ranges(base + lo, lengths)]

    # Physical order: sequence output blocks in global sequence order (round-major).
    n_out = e - s
    seq_cu = _cu(n_out)
    assert int(seq_cu[-1]) == C, "plan outputs do not cover the compact rows"
    row_of_out = path_rows(s, n_out)  # [C] in physical order
    P = -(-C // pad_to_multiple) * pad_to_multiple
    row_of_phys = np.full(P, -1, dtype=np.int64)
    row_of_phys[:C] = row_of_out
    phys_of_row = np.empty(C, dtype=np.int64)
    phys_of_row[row_of_out] = np.arange(C, dtype=np.int64)
    tokens = np.zeros(P, dtype=np.int64)
    tokens[:C] = trie.tokens[row_of_out]
    position_ids = np.zeros(P, dtype=np.int64)
    position_ids[:C] = trie.depth[row_of_out]
    multiplicity = np.zeros(P, dtype=np.int64)
    multiplicity[:C] = trie.multiplicity[row_of_out]
    parent_phys = np.full(P, -1, dtype=np.int64)
    tp = trie.parent[row_of_out]
    parent_phys[:C] = np.where(tp >= 0, phys_of_row[np.maximum(tp, 0)], -1)

    # States: the plan's emit list is already ordered (round, sequence, chunk), so state id = its index.
    eo, ec = plan.emit_offsets, plan.emit_chunks
    emit_seq_global = np.repeat(np.arange(Q, dtype=np.int64), np.diff(eo))
    R = plan.num_calls
    ro = plan.round_offsets
    state_offsets = eo[ro]
    init_chunk = plan.init_chunk()
    init_src = np.full(Q, -1, dtype=np.int64)
    has = plan.seq_init >= 0
    if has.any():
        # The emit list is sorted by (sequence, chunk): look every initial state up in one searchsorted.
        M = int(ec.max()) + 1
        keys = emit_seq_global * M + ec
        want = plan.seq_init[has] * M + init_chunk[has]
        k = np.searchsorted(keys, want)
        ok = (k < keys.shape[0]) & (keys[np.minimum(k, keys.shape[0] - 1)] == want)
        if not ok.all():
            q = int(np.flatnonzero(has)[np.flatnonzero(~ok)[0]])
            raise AssertionError(f"sequence {q}: its initial state is not emitted by sequence {int(plan.seq_init[q])}")
        init_src[has] = k

    # Rounds
    in_len = e - a
    rounds = []
    for r in range(R):
        lo, hi = int(ro[r]), int(ro[r + 1])
        seqs = np.arange(lo, hi, dtype=np.int64)
        cu = _cu(in_len[lo:hi])
        gather = phys_of_row[path_rows(a[lo:hi], in_len[lo:hi], seqs)]
        local_pos = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1], in_len[lo:hi])
        is_output = local_pos >= np.repeat(s[lo:hi] - a[lo:hi], in_len[lo:hi])
        out_pos = np.flatnonzero(is_output).astype(np.int64)
        e_lo, e_hi = int(state_offsets[r]), int(state_offsets[r + 1])
        emit_seq = emit_seq_global[e_lo:e_hi] - lo
        emit_chunk = ec[e_lo:e_hi]
        n_chunks = -(-in_len[lo:hi] // B)
        chunk_off = _cu(n_chunks)
        rounds.append(
            RoundLayout(
                seq_offset=lo,
                cu_seqlens=cu,
                max_seqlen=int(in_len[lo:hi].max()),
                gather=gather,
                is_output=is_output,
                output_positions=out_pos,
                output_rows=gather[out_pos],
                phys_start=int(seq_cu[lo]),
                phys_end=int(seq_cu[hi]),
                init_source=init_src[lo:hi],
                emit_seq=emit_seq,
                emit_chunk=emit_chunk,
                emit_state=np.arange(e_lo, e_hi, dtype=np.int64),
                emit_global_chunk=chunk_off[emit_seq] + emit_chunk,
            )
        )

    # MLA: Q = own outputs, KV = path positions [0, e).
    mla_kv_rows = phys_of_row[path_rows(np.zeros(Q, dtype=np.int64), e)]
    # Conv context: positions s-w+1 .. s-1 (oldest first), -1 where the position is negative.
    w1 = conv_width - 1
    if w1 > 0:
        offs = np.arange(-w1, 0, dtype=np.int64)
        pos = s[:, None] + offs[None, :]  # [Q, w-1]
        valid = pos >= 0
        sem = path_base[:, None] + np.maximum(pos, 0)
        conv_context = np.where(valid, phys_of_row[trie.row_of_position[sem]], -1)
    else:
        conv_context = np.zeros((Q, 0), dtype=np.int64)

    # Log-probs in original order.
    semantic_rows = phys_of_row[trie.row_of_position]
    lens = trie.lengths
    lp_len = lens - 1
    lp_sem = _ranges(trie.offsets[:-1], lp_len)
    logprob_rows = semantic_rows[lp_sem]
    # Next-token targets come from the trie tokens of (i, t+1).
    logprob_targets = trie.tokens[trie.row_of_position[lp_sem + 1]]

    return ExecutionLayout(
        chunk_size=B,
        conv_width=int(conv_width),
        num_rows=C,
        num_phys=P,
        row_of_phys=row_of_phys,
        phys_of_row=phys_of_row,
        tokens=tokens,
        position_ids=position_ids,
        multiplicity=multiplicity,
        parent_phys=parent_phys,
        seq_round=plan.seq_round.copy(),
        seq_trajectory=traj.copy(),
        seq_replay_start=a.copy(),
        seq_start=s.copy(),
        seq_end=e.copy(),
        seq_cu_seqlens=seq_cu,
        round_offsets=ro.copy(),
        state_offsets=state_offsets.astype(np.int64),
        rounds=tuple(rounds),
        mla_q_rows=np.arange(C, dtype=np.int64),
        mla_kv_rows=mla_kv_rows,
        cu_seqlens_q=seq_cu.copy(),
        cu_seqlens_k=_cu(e),
        max_seqlen_q=int(n_out.max()),
        max_seqlen_k=int(e.max()),
        conv_context=conv_context.astype(np.int64),
        semantic_offsets=trie.offsets.copy(),
        semantic_rows=semantic_rows,
        logprob_offsets=_cu(lp_len),
        logprob_rows=logprob_rows,
        logprob_targets=logprob_targets,
    )


# ---------------------------------------------------------------------------------------------- validation
def _validate_layout(lay: ExecutionLayout, plan: CallPlan | None) -> None:
    C, P, B = lay.num_rows, lay.num_phys, lay.chunk_size
    Q, R = lay.num_sequences, lay.num_rounds
    # Physical ordering: a bijection between trie rows and the first C physical rows; padding after.
    assert P >= C and lay.row_of_phys.shape == (P,) and lay.phys_of_row.shape == (C,)
    assert np.array_equal(np.sort(lay.row_of_phys[:C]), np.arange(C)), "physical rows are not a permutation"
    assert np.all(lay.row_of_phys[C:] == -1), "padding rows must map to no trie row"
    assert np.array_equal(lay.phys_of_row[lay.row_of_phys[:C]], np.arange(C))
    for name in ("tokens", "position_ids", "multiplicity"):
        arr = getattr(lay, name)
        assert arr.shape == (P,) and np.all(arr[C:] == 0), f"{name}: padding rows must be 0"
    assert lay.parent_phys.shape == (P,) and np.all(lay.parent_phys[C:] == -1)
    assert np.all(lay.parent_phys[:C] < C)
    assert np.all(lay.multiplicity[:C] >= 1)
    # Sequences tile [0, C) round-major; rounds nonempty.
    assert lay.seq_cu_seqlens[0] == 0 and lay.seq_cu_seqlens[-1] == C
    n_out = lay.seq_end - lay.seq_start
    assert np.all(n_out >= 1) and np.array_equal(np.diff(lay.seq_cu_seqlens), n_out)
    assert np.all(np.diff(lay.round_offsets) >= 1) and lay.round_offsets[-1] == Q
    assert np.array_equal(lay.seq_round, np.repeat(np.arange(R), np.diff(lay.round_offsets)))
    assert np.array_equal(lay.seq_replay_start, (lay.seq_start // B) * B), "replay is not [a(p), p)"
    # Every physical row is on a path: its position id follows its sequence's positions.
    pos_of_out = _ranges(lay.seq_start, n_out)
    assert np.array_equal(lay.position_ids[:C], pos_of_out), "position ids do not follow the sequences"
    covered = np.zeros(P, dtype=np.int64)
    for r, rd in enumerate(lay.rounds):
        lo, hi = int(lay.round_offsets[r]), int(lay.round_offsets[r + 1])
        n = hi - lo
        assert rd.seq_offset == lo and rd.cu_seqlens.shape == (n + 1,) and rd.cu_seqlens[0] == 0
        lens = lay.seq_end[lo:hi] - lay.seq_replay_start[lo:hi]
        assert np.array_equal(np.diff(rd.cu_seqlens), lens) and rd.max_seqlen == int(lens.max())
        T = rd.num_tokens
        assert rd.gather.shape == (T,) and rd.is_output.shape == (T,)
        assert np.all((rd.gather >= 0) & (rd.gather < C)), f"round {r}: gathers padding or out of range"
        # Every input position reads the row at its own position on a true path.
        want_pos = _ranges(lay.seq_replay_start[lo:hi], lens)
        assert np.array_equal(lay.position_ids[rd.gather], want_pos), f"round {r}: gathered positions"
        local = np.arange(T) - np.repeat(rd.cu_seqlens[:-1], lens)
        assert np.array_equal(rd.is_output, local >= np.repeat(lay.seq_start[lo:hi] - lay.seq_replay_start[lo:hi], lens))
        assert np.array_equal(rd.output_positions, np.flatnonzero(rd.is_output))
        assert np.array_equal(rd.output_rows, rd.gather[rd.output_positions])
        assert rd.phys_start == lay.seq_cu_seqlens[lo] and rd.phys_end == lay.seq_cu_seqlens[hi]
        assert np.array_equal(rd.output_rows, np.arange(rd.phys_start, rd.phys_end)), f"round {r}: outputs not contiguous"
        covered[rd.output_rows] += 1
        # Every sequence reads exactly the rows of positions [replay_start, end) of its KV path (below).
        kv_pos = _ranges(lay.cu_seqlens_k[lo:hi] + lay.seq_replay_start[lo:hi], lens)
        assert np.array_equal(rd.gather, lay.mla_kv_rows[kv_pos]), f"round {r}: gathers rows off the path"
        # Initial states: zero iff replay_start == 0, else a state emitted by an earlier round.
        a = lay.seq_replay_start[lo:hi]
        assert np.array_equal(rd.init_source < 0, a == 0), f"round {r}: zero state iff replay_start == 0"
        assert np.all(rd.init_source < lay.state_offsets[r]), f"round {r}: initial state from this or a later round"
        # Requested states.
        e_lo, e_hi = int(lay.state_offsets[r]), int(lay.state_offsets[r + 1])
        assert np.array_equal(rd.emit_state, np.arange(e_lo, e_hi))
        assert np.all((rd.emit_seq >= 0) & (rd.emit_seq < n))
        key = rd.emit_seq * (int(lens.max()) + 1) + rd.emit_chunk
        assert np.all(np.diff(key) > 0), f"round {r}: requests not sorted/unique"
        assert np.all(rd.emit_chunk >= 1) and np.all(rd.emit_chunk * B < lens[rd.emit_seq]), f"round {r}: bad chunk"
        nt = -(-lens // B)
        assert np.array_equal(rd.emit_global_chunk, _cu(nt)[rd.emit_seq] + rd.emit_chunk)
    assert np.all(covered[:C] == 1) and np.all(covered[C:] == 0), "a compact row is not output exactly once"
    # Initial states come from a sequence whose path agrees with ours up to the anchor.
    st_round = np.repeat(np.arange(R), np.diff(lay.state_offsets))
    st_seq = np.concatenate([rd.emit_seq + rd.seq_offset for rd in lay.rounds])
    st_chunk = np.concatenate([rd.emit_chunk for rd in lay.rounds])
    consumers = np.zeros(lay.num_states, dtype=np.int64)
    for r, rd in enumerate(lay.rounds):
        for n in np.flatnonzero(rd.init_source >= 0).tolist():
            q = rd.seq_offset + n
            k = int(rd.init_source[n])
            j, c = int(st_seq[k]), int(st_chunk[k])
            assert st_round[k] < r
            a = int(lay.seq_replay_start[q])
            assert lay.seq_replay_start[j] + c * B == a, f"sequence {q}: state {k} is not at position {a}"
            # The row at position a-1 on both paths must agree (a trie row fixes the whole prefix).
            assert _path_row(lay, j, a - 1) == _path_row(lay, q, a - 1), f"sequence {q}: emitter {j} is on another path"
            consumers[k] += 1
    assert np.all(consumers >= 1), "an emitted state is never consumed"
    # MLA views: KV = positions [0, e) of the path, ending with the sequence's own outputs (bottom-right).
    e = lay.seq_end
    assert np.array_equal(lay.cu_seqlens_q, lay.seq_cu_seqlens) and np.array_equal(lay.cu_seqlens_k, _cu(e))
    assert np.array_equal(lay.mla_q_rows, np.arange(C))
    kv = lay.mla_kv_rows
    assert kv.shape == (int(e.sum()),) and np.all((kv >= 0) & (kv < C))
    assert np.array_equal(lay.position_ids[kv], _ranges(np.zeros(Q, dtype=np.int64), e)), "KV positions"
    tail = _ranges(lay.cu_seqlens_k[:-1] + lay.seq_start, n_out)
    assert np.array_equal(kv[tail], lay.mla_q_rows), "the KV view does not end with the sequence's own rows"
    # Each KV view is one true root path: a root row, then parent -> child links.
    nxt = np.ones(kv.shape[0], dtype=bool)
    nxt[lay.cu_seqlens_k[:-1]] = False
    assert np.all(lay.parent_phys[kv[~nxt]] == -1), "a KV view does not start at a root"
    assert np.array_equal(lay.parent_phys[kv[nxt]], kv[np.flatnonzero(nxt) - 1]), "a KV view leaves its path"
    assert lay.max_seqlen_q == int(n_out.max()) and lay.max_seqlen_k == int(e.max())
    # Conv context: the w-1 path rows before the first output, -1 before position 0.
    w1 = lay.conv_width - 1
    assert lay.conv_context.shape == (Q, w1)
    if w1:
        pos = lay.seq_start[:, None] + np.arange(-w1, 0)[None, :]
        valid = pos >= 0
        assert np.array_equal(lay.conv_context < 0, ~valid)
        want = kv[(lay.cu_seqlens_k[:-1, None] + np.maximum(pos, 0))]
        assert np.array_equal(lay.conv_context[valid], want[valid]), "conv context is not the true ancestors"
    # Log-probs.
    N = lay.num_trajectories
    lens_t = np.diff(lay.semantic_offsets)
    assert np.array_equal(lay.logprob_offsets, _cu(lens_t - 1))
    sem_next = _ranges(lay.semantic_offsets[:-1] + 1, lens_t - 1)
    sem_cur = sem_next - 1
    assert np.array_equal(lay.logprob_rows, lay.semantic_rows[sem_cur])
    assert np.array_equal(lay.logprob_targets, lay.tokens[lay.semantic_rows[sem_next]])
    assert np.array_equal(lay.position_ids[lay.semantic_rows], _ranges(np.zeros(N, dtype=np.int64), lens_t))
    assert np.array_equal(np.bincount(lay.semantic_rows, minlength=P), lay.multiplicity), "multiplicities"
    if plan is not None:
        assert R == plan.num_calls and lay.replay_tokens == plan.replay_tokens
        assert np.array_equal(lay.seq_start, plan.seq_start) and np.array_equal(lay.seq_end, plan.seq_end)
        trie = plan.trie
        if trie is not None:
            rows = lay.row_of_phys[:C]
            assert np.array_equal(lay.tokens[:C], trie.tokens[rows])
            assert np.array_equal(lay.position_ids[:C], trie.depth[rows])
            assert np.array_equal(lay.multiplicity[:C], trie.multiplicity[rows])
            tp = trie.parent[rows]
            assert np.array_equal(lay.parent_phys[:C], np.where(tp >= 0, lay.phys_of_row[np.maximum(tp, 0)], -1))
            assert np.array_equal(lay.semantic_rows, lay.phys_of_row[trie.row_of_position])


def _path_row(lay: ExecutionLayout, q: int, t: int) -> int:
    return int(lay.row_of_phys[lay.mla_kv_rows[lay.cu_seqlens_k[q] + t]])
