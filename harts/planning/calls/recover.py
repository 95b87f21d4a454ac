"""Recovery of Algorithm 1 (paper 3.3, lines 12-29): from the DP's round counts to the sequences of each round.

In preorder, propagate (ready, round budget K, round r, sequence q) down the tree. At v: same = ready and
e_v < a_v + B; K_side = K - (0 if same else 1); the direct child is the first child o with H[o] <= K whose
removal leaves no child with T_pre > K_side; side children start new sequences in round r from S_{a_v} (same)
or in round r + 1 from S_{b_v}, which the current sequence must emit (sequence-local chunk
(b_v - replay_start) / B). The recursion is unrolled into one sweep in segment-id order, which is valid
because every parent id precedes its children's: the state Recover(v, ...) needs is written when the parent
is visited. Independent trees share the sweep and are merged by round number.

``plan_segment_tree`` is the linear-time fast path; ``plan_segment_tree_reference`` the literal transcription.
Legend: G segments.
"""
from __future__ import annotations

import numpy as np

from harts.planning.calls.dp import dp_with_argmax, min_calls_dp_reference
from harts.planning.calls.plan import ZERO_STATE, CallPlan, assemble_plan
from harts.planning.checks import integer_arg
from harts.planning.segments import SegmentTree


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
    B = integer_arg(chunk_size, "chunk_size", where="plan_segment_tree")
    t_pre, t_in, m1, uarg = dp_with_argmax(tree, B)
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
        raise RuntimeError(
            f"planner bug: segment {v}: no direct child fits its round budget (DP and recovery disagree)"
        )
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
    return assemble_plan(
        tree, B, np.asarray(t_pre, dtype=np.int64), np.asarray(t_in, dtype=np.int64), direct_a, first_a,
        rnd_a[seq_firsts], seq_firsts, last_of[seq_firsts], seq_src_a[seq_firsts], tree.entry_anchor(B)[seq_firsts],
        state_first, state_pos, trie=trie, leaf_trajectory=leaf_trajectory, seq_named_by_first=True,
    )



def plan_segment_tree_reference(tree: SegmentTree, chunk_size: int, *, trie=None, leaf_trajectory=None) -> CallPlan:
    """Algorithm 1 on a segment forest, transcribed literally: DP, recovery, merge of trees by round.

    The exact reference for ``plan_segment_tree`` (tests check the two plans are identical).
    """
    B = integer_arg(chunk_size, "chunk_size", where="plan_segment_tree_reference")
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
            raise RuntimeError(f"planner bug: segment {v}: no direct child fits budget {K} (DP and recovery disagree)")
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

    return assemble_plan(tree, B, t_pre_a, t_in_a, direct, seq_of, s_round, s_first, s_last, s_src, s_a,
                         state_seq, state_pos, trie=trie, leaf_trajectory=leaf_trajectory)
