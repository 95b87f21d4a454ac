"""benchmarks.kernels' comparisons on CPU (float32, small shapes; the tree convolution under the Triton
interpreter): the code paths of ``--only conv`` and ``--only experts`` run, every variant is timed and they agree.
Not measurements."""
import torch

from benchmarks.kernels import bench_experts, bench_tree_conv


def test_tree_conv_comparison_runs_and_implementations_agree():
    (r,) = bench_tree_conv(C=200, Q=3, widths=(16,), reps=1, device="cpu")
    from harts.ops.tree_conv import fast

    for impl in fast._IMPLS:
        assert r[f"tree {impl} fwd+bwd ms"] > 0
    assert r["trajectory-wise fwd ms"] > 0
    assert r["tree harts fwd+bwd ms"] > 0 and r["trajectory-wise harts fwd+bwd ms"] > 0  # kernel choice conv="harts"
    assert r["max_rel_diff"] < 1e-6
    assert fast.IMPL == "split_chunks"  # the benchmark leaves the module's choice as it found it


def test_experts_comparison_runs_and_the_stacked_weights_give_the_same_output(monkeypatch):
    """The stacked gate/up variant computes what the model's experts compute (``_grouped_swiglu``, itself tested
    against the per-expert reference in tests/test_ops_moe.py): the same output up to float32 rounding. The
    ``stacked`` variant is the torch ops whatever the default kernel choice: only ``stacked fused`` calls the op."""
    import inspect

    import harts.kernels.moe_swiglu as moe_swiglu

    op, callers = moe_swiglu.moe_swiglu_down, []

    def spy(*args):
        callers.append(inspect.stack()[1].function)
        return op(*args)

    monkeypatch.setattr(moe_swiglu, "moe_swiglu_down", spy, raising=False)
    (r,) = bench_experts(T=64, K=4, D=32, F=16, E=4, reps=1, device="cpu", dtype=torch.float32)
    assert callers and set(callers) == {"stacked_fused"}
    assert r["eager separate fwd+bwd ms"] > 0 and r["eager stacked fwd+bwd ms"] > 0
    assert r["max_abs_diff"] < 1e-5 and r["stacked fused vs stacked max_abs_diff"] < 1e-5  # (interpreted)
    assert r["eager stacked fused fwd+bwd ms"] > 0
    for name in ("separate", "stacked"):  # the GEMMs alone, and what the SwiGLU adds on top of them
        assert r[f"GEMMs alone {name} fwd+bwd ms"] > 0
        assert r[f"eager {name} elementwise ms"] == r[f"eager {name} fwd+bwd ms"] - r[f"GEMMs alone {name} fwd+bwd ms"]
    assert (r["eager stacked fused elementwise ms"]
            == r["eager stacked fused fwd+bwd ms"] - r["GEMMs alone stacked fwd+bwd ms"])
