"""The segment tree of one microbatch (paper 3.3, "Execution model").

A segment is a maximal fork-free token path of the compact trie, [s_v, e_v) in position space. Contracting
every segment into a vertex gives a forest G = (V, E), one rooted tree per distinct first token. The
planner only needs, per segment: its parent, its position interval, and its children in a fixed order.

Resume anchors (Eq. 2): a(p) = B * floor(p / B), the nearest legal chunk boundary at or before p. For a
segment v, a_v = a(s_v) is its entry anchor and b_v = a(e_v) its terminal anchor; every child u of v starts
at s_u = e_v, so a_u = b_v. A segment is *short* when it crosses no new chunk boundary (Eq. 11,
e_v < a_v + B); a side branch of a short segment can start from the already available entry anchor.

Legend: G segments, C compact rows, N trajectories.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def anchor(p, chunk_size: int):
    """a(p) = B * floor(p / B) (Eq. 2), elementwise for arrays."""
    return (np.asarray(p) // chunk_size) * chunk_size


@dataclass(frozen=True, eq=False)
class SegmentTree:
    """A rooted segment forest; every parent id is smaller than its children's (the trie gives preorder).

    ``start``/``end`` are positions (depths), not rows. ``children`` lists each segment's children
    contiguously (CSR through ``child_offsets``) in increasing id order, which is the trie's lexicographic
    order: that is the "fixed child order" recovery scans. ``first_row``/``last_row`` link back to the
    compact trie (-1 when the tree was built from bare arrays, e.g. in benchmarks).
    """

    parent: np.ndarray  # [G] int64, parent segment (-1 for a root)
    start: np.ndarray  # [G] int64, s_v: position of the segment's first token
    end: np.ndarray  # [G] int64, e_v: one past the position of its last token (the fork position)
    child_offsets: np.ndarray  # [G+1] int64
    children: np.ndarray  # [G - num_roots] int64, children of v at child_offsets[v]:child_offsets[v+1]
    roots: np.ndarray  # [num_trees] int64, root segment of each tree, in tree order
    first_row: np.ndarray  # [G] int64, first compact row of the segment (-1 without a trie)
    last_row: np.ndarray  # [G] int64, last compact row (-1 without a trie)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_arrays(cls, parent, start, end, *, first_row=None, last_row=None) -> SegmentTree:
        """Build from parent/start/end arrays; checks preorder ids and that children start at the fork."""
        parent = np.asarray(parent, dtype=np.int64)
        start = np.asarray(start, dtype=np.int64)
        end = np.asarray(end, dtype=np.int64)
        G = parent.shape[0]
        if G == 0:
            raise ValueError("segment tree: no segments")
        if start.shape != (G,) or end.shape != (G,):
            raise ValueError(
                f"segment tree: parent/start/end shapes differ: {parent.shape}, {start.shape}, {end.shape}"
            )
        ids = np.arange(G, dtype=np.int64)
        bad = np.flatnonzero(parent >= ids)
        if bad.shape[0]:
            v = int(bad[0])
            raise ValueError(
                f"segment {v}: parent {int(parent[v])} is not an earlier segment (parents must precede children)"
            )
        bad = np.flatnonzero(end <= start)
        if bad.shape[0]:
            v = int(bad[0])
            raise ValueError(f"segment {v}: empty interval [{int(start[v])}, {int(end[v])})")
        nonroot = parent >= 0
        bad = np.flatnonzero(nonroot & (start != end[np.maximum(parent, 0)]))
        if bad.shape[0]:
            v = int(bad[0])
            raise ValueError(
                f"segment {v}: starts at {int(start[v])} but its parent {int(parent[v])} ends at {int(end[parent[v]])}"
            )
        bad = np.flatnonzero(~nonroot & (start != 0))
        if bad.shape[0]:
            v = int(bad[0])
            raise ValueError(f"segment {v}: a root segment must start at position 0, got {int(start[v])}")
        counts = np.bincount(parent[nonroot], minlength=G)
        child_offsets = np.zeros(G + 1, dtype=np.int64)
        np.cumsum(counts, out=child_offsets[1:])
        children = np.argsort(np.where(nonroot, parent, -1), kind="stable")[int((~nonroot).sum()) :].astype(np.int64)
        roots = np.flatnonzero(~nonroot).astype(np.int64)
        neg = np.full(G, -1, dtype=np.int64)
        return cls(
            parent=parent,
            start=start,
            end=end,
            child_offsets=child_offsets,
            children=children,
            roots=roots,
            first_row=neg if first_row is None else np.asarray(first_row, dtype=np.int64),
            last_row=neg if last_row is None else np.asarray(last_row, dtype=np.int64),
        )

    @classmethod
    def from_trie(cls, trie) -> SegmentTree:
        """Segments of a ``harts.data.trie.CompactTrie`` (its segments are already maximal fork-free paths)."""
        first = trie.segment_start
        last = trie.segment_end - 1
        return cls.from_arrays(
            trie.segment_parent, trie.depth[first], trie.depth[last] + 1, first_row=first, last_row=last
        )

    # ------------------------------------------------------------------ derived quantities
    @property
    def num_segments(self) -> int:
        return int(self.parent.shape[0])

    @property
    def num_trees(self) -> int:
        return int(self.roots.shape[0])

    @property
    def num_children(self) -> np.ndarray:
        return np.diff(self.child_offsets)

    @property
    def is_leaf(self) -> np.ndarray:
        return self.num_children == 0

    @property
    def tree_of_segment(self) -> np.ndarray:
        """Index of the tree each segment belongs to (roots come first in each tree's preorder block)."""
        return np.cumsum(self.parent < 0) - 1

    def entry_anchor(self, chunk_size: int) -> np.ndarray:
        """a_v = a(s_v)."""
        return anchor(self.start, chunk_size)

    def terminal_anchor(self, chunk_size: int) -> np.ndarray:
        """b_v = a(e_v): the state every side branch of v starts from."""
        return anchor(self.end, chunk_size)

    def is_short(self, chunk_size: int) -> np.ndarray:
        """Eq. (11): e_v < a_v + B, i.e. the segment crosses no new chunk boundary (strict inequality)."""
        return self.end < self.entry_anchor(chunk_size) + chunk_size

    def fork_positions(self) -> np.ndarray:
        """Positions p = e_v of the internal segments' forks (the first position of every child)."""
        return self.end[~self.is_leaf]

    def mandatory_replay(self, chunk_size: int) -> int:
        """Eq. (15): R = sum over internal v of (|ch(v)| - 1) * (e_v mod B), independent of any schedule."""
        nc = self.num_children
        internal = nc > 0
        return int(((nc[internal] - 1) * (self.end[internal] % chunk_size)).sum())

    def height(self) -> int:
        """Number of segments on the longest root-to-leaf path (the naive depth-by-depth call count)."""
        level = np.zeros(self.num_segments, dtype=np.int64)
        nonroot = np.flatnonzero(self.parent >= 0)
        # Preorder: a parent precedes its children, so one forward sweep in id order suffices.
        par = self.parent
        lv = level.tolist()
        pl = par.tolist()
        for v in nonroot.tolist():
            lv[v] = lv[pl[v]] + 1
        return int(max(lv)) + 1
