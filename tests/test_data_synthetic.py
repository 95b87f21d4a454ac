"""Synthetic workloads: determinism, shape, and the swe-step calibration ranges (paper Tables 2 and 4)."""
import numpy as np
import pytest

from harts.data import build_trie
from harts.data.stats import format_stats, workload_stats
from harts.data.synthetic import PRESETS, generate
from harts.data.synthetic import main as synthetic_main


@pytest.mark.parametrize("preset", ["tiny", "swe-small"])
def test_small_presets_are_deterministic_trees(preset):
    a, b = generate(preset, seed=3), generate(preset, seed=3)
    assert len(a) == len(b) and all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))
    trie = build_trie(a)
    trie.validate(a)
    assert trie.compression > 1.5  # real sharing
    assert trie.num_trees >= 2  # several trees per step
    assert (trie.num_children > 1).sum() > 0  # forks
    for t in a:
        assert t.loss_mask is not None and t.loss_mask.shape == t.tokens.shape
        assert t.loss_mask[0] == 0  # the prompt is not trained on
        assert t.tokens.max() < PRESETS[preset].vocab_size
    # group id = tree: trajectories of one group share their first token (the prompt).
    firsts = {}
    for t in a:
        firsts.setdefault(t.group_id, set()).add(int(t.tokens[0]))
    assert all(len(v) == 1 for v in firsts.values())


def test_scale_shrinks_the_step_not_the_trees():
    full = build_trie(generate("swe-small", seed=1, scale=4.0))
    small = build_trie(generate("swe-small", seed=1, scale=1.0))
    assert full.num_trees > 2 * small.num_trees
    ratio = np.median(np.bincount(full.tree_of_row)) / np.median(np.bincount(small.tree_of_row))
    assert 0.5 < ratio < 2.0


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 7])
def test_swe_step_lands_in_calibration_ranges(seed):
    batch = generate("swe-step", seed=seed, metadata=False)
    trie = build_trie(batch)
    paths, raw = len(batch), trie.num_positions
    assert 1300 <= paths <= 2400
    assert 35e6 <= raw <= 60e6
    assert 20e3 <= raw / paths <= 35e3
    assert 5.5 <= trie.compression <= 7.5
    assert int(trie.lengths.max()) <= 60000  # every trajectory fits the 65,536-token capacity
    # Trees are mostly comparable to the 65,536-token microbatch capacity.
    assert 0.5 * 65536 <= np.median(np.bincount(trie.tree_of_row)) <= 2 * 65536


def test_cli_and_stats(tmp_path, capsys):
    out = tmp_path / "w.jsonl"
    assert synthetic_main(["--preset", "tiny", "--seed", "0", "--out", str(out)]) == 0
    from harts.data.stats import main as stats_main

    assert stats_main([str(out), "--chunk-size", "16"]) == 0
    text = capsys.readouterr().out
    for key in ("paths", "raw tokens", "compact tokens", "compression", "trees", "fan-out", "fork position mod 16"):
        assert key in text
    s = workload_stats(build_trie(generate("tiny", seed=0)), 16)
    assert int(s["fork_mod"].sum()) == int((build_trie(generate("tiny", seed=0)).num_children > 1).sum())
    assert "compression" in format_stats(s, 16)
