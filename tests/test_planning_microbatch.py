"""Prefix-aware microbatch / DP-replica / slot planner (paper 3.2) against brute-force references.

References are independent of the planner: compact work is the number of distinct token prefixes
(a set of tuples), the exact DP is checked against enumerating every contiguous partition, and the
objective J is recomputed from the returned work and replica lists.
"""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.plan_microbatches_cli import main
from harts.data.trajectory import RolloutBatch
from harts.planning import MicrobatchPlan, plan_microbatches
from harts.planning.exact_dp import exact_partitions, exact_partitions_pairwise, first_feasible_start
from harts.planning.greedy import align_to_dp, eliminate_small, greedy_place, neighbour_shared, processing_orders
from harts.planning.heuristic import evolve_natural, sample_targets
from harts.planning.microbatch import PlanningError, plan_index
from harts.planning.natural import k_range, natural_partition
from harts.planning.prefix_cost import build_prefix_index
from harts.planning.refine import boundary_refine, sparse_repair
from harts.planning.schedule import assign_slots, objective

# ----------------------------------------------------------------------------------- references


def brute_work(seqs) -> int:
    """Compact work = number of distinct nonempty prefixes."""
    return len({tuple(s[: t + 1]) for s in seqs for t in range(len(s))})


def random_forest(rng: np.random.Generator, n: int, *, vocab: int = 3, max_len: int = 12, trees: int = 2):
    """Root-to-leaf paths of random trees: forks of earlier paths plus fresh roots; small vocabularies
    also give accidental sharing, duplicates and paths that are prefixes of others."""
    paths: list[list[int]] = []
    for i in range(n):
        if not paths or rng.random() < trees / max(n, 1):
            p = rng.integers(0, vocab, rng.integers(1, max_len + 1)).tolist()
        else:
            parent = paths[rng.integers(0, len(paths))]
            fork = int(rng.integers(0, len(parent) + 1))
            tail = rng.integers(0, vocab, rng.integers(0, max_len - fork + 1)).tolist()
            p = parent[:fork] + tail
            if not p:
                p = [int(rng.integers(0, vocab))]
        paths.append(p)
    return paths


forest_params = st.tuples(
    st.integers(0, 2**31 - 1),  # seed
    st.integers(1, 40),  # N
    st.integers(2, 5),  # vocab
    st.integers(1, 14),  # max_len
)


def independent_objective(plan: MicrobatchPlan):
    w = np.asarray(plan.work)
    per_replica = [[w[i] for i in r] for r in plan.replicas]
    slots = list(zip(*per_replica))
    return (int(w.sum()), int(sum(max(s) for s in slots)), int(max(sum(r) for r in per_replica)))


