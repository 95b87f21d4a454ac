"""Adaptive candidate refinement (paper 3.2, "Adaptive candidate refinement").

Local refinement changes a few memberships without changing K: boundary refinement moves the cuts of a
lexicographically contiguous anchor within H = 8 positions (at most two sweeps); sparse repair then makes
at most four single moves or swaps between lexicographic neighbours (within H positions), each the best
strict improvement of the two affected microbatches' total work. Every step keeps coverage, nonempty
microbatches and capacity.

All move/swap costs are exact and vectorised with Eq. 10: the work x adds to (or removes from) a
microbatch is |x| minus its largest LCP with the other members, found at their nearest members on
either side of x's position (read off each microbatch's previous/next-member links, ``group_links``).
Pairs within H positions read their LCP from a running-minimum table (``near_lcp``), the rest from
the RMQ. No position can share more with anyone than with a lexicographic neighbour, so a move or
swap only gains where some position shares less with its own microbatch than with a neighbour
("slack"); candidates without slack are skipped before any LCP is evaluated (same result).
"""
from __future__ import annotations

import numpy as np

from harts.planning.natural import cuts_to_owner, owner_is_contiguous, owner_to_cuts
from harts.planning.prefix_cost import PrefixIndex

H = 8
BOUNDARY_SWEEPS = 2
REPAIR_ITERS = 4


def _best_cuts(index: PrefixIndex, a: np.ndarray, c: np.ndarray, b: np.ndarray, capacity: int) -> np.ndarray:
    """For every cut c between neighbours a < c < b (vectorised): the position t in (a, b) within H of c
    with the lowest (pair total, pair max), strictly better than c, ties closest to c then leftmost;
    c itself when no position improves."""
    off = np.arange(-H, H + 1, dtype=np.int64)
    t = c[:, None] + off[None, :]
    valid = (t > a[:, None]) & (t < b[:, None])
    t_safe = np.where(valid, t, c[:, None])
    left = index.interval_work(a[:, None], t_safe)
    right = index.interval_work(t_safe, b[:, None])
    tot, mx = left + right, np.maximum(left, right)
    cur_l, cur_r = index.interval_work(a, c), index.interval_work(c, b)
    cur_tot, cur_mx = (cur_l + cur_r)[:, None], np.maximum(cur_l, cur_r)[:, None]
    ok = valid & (left <= capacity) & (right <= capacity) & ((tot < cur_tot) | ((tot == cur_tot) & (mx < cur_mx)))
    rows, cols = np.nonzero(ok)
    out = c.copy()
    if rows.shape[0]:
        pick = np.lexsort((t[rows, cols], np.abs(off)[cols], mx[rows, cols], tot[rows, cols], rows))
        first = pick[np.concatenate(([True], rows[pick][1:] != rows[pick][:-1]))]
        out[rows[first]] = t[rows[first], cols[first]]
    return out


def boundary_refine(index: PrefixIndex, cuts: np.ndarray, capacity: int) -> np.ndarray:
    """Move each inner cut, left to right, within H positions to lower (pair total, pair max); strict
    improvements only, closest move then leftmost on ties; at most BOUNDARY_SWEEPS sweeps.

    Each sweep is sequential (a cut sees its left neighbour's new place), but all cuts are first
    evaluated at once against the sweep's starting cuts; only a cut whose left neighbour has just moved
    is re-evaluated (its right neighbour has not moved yet in this sweep)."""
    cuts = cuts.copy()
    for _ in range(BOUNDARY_SWEEPS):
        proposal = _best_cuts(index, cuts[:-2], cuts[1:-1], cuts[2:], capacity).tolist()
        changed = moved = False
        for i in range(1, cuts.shape[0] - 1):
            if moved:
                new = int(_best_cuts(index, cuts[i - 1 : i], cuts[i : i + 1], cuts[i + 1 : i + 2], capacity)[0])
            else:
                new = proposal[i - 1]
            moved = new != cuts[i]
            if moved:
                cuts[i] = new
                changed = True
        if not changed:
            break
    return cuts


