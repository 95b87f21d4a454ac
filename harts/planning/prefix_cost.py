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
    table: tuple  # sparse table: table[k][i] = min(lcp[i : i + 2**k])
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
        """min(lcp[lo..hi]) inclusive, lo <= hi; vectorised."""
        lo = np.asarray(lo, dtype=np.int64)
        hi = np.asarray(hi, dtype=np.int64)
        span = hi - lo + 1
        k = np.floor(np.log2(np.maximum(span, 1))).astype(np.int64)
        # log2 of exact powers of two is exact in float64; guard anyway against rounding.
        k = np.where((1 << (k + 1)) <= span, k + 1, k)
        k = np.where((1 << k) > span, k - 1, k)
        out = np.empty(np.broadcast(lo, hi).shape, dtype=np.int64)
        flat_k, flat_lo, flat_hi = k.ravel(), np.broadcast_to(lo, out.shape).ravel(), np.broadcast_to(hi, out.shape).ravel()
        res = out.ravel()
        for level in np.unique(flat_k).tolist():
            sel = flat_k == level
            t = self.table[level]
            res[sel] = np.minimum(t[flat_lo[sel]], t[flat_hi[sel] - (1 << level) + 1])
        return out

    def pair_lcp(self, p, q):
        """LCP of the trajectories at positions p and q (vectorised); LCP(x, x) = |x|."""
        p = np.asarray(p, dtype=np.int64)
        q = np.asarray(q, dtype=np.int64)
        lo = np.minimum(p, q)
        hi = np.maximum(p, q)
        same = lo == hi
        safe_hi = np.where(same, lo + 1, hi)
        safe_lo = np.where(same, lo, lo)
        n = self.n
        res = self.range_min(np.minimum(safe_lo + 1, n - 1), np.minimum(safe_hi, n - 1)) if n > 1 else np.zeros_like(lo)
        return np.where(same, self.length[np.minimum(lo, n - 1)], res)

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


def _sort_keys(arrays: list[np.ndarray]) -> list[bytes]:
    """Big-endian fixed-width bytes compare like the integer sequences (a prefix sorts first)."""
    top = max(int(a.max()) for a in arrays)
    dtype = ">u2" if top < (1 << 16) else ">u4" if top < (1 << 32) else ">u8"
    return [a.astype(dtype).tobytes() for a in arrays]


def _lcp_of(a: np.ndarray, b: np.ndarray) -> int:
    """First mismatch of two int arrays, probing growing chunks so short LCPs stay cheap."""
    m = min(a.shape[0], b.shape[0])
    start, step = 0, 256
    while start < m:
        stop = min(m, start + step)
        diff = np.flatnonzero(a[start:stop] != b[start:stop])
        if diff.shape[0]:
            return start + int(diff[0])
        start, step = stop, step * 4
    return m


def build_prefix_index(arrays: list[np.ndarray]) -> PrefixIndex:
    """Sort N token arrays lexicographically (stable) and index their adjacent LCPs."""
    n = len(arrays)
    if n == 0:
        raise ValueError("build_prefix_index: no trajectories")
    keys = _sort_keys(arrays)
    order = np.asarray(sorted(range(n), key=keys.__getitem__), dtype=np.int64)
    del keys
    length = np.fromiter((arrays[i].shape[0] for i in order.tolist()), dtype=np.int64, count=n)
    lcp = np.zeros(n, dtype=np.int64)
    ol = order.tolist()
    for p in range(1, n):
        lcp[p] = _lcp_of(arrays[ol[p - 1]], arrays[ol[p]])
    return index_from_lcp(order, length, lcp)


def index_from_lcp(order: np.ndarray, length: np.ndarray, lcp: np.ndarray) -> PrefixIndex:
    """Build the index from a lexicographic order, lengths by position and adjacent LCPs."""
    n = order.shape[0]
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n, dtype=np.int64)
    prefix = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(length - lcp, out=prefix[1:])
    table = [lcp]
    width = 1
    while 2 * width <= n:
        prev = table[-1]
        table.append(np.minimum(prev[:-width], prev[width:]))
        width *= 2
    floor = int(lcp[1:].min()) if n > 1 else 0
    return PrefixIndex(
        order=order,
        position=position,
        length=length,
        lcp=lcp,
        prefix=prefix,
        table=tuple(table),
        floor=floor,
    )


def split_cost(index: PrefixIndex, t) -> np.ndarray:
    """Eq. 6: splitting a contiguous interval before position t costs exactly lcp[t]."""
    return index.lcp[np.asarray(t)]
