"""Validator of a ``CallPlan``: every guarantee of the execution model, checked independently of how the plan
was made (paper 3.3). Raises ValueError naming the offending round, sequence, segment or row and its values.

Checks, in order: array shapes; rounds (round-major numbering, none empty); chains (every segment output by
exactly one sequence along direct-continuation links, each sequence ending at a leaf); intervals (replay is
the fixed [a(p), p)); initial states (from an earlier round, at a chunk start of an emitter on the same path,
every emitted state consumed); Eq. (15) replay and the DP minimum of rounds; with a trie, every compact row
output exactly once on its trajectory's path.

Legend: G segments, Q input sequences, R rounds, E emitted boundary states, C compact rows.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from harts.planning.calls.dp import min_calls_dp_reference
from harts.planning.checks import require, require_all, require_equal, require_shape
from harts.planning.segments import SegmentTree, anchor

if TYPE_CHECKING:
    from harts.planning.calls.plan import CallPlan


def euler_times(tree: SegmentTree) -> tuple[np.ndarray, np.ndarray]:
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


def validate_plan(plan: CallPlan) -> None:
    """Check every guarantee of ``plan``; ValueError naming the first offending item."""
    check_shapes(plan)
    check_rounds(plan)
    check_chains(plan)
    check_intervals(plan)
    check_initial_states(plan)
    check_optimality(plan)
    if plan.trie is not None:
        check_rows(plan)


def check_shapes(plan: CallPlan) -> None:
    G, Q = plan.tree.num_segments, plan.num_sequences
    require(isinstance(plan.chunk_size, int) and plan.chunk_size >= 1,
            lambda: f"plan: chunk_size must be an int >= 1, got {plan.chunk_size!r}")
    for name in ("t_pre", "t_in", "direct_child", "segment_sequence"):
        require_shape(getattr(plan, name), (G,), f"plan.{name}")
    for name in ("seq_first_segment", "seq_last_segment", "seq_replay_start", "seq_start", "seq_end", "seq_init",
                 "seq_trajectory"):
        require_shape(getattr(plan, name), (Q,), f"plan.{name}")
    require_shape(plan.emit_offsets, (Q + 1,), "plan.emit_offsets")
    require(plan.round_offsets.ndim == 1 and plan.round_offsets.shape[0] >= 2,
            lambda: f"plan.round_offsets: need at least one round, got shape {plan.round_offsets.shape}")
    for name in ("seq_first_segment", "seq_last_segment"):
        arr = getattr(plan, name)
        require_all((arr >= 0) & (arr < G), lambda q: f"plan.{name}: sequence {q} names segment {int(arr[q])}, "
                                                      f"not in [0, {G})")


def check_rounds(plan: CallPlan) -> None:
    """Round-major numbering, no empty round."""
    ro, Q, R = plan.round_offsets, plan.num_sequences, plan.num_calls
    require(ro[0] == 0 and ro[-1] == Q, lambda: f"round_offsets must run from 0 to Q = {Q}, got {ro.tolist()}")
    sizes = np.diff(ro)
    require_all(sizes >= 1, lambda r: f"round {r} is empty (round_offsets {ro.tolist()})")
    require_equal(plan.seq_round, np.repeat(np.arange(R), sizes), "round", item="sequence")


def check_chains(plan: CallPlan) -> None:
    """Every segment is output by exactly one sequence, along direct-continuation links."""
    tree, Q = plan.tree, plan.num_sequences
    G, par, leaf = tree.num_segments, tree.parent, tree.is_leaf
    seq, dc = plan.segment_sequence, plan.direct_child
    first, last = plan.seq_first_segment, plan.seq_last_segment
    require_all((seq >= 0) & (seq < Q), lambda v: f"segment {v}: output by sequence {int(seq[v])}, not in [0, {Q})")
    require_equal(seq[first], np.arange(Q), "sequence owning the first segment", item="sequence")
    require_equal(seq[last], np.arange(Q), "sequence owning the last segment", item="sequence")
    require_all(leaf[last], lambda q: f"sequence {q}: ends at segment {int(last[q])}, which is not a leaf")
    require_all(dc[leaf] == -1, lambda k: f"leaf segment {int(np.flatnonzero(leaf)[k])}: has direct child "
                                          f"{int(dc[leaf][k])}, expected -1")
    internal = np.flatnonzero(~leaf)
    d = dc[internal]
    require_all((d >= 0) & (d < G), lambda k: f"segment {int(internal[k])}: direct child {int(d[k])} is not a segment")
    require_all(par[d] == internal, lambda k: f"segment {int(internal[k])}: direct child {int(d[k])} is not its "
                                              f"child (its parent is {int(par[d[k]])})")
    require_all(seq[d] == seq[internal], lambda k: f"segment {int(internal[k])}: direct child {int(d[k])} is output "
                                                   f"by sequence {int(seq[d[k]])}, not {int(seq[internal[k]])}")
    firsts, counts = np.unique(first, return_counts=True)
    require_all(counts == 1, lambda k: f"segment {int(firsts[k])} is the first segment of {int(counts[k])} sequences")
    is_first = np.zeros(G, dtype=bool)
    is_first[first] = True
    is_direct = np.zeros(G, dtype=bool)
    is_direct[d] = True
    roots = np.flatnonzero(par < 0)
    require_all(is_first[roots], lambda k: f"root segment {int(roots[k])} does not start a sequence")
    nonroot = np.flatnonzero(par >= 0)
    require_all(is_first[nonroot] != is_direct[nonroot],
                lambda k: f"segment {int(nonroot[k])}: "
                          + ("a direct child that starts its own sequence" if is_first[nonroot[k]]
                             else "a side branch that does not start its own sequence"))


def check_intervals(plan: CallPlan) -> None:
    """Sequence intervals follow their segments and replay is the fixed [a(p), p)."""
    tree, B = plan.tree, plan.chunk_size
    require_equal(plan.seq_start, tree.start[plan.seq_first_segment], "start", item="sequence")
    require_equal(plan.seq_end, tree.end[plan.seq_last_segment], "end", item="sequence")
    require_equal(plan.seq_replay_start, anchor(plan.seq_start, B), "replay_start (must be a(start))",
                  item="sequence")


def check_initial_states(plan: CallPlan) -> None:
    """Zero state iff replay starts at 0; otherwise a state emitted by an earlier sequence on the same path."""
    tree, B, Q = plan.tree, plan.chunk_size, plan.num_sequences
    src, a_all = plan.seq_init, plan.seq_replay_start
    require_equal(src < 0, a_all == 0, "starts from the zero state (iff replay_start == 0)", item="sequence")
    eo, ec = plan.emit_offsets, plan.emit_chunks
    require(eo[0] == 0 and eo[-1] == ec.shape[0],
            lambda: f"emit_offsets must run from 0 to E = {ec.shape[0]}, got {eo[0]} .. {eo[-1]}")
    require_all(np.diff(eo) >= 0, lambda q: f"sequence {q}: emit_offsets decrease ({int(eo[q])} -> {int(eo[q + 1])})")
    owner = np.repeat(np.arange(Q), np.diff(eo))
    require_all(ec >= 1, lambda k: f"sequence {int(owner[k])}: emits chunk {int(ec[k])}, must be >= 1")
    same_seq = owner[1:] == owner[:-1]
    require_all(~same_seq | (ec[1:] > ec[:-1]), lambda k: f"sequence {int(owner[k])}: emit chunks not sorted and "
                                                          f"unique ({int(ec[k])} then {int(ec[k + 1])})")
    emitted = set(zip(owner.tolist(), ec.tolist()))
    tin, tout = euler_times(tree)
    par, first, last = tree.parent, plan.seq_first_segment, plan.seq_last_segment
    start = tree.start.tolist()
    rnd, a_l, e_l = plan.seq_round.tolist(), a_all.tolist(), plan.seq_end.tolist()
    consumed = set()
    for q in np.flatnonzero(src >= 0).tolist():
        j, a = int(src[q]), a_l[q]
        require(j < Q, lambda: f"sequence {q}: initial state from sequence {j}, not in [0, {Q})")
        require(rnd[j] < rnd[q], lambda: f"sequence {q} (round {rnd[q]}): initial state from sequence {j} of "
                                         f"round {rnd[j]}, not an earlier round")
        aj = a_l[j]
        require(aj < a < e_l[j] and (a - aj) % B == 0,
                lambda: f"sequence {q}: its state at position {a} is not a chunk start inside sequence {j} "
                        f"(replay_start {aj}, end {e_l[j]}, B {B})")
        c = (a - aj) // B
        require((j, c) in emitted, lambda: f"sequence {q}: its initial state (sequence {j}, chunk {c}) is not emitted")
        consumed.add((j, c))
        # The segment holding position a-1 on q's path must lie on the path to j's last segment.
        w = int(par[first[q]])
        while w >= 0 and start[w] > a - 1:
            w = int(par[w])
        x = int(last[j])
        require(w >= 0 and tin[w] <= tin[x] < tout[w],
                lambda: f"sequence {q}: emitter sequence {j} does not pass through position {a} of its path")
    unused = sorted(emitted - consumed)
    require(not unused, lambda: f"emitted states never used (sequence, chunk): {unused[:5]}"
                                + (f" and {len(unused) - 5} more" if len(unused) > 5 else ""))


def check_optimality(plan: CallPlan) -> None:
    """Replay equals Eq. (15) and the number of rounds is the DP minimum (Eqs. 12-14)."""
    tree, B = plan.tree, plan.chunk_size
    want = tree.mandatory_replay(B)
    require(plan.replay_tokens == want, lambda: f"plan replays {plan.replay_tokens} tokens, Eq. (15) gives {want}")
    t_pre, _ = min_calls_dp_reference(tree, B)
    best = int(t_pre[tree.roots].max())
    require(plan.num_calls == best, lambda: f"plan has {plan.num_calls} rounds, the DP minimum is {best}")


def check_rows(plan: CallPlan) -> None:
    """With a trie, every compact row is output by exactly one sequence, on its trajectory's path."""
    trie, Q = plan.trie, plan.num_sequences
    traj = plan.seq_trajectory
    N = trie.num_trajectories
    require_all((traj >= 0) & (traj < N), lambda q: f"sequence {q}: trajectory {int(traj[q])} not in [0, {N})")
    lens = trie.lengths[traj]
    require_all(plan.seq_end <= lens, lambda q: f"sequence {q}: ends at {int(plan.seq_end[q])}, past the end "
                                                f"{int(lens[q])} of trajectory {int(traj[q])}")
    n_out = plan.seq_end - plan.seq_start
    base = np.cumsum(n_out) - n_out
    pos = np.arange(int(n_out.sum())) - np.repeat(base, n_out) + np.repeat(plan.seq_start, n_out)
    rows = trie.row_of_position[np.repeat(trie.offsets[traj], n_out) + pos]
    counts = np.bincount(rows, minlength=trie.num_rows)
    require_all(counts == 1, lambda c: f"compact row {c} is output by {int(counts[c])} sequences, expected 1")
    owner = np.repeat(np.arange(Q), n_out)
    got = plan.segment_sequence[trie.segment_of_row[rows]]
    require_all(got == owner, lambda k: f"sequence {int(owner[k])}: outputs compact row {int(rows[k])} of a segment "
                                        f"owned by sequence {int(got[k])}")
