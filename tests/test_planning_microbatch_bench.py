"""The planning benchmark's baselines produce valid, exactly-costed plans, and the CLI runs end to end
on the small synthetic preset (no timing assertions: performance lives in the benchmark's tables)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import planner as bench
from harts.data.synthetic import generate
from harts.data.trie import build_trie


def _batch(seed=0):
    return [a for a in generate("swe-small", seed=seed, metadata=False).token_arrays]


@pytest.mark.parametrize("name", ["harts", "ortools", "natural", "raw_ffd", "harts_paper"])
def test_baseline_plans_are_valid(name):
    arrays = _batch(1)
    dp, capacity = 2, 2048
    fn = bench.PLANNERS[name]
    work, slots = fn(arrays, dp, capacity, 5.0) if name == "ortools" else fn(arrays, dp, capacity)
    k = work.shape[0]
    assert k % dp == 0 and slots.shape == (k // dp, dp)
    assert sorted(slots.ravel().tolist()) == list(range(k))
    assert work.max() <= capacity and work.min() > 0
    # Total work is at least the whole-batch trie and at most the raw tokens.
    assert build_trie(arrays).num_rows <= work.sum() <= sum(a.shape[0] for a in arrays)


def test_ortools_microbatches_match_trie_counts():
    """Recompute the baseline's per-microbatch work with the independent trie (membership via a hook)."""
    arrays = _batch(2)
    index = bench.build_prefix_index(arrays)
    trees = bench._tree_ranges(index)
    assert trees[0, 0] == 0 and trees[-1, 1] == index.n
    for a, b in trees.tolist():  # each range is one connected component: one root token
        assert len({int(arrays[index.order[p]][0]) for p in range(a, b)}) == 1
        pieces = bench._dfs_pieces(index, a, b, 2048)
        assert pieces[0][0] == a and pieces[-1][1] == b
        for (s, e) in pieces:
            rows = build_trie([arrays[index.order[p]] for p in range(s, e)]).num_rows
            assert rows == int(index.interval_work(s, e)) <= 2048


def test_cp_sat_bin_packing_is_feasible_and_tight():
    sizes = [5, 5, 4, 4, 3, 3, 2, 2, 2]
    bins = bench._cp_sat_bin_packing(sizes, 10, 5.0)
    loads = np.bincount(bins, weights=sizes)
    assert loads.max() <= 10 and len(set(bins)) == 3  # 30 units in 3 full bins


def test_benchmark_cli_small(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--preset", "swe-small", "--steps", "1", "--dp", "2", "--capacity", "2048",
                       "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "OR/HARTS" in text and "slot P95" in text
    rep = json.loads(out.read_text())
    row = rep["results"]["dp2"]["rows"][0]
    assert set(row) >= {"harts", "ortools", "natural", "raw_ffd"}
    for name in ("harts", "ortools", "natural", "raw_ffd"):  # same timing rule for every planner
        runs = row[name]["runs"]
        assert 1 <= len(runs) <= rep["repeat"] and row[name]["seconds"] == min(runs)
        assert len(runs) == rep["repeat"] or sum(runs) >= rep["repeat_budget"]