def group_links(owner: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """prev[p] / nxt[p]: the previous / next position of p's own microbatch (-1 / N when there is none)."""
    prev, nxt, _, _ = _group_pairs(owner)
    return prev, nxt


def _group_pairs(owner: np.ndarray):
    """(prev, nxt, a, b): the links of ``group_links`` and the consecutive same-microbatch pairs a < b."""
    n = owner.shape[0]
    srt = np.argsort(owner, kind="stable")  # positions by (microbatch, position)
    same = owner[srt[1:]] == owner[srt[:-1]]
    a, b = srt[:-1][same], srt[1:][same]
    prev = np.full(n, -1, dtype=np.int64)
    nxt = np.full(n, n, dtype=np.int64)
    prev[b] = a
    nxt[a] = b
    return prev, nxt, a, b


def group_state(index: PrefixIndex, owner: np.ndarray, k: int):
    """(work per microbatch, (prev, nxt) links, own_shared): own_shared[p] is p's largest LCP with another
    member of its microbatch (at its previous or next member; 0 when alone). One RMQ batch serves all:
    the consecutive member pairs give both the Eq. 5 work and every member's shared amount."""
    prev, nxt, a, b = _group_pairs(owner)
    shared = index.pair_lcp(a, b)
    work = np.bincount(owner, weights=index.length, minlength=k).astype(np.int64)
    work -= np.bincount(owner[b], weights=shared, minlength=k).astype(np.int64)
    own_shared = np.zeros(owner.shape[0], dtype=np.int64)
    own_shared[b] = shared  # with the previous member
    own_shared[a] = np.maximum(own_shared[a], shared)  # with the next one (each position is one a, one b)
    return work, (prev, nxt), own_shared


def _lcp_or_zero(index: PrefixIndex, p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """LCP(p, q) where q is a real position, 0 where q is a -1 / N "no member" marker."""
    n = index.n
    real = (q >= 0) & (q < n)
    return np.where(real, index.pair_lcp(p, np.clip(q, 0, n - 1)), 0)


def near_lcp(index: PrefixIndex) -> np.ndarray:
    """[N, H + 1] LCP(p, p + o) for o = 0..H (column 0 = |p|; past the end: 0), by running minima of the
    adjacent LCPs, so pairs within H positions need no RMQ."""
    n = index.n
    out = np.zeros((n, H + 1), dtype=np.int64)
    out[:, 0] = index.length
    run = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    for o in range(1, min(H, n - 1) + 1):
        run[: n - o] = np.minimum(run[: n - o], index.lcp[o:])
        out[: n - o, o] = run[: n - o]
    return out


def _window_pairs(positions: np.ndarray, offsets: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """All (p, p + off) inside [0, N) for p in ``positions`` (ascending), p-major then offset order."""
    p = np.repeat(positions.astype(np.int64, copy=False), offsets.shape[0])
    q = p + np.tile(offsets, positions.shape[0])
    keep = (q >= 0) & (q < n)
    return p[keep], q[keep]


def _best_move(index, owner, work, links, own_shared, capacity, near, slack):
    """Best single move of x (position p) into a microbatch D with a member within H positions.

    x shares with D its larger LCP with D's nearest members on either side (Eq. 10). A candidate (p, D)
    is generated from each of those nearest members q that lies in the window; q is nearest on its side
    exactly when D's previous (next) member lies beyond p, and then that member is D's nearest on the
    other side. Both generators of one (p, D) give the same value, so duplicates are harmless.
    The gain sh - own_shared[p] is at most slack[p] (x shares most with a lexicographic neighbour), so
    only positions with slack are tried."""
    prev, nxt = links
    counts = np.bincount(owner, minlength=work.shape[0])
    offsets = np.concatenate((np.arange(-H, 0), np.arange(1, H + 1))).astype(np.int64)
    cand = np.flatnonzero((slack > 0) & (counts[owner] > 1))
    p, q = _window_pairs(cand, offsets, index.n)
    d = owner[q]
    right = q > p
    nearest = np.where(right, prev[q] < p, nxt[q] > p)
    keep = (d != owner[p]) & nearest
    p, q, d, right = p[keep], q[keep], d[keep], right[keep]
    if p.shape[0] == 0:
        return None
    other = np.where(right, prev[q], nxt[q])
    lo = np.minimum(p, q)
    sh = np.maximum(near[lo, np.abs(q - p)], _lcp_or_zero(index, p, other))
    new_d = work[d] + index.length[p] - sh
    gain = sh - own_shared[p]
    ok = (new_d <= capacity) & (gain > 0)
    if not ok.any():
        return None
    p, d, gain = p[ok], d[ok], gain[ok]
    j = np.lexsort((d, p, -gain))[0]
    return int(gain[j]), int(p[j]), int(d[j])


def _best_swap(index, owner, work, links, own_shared, capacity, slack):
    """Best swap of x (position p, microbatch A) and y (position q, microbatch B), p < q <= p + H.

    y's LCP with A without x comes from A's last member before q and first after q (x excluded), found
    by walking A's links from p; x's LCP with B without y likewise by walking B's links back from q.
    The gain s_ay + s_bx - own_shared[p] - own_shared[q] is at most slack[p] + slack[q], so pairs
    without slack are skipped."""
    n = index.n
    prev, nxt = links
    length = index.length
    p, q = _window_pairs(np.arange(n), np.arange(1, H + 1, dtype=np.int64), n)
    keep = (owner[p] != owner[q]) & ((slack[p] > 0) | (slack[q] > 0))
    p, q = p[keep], q[keep]
    if p.shape[0] == 0:
        return None
    a, b = owner[p], owner[q]
    last_a = p.copy()  # A's last member before q (members between p and q lie inside the window)
    for _ in range(H):
        step = nxt[last_a] < q
        if not step.any():
            break
        last_a = np.where(step, nxt[last_a], last_a)
    left_a = np.where(last_a == p, prev[p], last_a)
    s_ay = np.maximum(_lcp_or_zero(index, q, left_a), _lcp_or_zero(index, q, nxt[last_a]))
    first_b = q.copy()  # B's first member after p
    for _ in range(H):
        step = prev[first_b] > p
        if not step.any():
            break
        first_b = np.where(step, prev[first_b], first_b)
    right_b = np.where(first_b == q, nxt[q], first_b)
    s_bx = np.maximum(_lcp_or_zero(index, p, prev[first_b]), _lcp_or_zero(index, p, right_b))
    new_a = work[a] - length[p] + own_shared[p] + length[q] - s_ay
    new_b = work[b] - length[q] + own_shared[q] + length[p] - s_bx
    gain = work[a] + work[b] - new_a - new_b
    ok = (new_a <= capacity) & (new_b <= capacity) & (gain > 0)
    if not ok.any():
        return None
    p, q, gain = p[ok], q[ok], gain[ok]
    j = np.lexsort((q, p, -gain))[0]
    return int(gain[j]), int(p[j]), int(q[j])


def sparse_repair(index: PrefixIndex, owner: np.ndarray, capacity: int) -> np.ndarray:
    """At most REPAIR_ITERS best strict-improvement moves (else swaps) between near lexicographic neighbours."""
    owner = owner.copy()
    k = int(owner.max()) + 1
    near = near_lcp(index)
    neighbour = np.maximum(index.lcp, np.append(index.lcp[1:], 0))  # largest LCP with any other position
    for _ in range(REPAIR_ITERS):
        work, links, own_shared = group_state(index, owner, k)
        slack = neighbour - own_shared  # >= 0: what p could gain at most by sharing more
        move = _best_move(index, owner, work, links, own_shared, capacity, near, slack)
        if move is not None:
            _, p, d = move
            owner[p] = d
            continue
        swap = _best_swap(index, owner, work, links, own_shared, capacity, slack)
        if swap is None:
            break
        _, p, q = swap
        owner[p], owner[q] = owner[q], owner[p]
    return owner


def refine(index: PrefixIndex, owner: np.ndarray, capacity: int) -> np.ndarray:
    """Boundary refinement for contiguous anchors, then sparse repair (K unchanged)."""
    if owner_is_contiguous(owner):
        cuts = boundary_refine(index, owner_to_cuts(owner), capacity)
        owner = cuts_to_owner(cuts, index.n)
    return sparse_repair(index, owner, capacity)
