"""chunk_gdn_round's gate gradient at fast decays against a float64 per-token truth (Triton interpreter, float32).

At a per-token log decay of -20 the true dg is O(exp(-20)) while fla's dg identity sums O(1) terms that
cancel exactly; chunk_gdn_round forms dg without them (harts.kernels.gdn_round.gdn_round_bwd_kernel_dqkwg).
"""
import pytest

from benchmarks.gdn_gate_grad import GRAD_NAMES, errors, make_inputs, run_impl


@pytest.mark.parametrize("chunk_size,log_decay", [(16, -20.0), (64, -20.0), (32, -3.0), (32, -0.05)])
def test_chunk_gdn_round_gate_gradient_matches_float64_truth(chunk_size, log_decay):
    import torch

    inp = make_inputs(T=80, H=2, HV=4, K=16, V=32, log_decay=log_decay, seed=1)
    truth = run_impl("truth", inp, torch.device("cpu"), torch.float64, chunk_size)
    err = errors(run_impl("gdn_round", inp, torch.device("cpu"), torch.float32, chunk_size), truth)
    # float32 rounding of chunk-cumulative log decays (|g| * chunk_size * 2**-24 relative) bounds dg's error
    assert err["g"]["rel"] < max(1e-4, 4 * abs(log_decay) * chunk_size * 2.0 ** -24), err["g"]
    for n in GRAD_NAMES:
        if n != "g":
            assert err[n]["rel"] < 1e-5, (n, err[n])
