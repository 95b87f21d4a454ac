"""The DP of Algorithm 1 (paper 3.3, Eqs. 12-14, lines 3-11): per segment, the fewest rounds its subtree needs.

T_pre(v): rounds when v's entry anchor state is ready before the round; T_in(v): rounds when the entry state
arrives inside the current call as the parent's direct continuation. ``min_calls_dp_reference`` transcribes
the equations literally; ``min_calls_dp`` / ``dp_with_argmax`` are the linear-time fast path.

Legend: G segments.
"""
from __future__ import annotations

import numpy as np

from harts.planning.checks import integer_arg
from harts.planning.segments import SegmentTree


def min_calls_dp_reference(tree: SegmentTree, chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Eqs. (12)-(14) for every segment: (T_pre, T_in), int64 arrays of length G.

    Algorithm 1 lines 3-11, transcribed literally (the fast path is ``min_calls_dp``). Children have
    larger ids than their parent, so reverse id order is a postorder. Python lists instead of numpy
    scalars: this loop is the planner's hot path.
    """
    B = integer_arg(chunk_size, "chunk_size", where="min_calls_dp_reference")
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


def dp_with_argmax(tree: SegmentTree, chunk_size: int) -> tuple[list, list, list, list]:
    """Eqs. (12)-(14) streamed child -> parent; returns (T_pre, T_in, M1, unique-argmax child) as lists.

    By induction T_pre(v) <= T_in(v) <= T_pre(v) + 1, so with M1 the largest child T_pre (the
    largest/second-largest trick of Algorithm 1 line 7):
      T_in(v) = T_in(o*)  if o* is the unique child with T_pre = M1 (then h_{o*} = M2 < M1 <= T_in(o*)),
      T_in(v) = M1 + 1    otherwise (every child has h_o = M1 and T_in(o) <= M1 + 1).
    Only (M1, count of M1, T_in of the argmax) must be kept per segment, and leaves (T = 1) are folded in
    with numpy, so the Python loop touches internal segments only. ``min_calls_dp_reference`` is the
    literal per-child transcription; tests check the two agree.
    """
    B = integer_arg(chunk_size, "chunk_size", where="min_calls_dp")
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
    t_pre, t_in, _, _ = dp_with_argmax(tree, chunk_size)
    return np.asarray(t_pre, dtype=np.int64), np.asarray(t_in, dtype=np.int64)

