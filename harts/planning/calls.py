"""Minimum-call planning for linear-attention execution (paper 3.3, Eqs. 11-15, Algorithm 1).

Execution model (the scope of the optimality claim): one packed chunkwise linear-attention call per
*round*; a call runs several independent input sequences; a chunk-boundary state produced inside a call
can initialise another sequence only after the call returns; a side branch at fork p starts from the fixed
anchor state S_{a(p)} and replays [a(p), p) inside the core (replay length is fixed by B and p, never
optimised); every non-replay output is produced exactly once.

Two passes over the segment tree, both linear:
1. DP (Eqs. 12-14) in postorder: T_pre(v) (entry anchor state ready before the round) and T_in(v) (entry
   state arrives inside the current call as the parent's direct continuation). h_o = max over the other
   children of T_pre comes from the largest and second-largest child T_pre, so T_in costs O(|ch(v)|).
2. Recovery (Algorithm 1, lines 12-29) in preorder: propagate (ready, round budget K, round r, sequence q)
   down the tree. At v: same = ready and e_v < a_v + B; K_side = K - (0 if same else 1); the direct child is
   the first child o with H[o] <= K whose removal leaves no child with T_pre > K_side; side children start new
   sequences in round r from S_{a_v} (same) or in round r + 1 from S_{b_v}, which the current sequence must
   emit (sequence-local chunk (b_v - replay_start) / B).
The recursion of Algorithm 1 is unrolled into one sweep in segment-id order, which is valid because every
parent id precedes its children's: the state Recover(v, ...) needs is written when the parent is visited.
Independent trees share the sweep and are merged by round number.

Legend: G segments, Q input sequences (all rounds), R rounds (= num_calls), E emitted boundary states.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import numpy as np

from harts.planning.segments import SegmentTree, anchor

ZERO_STATE = -1  # state source of a sequence that starts from the zero state (position 0)


# ---------------------------------------------------------------------------------------------- DP
def min_calls_dp_reference(tree: SegmentTree, chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Eqs. (12)-(14) for every segment: (T_pre, T_in), int64 arrays of length G.

    Algorithm 1 lines 3-11, transcribed literally (the fast path is ``min_calls_dp``). Children have
    larger ids than their parent, so reverse id order is a postorder. Python lists instead of numpy scalars: this loop is the planner's hot path.
    """
    B = int(chunk_size)
    if B <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    G = tree.num_segments
    short = tree.is_short(B).tolist()
    offs = tree.child_offsets.tolist()
    ch = tree.children.tolist()
    t_pre = [1] * G
    t_in = [1] * G
    for v in range(G - 1, -1, -1):
        lo, hi = offs[v], offs[v + 1]
        if lo == hi:
            continue  # leaf: Eq. (12)
        # Largest and second-largest child T_pre (as a multiset: a tie makes both equal).
        m1 = m2 = 0
        for k in range(lo, hi):
            x = t_pre[ch[k]]
            if x > m1:
                m1, m2 = x, m1
            elif x > m2:
                m2 = x
        # Eq. (13): h_o = max_{u != o} T_pre(u) is m2 for a child holding the maximum, m1 otherwise.
        best = None
        for k in range(lo, hi):
            o = ch[k]
            h = m2 if t_pre[o] == m1 else m1
            val = t_in[o] if t_in[o] > h + 1 else h + 1
            if best is None or val < best:
                best = val
        t_in[v] = best
        # Eq. (14)
        t_pre[v] = m1 if short[v] else best
    return np.asarray(t_pre, dtype=np.int64), np.asarray(t_in, dtype=np.int64)


