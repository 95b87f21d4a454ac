"""KDA core: the chunkwise reference against fla's naive recurrence (float64), and fla's chunk_kda.

fla's ``naive_recurrent_kda`` hard-casts to ``torch.float``; to run the *same* recurrence in float64 we
hand it a torch proxy whose ``float`` is float64 (everything else is torch itself).
"""
import types

import pytest
import torch

from harts.ops.kda import kda, kda_chunk_reference, kda_gate_reference


class _TorchF64(types.ModuleType):
    float = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def naive_kda_f64(q, k, v, g, beta, h0, scale):
    import fla.ops.kda.naive as naive

    orig = naive.torch
    naive.torch = _TorchF64("torch_f64")
    try:
        return naive.naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True)
    finally:
        naive.torch = orig


def _inputs(lens, H=2, K=8, V=6, dtype=torch.float64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    T, N = sum(lens), len(lens)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype).to(device)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=device)
    return dict(q=r(T, H, K), k=r(T, H, K), v=r(T, H, V), f=r(T, H, K) * 2,
                beta=torch.rand(T, H, generator=g, dtype=dtype).to(device), A_log=r(H) * 0.5 + 1.0,
                dt_bias=r(H * K) * 0.3, cu=cu, h0=r(N, H, K, V))


def _oracle(x, lower_bound):
    """Per sequence: gate and l2norm in float64 (as the kernels do), then fla's naive recurrence."""
    from harts.ops.kda.reference import l2norm

    g = kda_gate_reference(x["f"], x["A_log"], x["dt_bias"], lower_bound)
    q, k = l2norm(x["q"]), l2norm(x["k"])
    K = q.shape[-1]
    cu = x["cu"].tolist()
    os_, hs = [], []
    for n in range(len(cu) - 1):
        s = slice(cu[n], cu[n + 1])
        o, h = naive_kda_f64(q[s][None], k[s][None], x["v"][s][None], g[s][None], x["beta"][s][None],
                             x["h0"][n:n + 1], K ** -0.5)
        os_.append(o[0])
        hs.append(h[0])
    return torch.cat(os_), torch.stack(hs)


@pytest.mark.parametrize("chunk_size,lens", [(16, [37, 16, 1, 50]), (64, [130, 7]), (4, [9, 4, 13])])
def test_reference_matches_naive_recurrence_float64(chunk_size, lens):
    x = _inputs(lens)
    o, h = kda_chunk_reference(x["q"], x["k"], x["v"], x["f"], x["beta"], x["A_log"], x["dt_bias"], x["cu"],
                               lower_bound=-5.0, chunk_size=chunk_size, initial_state_NHKV=x["h0"],
                               output_final_state=True)
    o_ref, h_ref = _oracle(x, -5.0)
    assert o.dtype == torch.float64
    assert (o - o_ref).abs().max().item() <= 1e-10
    assert (h - h_ref).abs().max().item() <= 1e-10


def test_gate_matches_fla_lowerbound_gate():
    from fla.ops.kda.gate import naive_kda_lowerbound_gate

    x = _inputs([20], dtype=torch.float32)
    ours = kda_gate_reference(x["f"], x["A_log"], x["dt_bias"], -5.0)
    theirs = naive_kda_lowerbound_gate(x["f"][None], x["A_log"], x["dt_bias"], lower_bound=-5.0)[0]
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=1e-6, atol=1e-6)
    assert ours.min() > -5.0 and ours.max() < 0


def test_reference_gradients_match_recurrence():
    x = _inputs([21, 11], H=1, K=4, V=3)
    leaves = {k: x[k].clone().requires_grad_(True) for k in ("q", "k", "v", "f", "beta", "h0")}
    y = {**x, **leaves}
    o, h = kda_chunk_reference(y["q"], y["k"], y["v"], y["f"], y["beta"], y["A_log"], y["dt_bias"], y["cu"],
                               chunk_size=8, initial_state_NHKV=y["h0"], output_final_state=True)
    ga = torch.autograd.grad(o.sum() + h.square().sum(), list(leaves.values()))
    o2, h2 = _oracle(y, -5.0)
    gb = torch.autograd.grad(o2.sum() + h2.square().sum(), list(leaves.values()))
    for a, b in zip(ga, gb):
        assert (a - b).abs().max().item() <= 1e-9


def test_bad_inputs_are_named():
    x = _inputs([5, 5])
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda_chunk_reference(x["q"], x["k"], x["v"], x["f"], x["beta"], x["A_log"], x["dt_bias"],
                            torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="initial_state"):
        kda_chunk_reference(x["q"], x["k"], x["v"], x["f"], x["beta"], x["A_log"], x["dt_bias"], x["cu"],
                            initial_state_NHKV=x["h0"][:1])


