"""Scale-independent trie-aware greedy (paper 3.2, "Scale-independent trie-aware greedy", Eq. 10).

Inserting x between its lexicographic neighbours p and q inside a microbatch costs
dC = |x| - LCP(p, x) - LCP(x, q) + LCP(p, q) (Eq. 10). Because LCP(p, q) = min(LCP(p, x), LCP(x, q)) when
p < x < q, this is |x| - max(LCP(p, x), LCP(x, q)): the shared amount is the largest LCP of x with any
member, reached at its nearest member on either side. Only members of x's own "tree" (the run of
positions around x whose adjacent LCPs stay above the batch floor, the LCP every pair shares, usually 0)
share more than the floor: their LCPs with x are read from precomputed rows (or, in a very large tree,
by scanning outward with a running minimum). Every other microbatch shares exactly the floor with x, and
among those the best one is found by bisection on a work-sorted list. That keeps one insertion
O(placed tree mates + log K), not O(K).

Groupings are ``owner`` arrays: owner[position] = microbatch id (ids 0..K-1, by order of creation).
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right, insort

import numpy as np

from harts.planning.prefix_cost import PrefixIndex

POLICIES = ("best_fit", "max_shared")


def processing_orders(index: PrefixIndex) -> dict[str, list[int]]:
    """The four processing orders, as lists of positions (ties by lexicographic position)."""
    n = index.n
    pos = np.arange(n, dtype=np.int64)
    nxt = np.append(index.lcp[1:], 0)
    unique_suffix = index.length - np.maximum(index.lcp, nxt)
    return {
        "lex_asc": pos.tolist(),
        "lex_desc": pos[::-1].tolist(),
        "len_desc": np.lexsort((pos, -index.length)).tolist(),
        "suffix_desc": np.lexsort((pos, -unique_suffix)).tolist(),
    }


TREE_ROWS_MAX = 256  # trees up to this many positions get precomputed LCP rows; larger ones are scanned


class Neighbourhoods:
    """Static part of every insertion, shared by the eight greedy plans.

    A "tree" is a maximal run of positions whose adjacent LCPs exceed the batch floor; x shares more than
    the floor only with members of its own tree. For trees of at most TREE_ROWS_MAX positions, ``rows[p]``
    lists LCP(p, q) for every q of p's tree (index q - start[p]), so an insertion reads the LCPs of the
    placed mates directly instead of scanning with a running minimum."""

    def __init__(self, index: PrefixIndex):
        n = index.n
        lcp = index.lcp
        tree_first = np.flatnonzero(np.concatenate(([True], lcp[1:] <= index.floor)))
        size = np.diff(np.append(tree_first, n))
        tree = np.repeat(np.arange(tree_first.shape[0]), size)
        self.tree = tree.tolist()
        self.start = tree_first[tree].tolist()
        small = np.flatnonzero((size >= 2) & (size <= TREE_ROWS_MAX))
        self.rows: list[list[int] | None] = [None] * n
        if small.shape[0]:
            pos = np.concatenate([np.arange(tree_first[t], tree_first[t] + size[t]) for t in small.tolist()])
            width = np.repeat(size[small], size[small])  # row length of every position in a small tree
            p = np.repeat(pos, width)
            first = np.repeat(tree_first[tree[pos]], width)
            offset = np.arange(p.shape[0]) - np.repeat(np.cumsum(width) - width, width)
            flat = index.pair_lcp(p, first + offset)
            at = 0
            for t0, s in zip(tree_first[small].tolist(), size[small].tolist()):  # one [s, s] block per tree
                self.rows[t0 : t0 + s] = flat[at : at + s * s].reshape(s, s).tolist()
                at += s * s


def greedy_place(index: PrefixIndex, order: list[int], policy: str, capacity: int,
                 hoods: Neighbourhoods | None = None, max_heavy: int | None = None) -> np.ndarray | None:
    """Insert positions in ``order``; best-fit maximises work after insertion, max-shared maximises
    |x| - dC. Ties: the other criterion, then the lowest microbatch id. Opens a microbatch when none fits.

    ``max_heavy``: give up (return None) as soon as more than this many microbatches hold work above
    T/2. Work only grows during placement and small-microbatch elimination never dissolves such a
    microbatch, so the plan would end with more than ``max_heavy`` microbatches (``best_greedy`` uses
    it to stop plans that can no longer have the fewest)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown greedy policy {policy!r}; expected one of {POLICIES}")
    if hoods is None:
        hoods = Neighbourhoods(index)
    best_fit = policy == "best_fit"
    n = index.n
    big = n + 1  # by_work entries are work * big + (n - id): ascending work, then descending id
    length = index.length.tolist()
    lcp = index.lcp.tolist()
    floor = index.floor
    rows, tree_of, start_of = hoods.rows, hoods.tree, hoods.start
    # x's largest LCP with a microbatch is at its member nearest to x. When ``order`` visits every tree
    # monotonically, that is the microbatch's latest placed member of the tree: placed[tree] is then
    # {id: column of its latest member}, else [(column, id)] of every placed member.
    monotone = placed_monotonically(hoods, order)
    placed: dict = {}
    owner = [-1] * n
    work: list[int] = []
    by_work: list[int] = []  # sorted keys; the last one <= a bound is the heaviest fit (lowest id on ties)
    fit_key = (capacity + floor) * big + big - 1  # minus x * big: the largest key that fits x
    half = capacity // 2  # work > half <=> work above T/2
    heavy = 0
    limit = n if max_heavy is None else max_heavy
    none: dict[int, int] = {}  # shared, never written: "no microbatch shares more than the floor"
    for p in order:
        x = length[p]
        row = rows[p]
        mates = placed.get(tree_of[p]) if row is not None else None
        # seen: id -> largest LCP of x with a member (only ids sharing > floor)
        if x <= floor:
            seen = none  # x shares all of itself with everyone
        elif row is None:
            seen = _scan_shared(p, x, lcp, owner, floor)
        elif mates is None:
            seen = none  # no tree mate placed yet
        elif monotone:
            seen = {}
            for g, c in mates.items():
                seen[g] = row[c]
        else:
            seen = {}
            for c, g in mates:
                v = row[c]
                if v > seen.get(g, -1):
                    seen[g] = v
        best = None  # key of the best candidate so far, then its id and new work
        for g, sh in seen.items():
            new = work[g] + x - sh
            if new <= capacity:
                key = (new, sh, -g) if best_fit else (sh, new, -g)
                if best is None or key > best:
                    best, g_best, new_best = key, g, new
        # Best microbatch among those sharing only the floor: the heaviest that still fits. Max-shared
        # needs it only when no microbatch sharing more than the floor fits (shared comes first).
        if best is None or best_fit:
            i = bisect_right(by_work, fit_key - x * big) - 1
            while i >= 0 and n - by_work[i] % big in seen:
                i -= 1
            if i >= 0:
                g = n - by_work[i] % big
                new = by_work[i] // big + x - floor
                key = (new, floor, -g) if best_fit else (floor, new, -g)
                if best is None or key > best:
                    best, g_best, new_best = key, g, new
        if best is None:
            g_best = len(work)
            work.append(x)
            insort(by_work, x * big + n - g_best)
            heavy += x > half
        else:
            old = work[g_best]
            del by_work[bisect_left(by_work, old * big + n - g_best)]
            work[g_best] = new_best
            insort(by_work, new_best * big + n - g_best)
            heavy += old <= half < new_best
        if heavy > limit:
            return None
        owner[p] = g_best
        if row is not None:
            if monotone:
                if mates is None:
                    placed[tree_of[p]] = {g_best: p - start_of[p]}
                else:
                    mates[g_best] = p - start_of[p]
            elif mates is None:
                placed[tree_of[p]] = [(p - start_of[p], g_best)]
            else:
                mates.append((p - start_of[p], g_best))
    return np.asarray(owner, dtype=np.int64)


