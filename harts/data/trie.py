"""The compact trie of a batch of trajectories: the map m: S -> C and multiplicities q_c (paper 3.1).

Semantic position s = (trajectory i, position t). Two semantic positions share a compact row exactly
when their trajectories have the same token prefix up to and including t (sharing is by actual
tokens, never by group id).

Construction is sort + adjacent LCP: in lexicographic order, the longest prefix a trajectory shares
with *any* earlier trajectory is the one it shares with its immediate predecessor. So trajectory j (in
sorted order) reuses the first lcp_j rows of its predecessor and creates len_j - lcp_j new rows.
Rows are numbered in creation order, which is a depth-first preorder of the trie: a parent row has a
smaller number than its children and every fork-free path (segment) is a contiguous row range.

Legend: N trajectories, S semantic positions (sum of lengths), C compact rows, G segments.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.data.trajectory import as_token_arrays


@dataclass(frozen=True, eq=False)
class CompactTrie:
    """Prefix trie of N trajectories, as flat numpy arrays.

    Semantic arrays (length S) are in original order: trajectory 0 positions 0..L0-1, then trajectory
    1, ...; ``offsets`` (N+1) delimits them.
    """

    offsets: np.ndarray  # [N+1] int64, semantic offsets of each trajectory
    row_of_position: np.ndarray  # [S] int64, m(s): compact row of each semantic position
    tokens: np.ndarray  # [C] int64, token id of each compact row
    parent: np.ndarray  # [C] int64, parent row (-1 for a root row, i.e. position 0)
    depth: np.ndarray  # [C] int64, position id of the row (= its position t in every trajectory through it)
    multiplicity: np.ndarray  # [C] int64, q_c = number of semantic positions mapped to row c
    num_children: np.ndarray  # [C] int64
    order: np.ndarray  # [N] int64, trajectory indices in lexicographic order
    lcp_prev: np.ndarray  # [N] int64, LCP of order[j] with order[j-1] (0 for j = 0)
    segment_start: np.ndarray  # [G] int64, first row of each segment (rows start..end-1 are contiguous)
    segment_end: np.ndarray  # [G] int64, one past the last row
    segment_parent: np.ndarray  # [G] int64, parent segment (-1 for a tree root)
    segment_of_row: np.ndarray  # [C] int64
    tree_of_row: np.ndarray  # [C] int64, index of the tree (distinct first token) a row belongs to

    # ------------------------------------------------------------------ sizes
    @property
    def num_trajectories(self) -> int:
        return int(self.offsets.shape[0] - 1)

    @property
    def num_positions(self) -> int:
        """S: semantic positions (raw tokens)."""
        return int(self.offsets[-1])

    @property
    def num_rows(self) -> int:
        """C: compact rows (unique prefixes)."""
        return int(self.tokens.shape[0])

    @property
    def num_segments(self) -> int:
        return int(self.segment_start.shape[0])

    @property
    def num_trees(self) -> int:
        return int(self.tree_of_row.max()) + 1 if self.num_rows else 0

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def compression(self) -> float:
        return self.num_positions / max(self.num_rows, 1)

    def rows_of(self, i: int) -> np.ndarray:
        """Compact rows of trajectory i, position by position."""
        return self.row_of_position[self.offsets[i] : self.offsets[i + 1]]

    # ------------------------------------------------------------------ checks
    def validate(self, token_arrays=None) -> None:
        """Check every structural guarantee; with ``token_arrays`` also check tokens and depths."""
        C, S = self.num_rows, self.num_positions
        assert self.row_of_position.shape == (S,)
        assert np.all((self.row_of_position >= 0) & (self.row_of_position < C))
        assert int(self.multiplicity.sum()) == S, "multiplicities must sum to S"
        assert np.array_equal(np.bincount(self.row_of_position, minlength=C), self.multiplicity)
        roots = self.parent < 0
        assert np.all(self.depth[roots] == 0)
        nonroot = ~roots
        assert np.all(self.parent[nonroot] < np.flatnonzero(nonroot)), "rows must be in preorder"
        assert np.all(self.depth[nonroot] == self.depth[self.parent[nonroot]] + 1)
        # Each trajectory walks parent links: row of (i, t) has parent row of (i, t-1).
        starts = self.offsets[:-1]
        first = np.zeros(S, dtype=bool)
        first[starts[self.lengths > 0]] = True
        prev = np.roll(self.row_of_position, 1)
        assert np.all(self.parent[self.row_of_position[~first]] == prev[~first])
        assert np.all(self.parent[self.row_of_position[first]] == -1)
        # Distinct children of a row carry distinct tokens (the trie is a trie).
        if nonroot.any():
            keys = np.stack([self.parent[nonroot], self.tokens[nonroot]], axis=1)
            assert np.unique(keys, axis=0).shape[0] == keys.shape[0], "duplicate child token"
        root_tokens = self.tokens[roots]
        assert np.unique(root_tokens).shape[0] == root_tokens.shape[0], "duplicate root token"
        # Segments partition the rows into contiguous fork-free paths.
        assert self.segment_start[0] == 0 and self.segment_end[-1] == C
        assert np.array_equal(self.segment_start[1:], self.segment_end[:-1])
        inner = np.ones(C, dtype=bool)
        inner[self.segment_start] = False
        assert np.all(self.parent[inner] == np.flatnonzero(inner) - 1)
        assert np.all(self.num_children[np.flatnonzero(inner) - 1] == 1)
        if token_arrays is not None:
            arrays = as_token_arrays(token_arrays)
            assert len(arrays) == self.num_trajectories
            for i, toks in enumerate(arrays):
                rows = self.rows_of(i)
                assert np.array_equal(self.tokens[rows], toks), f"trajectory {i}: tokens mismatch"
                assert np.array_equal(self.depth[rows], np.arange(len(toks))), f"trajectory {i}: depth mismatch"


def lexicographic_order(arrays: list[np.ndarray]) -> np.ndarray:
    """Stable lexicographic order of token sequences (a proper prefix sorts before its extensions).

    Big-endian fixed-width bytes compare exactly like the integer sequences they encode, so Python's
    bytes ordering (memcmp) does the work.
    """
    wide = any(int(a.max()) >= 2**32 for a in arrays if a.shape[0])
    dtype = ">u8" if wide else ">u4"
    keys = [a.astype(dtype).tobytes() for a in arrays]
    return np.asarray(sorted(range(len(arrays)), key=keys.__getitem__), dtype=np.int64)


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    m = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.shape[0] else m


def adjacent_lcp(arrays: list[np.ndarray], order: np.ndarray) -> np.ndarray:
    """lcp[j] = LCP(arrays[order[j-1]], arrays[order[j]]), lcp[0] = 0."""
    lcp = np.zeros(len(order), dtype=np.int64)
    for j in range(1, len(order)):
        lcp[j] = common_prefix_length(arrays[order[j - 1]], arrays[order[j]])
    return lcp


def build_trie(trajectories) -> CompactTrie:
    """Build the compact trie of a batch (RolloutBatch, Trajectory objects or token sequences)."""
    arrays = as_token_arrays(trajectories)
    N = len(arrays)
    if N == 0:
        raise ValueError("build_trie: empty batch (no trajectories)")
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=N)
    offsets = np.zeros(N + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    S = int(offsets[-1])

    order = lexicographic_order(arrays)
    lcp = adjacent_lcp(arrays, order)
    new_counts = lengths[order] - lcp
    C = int(new_counts.sum())
    row_base = np.zeros(N + 1, dtype=np.int64)  # first new row of each sorted trajectory
    np.cumsum(new_counts, out=row_base[1:])

    row_of_position = np.empty(S, dtype=np.int64)
    tokens = np.empty(C, dtype=np.int64)
    prev_rows = None
    for j in range(N):
        i = order[j]
        lo, L, shared = offsets[i], lengths[i], lcp[j]
        rows = row_of_position[lo : lo + L]
        if shared:
            rows[:shared] = prev_rows[:shared]
        rows[shared:] = np.arange(row_base[j], row_base[j + 1])
        tokens[row_base[j] : row_base[j + 1]] = arrays[i][shared:]
        prev_rows = rows

    # Depth and parent of each new row follow from the (sorted) trajectory that created it.
    creator_len_start = np.repeat(lcp, new_counts)  # depth of the first new row of each creator
    first_new = np.repeat(row_base[:-1], new_counts)
    depth = creator_len_start + (np.arange(C, dtype=np.int64) - first_new)
    parent = np.arange(C, dtype=np.int64) - 1
    # The first new row of a creator hangs off its predecessor's row at depth lcp-1 (or is a root).
    firsts = row_base[:-1][new_counts > 0]
    first_js = np.flatnonzero(new_counts > 0)
    for r, j in zip(firsts.tolist(), first_js.tolist()):
        if lcp[j] == 0:
            parent[r] = -1
        else:
            i_prev = order[j - 1]
            parent[r] = row_of_position[offsets[i_prev] + lcp[j] - 1]

    multiplicity = np.bincount(row_of_position, minlength=C).astype(np.int64)
    num_children = np.bincount(parent[parent >= 0], minlength=C).astype(np.int64)

    # Segments: a row starts a segment when it is a root or its parent forks (or is not the row before it).
    is_start = np.ones(C, dtype=bool)
    nonroot = parent >= 0
    idx = np.arange(C)
    is_start[nonroot] = (num_children[parent[nonroot]] != 1) | (parent[nonroot] != idx[nonroot] - 1)
    segment_start = np.flatnonzero(is_start).astype(np.int64)
    segment_end = np.append(segment_start[1:], C).astype(np.int64)
    segment_of_row = np.cumsum(is_start) - 1
    seg_first_parent = parent[segment_start]
    segment_parent = np.where(seg_first_parent >= 0, segment_of_row[np.maximum(seg_first_parent, 0)], -1)
    tree_of_row = np.cumsum(parent < 0) - 1

    return CompactTrie(
        offsets=offsets,
        row_of_position=row_of_position,
        tokens=tokens,
        parent=parent,
        depth=depth,
        multiplicity=multiplicity,
        num_children=num_children,
        order=order,
        lcp_prev=lcp,
        segment_start=segment_start,
        segment_end=segment_end,
        segment_parent=segment_parent.astype(np.int64),
        segment_of_row=segment_of_row.astype(np.int64),
        tree_of_row=tree_of_row.astype(np.int64),
    )
