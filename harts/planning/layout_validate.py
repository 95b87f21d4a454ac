"""Validator of an ``ExecutionLayout``: every index the runtime relies on, checked against the layout's own
arrays, the trie and (when given) the plan. Raises ValueError naming the offending physical row, sequence,
round, state or trajectory and its values; ordinary code, so ``python -O`` keeps it.

Sections: physical order (a bijection between trie rows and the first C physical rows, padding after);
sequences (output blocks tile [0, C) round-major, replay is [a(p), p)); MLA views (each KV view one true root
path ending with the sequence's own rows; ``mla_row_end`` the end of each row's trie subtree); rounds
(gathers on the path, outputs contiguous, states from earlier rounds, sorted requests); state provenance
(emitter on the same path up to the anchor, every state consumed); conv context; log-probs; agreement with
the plan and its trie.

Legend: C compact rows, P physical rows, Q sequences, R rounds, E emitted states, N trajectories,
W = w - 1 conv window rows, T_r input positions of round r.
"""
from __future__ import annotations

import numpy as np

from harts.planning.calls import CallPlan
from harts.planning.checks import require, require_all, require_equal, require_shape
from harts.planning.layout import ExecutionLayout, RoundLayout, concat_ranges, offsets_of


def validate_layout(lay: ExecutionLayout, plan: CallPlan | None = None) -> None:
    check_physical_order(lay)
    check_sequences(lay)
    check_mla_views(lay)
    covered_P = np.zeros(lay.num_phys, dtype=np.int64)
    for r, rd in enumerate(lay.rounds):
        check_round(lay, r, rd)
        covered_P[rd.output_rows] += 1
    C = lay.num_rows
    require_all(covered_P[:C] == 1, lambda p: f"physical row {p} is output {int(covered_P[p])} times, expected once")
    require_all(covered_P[C:] == 0, lambda p: f"padding row {C + p} is output by a round")
    check_state_provenance(lay)
    check_conv_context(lay)
    check_logprobs(lay)
    if plan is not None:
        check_against_plan(lay, plan)


def check_physical_order(lay: ExecutionLayout) -> None:
    """Trie rows <-> physical rows [0, C) is a bijection; padding rows [C, P) are inert."""
    C, P = lay.num_rows, lay.num_phys
    require(P >= C, lambda: f"num_phys P = {P} is smaller than num_rows C = {C}")
    require_shape(lay.row_of_phys, (P,), "row_of_phys")
    require_shape(lay.phys_of_row, (C,), "phys_of_row")
    rows = lay.row_of_phys[:C]
    require_all((rows >= 0) & (rows < C),
                lambda p: f"physical row {p} maps to trie row {int(rows[p])}, not in [0, {C})")
    seen = np.bincount(rows, minlength=C)
    require_all(seen == 1, lambda c: f"trie row {c} has {int(seen[c])} physical rows, expected 1")
    require_all(lay.row_of_phys[C:] == -1, lambda k: f"padding row {C + k} maps to trie row "
                                                     f"{int(lay.row_of_phys[C + k])}, expected -1")
    require_equal(lay.phys_of_row[rows], np.arange(C), "phys_of_row[row_of_phys]", item="physical row")
    for name in ("tokens", "position_ids", "multiplicity"):
        arr = getattr(lay, name)
        require_shape(arr, (P,), name)
        require_all(arr[C:] == 0, lambda k: f"{name} of padding row {C + k} is {int(arr[C + k])}, expected 0")
    require_shape(lay.parent_phys, (P,), "parent_phys")
    require_all(lay.parent_phys[C:] == -1, lambda k: f"parent_phys of padding row {C + k} is "
                                                     f"{int(lay.parent_phys[C + k])}, expected -1")
    par = lay.parent_phys[:C]
    require_all((par >= -1) & (par < C), lambda p: f"parent_phys of physical row {p} is {int(par[p])}, not a row")
    require_all(lay.multiplicity[:C] >= 1, lambda p: f"multiplicity of physical row {p} is "
                                                     f"{int(lay.multiplicity[p])}, expected >= 1")


