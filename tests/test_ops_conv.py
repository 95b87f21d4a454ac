"""Packed causal short convolution vs per-sequence nn.functional.conv1d, and fla's causal_conv1d."""
import pytest
import torch
import torch.nn.functional as F

from harts.ops.conv import short_conv, short_conv_reference


def per_sequence_conv1d(x, w, cu, act=True):
    out = []
    C, W = w.shape
    for n in range(len(cu) - 1):
        xs = x[cu[n]:cu[n + 1]].T[None]  # [1, C, L]
        y = F.conv1d(xs, w[:, None, :], padding=W - 1, groups=C)[0, :, : xs.shape[-1]].T
        out.append(F.silu(y) if act else y)
    return torch.cat(out)


def _inputs(lens, C=6, W=4, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(0)
    T = sum(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=device)
    return (torch.randn(T, C, generator=g).to(device, dtype), torch.randn(C, W, generator=g).to(device, dtype), cu)


@pytest.mark.parametrize("lens", [[10], [1, 3, 7, 2], [4, 4]])
def test_reference_matches_conv1d(lens):
    x, w, cu = _inputs(lens)
    torch.testing.assert_close(short_conv_reference(x, w, cu), per_sequence_conv1d(x, w, cu.tolist()),
                               rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(short_conv_reference(x, w, cu, activation=None),
                               per_sequence_conv1d(x, w, cu.tolist(), act=False), rtol=1e-13, atol=1e-13)


def test_fla_causal_conv1d_interpreted():
    if torch.cuda.is_available():
        pytest.skip("interpreter test; the GPU test covers the compiled kernel")
    import harts.ops
    from harts.ops.conv.fast import short_conv_fast

    x, w, cu = _inputs([5, 11, 3], C=16, dtype=torch.float32)
    with harts.ops.use_kernel_choices(conv="fla"):
        torch.testing.assert_close(short_conv_fast(x, w, cu), short_conv_reference(x, w, cu), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_fast_matches_reference_gpu():
    x, w, cu = _inputs([300, 1, 77, 1000], C=256, dtype=torch.bfloat16, device="cuda")
    x.requires_grad_(True)
    y = short_conv(x, w, cu, backend="fast")
    gy = torch.randn_like(y)
    (gx,) = torch.autograd.grad((y * gy).sum(), x)
    xf = x.detach().float().requires_grad_(True)
    y_ref = short_conv_reference(xf, w.float(), cu)
    (gx_ref,) = torch.autograd.grad((y_ref * gy.float()).sum(), xf)
    torch.testing.assert_close(y.float(), y_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gx.float(), gx_ref, rtol=3e-2, atol=3e-2)