def placed_monotonically(hoods: Neighbourhoods, order: list[int]) -> bool:
    """True when ``order`` visits the positions of every tree in increasing or in decreasing order."""
    pos = np.asarray(order, dtype=np.int64)
    tree = np.asarray(hoods.tree, dtype=np.int64)[pos]
    by_tree = np.argsort(tree, kind="stable")  # grouped by tree, in visiting order
    step = np.sign(np.diff(pos[by_tree]))
    inside = np.diff(tree[by_tree]) == 0  # consecutive visits of one tree
    both = inside[1:] & inside[:-1]
    return bool(np.all(step[1:][both] == step[:-1][both]))


def _scan_shared(p: int, x: int, lcp: list[int], owner: list[int], floor: int) -> dict[int, int]:
    """Large trees (no precomputed rows): {id: largest LCP of x with a placed member} for the ids sharing
    more than the floor, scanning outward from p with a running minimum while it stays above the floor."""
    n = len(owner)
    seen: dict[int, int] = {}
    m = x
    q = p - 1
    while q >= 0:
        v = lcp[q + 1]
        if v < m:
            m = v
            if m <= floor:
                break
        g = owner[q]
        if g >= 0 and g not in seen:
            seen[g] = m
        q -= 1
    m = x
    q = p + 1
    while q < n:
        v = lcp[q]
        if v < m:
            m = v
            if m <= floor:
                break
        g = owner[q]
        if g >= 0 and seen.get(g, -1) < m:
            seen[g] = m
        q += 1
    return seen


# ------------------------------------------------------------------------------ post-processing


