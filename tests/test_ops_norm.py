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
    fast = ((lambda x, g, w: gated_rms_norm(x, g, w, 1e-6, "fast")) if gated
            else (lambda x, w: rms_norm(x, w, 1e-6, "fast")))
    ref = ((lambda x, g, w: gated_rms_norm_reference(x, g, w, 1e-6)) if gated
           else (lambda x, w: rms_norm_reference(x, w, 1e-6)))
    for a, b in zip(_grads(fast, x, g, w, gated), _grads(ref, x, g, w, gated)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(CUDA, reason="interpreter case; on CUDA the gpu-marked tests below run the compiled launchers")
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
    fast = ((lambda x, g, w: gated_rms_norm(x, g, w, 1e-6, "fast")) if gated
            else (lambda x, w: rms_norm(x, w, 1e-6, "fast")))
    ref = ((lambda x, g, w: gated_rms_norm_reference(x, g, w, 1e-6)) if gated
           else (lambda x, w: rms_norm_reference(x, w, 1e-6)))
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
    for name, a, b, c in zip(("y", "dx", "dg" if gated else "dw", "dw"), _grads(fast, x, g, w, gated),
                             _grads(ref, x, g, w, gated), _grads(ref, x.float(), g.float(), w.float(), gated)):
        e, floor = rel(a, c), rel(b, c)
        print(f"{'gated ' if gated else ''}{name}: fused vs fp32 {e:.2e} (torch bf16 vs fp32 {floor:.2e})")
        assert e < 2 * floor + 1e-3, (name, e, floor)


# ---- bucketed launchers (harts.ops.norm.fast): few NB / BS values, same kernels ----

def test_bucketed_nb_and_rows_per_program_take_few_values():
    import triton

    from harts.ops.norm.fast import _round_bs, bucket_nb

    nbs = {bucket_nb(triton.cdiv(T, 2048)) for T in range(1, 65537)}
    assert len(nbs) <= 7 and all(b & (b - 1) == 0 for b in nbs)
    assert all(bucket_nb(nb) >= nb and bucket_nb(nb) & (bucket_nb(nb) - 1) == 0 for nb in range(1, 600))
    bss = range(1, triton.cdiv(65536, 132) + 1)  # fla's rows per program on the H200's 132 SMs
    blocked, per_row = {_round_bs(bs, 32) for bs in bss}, {_round_bs(bs, None) for bs in bss}
    assert len(blocked) <= 16 and len(per_row) <= 31, (len(blocked), len(per_row))
    for bs in bss:  # blocked: as many BT tiles per program; per row: never more rows, under 20% fewer
        assert all(triton.cdiv(_round_bs(bs, 32), bt) == triton.cdiv(bs, bt) for bt in (32, 64))
        assert bs >= _round_bs(bs, None) > 0.8 * bs


@pytest.fixture
def eight_sms(monkeypatch):
    """The interpreter reports one SM (one backward program); pretend eight, so the backward splits rows
    over several programs and sums their dw partials."""
    import harts.ops.norm.fast as fast

    monkeypatch.setattr(fast, "get_multiprocessor_count", lambda index=None: 8)
    return fast


@pytest.mark.skipif(CUDA, reason="interpreter case; on CUDA the gpu-marked tests below run the compiled launchers")
@pytest.mark.parametrize("gated", [False, True])
def test_bucketed_launchers_match_reference_interpreter_fp32(gated, eight_sms, monkeypatch):
    """Row counts in two NB buckets (the gated divisor shrunk to 64 rows, as 2x65536 rows are too slow
    interpreted), the blocked kernels (D=48) and the per-row ones (D=520)."""
    fast = eight_sms
    monkeypatch.setattr(fast, "GATED_ROWS_PER_NB", 64)
    rows_per_nb = 64 if gated else fast.LN_ROWS_PER_NB
    fn = ((lambda x, g, w: fast.gated_rms_norm_fast(x, g, w, 1e-6)) if gated
          else (lambda x, w: fast.rms_norm_fast(x, w, 1e-6)))
    ref = ((lambda x, g, w: gated_rms_norm_reference(x, g, w, 1e-6)) if gated
           else (lambda x, w: rms_norm_reference(x, w, 1e-6)))
    shapes = [(9, 4, 48), (100 if gated else 2100, 48), (100, 520)]
    assert len({fast._nb(s[0] * (s[1] if len(s) == 3 else 1), rows_per_nb) for s in shapes[:2]}) == 2
    for shape in shapes:
        x, g, w = _inputs(shape, torch.float32)
        for a, b in zip(_grads(fn, x, g, w, gated), _grads(ref, x, g, w, gated)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(CUDA, reason="interpreter case; on CUDA the gpu-marked tests below run the compiled launchers")
def test_bucketed_l2norm_matches_fla_interpreter_fp32(monkeypatch):
    from fla.modules.norm.l2norm import l2norm_bwd, l2norm_fwd

    import harts.ops.norm.fast as fast

    monkeypatch.setattr(fast, "L2_ROWS_PER_NB", 64)  # two buckets at interpreter sizes
    for shape in [(20, 2, 16), (50, 3, 16), (5, 600)]:
        x, dy, _ = _inputs(shape, torch.float32)
        y, rstd = fast.l2norm_fwd_bucketed(x)
        y_fla, rstd_fla = l2norm_fwd(x)
        assert y.shape == x.shape and rstd.shape == x.shape[:-1] and rstd.dtype == torch.float32
        torch.testing.assert_close(y, y_fla, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rstd, rstd_fla, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fast.l2norm_bwd_bucketed(y, rstd, dy), l2norm_bwd(y_fla, rstd_fla, dy),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_bucketed_rms_norm_compiles_once_per_size_class_gpu():
    """Three row counts in one NB bucket (cdiv(T, 2048) = 3, 4, 4 -> 4) and, on 132 SMs, one rows-per-program
    class (38, 50, 61 -> 64): after the first, fwd+bwd loads no Triton kernel (fla's own wrapper recompiles
    and re-autotunes at each new NB)."""
    import triton
    from triton import knobs

    from harts.ops.norm.fast import _programs, rms_norm_fast

    Ts, D = (5000, 6500, 8000), 512
    assert len({_programs(T, torch.device("cuda", 0), 32)[1] for T in Ts}) == 1, "pick Ts for this GPU's SM count"
    assert len({triton.next_power_of_2(triton.cdiv(T, 2048)) for T in Ts}) == 1
    w = torch.randn(D, device="cuda", dtype=torch.bfloat16)
    loads, prev = [], knobs.runtime.jit_post_compile_hook

    def hook(**kw):
        loads.append(kw["repr"])
        return prev(**kw) if prev is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        per_T = []
        for T in Ts:
            x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            n = len(loads)
            rms_norm_fast(x, w, 1e-6).backward(torch.randn(T, D, device="cuda", dtype=torch.bfloat16))
            torch.cuda.synchronize()
            per_T.append(loads[n:])
    finally:
        knobs.runtime.jit_post_compile_hook = prev
    assert per_T[1] == [] and per_T[2] == [], per_T[1:]
