"""Tree-path short convolution: reference vs per-trajectory conv1d, and fla's varlen causal_conv1d with
ancestor windows (interpreted on CPU in fp32, compiled on the GPU) vs the reference, values and gradients."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harts.ops.tree_conv import tree_short_conv, tree_short_conv_reference
from harts.runtime import pack
from tests.helpers import fork_tree


def _batch(B=4, seed=0):
    return pack(fork_tree(B, np.random.default_rng(seed)), chunk_size=B)


def test_reference_equals_per_trajectory_conv1d():
    b = _batch()
    C, P, W = b.num_rows, 6, 4
    g = torch.Generator().manual_seed(1)
    x = torch.randn(C, P, generator=g, dtype=torch.float64)
    w = torch.randn(P, W, generator=g, dtype=torch.float64)
    y = tree_short_conv_reference(x, w, b.conv_pred)
    # Independent: expand each trajectory's rows, convolve it alone, compare row by row.
    o = b.logprob_offsets
    for i in range(b.num_trajectories):
        rows = b.logprob_rows[o[i]:o[i + 1]]  # rows of positions 0..L-2 of trajectory i
        if rows.shape[0] == 0:
            continue
        xs = x[rows].T[None]
        ref = F.silu(F.conv1d(xs, w[:, None, :], padding=W - 1, groups=P)[0, :, : rows.shape[0]].T)
        torch.testing.assert_close(y[rows], ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 3])
def test_fla_varlen_with_ancestor_windows_matches_reference(seed):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    b = _batch(seed=seed).to(dev)
    C, P, W = b.num_rows, 16, 4
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(C, P, generator=g).to(dev).requires_grad_(True)
    w = torch.randn(P, W, generator=g).to(dev).requires_grad_(True)
    if dev == "cuda":
        y = tree_short_conv(x, w, b.conv_pred, seq_cu=b.conv_cu_seqlens, context=b.conv_context, backend="fast")
    else:
        y = _fast_cpu(x, w, b)
    gy = torch.randn(y.shape, generator=g).to(dev)
    gx, gw = torch.autograd.grad((y * gy).sum(), (x, w))
    y_ref = tree_short_conv_reference(x, w, b.conv_pred)
    gx_ref, gw_ref = torch.autograd.grad((y_ref * gy).sum(), (x, w))
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-4, atol=1e-4)


def _fast_cpu(x, w, b):
    """The fast path's code under the Triton interpreter (backend resolution would pick the reference on CPU)."""
    from harts.ops.tree_conv.fast import tree_short_conv_fast

    return tree_short_conv_fast(x, w, b.conv_cu_seqlens, b.conv_context)