def _dp_fast(tree: SegmentTree, chunk_size: int):
    """Eqs. (12)-(14) streamed child -> parent; returns (T_pre, T_in, M1, unique-argmax child) as lists.

    By induction T_pre(v) <= T_in(v) <= T_pre(v) + 1, so with M1 the largest child T_pre (the
    largest/second-largest trick of Algorithm 1 line 7):
      T_in(v) = T_in(o*)  if o* is the unique child with T_pre = M1 (then h_{o*} = M2 < M1 <= T_in(o*)),
      T_in(v) = M1 + 1    otherwise (every child has h_o = M1 and T_in(o) <= M1 + 1).
    Only (M1, count of M1, T_in of the argmax) must be kept per segment, and leaves (T = 1) are folded in
    with numpy, so the Python loop touches internal segments only. ``min_calls_dp_reference`` is the
    literal per-child transcription; tests check the two agree.
    """
    B = int(chunk_size)
    if B <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    G = tree.num_segments
    parent = tree.parent
    nch = tree.num_children
    leaf = nch == 0
    # Leaf children contribute T_pre = T_in = 1.
    leaf_par = parent[leaf & (parent >= 0)]
    n_leaf_ch = np.bincount(leaf_par, minlength=G)
    m1_a = (n_leaf_ch > 0).astype(np.int64)
    arg_a = np.full(G, -1, dtype=np.int64)
    lv = np.flatnonzero(leaf & (parent >= 0))
    arg_a[parent[lv[::-1]]] = lv[::-1]  # any leaf child; only used when it is the unique maximum
    m1, cnt, arg = m1_a.tolist(), n_leaf_ch.tolist(), arg_a.tolist()
    iarg = [1] * G  # T_in of the current argmax child
    t_pre = [1] * G
    t_in = [1] * G
    short = tree.is_short(B).tolist()
    par = parent.tolist()
    for v in np.flatnonzero(~leaf)[::-1].tolist():
        x = m1[v]
        y = iarg[v] if cnt[v] == 1 else x + 1
        t_in[v] = y
        if not short[v]:
            x = y
        t_pre[v] = x
        p = par[v]
        if p >= 0:
            if x > m1[p]:
                m1[p] = x
                cnt[p] = 1
                iarg[p] = y
                arg[p] = v
            elif x == m1[p]:
                cnt[p] += 1
    unique_arg = [a if c == 1 else -1 for a, c in zip(arg, cnt)]
    return t_pre, t_in, m1, unique_arg