def neighbour_shared(index: PrefixIndex, owner: np.ndarray) -> np.ndarray:
    """For every position, its largest LCP with another member of its own microbatch (0 if alone)."""
    n = index.n
    srt = np.argsort(owner, kind="stable")
    g = owner[srt]
    same = g[1:] == g[:-1]
    lcp_next = np.zeros(n, dtype=np.int64)
    if same.any():
        lcp_next[np.flatnonzero(same)] = index.pair_lcp(srt[:-1][same], srt[1:][same])
    # lcp_next[i] pairs sorted entries i and i+1; each entry takes the max of both sides.
    best = np.maximum(lcp_next, np.concatenate(([0], lcp_next[:-1])))
    out = np.empty(n, dtype=np.int64)
    out[srt] = best
    return out


def relabel(owner: np.ndarray) -> np.ndarray:
    """Ids 0..K-1 in order of each microbatch's first position (a canonical labelling)."""
    _, first, inv = np.unique(owner, return_index=True, return_inverse=True)
    rank = np.empty(first.shape[0], dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(first.shape[0])
    return rank[inv.ravel()]


def merge_gains(index: PrefixIndex, owner: np.ndarray, a: int, k: int) -> np.ndarray:
    """C(A u B) for microbatch a against every microbatch B (entry a is C(A)), vectorised."""
    pa = np.flatnonzero(owner == a)
    others = np.flatnonzero(owner != a)
    # Every B gets its own members plus a copy of A's; sorted by (B, position).
    grp = np.concatenate((owner[others], np.repeat(np.arange(k), pa.shape[0])))
    pos = np.concatenate((others, np.tile(pa, k)))
    keep = grp != a
    grp, pos = grp[keep], pos[keep]
    srt = np.lexsort((pos, grp))
    grp, pos = grp[srt], pos[srt]
    total = np.bincount(grp, weights=index.length[pos], minlength=k).astype(np.int64)
    same = grp[1:] == grp[:-1]
    if same.any():
        shared = index.pair_lcp(pos[:-1][same], pos[1:][same])
        total -= np.bincount(grp[1:][same], weights=shared, minlength=k).astype(np.int64)
    total[a] = index.group_work(pa)
    return total


def eliminate_small(index: PrefixIndex, owner: np.ndarray, capacity: int) -> np.ndarray:
    """Dissolve light microbatches (work <= T/2) into the capacity-feasible partner with the largest
    saving C(A) + C(B) - C(A u B) (then the heaviest result, then the lowest id), lightest first; each
    light microbatch is tried once."""
    owner = relabel(owner)
    k = int(owner.max()) + 1
    work = index.owner_work(owner, k)
    tried: set[int] = set()
    while k > 1:
        light = [g for g in np.lexsort((np.arange(k), work)).tolist() if work[g] * 2 <= capacity and g not in tried]
        if not light:
            break
        a = light[0]
        merged = merge_gains(index, owner, a, k)
        saving = work[a] + work - merged
        ok = merged <= capacity
        ok[a] = False
        if not ok.any():
            tried.add(a)
            continue
        cand = np.flatnonzero(ok)
        b = int(cand[np.lexsort((cand, -merged[cand], -saving[cand]))[0]])
        owner = np.where(owner == a, b, owner)
        owner = np.where(owner > a, owner - 1, owner)
        # Ids shift down past a; keep the bookkeeping consistent.
        tried = {t - (t > a) for t in tried}
        b -= b > a
        work = np.delete(work, a)
        work[b] = merged[b + (b >= a)]
        k -= 1
    return owner


def align_to_dp(index: PrefixIndex, owner: np.ndarray, dp: int) -> np.ndarray | None:
    """Raise K to a multiple of D by singleton splits: detach the member whose split costs least
    (its largest LCP with its microbatch mates; then the lowest position). None if impossible."""
    owner = owner.copy()
    k = int(owner.max()) + 1
    need = (-k) % dp
    if k + need > index.n:
        return None
    for _ in range(need):
        counts = np.bincount(owner, minlength=k)
        cost = neighbour_shared(index, owner)
        movable = counts[owner] > 1
        cand = np.flatnonzero(movable)
        p = int(cand[np.argmin(cost[cand])])  # argmin returns the first (lowest position) on ties
        owner[p] = k
        k += 1
    return owner


def best_greedy(index: PrefixIndex, capacity: int, dp: int) -> np.ndarray | None:
    """Eight greedy plans (4 orders x 2 policies), each small-eliminated and DP-aligned; the one with the
    fewest microbatches, then the least work, then the first generated."""
    best = None
    hoods = Neighbourhoods(index)
    for order in processing_orders(index).values():
        for policy in POLICIES:
            # A plan ending with more microbatches than the best so far can never be chosen.
            owner = greedy_place(index, order, policy, capacity, hoods, None if best is None else best[0][0])
            if owner is None:
                continue
            owner = eliminate_small(index, owner, capacity)
            owner = align_to_dp(index, owner, dp)
            if owner is None:
                continue
            k = int(owner.max()) + 1
            key = (k, int(index.owner_work(owner, k).sum()))
            if best is None or key < best[0]:
                best = (key, owner)
    return None if best is None else relabel(best[1])