def check_plan(plan: MicrobatchPlan, seqs, dp: int, capacity: int) -> None:
    plan.validate()
    k = len(plan.microbatches)
    assert k % dp == 0 and k >= dp
    assert sorted(i for mb in plan.microbatches for i in mb) == list(range(len(seqs)))
    assert all(len(mb) > 0 for mb in plan.microbatches)
    assert len(plan.replicas) == dp and all(len(r) == k // dp for r in plan.replicas)
    for mb, w in zip(plan.microbatches, plan.work):
        assert w == brute_work([seqs[i] for i in mb])
        assert w <= capacity
    assert tuple(plan.objective) == independent_objective(plan)
    d = plan.to_dict()
    assert set(d) == {"microbatches", "replicas", "work", "objective"}
    json.dumps(d)


# ----------------------------------------------------------------------------------- prefix cost


@settings(max_examples=60, deadline=None)
@given(forest_params)
def test_interval_work_pair_lcp_and_split_cost(params):
    seed, n, vocab, max_len = params
    seqs = random_forest(np.random.default_rng(seed), n, vocab=vocab, max_len=max_len)
    idx = build_prefix_index([np.asarray(s) for s in seqs])
    srt = sorted(seqs)  # Python list order is numeric lexicographic with prefixes first
    assert [seqs[i] for i in idx.order] == srt
    assert idx.total_work == brute_work(seqs)
    for a in range(n):
        for b in range(a + 1, n + 1):
            assert int(idx.interval_work(a, b)) == brute_work(srt[a:b])
            for t in range(a + 1, b):  # Eq. 6
                assert brute_work(srt[a:t]) + brute_work(srt[t:b]) - brute_work(srt[a:b]) == idx.lcp[t]
    p, q = np.meshgrid(np.arange(n), np.arange(n))
    got = idx.pair_lcp(p.ravel(), q.ravel())
    for (i, j), v in zip(zip(p.ravel(), q.ravel()), got):
        x, y = srt[i], srt[j]
        ref = next((t for t in range(min(len(x), len(y))) if x[t] != y[t]), min(len(x), len(y)))
        assert v == ref
    sub = np.random.default_rng(seed).random(n) < 0.5
    assert idx.group_work(np.flatnonzero(sub)) == brute_work([s for s, m in zip(srt, sub) if m])


@settings(max_examples=40, deadline=None)
@given(forest_params, st.sampled_from([1, 2, 3, 16]), st.sampled_from([3, 70_000, 2**40]),
       st.sampled_from([1, 2, 4096]))
def test_prefix_index_order_and_lcp_with_shared_trunks(params, head, top, probe):
    """Head groups and pivot partitioning give Python's sorted order (ties by index) and the brute-force
    adjacent LCPs; small HEADs make the partitioning run on small inputs and small probes make the
    mismatch search take several growing steps."""
    from unittest import mock

    import harts.planning.prefix_cost as pc

    seed, n, vocab, max_len = params
    rng = np.random.default_rng(seed)
    seqs = random_forest(rng, n, vocab=vocab, max_len=max_len + 20)
    big = rng.integers(0, top, 64).tolist()  # a few large token ids
    seqs = [[big[t % 64] if t % 3 == 0 else t for t in s] for s in seqs]
    with mock.patch.object(pc, "HEAD", head), mock.patch.object(pc, "FIRST_PROBE", probe):
        idx = build_prefix_index([np.asarray(s, dtype=np.int64) for s in seqs])
    assert idx.order.tolist() == sorted(range(n), key=lambda i: (seqs[i], i))
    srt = [seqs[i] for i in idx.order]
    for p in range(1, n):
        x, y = srt[p - 1], srt[p]
        ref = next((t for t in range(min(len(x), len(y))) if x[t] != y[t]), min(len(x), len(y)))
        assert idx.lcp[p] == ref
    assert idx.total_work == brute_work(seqs)


@settings(max_examples=30, deadline=None)
@given(forest_params, st.integers(0, 2**31 - 1))
def test_near_lcp_and_group_state_match_rmq_and_owner_work(params, seed2):
    """The running-minimum window table equals RMQ pair LCPs; group_state's work, links and shared
    amounts equal owner_work, the nearest mates on either side and the maximum LCP over all mates."""
    from harts.planning.refine import H, group_state, near_lcp

    seed, n, vocab, max_len = params
    seqs = random_forest(np.random.default_rng(seed), n, vocab=vocab, max_len=max_len)
    idx = build_prefix_index([np.asarray(s) for s in seqs])
    near = near_lcp(idx)
    for p in range(n):
        for o in range(H + 1):
            assert near[p, o] == (idx.pair_lcp(p, p + o) if p + o < n else 0)
    k = min(n, 4)
    owner = np.random.default_rng(seed2).integers(0, k, n)
    owner[:k] = np.arange(k)
    work, (prev, nxt), own = group_state(idx, owner, k)
    assert work.tolist() == idx.owner_work(owner, k).tolist()
    for p in range(n):
        mates = [q for q in range(n) if q != p and owner[q] == owner[p]]
        assert prev[p] == max((q for q in mates if q < p), default=-1)
        assert nxt[p] == min((q for q in mates if q > p), default=n)
        assert own[p] == max((int(idx.pair_lcp(p, q)) for q in mates), default=0)


def test_first_feasible_start_is_the_first_fitting_start():
    rng = np.random.default_rng(3)
    seqs = random_forest(rng, 30, vocab=3, max_len=10)
    idx = build_prefix_index([np.asarray(s) for s in seqs])
    first = first_feasible_start(idx, 15)
    for e in range(1, idx.n + 1):
        fits = [s for s in range(e) if idx.interval_work(s, e) <= 15]
        assert first[e] == fits[0]
        assert fits == list(range(fits[0], e))  # monotone: every later start fits too


# ----------------------------------------------------------------------------------- natural


def naive_natural(srt, capacity):
    """Recursive lowest-valley splits written from the paper's wording, on sequences directly."""
    def lcp(x, y):
        return next((t for t in range(min(len(x), len(y))) if x[t] != y[t]), min(len(x), len(y)))

    if brute_work(srt) <= capacity:
        return [len(srt)]
    best = min(
        range(1, len(srt)),
        key=lambda t: (lcp(srt[t - 1], srt[t]), max(brute_work(srt[:t]), brute_work(srt[t:])),
                       abs(brute_work(srt[:t]) - brute_work(srt[t:])), t),
    )
    return naive_natural(srt[:best], capacity) + naive_natural(srt[best:], capacity)


@settings(max_examples=40, deadline=None)
@given(forest_params, st.integers(0, 30))
def test_natural_partition_matches_naive_recursion(params, extra):
    seed, n, vocab, max_len = params
    seqs = random_forest(np.random.default_rng(seed), n, vocab=vocab, max_len=max_len)
    capacity = max(len(s) for s in seqs) + extra
    idx = build_prefix_index([np.asarray(s) for s in seqs])
    cuts = natural_partition(idx, capacity)
    sizes = naive_natural(sorted(seqs), capacity)
    assert np.diff(cuts).tolist() == sizes


def test_k_range_equations_7_8():
    assert k_range(1000, 100, 4, 13, 50) == [12, 16]  # K_min = 4*ceil(1000/400)=12, K_max = min(16, 48)
    assert k_range(10, 100, 4, 1, 50) == [4]
    assert k_range(1000, 100, 4, 30, 21) == [12, 16, 20]  # K_max capped by D*floor(N/D)
    assert k_range(1000, 100, 4, 30, 9) == [12]  # K_max = max(K_min, ...)


# ----------------------------------------------------------------------------------- exact DP


def brute_contiguous(srt, capacity, k):
    """Best (total, peak) over every contiguous partition of srt into k capacity-feasible parts."""
    n = len(srt)
    best = None
    for inner in itertools.combinations(range(1, n), k - 1):
        cuts = (0, *inner, n)
        works = [brute_work(srt[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
        if max(works) > capacity:
            continue
        key = (sum(works), max(works))
        best = key if best is None or key < best else best
    return best


@settings(max_examples=40, deadline=None)
@given(forest_params, st.integers(0, 20))
def test_exact_dp_equals_brute_force_over_contiguous_partitions(params, extra):
    seed, n, vocab, max_len = params
    n = min(n, 10)
    seqs = random_forest(np.random.default_rng(seed), n, vocab=vocab, max_len=max_len)
    capacity = max(len(s) for s in seqs) + extra
    idx = build_prefix_index([np.asarray(s) for s in seqs])
    srt = sorted(seqs)
    ks = list(range(1, n + 1))
    found = exact_partitions(idx, capacity, ks)
    for k in ks:
        ref = brute_contiguous(srt, capacity, k)
        if ref is None:
            assert k not in found
            continue
        cuts = found[k]
        works = [brute_work(srt[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
        assert len(works) == k and max(works) <= capacity
        assert (sum(works), max(works)) == ref
    # The packed-key, windowed fast path and the pairwise reference pick identical partitions.
    ref_found = exact_partitions_pairwise(idx, capacity, ks)
    assert found.keys() == ref_found.keys()
    assert all(np.array_equal(found[k], ref_found[k]) for k in found)


@settings(max_examples=30, deadline=None)
@given(forest_params, st.integers(0, 20), st.lists(st.integers(1, 40), min_size=1, max_size=6))
def test_exact_dp_fast_path_equals_pairwise_reference(params, extra, targets):
    """Larger inputs than brute force allows: same cuts for every target subset (windows depend on it)."""
    seed, n, vocab, max_len = params
    seqs = random_forest(np.random.default_rng(seed), n, vocab=vocab, max_len=max_len, trees=3)
    capacity = max(len(s) for s in seqs) + extra
    idx = build_prefix_index([np.asarray(s) for s in seqs])
    fast = exact_partitions(idx, capacity, targets)
    ref = exact_partitions_pairwise(idx, capacity, targets)
    assert fast.keys() == ref.keys() and all(np.array_equal(fast[k], ref[k]) for k in fast)


# ----------------------------------------------------------------------------------- heuristic


def test_sample_targets_budget():
    ks = list(range(8, 8 + 4 * 100, 4))
    got = sample_targets(ks)
    assert len(got) <= 32 and got[0] == ks[0] and got[-1] == ks[-1]
    assert got[:16] == ks[:16]  # dense small values from K_min
    assert sample_targets(ks[:20]) == ks[:20]


@settings(max_examples=30, deadline=None)
@given(forest_params, st.integers(0, 20))
def test_evolved_partitions_are_feasible_and_follow_eq6(params, extra):
    seed, n, vocab, max_len = params
    seqs = random_forest(np.random.default_rng(seed), n, vocab=vocab, max_len=max_len)
    capacity = max(len(s) for s in seqs) + extra
    idx = build_prefix_index([np.asarray(s) for s in seqs])
    nat = natural_partition(idx, capacity)
    k0 = nat.shape[0] - 1
    out = evolve_natural(idx, nat, capacity, list(range(1, n + 1)))
    srt = sorted(seqs)
    assert k0 in out
    for k, cuts in out.items():
        assert cuts.shape[0] - 1 == k and cuts[0] == 0 and cuts[-1] == n and np.all(np.diff(cuts) > 0)
        works = [brute_work(srt[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
        assert max(works) <= capacity
        # Eq. 6: total work = G + sum of the LCPs at the cuts.
        assert sum(works) == idx.total_work + int(idx.lcp[cuts[1:-1]].sum())
    for k in range(k0, n + 1):  # splits are always legal
        assert k in out


# ----------------------------------------------------------------------------------- greedy


@settings(max_examples=40, deadline=None)
@given(forest_params, st.integers(0, 20), st.sampled_from(["best_fit", "max_shared"]))
def test_greedy_placement_feasible_and_post_processing(params, extra, policy):
    seed, n, vocab, max_len = params
    seqs = random_forest(np.random.default_rng(seed), n, vocab=vocab, max_len=max_len)
    capacity = max(len(s) for s in seqs) + extra
    idx = build_prefix_index([np.asarray(s) for s in seqs])
    srt = sorted(seqs)
    for order in processing_orders(idx).values():
        assert sorted(order) == list(range(n))
        owner = greedy_place(idx, order, policy, capacity)
        k = int(owner.max()) + 1
        assert set(owner.tolist()) == set(range(k))
        for g in range(k):
            assert brute_work([srt[p] for p in np.flatnonzero(owner == g)]) <= capacity
        merged = eliminate_small(idx, owner, capacity)
        k2 = int(merged.max()) + 1
        assert k2 <= k and set(merged.tolist()) == set(range(k2))
        w_before = sum(brute_work([srt[p] for p in np.flatnonzero(owner == g)]) for g in range(k))
        w_after = [brute_work([srt[p] for p in np.flatnonzero(merged == g)]) for g in range(k2)]
        assert max(w_after) <= capacity and sum(w_after) <= w_before
        for dp in (1, 2, 3):
            aligned = align_to_dp(idx, merged, dp)
            if k2 + (-k2) % dp > n:
                assert aligned is None
                continue
            k3 = int(aligned.max()) + 1
            assert k3 % dp == 0 and k3 - k2 == (-k2) % dp and set(aligned.tolist()) == set(range(k3))


def naive_greedy(srt, order, policy, capacity):
    """Eq. 10 greedy from the wording, on sequence sets: each position joins the microbatch maximising
    (work after, shared) for best-fit or (shared, work after) for max-shared, lowest id on ties."""
    groups: list[list[int]] = []
    owner = [-1] * len(srt)
    for p in order:
        x = len(srt[p])
        best = None
        for g, members in enumerate(groups):
            before = brute_work([srt[q] for q in members])
            after = brute_work([srt[q] for q in members] + [srt[p]])
            if after > capacity:
                continue
            shared = x - (after - before)
            key = (after, shared, -g) if policy == "best_fit" else (shared, after, -g)
            if best is None or key > best[0]:
                best = (key, g)
        if best is None:
            groups.append([p])
            owner[p] = len(groups) - 1
        else:
            groups[best[1]].append(p)
            owner[p] = best[1]
    return owner


@settings(max_examples=30, deadline=None)
@given(forest_params, st.integers(0, 20), st.sampled_from([256, 2]))
def test_greedy_equals_naive_reference(params, extra, rows_max):
    """Same placements as the naive greedy, with precomputed tree rows and with the scanning fallback."""
    from unittest import mock

    import harts.planning.greedy as gr

    seed, n, vocab, max_len = params
    n = min(n, 24)
    seqs = random_forest(np.random.default_rng(seed), n, vocab=vocab, max_len=max_len)
    capacity = max(len(s) for s in seqs) + extra
    idx = build_prefix_index([np.asarray(s) for s in seqs])
    srt = [seqs[i] for i in idx.order]
    # Besides the four orders: trees in random order, each visited ascending or descending (monotone,
    # the latest-member shortcut applies) and a random permutation (generally not monotone).
    rng = np.random.default_rng(seed)
    trees = np.split(np.arange(n), np.flatnonzero(idx.lcp[1:] <= idx.floor) + 1)
    monotone = [p for t in rng.permutation(len(trees))
                for p in (trees[t] if rng.random() < 0.5 else trees[t][::-1]).tolist()]
    orders = [*processing_orders(idx).values(), monotone, rng.permutation(n).tolist()]
    with mock.patch.object(gr, "TREE_ROWS_MAX", rows_max):
        hoods = gr.Neighbourhoods(idx)
        assert gr.placed_monotonically(hoods, monotone)
        for order in orders:
            for policy in ("best_fit", "max_shared"):
                got = greedy_place(idx, order, policy, capacity, hoods)
                assert got.tolist() == naive_greedy(srt, order, policy, capacity)


@settings(max_examples=40, deadline=None)
@given(forest_params, st.integers(0, 20), st.integers(1, 4))
def test_best_greedy_pruning_keeps_the_unpruned_choice(params, extra, dp):
    """best_greedy stops a plan once more than the best K microbatches exceed T/2; the chosen plan is
    the one the unpruned selection (all eight plans run to the end) picks, and a stopped plan always
    ends with more microbatches than that bound."""
    from harts.planning.greedy import POLICIES, Neighbourhoods, best_greedy, relabel

    seed, n, vocab, max_len = params
    seqs = random_forest(np.random.default_rng(seed), n, vocab=vocab, max_len=max_len)
    capacity = max(len(s) for s in seqs) + extra
    idx = build_prefix_index([np.asarray(s) for s in seqs])
    hoods = Neighbourhoods(idx)
    best = None
    for order in processing_orders(idx).values():
        for policy in POLICIES:
            full = greedy_place(idx, order, policy, capacity, hoods)
            owner = align_to_dp(idx, eliminate_small(idx, full, capacity), dp)
            k = None if owner is None else int(owner.max()) + 1
            for bound in range(0, n + 1):
                pruned = greedy_place(idx, order, policy, capacity, hoods, max_heavy=bound)
                if pruned is None:
                    assert k is None or k > bound
                else:
                    assert pruned.tolist() == full.tolist()
            if owner is not None:
                key = (k, int(idx.owner_work(owner, k).sum()))
                if best is None or key < best[0]:
                    best = (key, owner)
    got = best_greedy(idx, capacity, dp)
    assert (got is None) == (best is None)
    if best is not None:
        assert got.tolist() == relabel(best[1]).tolist()


def test_placed_monotonically():
    """True exactly when every tree (run of positions sharing more than the floor) is visited in one
    direction; trees may come in any order and directions may differ between trees."""
    from harts.planning.greedy import Neighbourhoods, placed_monotonically

    seqs = [[1, 2, 3], [1, 2, 4], [1, 2, 5], [7, 1], [7, 2], [9]]  # trees: positions 0-2, 3-4, 5
    idx = build_prefix_index([np.asarray(s) for s in seqs])
    hoods = Neighbourhoods(idx)
    assert placed_monotonically(hoods, [0, 1, 2, 3, 4, 5])
    assert placed_monotonically(hoods, [4, 3, 5, 2, 1, 0])
    assert placed_monotonically(hoods, [0, 4, 1, 3, 5, 2])  # interleaved trees, each one direction
    assert not placed_monotonically(hoods, [0, 2, 1, 3, 4, 5])  # tree 0-2 zigzags
    assert not placed_monotonically(hoods, [1, 0, 2, 3, 4, 5])


def test_greedy_eq10_insertion_cost_brute_force():
    """neighbour_shared is |x| minus the work x adds to its microbatch (Eq. 10 with p, q its neighbours)."""
    rng = np.random.default_rng(11)
    for _ in range(20):
        seqs = random_forest(rng, 25, vocab=3, max_len=10)
        idx = build_prefix_index([np.asarray(s) for s in seqs])
        srt = sorted(seqs)
        owner = rng.integers(0, 4, idx.n)
        sh = neighbour_shared(idx, owner)
        for p in range(idx.n):
            mates = [srt[q] for q in np.flatnonzero(owner == owner[p]) if q != p]
            delta = brute_work(mates + [srt[p]]) - brute_work(mates)
            assert len(srt[p]) - sh[p] == delta


# ----------------------------------------------------------------------------------- refinement


def naive_boundary_refine(srt, cuts, capacity, h=8, sweeps=2):
    cuts = list(cuts)
    for _ in range(sweeps):
        changed = False
        for i in range(1, len(cuts) - 1):
            a, c, b = cuts[i - 1], cuts[i], cuts[i + 1]
            pair = lambda t: (brute_work(srt[a:t]), brute_work(srt[t:b]))  # noqa: E731
            cur = (sum(pair(c)), max(pair(c)))
            options = []
            for t in range(max(a + 1, c - h), min(b - 1, c + h) + 1):
                left, right = pair(t)
                if left <= capacity and right <= capacity and (left + right, max(left, right)) < cur:
                    options.append((left + right, max(left, right), abs(t - c), t))
            if options:
                cuts[i] = min(options)[3]
                changed = True
        if not changed:
            break
    return cuts


def naive_sparse_repair(srt, owner, capacity, h=8, iters=4):
    owner = list(owner)
    n = len(srt)
    k = max(owner) + 1
    for _ in range(iters):
        members = [[p for p in range(n) if owner[p] == g] for g in range(k)]
        work = [brute_work([srt[p] for p in m]) for m in members]
        moves = []
        for p in range(n):
            a = owner[p]
            if len(members[a]) < 2:
                continue
            for d in sorted({owner[q] for q in range(max(0, p - h), min(n, p + h + 1))} - {a}):
                new_a = brute_work([srt[q] for q in members[a] if q != p])
                new_d = brute_work([srt[q] for q in members[d]] + [srt[p]])
                gain = work[a] + work[d] - new_a - new_d
                if new_d <= capacity and gain > 0:
                    moves.append((-gain, p, d))
        if moves:
            _, p, d = min(moves)
            owner[p] = d
            continue
        swaps = []
        for p in range(n):
            for q in range(p + 1, min(n, p + h + 1)):
                a, b = owner[p], owner[q]
                if a == b:
                    continue
                new_a = brute_work([srt[r] for r in members[a] if r != p] + [srt[q]])
                new_b = brute_work([srt[r] for r in members[b] if r != q] + [srt[p]])
                gain = work[a] + work[b] - new_a - new_b
                if new_a <= capacity and new_b <= capacity and gain > 0:
                    swaps.append((-gain, p, q))
        if not swaps:
            break
        _, p, q = min(swaps)
        owner[p], owner[q] = owner[q], owner[p]
    return owner


@settings(max_examples=25, deadline=None)
@given(forest_params, st.integers(0, 20), st.integers(0, 2**31 - 1))
def test_refinement_equals_naive_reference(params, extra, seed2):
    """Vectorised boundary sweeps and link-based sparse repair make the naive references' exact choices."""
    seed, n, vocab, max_len = params
    n = min(n, 22)
    seqs = random_forest(np.random.default_rng(seed), n, vocab=vocab, max_len=max_len)
    capacity = max(len(s) for s in seqs) + extra
    idx = build_prefix_index([np.asarray(s) for s in seqs])
    srt = [seqs[i] for i in idx.order]
    rng = np.random.default_rng(seed2)
    k = int(rng.integers(1, n + 1))
    cuts = np.concatenate(([0], np.sort(rng.choice(np.arange(1, n), k - 1, replace=False)), [n])).astype(np.int64)
    for c in (cuts, natural_partition(idx, capacity)):
        assert boundary_refine(idx, c, capacity).tolist() == naive_boundary_refine(srt, c.tolist(), capacity)
    owner = greedy_place(idx, processing_orders(idx)["suffix_desc"], "max_shared", capacity)
    assert sparse_repair(idx, owner, capacity).tolist() == naive_sparse_repair(srt, owner.tolist(), capacity)
    loose = rng.integers(0, max(1, n // 3), n)  # arbitrary grouping, no capacity pressure
    loose = np.unique(loose, return_inverse=True)[1].ravel()
    assert sparse_repair(idx, loose, 10**9).tolist() == naive_sparse_repair(srt, loose.tolist(), 10**9)


@settings(max_examples=40, deadline=None)
@given(forest_params, st.integers(0, 20), st.integers(0, 2**31 - 1))
def test_refinement_keeps_k_coverage_capacity_and_never_adds_work(params, extra, seed2):
    seed, n, vocab, max_len = params
    seqs = random_forest(np.random.default_rng(seed), n, vocab=vocab, max_len=max_len)
    capacity = max(len(s) for s in seqs) + extra
    idx = build_prefix_index([np.asarray(s) for s in seqs])
    srt = sorted(seqs)
    nat = natural_partition(idx, capacity)
    cuts = boundary_refine(idx, nat, capacity)
    assert cuts.shape == nat.shape and np.all(np.diff(cuts) > 0)
    wk = lambda c: [brute_work(srt[a:b]) for a, b in zip(c[:-1], c[1:])]  # noqa: E731
    assert max(wk(cuts)) <= capacity
    assert (sum(wk(cuts)), max(wk(cuts))) <= (sum(wk(nat)), max(wk(nat)))
    owner = greedy_place(idx, processing_orders(idx)["len_desc"], "best_fit", capacity)
    k = int(owner.max()) + 1
    rep = sparse_repair(idx, owner, capacity)
    assert set(rep.tolist()) == set(range(k))
    before = sum(brute_work([srt[p] for p in np.flatnonzero(owner == g)]) for g in range(k))
    after = [brute_work([srt[p] for p in np.flatnonzero(rep == g)]) for g in range(k)]
    assert max(after) <= capacity and sum(after) <= before
    if not np.array_equal(rep, owner):
        assert sum(after) < before  # only strict improvements are applied


# ----------------------------------------------------------------------------------- schedule


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=40), st.integers(1, 5))
def test_assign_slots(work, dp):
    work = work[: len(work) - len(work) % dp] or None
    if work is None:
        return
    w = np.asarray(work)
    slots = assign_slots(w, dp)
    k = w.shape[0]
    assert sorted(slots.ravel().tolist()) == list(range(k))
    heavy_first = np.sort(w)[::-1]
    for j in range(k // dp):  # slot j holds the j-th block of D by descending work
        assert sorted(w[slots[j]].tolist()) == sorted(heavy_first[j * dp : (j + 1) * dp].tolist())
    load = np.zeros(dp, dtype=np.int64)
    for j in range(k // dp):  # heavier microbatch -> replica with less cumulative work so far
        by_load = np.argsort(load, kind="stable")
        assert np.all(np.diff(w[slots[j, by_load]]) <= 0)
        load += w[slots[j]]
    total, crit, peak = objective(w, slots)
    assert total == w.sum() and crit == sum(w[s].max() for s in slots) and peak == w[slots].sum(axis=0).max()


# ----------------------------------------------------------------------------------- end to end


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(forest_params, st.integers(0, 25), st.integers(1, 4))
def test_plan_properties(params, extra, dp):
    seed, n, vocab, max_len = params
    seqs = random_forest(np.random.default_rng(seed), n, vocab=vocab, max_len=max_len)
    capacity = max(len(s) for s in seqs) + extra
    if n < dp:
        with pytest.raises(PlanningError, match="DP replicas"):
            plan_microbatches(seqs, dp_degree=dp, capacity=capacity)
        return
    try:
        plan = plan_microbatches(seqs, dp_degree=dp, capacity=capacity)
    except PlanningError as e:  # legitimate only when no multiple of D fits into N nonempty microbatches
        assert "no DP-compatible plan" in str(e)
        if n <= 8:
            assert min_feasible_k(seqs, capacity, dp) is None
        return
    check_plan(plan, seqs, dp, capacity)
    again = plan_microbatches([np.asarray(s) for s in seqs], dp_degree=dp, capacity=capacity)
    assert again.to_dict() == plan.to_dict()  # deterministic, and the input type does not matter


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(forest_params, st.integers(0, 25), st.integers(1, 4))
def test_plan_properties_heuristic_mode(params, extra, dp):
    """The same guarantees in the paper's literal heuristic mode (N0 = 0: sampled-K evolution + anchors),
    and the default mode above N0 (exact DP partitions added) is never worse under J."""
    from unittest import mock

    import harts.planning.microbatch as mb

    seed, n, vocab, max_len = params
    seqs = random_forest(np.random.default_rng(seed), n, vocab=vocab, max_len=max_len)
    capacity = max(len(s) for s in seqs) + extra
    if n < dp:
        return
    try:
        plan = plan_microbatches(seqs, dp_degree=dp, capacity=capacity, exact_threshold=0)
    except PlanningError as e:
        assert "no DP-compatible plan" in str(e)
        if n <= 8:
            assert min_feasible_k(seqs, capacity, dp) is None
        return
    assert not plan.candidate.startswith("exact")
    check_plan(plan, seqs, dp, capacity)
    again = plan_microbatches(seqs, dp_degree=dp, capacity=capacity, exact_threshold=0)
    assert again.to_dict() == plan.to_dict()
    with mock.patch.object(mb, "N0", 0):
        default = plan_microbatches(seqs, dp_degree=dp, capacity=capacity)
        check_plan(default, seqs, dp, capacity)
        assert tuple(default.objective) <= tuple(plan.objective)
        if tuple(default.objective) == tuple(plan.objective):  # ties go to the paper's candidates
            assert default.to_dict() == plan.to_dict()
        with mock.patch.object(mb, "EXACT_CELL_BUDGET", 0):  # over budget: exactly the literal plan
            assert plan_microbatches(seqs, dp_degree=dp, capacity=capacity).to_dict() == plan.to_dict()


def set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1 :]
        yield [[first]] + part


def min_feasible_k(seqs, capacity, dp):
    """Smallest K % D == 0 over all set partitions into capacity-feasible parts (None if there is none)."""
    ks = [len(p) for p in set_partitions(list(range(len(seqs))))
          if len(p) % dp == 0 and all(brute_work([seqs[i] for i in b]) <= capacity for b in p)]
    return min(ks) if ks else None


def test_large_input_uses_heuristic_mode_and_is_valid():
    rng = np.random.default_rng(5)
    seqs = random_forest(rng, 700, vocab=4, max_len=40, trees=30)
    capacity = 400
    literal = plan_microbatches(seqs, dp_degree=4, capacity=capacity, exact_threshold=512)
    check_plan(literal, seqs, 4, capacity)
    assert not literal.candidate.startswith("exact")
    idx = build_prefix_index([np.asarray(s) for s in seqs])
    # Never worse than the natural partition evolved to any sampled K (those are candidates too).
    nat = natural_partition(idx, capacity)
    targets = k_range(idx.total_work, capacity, 4, nat.shape[0] - 1, idx.n)
    for k, cuts in evolve_natural(idx, nat, capacity, sample_targets(targets)).items():
        assert literal.objective[0] <= idx.total_work + int(idx.lcp[cuts[1:-1]].sum())
    # The default adds the exact DP above N0 = 512: never worse, and no worse than any exact partition.
    plan = plan_microbatches(seqs, dp_degree=4, capacity=capacity)
    check_plan(plan, seqs, 4, capacity)
    assert tuple(plan.objective) <= tuple(literal.objective)
    for k, cuts in exact_partitions(idx, capacity, targets).items():
        assert plan.objective[0] <= idx.total_work + int(idx.lcp[cuts[1:-1]].sum())


def test_small_input_contains_exact_candidates():
    rng = np.random.default_rng(7)
    seqs = random_forest(rng, 60, vocab=3, max_len=20, trees=4)
    capacity = 60
    idx = build_prefix_index([np.asarray(s) for s in seqs])
    label, owner, work, slots, j = plan_index(idx, 2, capacity)
    nat = natural_partition(idx, capacity)
    targets = k_range(idx.total_work, capacity, 2, nat.shape[0] - 1, idx.n)
    for k, cuts in exact_partitions(idx, capacity, targets).items():
        assert j[0] <= idx.total_work + int(idx.lcp[cuts[1:-1]].sum())


def test_rollout_batch_input_and_dp1():
    batch = RolloutBatch.from_tokens([[1, 2, 3], [1, 2, 4], [5, 6], [5, 7, 8, 9]])
    plan = plan_microbatches(batch, dp_degree=1, capacity=100)
    assert plan.microbatches == [[0, 1, 2, 3]] and plan.work == [9] and plan.replicas == [[0]]
    assert plan.objective == (9, 9, 9)


def test_bad_inputs_have_clear_errors():
    seqs = [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [4]]
    with pytest.raises(PlanningError, match="trajectory 1 has 7 tokens.*capacity 5"):
        plan_microbatches(seqs, dp_degree=1, capacity=5)
    with pytest.raises(PlanningError, match="dp_degree must be >= 1"):
        plan_microbatches(seqs, dp_degree=0, capacity=5)
    with pytest.raises(PlanningError, match="capacity must be >= 1"):
        plan_microbatches(seqs, dp_degree=1, capacity=0)
    with pytest.raises(PlanningError, match="empty input"):
        plan_microbatches([], dp_degree=1, capacity=5)
    with pytest.raises(PlanningError, match="3 trajectories cannot fill 4 DP replicas"):
        plan_microbatches(seqs, dp_degree=4, capacity=50)
    with pytest.raises(ValueError, match="trajectory 1"):
        plan_microbatches([[1], []], dp_degree=1, capacity=5)
    with pytest.raises(PlanningError, match="no DP-compatible plan"):
        plan_microbatches([[1, 2], [3, 4], [5, 6]], dp_degree=2, capacity=2)  # needs K = 3, not a multiple of 2


def test_cli_prints_summary_and_writes_json(tmp_path, capsys):
    rng = np.random.default_rng(2)
    seqs = random_forest(rng, 30, vocab=4, max_len=20, trees=3)
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps({"tokens": s}) + "\n" for s in seqs))
    out = tmp_path / "plan.json"
    assert main(["--input", str(f), "--dp", "2", "--capacity", "40", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for word in ("K ", "total compact work", "slot-critical work", "max replica work", "P50", "P95",
                 "step-total imbalance", "planning time"):
        assert word in text
    d = json.loads(out.read_text())
    plan = MicrobatchPlan(d["microbatches"], d["replicas"], d["work"], tuple(d["objective"]), 40, 2)
    check_plan(plan, seqs, 2, 40)
    f.write_text(json.dumps({"tokens": list(range(50))}) + "\n")
    assert main(["--input", str(f), "--dp", "1", "--capacity", "40"]) == 2
    assert "trajectory 0 has 50 tokens" in capsys.readouterr().err