def check_sequences(lay: ExecutionLayout) -> None:
    """Output blocks tile [0, C) in round-major sequence order; rounds nonempty; replay is [a(p), p)."""
    C, Q, R, B = lay.num_rows, lay.num_sequences, lay.num_rounds, lay.chunk_size
    for name in ("seq_trajectory", "seq_replay_start", "seq_start", "seq_end"):
        require_shape(getattr(lay, name), (Q,), name)
    require_shape(lay.seq_cu_seqlens, (Q + 1,), "seq_cu_seqlens")
    cu = lay.seq_cu_seqlens
    require(cu[0] == 0 and cu[-1] == C, lambda: f"seq_cu_seqlens must run from 0 to C = {C}, got {cu[0]} .. {cu[-1]}")
    n_out = lay.seq_end - lay.seq_start
    require_all(n_out >= 1, lambda q: f"sequence {q}: outputs [{int(lay.seq_start[q])}, {int(lay.seq_end[q])}) "
                                      f"are empty")
    require_equal(np.diff(cu), n_out, "output block length (seq_cu_seqlens)", item="sequence")
    ro = lay.round_offsets
    require_shape(ro, (R + 1,), "round_offsets")
    require(ro[0] == 0 and ro[-1] == Q, lambda: f"round_offsets must run from 0 to Q = {Q}, got {ro.tolist()}")
    require_all(np.diff(ro) >= 1, lambda r: f"round {r} is empty (round_offsets {ro.tolist()})")
    require_equal(lay.seq_round, np.repeat(np.arange(R), np.diff(ro)), "round", item="sequence")
    require_equal(lay.seq_replay_start, (lay.seq_start // B) * B, "replay_start (must be a(start))", item="sequence")
    require_equal(lay.position_ids[:C], concat_ranges(lay.seq_start, n_out), "position id", item="physical row")
    require_shape(lay.state_offsets, (R + 1,), "state_offsets")
    require_all(np.diff(lay.state_offsets) >= 0, lambda r: f"state_offsets decrease at round {r}")


def check_mla_views(lay: ExecutionLayout) -> None:
    """Q = own outputs; KV = positions [0, e) of the path: one true root path ending with the own rows."""
    C, Q = lay.num_rows, lay.num_sequences
    e, n_out = lay.seq_end, lay.seq_end - lay.seq_start
    require_equal(lay.cu_seqlens_q, lay.seq_cu_seqlens, "cu_seqlens_q", item="sequence boundary")
    require_equal(lay.cu_seqlens_k, offsets_of(e), "cu_seqlens_k", item="sequence boundary")
    require_equal(lay.mla_q_rows, np.arange(C), "mla_q_rows", item="query")
    kv = lay.mla_kv_rows
    require_shape(kv, (int(e.sum()),), "mla_kv_rows")
    require_all((kv >= 0) & (kv < C), lambda k: f"mla_kv_rows entry {k} is {int(kv[k])}, not in [0, {C})")
    require_equal(lay.position_ids[kv], concat_ranges(np.zeros(Q, dtype=np.int64), e), "position id", item="KV entry")
    tail = concat_ranges(lay.cu_seqlens_k[:-1] + lay.seq_start, n_out)
    require_equal(kv[tail], lay.mla_q_rows, "KV row at the query's own position", item="query")
    starts = np.zeros(kv.shape[0], dtype=bool)
    starts[lay.cu_seqlens_k[:-1]] = True
    first = np.flatnonzero(starts)
    require_all(lay.parent_phys[kv[first]] == -1, lambda q: f"sequence {q}: KV view starts at physical row "
                                                            f"{int(kv[first[q]])}, not a root row")
    nxt = np.flatnonzero(~starts)
    require_equal(lay.parent_phys[kv[nxt]], kv[nxt - 1], "parent_phys along the KV view (leaves its path)",
                  item="KV link")
    require(lay.max_seqlen_q == int(n_out.max()), lambda: f"max_seqlen_q {lay.max_seqlen_q} != {int(n_out.max())}")
    require(lay.max_seqlen_k == int(e.max()), lambda: f"max_seqlen_k {lay.max_seqlen_k} != {int(e.max())}")
    check_mla_row_end(lay)


def check_mla_row_end(lay: ExecutionLayout) -> None:
    """``mla_row_end`` is each row's trie subtree end: a row lies strictly inside its parent's range, its own
    range nests in it, and the range sizes obey size = 1 + the children's sizes. Then each range holds
    exactly the row's descendants, which the ancestry mask of MLA relies on."""
    C, P = lay.num_rows, lay.num_phys
    end = lay.mla_row_end
    require_shape(end, (P,), "mla_row_end")
    require_all(end[C:] == -1, lambda k: f"mla_row_end of padding row {C + k} is {int(end[C + k])}, expected -1")
    rows = lay.row_of_phys[:C]
    end_P = end[:C]
    require_all((end_P > rows) & (end_P <= C), lambda p: f"mla_row_end of physical row {p} (trie row {int(rows[p])}) "
                                                         f"is {int(end_P[p])}, not in ({int(rows[p])}, {C}]")
    par = lay.parent_phys[:C]
    child = np.flatnonzero(par >= 0)
    pr, pe = lay.row_of_phys[par[child]], end[par[child]]
    require_all((pr < rows[child]) & (end_P[child] <= pe),
                lambda k: f"physical row {int(child[k])}: its trie range [{int(rows[child[k]])}, "
                          f"{int(end_P[child[k]])}) is not inside its parent's ({int(pr[k])}, {int(pe[k])})")
    size_C = np.zeros(C, dtype=np.int64)
    size_C[rows] = end_P - rows
    want_C = 1 + np.bincount(pr, weights=size_C[rows[child]], minlength=C).astype(np.int64)
    require_all(size_C == want_C, lambda c: f"mla_row_end of physical row {int(lay.phys_of_row[c])} (trie row {c}) "
                                            f"gives a subtree of {int(size_C[c])} rows, its children's subtrees "
                                            f"and itself hold {int(want_C[c])}")


def check_round(lay: ExecutionLayout, r: int, rd: RoundLayout) -> None:
    """Round r reads positions [replay_start, end) of its sequences' paths and writes its own output block."""
    C, B = lay.num_rows, lay.chunk_size
    lo, hi = int(lay.round_offsets[r]), int(lay.round_offsets[r + 1])
    n = hi - lo
    where = f"round {r}"
    require(rd.seq_offset == lo, lambda: f"{where}: seq_offset {rd.seq_offset}, expected {lo}")
    require_shape(rd.cu_seqlens, (n + 1,), f"{where}: cu_seqlens")
    a, s = lay.seq_replay_start[lo:hi], lay.seq_start[lo:hi]
    lens = lay.seq_end[lo:hi] - a
    require_equal(rd.cu_seqlens, offsets_of(lens), f"{where}: cu_seqlens", item="boundary")
    require(rd.max_seqlen == int(lens.max()), lambda: f"{where}: max_seqlen {rd.max_seqlen} != {int(lens.max())}")
    T = rd.num_tokens
    require_shape(rd.gather, (T,), f"{where}: gather")
    require_shape(rd.is_output, (T,), f"{where}: is_output")
    g = rd.gather
    require_all((g >= 0) & (g < C), lambda t: f"{where}: input position {t} gathers row {int(g[t])}, not in [0, {C})")
    # Every input position reads the row at its own position on its sequence's KV path.
    kv_pos = concat_ranges(lay.cu_seqlens_k[lo:hi] + a, lens)
    require_equal(g, lay.mla_kv_rows[kv_pos], f"{where}: gathered row (must be on the sequence's path)",
                  item="input position")
    local = np.arange(T) - np.repeat(rd.cu_seqlens[:-1], lens)
    require_equal(rd.is_output, local >= np.repeat(s - a, lens), f"{where}: is_output", item="input position")
    require_equal(rd.output_positions, np.flatnonzero(rd.is_output), f"{where}: output_positions", item="output")
    require_equal(rd.output_rows, g[rd.output_positions], f"{where}: output_rows", item="output")
    ps, pe = int(lay.seq_cu_seqlens[lo]), int(lay.seq_cu_seqlens[hi])
    require((rd.phys_start, rd.phys_end) == (ps, pe),
            lambda: f"{where}: physical block [{rd.phys_start}, {rd.phys_end}), expected [{ps}, {pe})")
    require_equal(rd.output_rows, np.arange(ps, pe), f"{where}: output row (must be contiguous)", item="output")
    # Initial states: zero iff replay_start == 0, else a state emitted by an earlier round.
    require_shape(rd.init_source, (n,), f"{where}: init_source")
    require_equal(rd.init_source < 0, a == 0, f"{where}: starts from the zero state (iff replay_start == 0)",
                  item="local sequence")
    before = int(lay.state_offsets[r])
    require_all(rd.init_source < before, lambda k: f"{where}: sequence {lo + k} starts from state "
                                                   f"{int(rd.init_source[k])}, not emitted before this round "
                                                   f"(states < {before})")
    # Requested states: ids in order, sorted and unique per sequence, inside the sequence's chunks.
    e_lo, e_hi = before, int(lay.state_offsets[r + 1])
    require_equal(rd.emit_state, np.arange(e_lo, e_hi), f"{where}: emit_state", item="request")
    require_shape(rd.emit_seq, (e_hi - e_lo,), f"{where}: emit_seq")
    require_shape(rd.emit_chunk, (e_hi - e_lo,), f"{where}: emit_chunk")
    es, ec = rd.emit_seq, rd.emit_chunk
    require_all((es >= 0) & (es < n), lambda k: f"{where}: request {k} names local sequence {int(es[k])}, "
                                                f"not in [0, {n})")
    key = es * (int(lens.max()) + 1) + ec
    require_all(np.diff(key) > 0, lambda k: f"{where}: requests {k} and {k + 1} are not sorted and unique "
                                            f"((sequence, chunk) = ({int(es[k])}, {int(ec[k])}), "
                                            f"({int(es[k + 1])}, {int(ec[k + 1])}))")
    require_all((ec >= 1) & (ec * B < lens[es]), lambda k: f"{where}: request {k} asks for chunk {int(ec[k])} of "
                                                           f"local sequence {int(es[k])} ({int(lens[es[k]])} "
                                                           f"inputs, B = {B})")
    require_equal(rd.emit_global_chunk, offsets_of(-(-lens // B))[es] + ec, f"{where}: emit_global_chunk",
                  item="request")


def check_state_provenance(lay: ExecutionLayout) -> None:
    """Each initial state comes from an emitter whose path agrees with the consumer's up to the anchor."""
    B, E = lay.chunk_size, lay.num_states
    st_round = np.repeat(np.arange(lay.num_rounds), np.diff(lay.state_offsets))
    st_seq = np.concatenate([rd.emit_seq + rd.seq_offset for rd in lay.rounds])
    st_chunk = np.concatenate([rd.emit_chunk for rd in lay.rounds])
    consumers = np.zeros(E, dtype=np.int64)
    for r, rd in enumerate(lay.rounds):
        for n in np.flatnonzero(rd.init_source >= 0).tolist():
            q = rd.seq_offset + n
            k = int(rd.init_source[n])
            j, c = int(st_seq[k]), int(st_chunk[k])
            require(st_round[k] < r, lambda: f"sequence {q} (round {r}): state {k} comes from round {st_round[k]}")
            a = int(lay.seq_replay_start[q])
            aj = int(lay.seq_replay_start[j])
            require(aj + c * B == a, lambda: f"sequence {q}: state {k} (sequence {j}, chunk {c}) is at position "
                                             f"{aj + c * B}, expected {a}")
            # The row at position a-1 on both paths must agree (a trie row fixes the whole prefix).
            require(_path_row(lay, j, a - 1) == _path_row(lay, q, a - 1),
                    lambda: f"sequence {q}: state {k} comes from sequence {j} on another path "
                            f"(position {a - 1} differs)")
            consumers[k] += 1
    require_all(consumers >= 1, lambda k: f"state {k} (sequence {int(st_seq[k])}, chunk {int(st_chunk[k])}) is "
                                          f"emitted but never consumed")


def check_conv_context(lay: ExecutionLayout) -> None:
    """The w-1 path rows before each sequence's first output, -1 before position 0."""
    Q, W = lay.num_sequences, lay.conv_width - 1
    require_shape(lay.conv_context, (Q, W), "conv_context")
    if W == 0:
        return
    pos_QW = lay.seq_start[:, None] + np.arange(-W, 0)[None, :]
    valid_QW = pos_QW >= 0
    want_QW = np.where(valid_QW, lay.mla_kv_rows[lay.cu_seqlens_k[:-1, None] + np.maximum(pos_QW, 0)], -1)
    got_QW = lay.conv_context
    require_all(got_QW == want_QW, lambda qk: f"conv_context of sequence {qk[0]} at position "
                                              f"{int(pos_QW[qk])} is row {int(got_QW[qk])}, expected "
                                              f"{int(want_QW[qk])} (the true ancestor, -1 before position 0)")


def check_logprobs(lay: ExecutionLayout) -> None:
    """Log-prob rows and targets in original semantic order; multiplicities count semantic positions."""
    N, P = lay.num_trajectories, lay.num_phys
    lens = np.diff(lay.semantic_offsets)
    S = int(lay.semantic_offsets[-1])
    require_shape(lay.semantic_rows, (S,), "semantic_rows")
    sr = lay.semantic_rows
    require_all((sr >= 0) & (sr < lay.num_rows), lambda k: f"semantic position {k} maps to physical row "
                                                           f"{int(sr[k])}, not in [0, {lay.num_rows})")
    require_equal(lay.logprob_offsets, offsets_of(lens - 1), "logprob_offsets", item="trajectory boundary")
    sem_next = concat_ranges(lay.semantic_offsets[:-1] + 1, lens - 1)
    require_equal(lay.logprob_rows, sr[sem_next - 1], "logprob_rows", item="log-prob")
    require_equal(lay.logprob_next_rows, sr[sem_next], "logprob_next_rows", item="log-prob")
    require_equal(lay.logprob_targets, lay.tokens[sr[sem_next]], "logprob_targets (the next token)", item="log-prob")
    require_equal(lay.position_ids[sr], concat_ranges(np.zeros(N, dtype=np.int64), lens), "position id",
                  item="semantic position")
    require_equal(lay.multiplicity, np.bincount(sr, minlength=P), "multiplicity", item="physical row")


def check_against_plan(lay: ExecutionLayout, plan: CallPlan) -> None:
    require(lay.num_rounds == plan.num_calls, lambda: f"layout has {lay.num_rounds} rounds, plan {plan.num_calls}")
    require(lay.replay_tokens == plan.replay_tokens,
            lambda: f"layout replays {lay.replay_tokens} tokens, plan {plan.replay_tokens}")
    require_equal(lay.seq_start, plan.seq_start, "start (layout vs plan)", item="sequence")
    require_equal(lay.seq_end, plan.seq_end, "end (layout vs plan)", item="sequence")
    trie = plan.trie
    if trie is None:
        return
    C = lay.num_rows
    require(C == trie.num_rows, lambda: f"layout has C = {C} rows, the plan's trie {trie.num_rows}")
    rows = lay.row_of_phys[:C]
    require_equal(lay.tokens[:C], trie.tokens[rows], "token (layout vs trie)", item="physical row")
    require_equal(lay.position_ids[:C], trie.depth[rows], "position id (layout vs trie depth)", item="physical row")
    require_equal(lay.multiplicity[:C], trie.multiplicity[rows], "multiplicity (layout vs trie)", item="physical row")
    tp = trie.parent[rows]
    require_equal(lay.parent_phys[:C], np.where(tp >= 0, lay.phys_of_row[np.maximum(tp, 0)], -1),
                  "parent_phys (layout vs trie)", item="physical row")
    require_equal(lay.semantic_rows, lay.phys_of_row[trie.row_of_position], "physical row (layout vs trie)",
                  item="semantic position")


def _path_row(lay: ExecutionLayout, q: int, t: int) -> int:
    return int(lay.row_of_phys[lay.mla_kv_rows[lay.cu_seqlens_k[q] + t]])
