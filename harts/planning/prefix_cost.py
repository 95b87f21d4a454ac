"""Exact prefix cost of trajectory groups (paper 3.2, "Exact prefix cost", Eqs. 5-6).

Everything the microbatch planner compares is compact work: the number of unique token nodes of the
trie a group of trajectories forms. Once the batch is sorted lexicographically, that number is
determined by lengths and adjacent LCPs alone (Eq. 5), a contiguous interval's work is a prefix-sum
difference, and the LCP of any two trajectories is a range minimum over adjacent LCPs. So the planner
never builds a trie: it works on lexicographic *positions* 0..N-1 and this index.

Legend: N trajectories; positions p are indices into the lexicographic order (``order[p]`` is the
original trajectory index). ``lcp[p]`` = LCP(order[p-1], order[p]), ``lcp[0] = 0``. Intervals are
half-open position ranges [a, b).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class PrefixIndex:
    """Lexicographic order, adjacent LCPs, Eq. 5 prefix sums and an RMQ sparse table over LCPs."""

    order: np.ndarray  # [N] int64: original index of the trajectory at each lexicographic position
    position: np.ndarray  # [N] int64: lexicographic position of each original trajectory
    length: np.ndarray  # [N] int64: |x| by position
    lcp: np.ndarray  # [N] int64: adjacent LCP by position (lcp[0] = 0)
    prefix: np.ndarray  # [N+1] int64: prefix[b] = sum_{p<b} (length[p] - lcp[p])
    table: np.ndarray  # [levels, N] sparse table: table[k, i] = min(lcp[i : i + 2**k]) (padded past N - 2**k)
    log2: np.ndarray  # [N+1] floor(log2(span)) for span >= 1 (RMQ level)
    floor: int  # LCP shared by every pair of trajectories (min adjacent LCP; 0 for N = 1)

    @property
    def n(self) -> int:
        return int(self.order.shape[0])

    @property
    def total_work(self) -> int:
        """G = C(X): compact work of the whole batch in one trie."""
        return int(self.prefix[-1])

    # ------------------------------------------------------------------ queries
    def interval_work(self, a, b):
        """W of the half-open position interval [a, b) (Eq. 5); vectorised over arrays, b > a."""
        a = np.asarray(a)
        return self.prefix[b] - self.prefix[a] + self.lcp[a]

    def range_min(self, lo, hi):
        """min(lcp[lo..hi]) inclusive, lo <= hi; vectorised (two gathers from the sparse table)."""
        lo = np.asarray(lo, dtype=np.int64)
        hi = np.asarray(hi, dtype=np.int64)
        k = self.log2[hi - lo + 1]
        return np.minimum(self.table[k, lo], self.table[k, hi - (1 << k) + 1])

    def pair_lcp(self, p, q):
        """LCP of the trajectories at positions p and q (vectorised); LCP(x, x) = |x|."""
        p = np.asarray(p, dtype=np.int64)
        q = np.asarray(q, dtype=np.int64)
        lo = np.minimum(p, q)
        hi = np.maximum(p, q)
        same = lo == hi
        # For p != q: min(lcp[lo+1 .. hi]); same-position queries read a harmless one-element range.
        res = self.range_min(np.minimum(lo + 1, hi), hi)
        return np.where(same, self.length[lo], res)

    def group_work(self, positions) -> int:
        """Compact work of an arbitrary group of positions (Eq. 5 on the sorted group)."""
        pos = np.unique(np.asarray(positions, dtype=np.int64))
        if pos.shape[0] == 0:
            return 0
        total = int(self.length[pos].sum())
        if pos.shape[0] > 1:
            total -= int(self.pair_lcp(pos[:-1], pos[1:]).sum())
        return total

    def owner_work(self, owner: np.ndarray, k: int) -> np.ndarray:
        """Compact work of every group of a grouping given as owner[position] in 0..k-1."""
        srt = np.argsort(owner, kind="stable")  # positions sorted by (owner, position)
        g = owner[srt]
        work = np.bincount(owner, weights=self.length, minlength=k).astype(np.int64)
        same = g[1:] == g[:-1]
        if same.any():
            shared = self.pair_lcp(srt[:-1][same], srt[1:][same])
            work -= np.bincount(g[1:][same], weights=shared, minlength=k).astype(np.int64)
        return work


# ---------------------------------------------------------------------------------------- build


HEAD = 16  # tokens per head key: sequences are first grouped by their first HEAD tokens
FIRST_PROBE = 1 << 15  # tokens compared by the first probe of a mismatch search (then 4x larger probes);
# large, because on rollout trees most searches run through a long shared trunk and a numpy call costs
# more than reading a few thousand tokens past an early mismatch
END = -1  # "the sequence has ended": below every token


def _first_mismatch(a: np.ndarray, b: np.ndarray, start: int, cap: int) -> int:
    """First mismatch of a and b in [start, cap) (cap if none); both are known equal before ``start``.
    Probes growing chunks so an early mismatch stays cheap."""
    step = FIRST_PROBE
    while start < cap:
        stop = min(cap, start + step)
        diff = a[start:stop] != b[start:stop]
        i = int(diff.argmax())  # the first True, or 0 when there is none (argmax stops at the first True)
        if diff[i]:
            return start + i
        start, step = stop, step * 4
    return cap


def _pivot_blocks(arrays: list[np.ndarray], lengths: list[int], members: list[int],
                  depth: int) -> list[tuple[int, int, list[int]]]:
    """Split ``members`` (ascending original index, sharing their first ``depth`` tokens) around the
    first one, the pivot, into lexicographically ordered blocks (level, next token, members).

    A member's class is (l, x): l = its LCP with the pivot, x its token at l (END if it ended there).
    Members before the pivot (x below the pivot's token at l) come by ascending l, then x; members after
    it by descending l, then x; the pivot's own block (it and every identical sequence) has level
    |pivot| and next token END. Two members of different blocks have LCP = min of the blocks' levels;
    a class shares l + 1 tokens (l tokens if x is END: then its members are identical)."""
    pivot_id = members[0]
    pivot = arrays[pivot_id]
    plen = lengths[pivot_id]
    classes: dict[tuple[int, int], list[int]] = {}
    same = [pivot_id]
    for m in members[1:]:
        a = arrays[m]
        alen = lengths[m]
        l = _first_mismatch(a, pivot, depth, alen if alen < plen else plen)
        if l < alen:
            key = (l, int(a[l]))
        elif alen == plen:
            same.append(m)
            continue
        else:
            key = (l, END)
        if key in classes:
            classes[key].append(m)
        else:
            classes[key] = [m]
    below, above = [], []
    for (l, x), ms in classes.items():
        (below if x < (int(pivot[l]) if l < plen else END) else above).append((l, x, ms))
    below.sort(key=lambda c: (c[0], c[1]))
    above.sort(key=lambda c: (-c[0], c[1]))
    return below + [(plen, END, same)] + above


def _sort_group(arrays: list[np.ndarray], lengths: list[int], members: list[int], depth: int, order: list[int],
                lcp: list[int], pos: int) -> None:
    """Write the lexicographic order of ``members`` (sharing ``depth`` tokens) to order[pos:] and their
    adjacent LCPs to lcp[pos + 1:], by repeated pivot partitioning (an explicit stack, no recursion).
    Every token a member shares with another is read once, when it is compared against a pivot."""
    stack = [(members, depth, pos)]
    while stack:
        members, depth, pos = stack.pop()
        if len(members) == 1:
            order[pos] = members[0]
            continue
        prev = None
        for level, x, ms in _pivot_blocks(arrays, lengths, members, depth):
            if prev is not None:
                lcp[pos] = min(prev, level)
            if x == END or len(ms) == 1:  # identical sequences (or a single one): stable by index
                order[pos : pos + len(ms)] = ms
                lcp[pos + 1 : pos + len(ms)] = [level] * (len(ms) - 1)
            else:
                stack.append((ms, level + 1, pos))
            pos += len(ms)
            prev = level


def build_prefix_index(arrays: list[np.ndarray]) -> PrefixIndex:
    """Sort N non-negative token arrays lexicographically (stable) and index their adjacent LCPs.

    Rollout trees make most tokens shared trunk, so the sort reads each shared token once: sequences
    are grouped by their first HEAD tokens (a group is contiguous in lexicographic order and groups are
    ordered by that head; across a group boundary the LCP lies inside the heads), and each group is
    sorted by pivot partitioning (``_pivot_blocks``): every member is compared with a pivot from the
    depth they are known to share, which yields its class, the order of the classes and the LCPs
    across classes; classes of several members are partitioned again from one token deeper. Exact for
    any input; ties (identical sequences) keep the original order."""
    n = len(arrays)
    if n == 0:
        raise ValueError("build_prefix_index: no trajectories")
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=n)
    # Heads padded with -1 (below every token), so a shorter head sorts first and rows compare exactly.
    head_len = np.minimum(lengths, HEAD)
    head = np.full((n, HEAD), -1, dtype=np.int64)
    flat = np.concatenate([a[:HEAD] for a in arrays]).astype(np.int64, copy=False)
    row = np.repeat(np.arange(n), head_len)
    col = np.arange(flat.shape[0]) - np.repeat(np.cumsum(head_len) - head_len, head_len)
    head[row, col] = flat
    by_head = np.lexsort((np.arange(n),) + tuple(head[:, j] for j in range(HEAD - 1, -1, -1)))
    sorted_head = head[by_head]
    differs = sorted_head[1:] != sorted_head[:-1]  # [N-1, HEAD]
    new_group = differs.any(axis=1)
    lcp_head = np.zeros(n, dtype=np.int64)
    # Across different heads: the first differing head column (a -1 there means one sequence ended).
    boundary = np.flatnonzero(new_group)
    lcp_head[boundary + 1] = np.argmax(differs[boundary], axis=1)
    starts = np.concatenate(([0], boundary + 1, [n])).tolist()
    order = by_head.tolist()
    lcp = lcp_head.tolist()
    length_list = lengths.tolist()
    for g0, g1 in zip(starts[:-1], starts[1:]):
        if g1 - g0 > 1:  # members share their whole head (all of it when one is shorter than HEAD)
            members = order[g0:g1]  # ascending original index (stable ties)
            depth = min(min(length_list[m] for m in members), HEAD)
            _sort_group(arrays, length_list, members, depth, order, lcp, g0)
    order_arr = np.asarray(order, dtype=np.int64)
    return index_from_lcp(order_arr, lengths[order_arr], np.asarray(lcp, dtype=np.int64))


def index_from_lcp(order: np.ndarray, length: np.ndarray, lcp: np.ndarray) -> PrefixIndex:
    """Build the index from a lexicographic order, lengths by position and adjacent LCPs."""
    n = order.shape[0]
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n, dtype=np.int64)
    prefix = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(length - lcp, out=prefix[1:])
    levels = max(1, int(n).bit_length())
    table = np.empty((levels, n), dtype=np.int64)
    table[0] = lcp
    width = 1
    for k in range(1, levels):
        prev = table[k - 1]
        table[k, : n - width] = np.minimum(prev[: n - width], prev[width:])
        table[k, n - width :] = prev[n - width :]  # padding: never read by a valid query
        width *= 2
    log2 = np.zeros(n + 1, dtype=np.int64)
    log2[1:] = np.frexp(np.arange(1, n + 1, dtype=np.float64))[1] - 1  # exact for integers < 2**53
    floor = int(lcp[1:].min()) if n > 1 else 0
    return PrefixIndex(
        order=order,
        position=position,
        length=length,
        lcp=lcp,
        prefix=prefix,
        table=table,
        log2=log2,
        floor=floor,
    )


def split_cost(index: PrefixIndex, t) -> np.ndarray:
    """Eq. 6: splitting a contiguous interval before position t costs exactly lcp[t]."""
    return index.lcp[np.asarray(t)]
