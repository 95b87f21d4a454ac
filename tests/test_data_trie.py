"""The compact trie against a brute-force dict-of-prefixes count (independent reference)."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.data import build_trie


def brute_force(trajs):
    """Map every prefix (tuple) to its multiplicity; rows are the distinct prefixes."""
    counts = {}
    for t in trajs:
        for i in range(1, len(t) + 1):
            key = tuple(t[:i])
            counts[key] = counts.get(key, 0) + 1
    return counts


@st.composite
def rollout_trees(draw):
    """Random forests: branches copy a prefix of an existing path, plus duplicates and prefixes."""
    vocab = draw(st.integers(2, 6))
    n_roots = draw(st.integers(1, 3))
    paths = [draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12)) for _ in range(n_roots)]
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["branch", "duplicate", "prefix", "single", "fresh"]))
        src = paths[draw(st.integers(0, len(paths) - 1))]
        if kind == "branch":
            cut = draw(st.integers(0, len(src)))
            paths.append(src[:cut] + draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8)))
        elif kind == "duplicate":
            paths.append(list(src))
        elif kind == "prefix":
            paths.append(src[: draw(st.integers(1, len(src)))])
        elif kind == "single":
            paths.append([draw(st.integers(0, vocab - 1))])
        else:
            paths.append(draw(st.lists(st.integers(vocab, vocab + 3), min_size=1, max_size=6)))
    perm = draw(st.permutations(range(len(paths))))
    return [paths[i] for i in perm]


@settings(max_examples=300, deadline=None)
@given(rollout_trees())
def test_trie_matches_brute_force_prefix_counts(trajs):
    trie = build_trie(trajs)
    trie.validate(trajs)
    ref = brute_force(trajs)
    S = sum(len(t) for t in trajs)
    assert trie.num_positions == S
    assert trie.num_rows == len(ref)
    assert int(trie.multiplicity.sum()) == S
    # Every semantic position maps to the row of exactly its prefix: same token, same depth, and the
    # row's multiplicity equals the brute-force count of that prefix.
    row_prefix = {}
    for i, t in enumerate(trajs):
        rows = trie.rows_of(i)
        for pos, r in enumerate(rows.tolist()):
            key = tuple(t[: pos + 1])
            assert trie.tokens[r] == t[pos]
            assert trie.depth[r] == pos
            assert trie.multiplicity[r] == ref[key]
            assert row_prefix.setdefault(r, key) == key, "one row serves two different prefixes"
    assert len(row_prefix) == len(ref)
    # Parent rows are the rows of the one-shorter prefix.
    for r, key in row_prefix.items():
        if len(key) == 1:
            assert trie.parent[r] == -1
        else:
            assert row_prefix[int(trie.parent[r])] == key[:-1]
    # Segments: each segment is a fork-free path; a segment ends where the trie forks or a leaf is.
    children = {}
    for key in ref:
        if len(key) > 1:
            children.setdefault(key[:-1], set()).add(key)
    for g in range(trie.num_segments):
        rows = range(int(trie.segment_start[g]), int(trie.segment_end[g]))
        for r in list(rows)[:-1]:
            assert len(children.get(row_prefix[r], ())) == 1
        last = row_prefix[int(trie.segment_end[g]) - 1]
        assert len(children.get(last, ())) != 1


def test_trie_edge_cases():
    trajs = [[5], [5], [5, 1, 2], [5, 1], [9, 9, 9], [5, 1, 3], [7]]
    trie = build_trie(trajs)
    trie.validate(trajs)
    assert trie.num_rows == len(brute_force(trajs)) == 8
    assert trie.num_trees == 3
    assert trie.multiplicity[trie.rows_of(0)[0]] == 5  # [5] is a prefix of five trajectories
    # Trajectories that share nothing: compression exactly 1.
    disjoint = [[1, 2, 3], [4, 5], [6]]
    t2 = build_trie(disjoint)
    assert t2.num_rows == 6 and t2.compression == 1.0 and t2.num_trees == 3


def test_trie_accepts_numpy_and_batches():
    from harts.data import RolloutBatch

    arrs = [np.array([3, 1, 4, 1, 5]), np.array([3, 1, 4, 2])]
    b = RolloutBatch.from_tokens(arrs)
    assert build_trie(b).num_rows == build_trie(arrs).num_rows == 6


def test_trie_rejects_empty_batch():
    import pytest

    with pytest.raises(ValueError, match="empty batch"):
        build_trie([])