def min_calls_dp(tree: SegmentTree, chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Eqs. (12)-(14) for every segment: (T_pre, T_in), int64 arrays of length G (linear time)."""
    t_pre, t_in, _, _ = _dp_fast(tree, chunk_size)
    return np.asarray(t_pre, dtype=np.int64), np.asarray(t_in, dtype=np.int64)


# ---------------------------------------------------------------------------------------------- plan value
@dataclass(frozen=True, eq=False)
class CallPlan:
    """The linear-attention schedule of one microbatch: rounds of packed input sequences.

    Sequences are numbered round-major (global id q; round r holds q in round_offsets[r]:round_offsets[r+1]).
    Sequence q covers positions [replay_start, end) of the path to its last segment (a leaf): positions
    [replay_start, start) are replay (state updates only), [start, end) produce outputs. It starts from the
    zero state (init_sequence == -1, then replay_start == 0) or from the state at position replay_start
    emitted by sequence init_sequence of an earlier round, at that sequence's local chunk
    (replay_start - its replay_start) / B. ``emit_chunks[emit_offsets[q]:emit_offsets[q+1]]`` are the
    sequence-local chunk indices whose start states q must return (sorted, unique, >= 1).
    """

    chunk_size: int
    tree: SegmentTree
    t_pre: np.ndarray  # [G] Eq. (14) per segment
    t_in: np.ndarray  # [G] Eq. (13) per segment
    direct_child: np.ndarray  # [G] chosen direct continuation (-1 for a leaf)
    segment_sequence: np.ndarray  # [G] the sequence that outputs the segment
    round_offsets: np.ndarray  # [R+1]
    seq_round: np.ndarray  # [Q]
    seq_first_segment: np.ndarray  # [Q]
    seq_last_segment: np.ndarray  # [Q] a leaf
    seq_replay_start: np.ndarray  # [Q] a = a(start)
    seq_start: np.ndarray  # [Q] s
    seq_end: np.ndarray  # [Q] e
    seq_init: np.ndarray  # [Q] global id of the emitting sequence, or ZERO_STATE
    emit_offsets: np.ndarray  # [Q+1]
    emit_chunks: np.ndarray  # [E] sequence-local chunk indices
    seq_trajectory: np.ndarray  # [Q] a trajectory whose path holds [0, end) (-1 without a trie)
    trie: object = None  # the CompactTrie the plan was made for (None for bare segment trees)

    # ------------------------------------------------------------------ sizes
    @property
    def num_calls(self) -> int:
        """Sequential packed linear-attention calls per layer (= rounds)."""
        return int(self.round_offsets.shape[0] - 1)

    @property
    def num_sequences(self) -> int:
        return int(self.seq_round.shape[0])

    @property
    def replay_tokens(self) -> int:
        """R of Eq. (15), as realised by the plan: total replay positions over all sequences."""
        return int((self.seq_start - self.seq_replay_start).sum())

    @property
    def num_emitted_states(self) -> int:
        return int(self.emit_chunks.shape[0])

    def sequences_per_round(self) -> list[int]:
        return np.diff(self.round_offsets).tolist()

    def seq_local_index(self) -> np.ndarray:
        """Index of each sequence within its round."""
        return np.arange(self.num_sequences) - self.round_offsets[self.seq_round]

    def init_chunk(self) -> np.ndarray:
        """[Q] the emitter-local chunk index of each sequence's initial state (-1 for the zero state)."""
        src = self.seq_init
        has = src >= 0
        out = np.full(self.num_sequences, -1, dtype=np.int64)
        out[has] = (self.seq_replay_start[has] - self.seq_replay_start[src[has]]) // self.chunk_size
        return out

    # ------------------------------------------------------------------ output
    def to_dict(self) -> dict:
        local = self.seq_local_index().tolist()
        rounds: list[list[dict]] = [[] for _ in range(self.num_calls)]
        traj = self.seq_trajectory.tolist()
        a, s, e = self.seq_replay_start.tolist(), self.seq_start.tolist(), self.seq_end.tolist()
        src, rnd = self.seq_init.tolist(), self.seq_round.tolist()
        eo, ec = self.emit_offsets.tolist(), self.emit_chunks.tolist()
        for q in range(self.num_sequences):
            j = src[q]
            rounds[rnd[q]].append(
                {
                    "trajectory": traj[q],
                    "replay_start": a[q],
                    "start": s[q],
                    "end": e[q],
                    "init_state": None if j < 0 else {"round": rnd[j], "sequence": local[j]},
                    "emit_chunks": ec[eo[q] : eo[q + 1]],
                }
            )
        return {"num_calls": self.num_calls, "replay_tokens": self.replay_tokens, "rounds": rounds}

    def summary(self) -> dict:
        return {
            "chunk_size": self.chunk_size,
            "segments": self.tree.num_segments,
            "trees": self.tree.num_trees,
            "num_calls": self.num_calls,
            "replay_tokens": self.replay_tokens,
            "sequences": self.num_sequences,
            "sequences_per_round": self.sequences_per_round(),
            "emitted_states": self.num_emitted_states,
        }

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Check every guarantee of the plan; raises AssertionError naming the offending item."""
        _validate_plan(self)


# ---------------------------------------------------------------------------------------------- recovery
def plan_segment_tree(tree: SegmentTree, chunk_size: int, *, trie=None, leaf_trajectory=None) -> CallPlan:
    """Algorithm 1 on a segment forest in linear time: DP, recovery, merge of trees by round.

    Recovery's choice (lines 19-21) in closed form, using T_pre <= T_in <= T_pre + 1 and K >= the
    subtree's requirement: when ``same`` every child fits and f = 0, so the first child is chosen; otherwise
    K_side = K - 1 and either K > M1 (f = 0: the first child) or K == M1, where exactly one child has
    T_pre = M1 > K_side and it must be the direct child. Recover(v, ...)'s arguments are derived from
    the parent's visit, so the Python loop touches internal segments only; leaves and sequence bookkeeping
    are vectorised. ``plan_segment_tree_reference`` is the literal transcription; tests check the plans
    are identical.
    """
    B = int(chunk_size)
    t_pre, t_in, m1, uarg = _dp_fast(tree, B)
    G = tree.num_segments
    parent = tree.parent
    leaf = tree.is_leaf
    par = parent.tolist()
    short = tree.is_short(B).tolist()
    b_of = tree.terminal_anchor(B).tolist()
    a_of = tree.entry_anchor(B).tolist()
    first_child_a = np.full(G, -1, dtype=np.int64)
    first_child_a[~leaf] = tree.children[tree.child_offsets[:-1][~leaf]]
    first_child = first_child_a.tolist()
    nch = tree.num_children.tolist()

    # Recover(v, ready, K, r, q) arguments of every internal segment, and its decisions.
    budget = [0] * G  # K
    rnd = [0] * G  # r
    first = list(range(G))  # q, named by its first segment
    ready = [True] * G
    src = [ZERO_STATE] * G  # id of S_{a_v} when ready
    direct = [-1] * G
    k_side = [0] * G
    r_side = [0] * G
    side_src = [ZERO_STATE] * G
    seq_src = [ZERO_STATE] * G  # init state of the sequence whose first segment is v
    last_req_pos = [-1] * G  # per sequence: the latest requested position (requests along a chain ascend)
    last_req_id = [-1] * G
    state_first: list[int] = []
    state_pos: list[int] = []

    for v in np.flatnonzero(~leaf).tolist():
        p = par[v]
        if p < 0:  # line 12/29: a root starts a zero-state sequence in round 0
            K = t_pre[v]
            r = 0
            q = v
            rdy = True
            sv = ZERO_STATE
        elif direct[p] == v:  # line 22: direct continuation of the parent's sequence
            K = budget[p]
            r = rnd[p]
            q = first[p]
            rdy = ready[p] and short[p]
            sv = src[p] if rdy else ZERO_STATE
        else:  # line 28: a side branch starts its own sequence
            K = k_side[p]
            r = r_side[p]
            q = v
            rdy = True
            sv = side_src[p]
            seq_src[v] = sv
        budget[v] = K
        rnd[v] = r
        first[v] = q
        ready[v] = rdy
        src[v] = sv
        if rdy and short[v]:  # same: children start from S_{a_v} in this round
            direct[v] = first_child[v]
            k_side[v] = K
            r_side[v] = r
            side_src[v] = sv
        else:
            direct[v] = uarg[v] if K == m1[v] else first_child[v]
            k_side[v] = K - 1
            r_side[v] = r + 1
            b = b_of[v]
            if nch[v] == 1:
                pass  # a single child (only in non-maximal segment trees): no side branch, no request
            elif b == a_of[q]:  # S_{b_v} is q's own initial state: forward its source
                side_src[v] = seq_src[q]
            elif last_req_pos[q] == b:
                side_src[v] = last_req_id[q]
            else:
                sid = len(state_first)
                state_first.append(q)
                state_pos.append(b)
                last_req_pos[q] = b
                last_req_id[q] = sid
                side_src[v] = sid

    # Vectorised bookkeeping: sequences are named by their first segment.
    direct_a = np.asarray(direct, dtype=np.int64)
    if np.any(direct_a[~leaf] < 0):
        v = int(np.flatnonzero(~leaf & (direct_a < 0))[0])
        raise AssertionError(f"segment {v}: no direct child fits its round budget (DP and recovery disagree)")
    nonroot = parent >= 0
    pp = np.maximum(parent, 0)
    is_direct = nonroot & (direct_a[pp] == np.arange(G))
    first_a = np.asarray(first, dtype=np.int64)
    rnd_a = np.asarray(rnd, dtype=np.int64)
    # Leaves were not visited: a direct-child leaf continues its parent's sequence, a side leaf is its own.
    lv = np.flatnonzero(leaf & is_direct)
    first_a[lv] = first_a[parent[lv]]
    rnd_a[lv] = rnd_a[parent[lv]]
    side = nonroot & ~is_direct
    r_side_a = np.asarray(r_side, dtype=np.int64)
    side_src_a = np.asarray(side_src, dtype=np.int64)
    sl = np.flatnonzero(leaf & side)
    rnd_a[sl] = r_side_a[parent[sl]]
    seq_firsts = np.flatnonzero(~is_direct)  # roots and side branches, in id order
    seq_src_a = np.full(G, ZERO_STATE, dtype=np.int64)
    sv = np.flatnonzero(side)
    seq_src_a[sv] = side_src_a[parent[sv]]
    last_of = np.full(G, -1, dtype=np.int64)
    lf = np.flatnonzero(leaf)
    last_of[first_a[lf]] = lf
    return _assemble(
        tree, B, np.asarray(t_pre, dtype=np.int64), np.asarray(t_in, dtype=np.int64), direct_a, first_a,
        rnd_a[seq_firsts], seq_firsts, last_of[seq_firsts], seq_src_a[seq_firsts], tree.entry_anchor(B)[seq_firsts],
        state_first, state_pos, trie=trie, leaf_trajectory=leaf_trajectory, seq_named_by_first=True,
    )


# ---------------------------------------------------------------------------------------------- reference recovery
def plan_segment_tree_reference(tree: SegmentTree, chunk_size: int, *, trie=None, leaf_trajectory=None) -> CallPlan:
    """Algorithm 1 on a segment forest, transcribed literally: DP, recovery, merge of trees by round.

    The exact reference for ``plan_segment_tree`` (tests check the two plans are identical).
    """
    B = int(chunk_size)
    t_pre_a, t_in_a = min_calls_dp_reference(tree, B)
    G = tree.num_segments
    t_pre, t_in = t_pre_a.tolist(), t_in_a.tolist()
    short = tree.is_short(B).tolist()
    start = tree.start.tolist()
    end = tree.end.tolist()
    offs = tree.child_offsets.tolist()
    ch = tree.children.tolist()

    # Per-segment recovery arguments, written by the parent (Recover(v, ready, K, r, q)).
    ready = [True] * G
    budget = [0] * G
    seq_of = [0] * G
    src_of = [ZERO_STATE] * G  # id of the state S_{a_v} when ready[v] (ZERO_STATE or an emitted-state id)
    direct = [-1] * G
    # Sequences in creation order.
    s_round: list[int] = []
    s_first: list[int] = []
    s_last: list[int] = []
    s_src: list[int] = []
    s_a: list[int] = []
    # Emitted states: (emitting sequence, position) -> state id.
    state_key: dict[tuple[int, int], int] = {}
    state_seq: list[int] = []
    state_pos: list[int] = []

    for rt in tree.roots.tolist():  # Algorithm 1 line 12 (+ line 29), one zero-state sequence per tree
        budget[rt] = t_pre[rt]
        seq_of[rt] = len(s_round)
        s_round.append(0)
        s_first.append(rt)
        s_last.append(-1)
        s_src.append(ZERO_STATE)
        s_a.append(0)

    for v in range(G):
        q = seq_of[v]
        lo, hi = offs[v], offs[v + 1]
        if lo == hi:  # line 14: a leaf closes its sequence
            s_last[q] = v
            continue
        K = budget[v]
        r = s_round[q]
        same = ready[v] and short[v]  # line 15
        k_side = K if same else K - 1  # line 16
        f = 0  # line 18
        for k in range(lo, hi):
            if t_pre[ch[k]] > k_side:
                f += 1
        o = -1
        for k in range(lo, hi):  # lines 19-21
            c = ch[k]
            h = t_pre[c] if same else t_in[c]
            if h <= K and f - (1 if t_pre[c] > k_side else 0) == 0:
                o = c
                break
        if o < 0:
            raise AssertionError(f"segment {v}: no direct child fits budget {K} (DP and recovery disagree)")
        direct[v] = o
        # line 22: the direct child continues sequence q in round r.
        ready[o] = same
        budget[o] = K
        seq_of[o] = q
        src_of[o] = src_of[v] if same else ZERO_STATE
        # lines 23-28: side children start new sequences.
        if hi - lo == 1:
            continue  # a single child (only in non-maximal segment trees): nothing to launch
        if same:
            src, r_side = src_of[v], r  # S_{a_v}, already available before round r
        else:
            b = (end[v] // B) * B
            if b == s_a[q]:  # the requested state is q's own initial state: forward its source
                src = s_src[q]
            else:
                key = (q, b)
                src = state_key.get(key, -1)
                if src < 0:
                    src = len(state_seq)
                    state_key[key] = src
                    state_seq.append(q)
                    state_pos.append(b)
            r_side = r + 1
        for k in range(lo, hi):
            u = ch[k]
            if u == o:
                continue
            ready[u] = True
            budget[u] = k_side
            src_of[u] = src
            seq_of[u] = len(s_round)
            s_round.append(r_side)
            s_first.append(u)
            s_last.append(-1)
            s_src.append(src)
            s_a.append((start[u] // B) * B)

    return _assemble(tree, B, t_pre_a, t_in_a, direct, seq_of, s_round, s_first, s_last, s_src, s_a,
                     state_seq, state_pos, trie=trie, leaf_trajectory=leaf_trajectory)


def _assemble(tree, B, t_pre, t_in, direct, seq_of, s_round, s_first, s_last, s_src, s_a, state_seq, state_pos,
              *, trie, leaf_trajectory, seq_named_by_first=False) -> CallPlan:
    """Renumber sequences round-major (by first segment within a round) and build the plan arrays.

    Sequences come in as creation ids 0..Q-1 (or, with ``seq_named_by_first``, as their first segment).
    """
    rnd = np.asarray(s_round, dtype=np.int64)
    Q = rnd.shape[0]
    if seq_named_by_first:
        cid = np.full(tree.num_segments, -1, dtype=np.int64)
        cid[np.asarray(s_first, dtype=np.int64)] = np.arange(Q, dtype=np.int64)
        seq_of = cid[np.asarray(seq_of, dtype=np.int64)]
        state_seq = cid[np.asarray(state_seq, dtype=np.int64)].tolist()
    order = np.lexsort((np.asarray(s_first, dtype=np.int64), rnd))  # new id -> creation id
    new_of = np.empty(Q, dtype=np.int64)
    new_of[order] = np.arange(Q, dtype=np.int64)
    R = int(rnd.max()) + 1
    round_offsets = np.zeros(R + 1, dtype=np.int64)
    np.cumsum(np.bincount(rnd, minlength=R), out=round_offsets[1:])

    first = np.asarray(s_first, dtype=np.int64)[order]
    last = np.asarray(s_last, dtype=np.int64)[order]
    a = np.asarray(s_a, dtype=np.int64)[order]
    # State ids -> emitting sequence (new numbering).
    st_seq = new_of[np.asarray(state_seq, dtype=np.int64)] if state_seq else np.zeros(0, dtype=np.int64)
    st_pos = np.asarray(state_pos, dtype=np.int64)
    src_c = np.asarray(s_src, dtype=np.int64)[order]
    seq_init = np.where(src_c >= 0, st_seq[np.maximum(src_c, 0)] if st_seq.shape[0] else -1, ZERO_STATE)
    # Emits per sequence: chunk (pos - a_emitter) / B, sorted.
    if st_seq.shape[0]:
        chunk = (st_pos - a[st_seq]) // B
        key = np.lexsort((chunk, st_seq))
        emit_seq, emit_chunks = st_seq[key], chunk[key]
    else:
        emit_seq = emit_chunks = np.zeros(0, dtype=np.int64)
    emit_offsets = np.zeros(Q + 1, dtype=np.int64)
    np.cumsum(np.bincount(emit_seq, minlength=Q), out=emit_offsets[1:])

    start = tree.start[first]
    end = tree.end[last]
    if leaf_trajectory is not None:
        seq_traj = leaf_trajectory[last]
    else:
        seq_traj = np.full(Q, -1, dtype=np.int64)
    return CallPlan(
        chunk_size=B,
        tree=tree,
        t_pre=t_pre,
        t_in=t_in,
        direct_child=np.asarray(direct, dtype=np.int64),
        segment_sequence=new_of[np.asarray(seq_of, dtype=np.int64)],
        round_offsets=round_offsets,
        seq_round=rnd[order],
        seq_first_segment=first,
        seq_last_segment=last,
        seq_replay_start=a,
        seq_start=start,
        seq_end=end,
        seq_init=seq_init.astype(np.int64),
        emit_offsets=emit_offsets,
        emit_chunks=emit_chunks.astype(np.int64),
        seq_trajectory=np.asarray(seq_traj, dtype=np.int64),
        trie=trie,
    )


def leaf_trajectories(trie) -> np.ndarray:
    """[G] for each leaf segment, the smallest trajectory index ending at its last row (-1 for internal ones)."""
    N = trie.num_trajectories
    last_rows = trie.row_of_position[trie.offsets[1:] - 1]
    by_row = np.full(trie.num_rows, -1, dtype=np.int64)
    by_row[last_rows[::-1]] = np.arange(N - 1, -1, -1, dtype=np.int64)  # the last write wins: smallest index
    out = by_row[trie.segment_end - 1]
    leaf = trie.num_children[trie.segment_end - 1] == 0
    assert np.all(out[leaf] >= 0), "a leaf row without a trajectory ending there"
    return np.where(leaf, out, -1)


def plan_calls_for_trie(trie, *, chunk_size: int) -> CallPlan:
    tree = SegmentTree.from_trie(trie)
    return plan_segment_tree(tree, chunk_size, trie=trie, leaf_trajectory=leaf_trajectories(trie))


def plan_calls(trajectories, *, chunk_size: int) -> CallPlan:
    """Minimum-call linear-attention plan of one microbatch (RolloutBatch, Trajectory objects or token lists)."""
    from harts.data.trie import build_trie

    if int(chunk_size) <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return plan_calls_for_trie(build_trie(trajectories), chunk_size=chunk_size)


# ---------------------------------------------------------------------------------------------- validation
def _euler(tree: SegmentTree) -> tuple[np.ndarray, np.ndarray]:
    """DFS entry/exit times: w is an ancestor-or-self of x iff tin[w] <= tin[x] < tout[w]."""
    G = tree.num_segments
    offs, ch = tree.child_offsets.tolist(), tree.children.tolist()
    tin, tout = [0] * G, [0] * G
    t = 0
    stack = [(r, 0) for r in reversed(tree.roots.tolist())]
    while stack:
        v, state = stack.pop()
        if state == 0:
            tin[v] = t
            t += 1
            stack.append((v, 1))
            for k in range(offs[v + 1] - 1, offs[v] - 1, -1):
                stack.append((ch[k], 0))
        else:
            tout[v] = t
    return np.asarray(tin), np.asarray(tout)


def _validate_plan(plan: CallPlan) -> None:
    tree, B = plan.tree, plan.chunk_size
    G, Q, R = tree.num_segments, plan.num_sequences, plan.num_calls
    par = tree.parent
    # Rounds: round-major numbering, no empty round.
    assert R >= 1 and plan.round_offsets[0] == 0 and plan.round_offsets[-1] == Q
    assert np.all(np.diff(plan.round_offsets) >= 1), f"empty round in {np.diff(plan.round_offsets).tolist()}"
    assert np.array_equal(plan.seq_round, np.repeat(np.arange(R), np.diff(plan.round_offsets)))
    # Chains: every segment is output by exactly one sequence, along direct-continuation links.
    seq = plan.segment_sequence
    assert seq.shape == (G,) and np.all((seq >= 0) & (seq < Q))
    assert np.array_equal(seq[plan.seq_first_segment], np.arange(Q)), "a sequence's first segment belongs elsewhere"
    assert np.array_equal(seq[plan.seq_last_segment], np.arange(Q)), "a sequence's last segment belongs elsewhere"
    assert np.all(tree.is_leaf[plan.seq_last_segment]), "a sequence does not end at a leaf"
    leaf = tree.is_leaf
    dc = plan.direct_child
    assert np.all(dc[leaf] == -1)
    internal = np.flatnonzero(~leaf)
    assert np.all(par[dc[internal]] == internal), "a direct child is not a child"
    assert np.array_equal(seq[dc[internal]], seq[internal]), "a direct child left its parent's sequence"
    is_first = np.zeros(G, dtype=bool)
    is_first[plan.seq_first_segment] = True
    assert np.unique(plan.seq_first_segment).shape[0] == Q
    nonroot = np.flatnonzero(par >= 0)
    is_direct = np.zeros(G, dtype=bool)
    is_direct[dc[internal]] = True
    assert np.all(is_first[par < 0]), "a root segment does not start a sequence"
    assert np.array_equal(is_first[nonroot], ~is_direct[nonroot]), "a side branch does not start its own sequence"
    # Sequence intervals and fixed replay [a(p), p).
    first, last = plan.seq_first_segment, plan.seq_last_segment
    assert np.array_equal(plan.seq_start, tree.start[first]) and np.array_equal(plan.seq_end, tree.end[last])
    assert np.array_equal(plan.seq_replay_start, anchor(plan.seq_start, B)), "replay interval is not [a(p), p)"
    # Initial states.
    src = plan.seq_init
    zero = src < 0
    assert np.array_equal(zero, plan.seq_replay_start == 0), "zero state iff replay_start == 0"
    tin, tout = _euler(tree)
    eo, ec = plan.emit_offsets, plan.emit_chunks
    assert eo[0] == 0 and eo[-1] == ec.shape[0] and np.all(np.diff(eo) >= 0)
    emitted = {(q, c) for q in range(Q) for c in ec[eo[q] : eo[q + 1]].tolist()}
    assert len(emitted) == ec.shape[0], "duplicate emit request"
    consumed = set()
    start, end = tree.start.tolist(), tree.end.tolist()
    for q in np.flatnonzero(~zero).tolist():
        j = int(src[q])
        a = int(plan.seq_replay_start[q])
        aj = int(plan.seq_replay_start[j])
        assert plan.seq_round[j] < plan.seq_round[q], f"sequence {q}: initial state from a later or the same round"
        assert aj < a < plan.seq_end[j] and (a - aj) % B == 0, f"sequence {q}: state {a} is not a chunk start of {j}"
        c = (a - aj) // B
        assert (j, c) in emitted, f"sequence {q}: state (sequence {j}, chunk {c}) is not emitted"
        consumed.add((j, c))
        # Segment holding position a-1 on q's path must lie on the path to j's last segment.
        w = int(par[first[q]])
        while start[w] > a - 1:
            w = int(par[w])
        assert start[w] <= a - 1 < end[w]
        x = int(last[j])
        assert tin[w] <= tin[x] < tout[w], f"sequence {q}: emitter {j} does not pass through position {a} of its path"
    assert consumed == emitted, f"emitted but unused states: {sorted(emitted - consumed)[:5]}"
    # Replay (Eq. 15) and optimality (Eqs. 12-14).
    assert plan.replay_tokens == tree.mandatory_replay(B), "replay differs from Eq. (15)"
    t_pre, _ = min_calls_dp_reference(tree, B)
    assert R == int(t_pre[tree.roots].max()), "num_calls differs from the DP minimum"
    # Rows: with a trie, every compact row is output by exactly one sequence, on its trajectory's path.
    trie = plan.trie
    if trie is not None:
        traj = plan.seq_trajectory
        assert np.all(traj >= 0)
        lens = trie.lengths[traj]
        assert np.all(plan.seq_end <= lens), "a sequence runs past its trajectory"
        n_out = plan.seq_end - plan.seq_start
        base = np.cumsum(n_out) - n_out
        pos = np.arange(int(n_out.sum())) - np.repeat(base, n_out) + np.repeat(plan.seq_start, n_out)
        rows = trie.row_of_position[np.repeat(trie.offsets[traj], n_out) + pos]
        counts = np.bincount(rows, minlength=trie.num_rows)
        bad = np.flatnonzero(counts != 1)
        if bad.shape[0]:
            raise AssertionError(f"compact row {int(bad[0])} is output by {int(counts[bad[0]])} sequences")
        assert np.array_equal(seq[trie.segment_of_row[rows]], np.repeat(np.arange(Q), n_out))


# ---------------------------------------------------------------------------------------------- baselines
def naive_schedule(tree: SegmentTree, chunk_size: int) -> dict:
    """Baselines for the CLI: one call per segment, and segments packed by depth (a parent's call must return)."""
    B = int(chunk_size)
    replay = int((tree.start[tree.parent >= 0] % B).sum())  # every non-root segment replays from a(s_v)
    return {
        "one_call_per_segment": {"num_calls": tree.num_segments, "replay_tokens": replay},
        "packed_by_depth": {"num_calls": tree.height(), "replay_tokens": replay},
    }


# ---------------------------------------------------------------------------------------------- CLI
def _read_jsonl(path: str) -> list:
    out = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}: line {n}: invalid JSON ({e})") from None
            toks = obj.get("tokens") if isinstance(obj, dict) else obj
            if toks is None:
                raise SystemExit(f"{path}: line {n}: no 'tokens' field")
            out.append(toks)
    if not out:
        raise SystemExit(f"{path}: no trajectories")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harts.planning.calls", description=__doc__.split("\n")[0])
    ap.add_argument("--input", required=True, help="JSONL, one trajectory per line ({'tokens': [...]} or a list)")
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--json", help="write the plan (to_dict) and the summary here")
    args = ap.parse_args(argv)
    from harts.data.trajectory import RolloutBatch

    batch = RolloutBatch.from_tokens(_read_jsonl(args.input))
    plan = plan_calls(batch, chunk_size=args.chunk_size)
    plan.validate()
    trie = plan.trie
    naive = naive_schedule(plan.tree, args.chunk_size)
    print(f"trajectories {trie.num_trajectories}  semantic tokens S={trie.num_positions}  compact rows C={trie.num_rows}"
          f"  segments {plan.tree.num_segments}  trees {plan.tree.num_trees}  chunk_size {args.chunk_size}")
    print(f"{'schedule':<24}{'calls':>8}{'replay':>10}  sequences per round")
    print(f"{'minimum-call (Alg. 1)':<24}{plan.num_calls:>8}{plan.replay_tokens:>10}  {plan.sequences_per_round()}")
    for name, d in naive.items():
        print(f"{name:<24}{d['num_calls']:>8}{d['replay_tokens']:>10}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"summary": plan.summary(), "naive": naive, "plan": plan.to_dict()}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
