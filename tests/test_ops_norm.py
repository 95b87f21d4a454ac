"""RMSNorm / gated RMSNorm: fla's fused kernels (under the Triton interpreter on CPU, compiled on the GPU)
against the torch reference, which is itself checked against a float64 formula written here."""
import pytest
import torch

from harts.ops.norm import gated_rms_norm, gated_rms_norm_reference, rms_norm, rms_norm_reference

CUDA = torch.cuda.is_available()


def formula(x, w, eps, g=None):
    x = x.double()
    y = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) * w.double()
    return y if g is None else y * torch.sigmoid(g.double())


def _inputs(shape, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(device, dtype)
    return r(*shape), r(*shape), (1 + 0.1 * r(shape[-1]))


def test_reference_matches_formula_float64():
    x, g, w = _inputs((7, 3, 40), torch.float64)
    torch.testing.assert_close(rms_norm_reference(x, w, 1e-6), formula(x, w, 1e-6), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gated_rms_norm_reference(x, g, w, 1e-6), formula(x, w, 1e-6, g), rtol=1e-12,
                               atol=1e-12)


def test_auto_on_cpu_is_reference():
    x, g, w = _inputs((5, 16), torch.float32)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
    assert torch.equal(gated_rms_norm(x, g, w, 1e-6), gated_rms_norm_reference(x, g, w, 1e-6))


def _grads(fn, x, g, w, gated):
    leaves = [t.detach().clone().requires_grad_(True) for t in ((x, g, w) if gated else (x, w))]
    y = fn(*leaves)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(y)
    return (y.detach(), *torch.autograd.grad((y * dy).sum(), leaves))


@pytest.mark.skipif(CUDA, reason="interpreter case; the GPU runs the compiled kernels below")
@pytest.mark.parametrize("gated", [False, True])
def test_fast_matches_reference_interpreter_fp32(gated):
    x, g, w = _inputs((9, 4, 48), torch.float32)  # leading dims flattened by the kernels; D not a power of 2
    fast = (lambda x, g, w: gated_rms_norm(x, g, w, 1e-6, "fast")) if gated else (lambda x, w: rms_norm(x, w, 1e-6, "fast"))
    ref = (lambda x, g, w: gated_rms_norm_reference(x, g, w, 1e-6)) if gated else (lambda x, w: rms_norm_reference(x, w, 1e-6))
    for a, b in zip(_grads(fast, x, g, w, gated), _grads(ref, x, g, w, gated)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(CUDA, reason="interpreter case")
def test_fast_on_a_column_slice_interpreter():
    """MLA normalises a column slice of the kv_a output (row stride > width): the fused path must not read
    across rows."""
    full = torch.randn(11, 48 + 16, generator=torch.Generator().manual_seed(4))
    x, w = full[:, :48], torch.randn(48, generator=torch.Generator().manual_seed(5))
    assert not x.is_contiguous()
    torch.testing.assert_close(rms_norm(x, w, 1e-6, "fast"), rms_norm_reference(x, w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
def test_fast_matches_reference_gpu_bf16(gated):
    """Ling-3.0-tiny widths: 1536 (residual stream) and 128 per KDA head (gated)."""
    shape = (4096, 16, 128) if gated else (4096, 1536)
    x, g, w = _inputs(shape, torch.bfloat16, "cuda")
    fast = (lambda x, g, w: gated_rms_norm(x, g, w, 1e-6, "fast")) if gated else (lambda x, w: rms_norm(x, w, 1e-6, "fast"))
    ref = (lambda x, g, w: gated_rms_norm_reference(x, g, w, 1e-6)) if gated else (lambda x, w: rms_norm_reference(x, w, 1e-6))
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
    for name, a, b, c in zip(("y", "dx", "dg" if gated else "dw", "dw"), _grads(fast, x, g, w, gated),
                             _grads(ref, x, g, w, gated), _grads(ref, x.float(), g.float(), w.float(), gated)):
        e, floor = rel(a, c), rel(b, c)
        print(f"{'gated ' if gated else ''}{name}: fused vs fp32 {e:.2e} (torch bf16 vs fp32 {floor:.2e})")
        assert e < 2 * floor + 1e-3, (name, e, floor)