def test_fla_chunk_kda_call_matches_reference_interpreted(fla_interpreter_patches):
    """Our fla call (gate in the kernel, safe gate, the q/k L2 norm through our bucketed launcher just
    before) under the Triton interpreter, fp32, small shape: against the float64 reference, and bit for bit
    against fla's own call with the L2 norm inside (``use_qk_l2norm_in_kernel``), gradients included.

    The safe-gate sub-chunk kernel reads the chunk's first gate row via ``tl.gather`` when the platform
    supports it; the interpreter cannot, so the test selects fla's equivalent plain-load branch (and 'ieee'
    dots; the fla_interpreter_patches fixture)."""
    if torch.cuda.is_available():
        pytest.skip("interpreter test; the GPU test covers the compiled kernel")
    from harts.ops.kda.fast import kda_fast

    names = ("q", "k", "v", "f", "beta", "A_log", "dt_bias", "h0")
    x = _inputs([40, 24], H=2, K=16, V=16, dtype=torch.float32)
    leaves = [x[n].clone().requires_grad_(True) for n in names]
    d = dict(zip(names, leaves))
    o, h = kda_fast(d["q"], d["k"], d["v"], d["f"], d["beta"], d["A_log"], d["dt_bias"], x["cu"],
                    chunk_size=32, initial_state_NHKV=d["h0"], output_final_state=True)
    l64 = [x[n].double().clone().requires_grad_(True) for n in names]
    e = dict(zip(names, l64))
    o_ref, h_ref = kda_chunk_reference(e["q"], e["k"], e["v"], e["f"], e["beta"], e["A_log"], e["dt_bias"], x["cu"],
                                       chunk_size=32, initial_state_NHKV=e["h0"], output_final_state=True)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h.double(), h_ref, rtol=1e-4, atol=1e-4)
    # every gradient, the gate parameters and beta included (the GPU test compared only q, k, v, f before)
    gen = torch.Generator().manual_seed(5)
    do, dh = torch.randn(o.shape, generator=gen), torch.randn(h.shape, generator=gen)
    g_fast = torch.autograd.grad((o * do).sum() + (h * dh).sum(), leaves)
    g_ref = torch.autograd.grad((o_ref * do.double()).sum() + (h_ref * dh.double()).sum(), l64)
    for n, a, b in zip(names, g_fast, g_ref):
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-4, n

    from fla.ops.kda import chunk_kda

    l_fla = [x[n].clone().requires_grad_(True) for n in names]
    f = dict(zip(names, l_fla))
    o_fla, h_fla = chunk_kda(q=f["q"][None], k=f["k"][None], v=f["v"][None], g=f["f"][None], beta=f["beta"][None],
                             initial_state=f["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                             use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, cu_seqlens=x["cu"].long(),
                             A_log=f["A_log"], dt_bias=f["dt_bias"], chunk_size=32)
    assert torch.equal(o, o_fla[0]) and torch.equal(h, h_fla)
    g_fla = torch.autograd.grad((o_fla[0] * do).sum() + (h_fla * dh).sum(), l_fla)
    for n, a, b in zip(names, g_fast, g_fla):
        assert torch.equal(a, b), n


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 8])
def test_chunk_kda_gpu_matches_reference_bf16(H):
    """H, K, V as in ling3-tiny (fla compiles and autotunes per shape family, the benchmark reuses it), and
    H = 8: one rank's heads under TP2, a shape whose A_log gradient once came out halved on the GPU. Gradients of
    every input, the gate parameters (A_log, dt_bias) and beta included."""
    x = _inputs([1000, 64, 3, 700], H=H, K=128, V=128, dtype=torch.float32, device="cuda")
    bf = {k: (v.bfloat16() if v.is_floating_point() and k not in ("A_log", "dt_bias", "h0") else v)
          for k, v in x.items()}
    names = ("q", "k", "v", "f", "beta", "A_log", "dt_bias")
    leaves = [bf[k].requires_grad_(True) for k in names]
    o, h = kda(bf["q"], bf["k"], bf["v"], bf["f"], bf["beta"], bf["A_log"], bf["dt_bias"], bf["cu"],
               chunk_size=64, initial_state_NHKV=bf["h0"], output_final_state=True, backend="fast")
    do = torch.randn_like(o)
    g_fast = torch.autograd.grad((o * do).sum(), leaves)
    x64 = {k: (bf[k].detach().double() if bf[k].is_floating_point() else bf[k]) for k in bf}
    l64 = [x64[k].requires_grad_(True) for k in names]
    o_ref, h_ref = kda(x64["q"], x64["k"], x64["v"], x64["f"], x64["beta"], x64["A_log"], x64["dt_bias"], x64["cu"],
                       chunk_size=64, initial_state_NHKV=x64["h0"], output_final_state=True, backend="reference")
    g_ref = torch.autograd.grad((o_ref * do.double()).sum(), l64)

    def rel(a, b):  # fla's tests use relative RMSE-style checks; bf16 inputs give ~1e-2
        return ((a.double() - b).norm() / b.norm()).item()

    assert rel(o, o_ref) < 2e-2
    assert rel(h, h_ref) < 2e-2
    errs = {n: rel(a, b) for n, a, b in zip(names, g_fast, g_ref)}
    print(f"H={H} gradient rel. error vs float64:", {n: f"{e:.2e}" for n, e in errs.items()})
    assert all(e < 5e-2 for e in errs.values()), errs
