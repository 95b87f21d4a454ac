"""benchmarks.kernels' tree-convolution comparison on CPU (the Triton interpreter in float32, small shapes): the
code path of ``--only conv`` runs, every implementation is timed and they agree. Not a measurement."""
from benchmarks.kernels import bench_tree_conv


def test_tree_conv_comparison_runs_and_implementations_agree():
    (r,) = bench_tree_conv(C=200, Q=3, widths=(16,), reps=1, device="cpu")
    from harts.ops.tree_conv import fast

    for impl in fast._IMPLS:
        assert r[f"tree {impl} fwd+bwd ms"] > 0
    assert r["trajectory-wise fwd ms"] > 0
    assert r["max_rel_diff"] < 1e-6
    assert fast.IMPL == "split_chunks"  # the benchmark leaves the module's choice as it found it
