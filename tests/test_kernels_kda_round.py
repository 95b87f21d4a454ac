"""chunk_kda_round: boundary states and their gradients.

Oracles: fla's ``naive_recurrent_kda`` run per sequence and per prefix (a boundary state is the final
state of the prefix that ends at it), a float64 per-token loop written here, and fla's ``chunk_kda``
for rounds without requests. The loss is L = <o, do> + <S_T, dS_T> + sum_j <B_j, dB_j>.
CPU runs the Triton kernels under the interpreter in float32 on a few small cases; the bf16 /
K = 64, 128 / speed-shaped checks are GPU tests.
"""
import functools

import pytest
import torch
import torch.nn.functional as F

from harts.ops.kda_round import chunk_kda_round_reference

CUDA = torch.cuda.is_available()


def rel_rmse(x, y):
    """fla's get_err_ratio: relative RMSE."""
    x, y = x.double(), y.double()
    return ((x - y).square().mean().sqrt() / y.square().mean().sqrt().clamp_min(1e-30)).item()


def make_inputs(lens, H, HV, K, V, dtype=torch.float32, h0=True, seed=0, device="cpu", raw_gate=False):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.long)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)
    q, k = r(1, T, H, K), r(1, T, H, K)
    if not raw_gate:  # fla's tests: normalised keys, logsigmoid gates
        q, k = q, F.normalize(k, dim=-1)
        g = F.logsigmoid(r(1, T, HV, K))
    else:
        g = r(1, T, HV, K)
    v, beta = r(1, T, HV, V), torch.rand(1, T, HV, generator=gen, dtype=torch.float64)
    ins = dict(q=q, k=k, v=v, g=g, beta=beta)
    ins = {n: x.to(dtype).to(device) for n, x in ins.items()}
    ins["g"] = ins["g"].float() if dtype != torch.float64 else ins["g"]
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    init = r(len(lens), HV, K, V).to(state_dtype).to(device) if h0 else None
    return ins, cu.to(device), init


def run_with_grads(fn, ins, cu, init, seq, chunk, seed=1, **kw):
    """Run fn, backprop L = <o,do> + <S_T,dS_T> + sum_j <B_j,dB_j>, return outputs and grads."""
    leaves = {n: x.detach().clone().requires_grad_() for n, x in ins.items()}
    h0 = init.detach().clone().requires_grad_() if init is not None else None
    extra = {n: kw.pop(n).detach().clone().requires_grad_() for n in ("A_log", "dt_bias") if n in kw}
    o, ht, B = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], cu, initial_state=h0,
                  output_final_state=True, state_seq=seq, state_chunk=chunk, **extra, **kw)
    gen = torch.Generator().manual_seed(seed)

    def rnd(x):
        return torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.device, x.dtype)
    loss = (o * rnd(o)).sum() + (ht * rnd(ht)).sum()
    if B is not None:
        loss = loss + (B * rnd(B)).sum()
    loss.backward()
    out = {"o": o, "ht": ht, "B": B}
    grads = {f"d{n}": x.grad for n, x in {**leaves, **extra}.items()}
    if h0 is not None:
        grads["dh0"] = h0.grad
    return out, grads


# ----------------------------------------------------------------------------------------------
# Reference path (pure torch): checked against independent oracles
# ----------------------------------------------------------------------------------------------

def loop_oracle_f64(q, k, v, g, beta, cu, h0, requests, BT, scale):
    """Per-sequence, per-token float64 loop (no padding, no vectorisation across sequences)."""
    H, HV = q.shape[2], v.shape[2]
    outs, finals, states = [], [], {}
    for n in range(len(cu) - 1):
        S = h0[n].clone() if h0 is not None else torch.zeros(HV, q.shape[3], v.shape[3], dtype=torch.float64)
        for t, i in enumerate(range(int(cu[n]), int(cu[n + 1]))):
            if t % BT == 0:
                states[n, t // BT] = S
            for hv in range(HV):
                kk, qq = k[0, i, hv // (HV // H)], q[0, i, hv // (HV // H)] * scale
                Sh = S[hv] * g[0, i, hv].exp()[:, None]
                Sh = Sh + beta[0, i, hv] * torch.outer(kk, v[0, i, hv] - kk @ Sh)
                S = torch.cat([S[:hv], Sh[None], S[hv + 1:]])
                outs.append(qq @ Sh)
        states[n, -(-(int(cu[n + 1]) - int(cu[n])) // BT)] = S
        finals.append(S)
    HVV = v.shape[2]
    o = torch.stack(outs).view(1, -1, HVV, v.shape[3])
    return o, torch.stack(finals), torch.stack([states[r] for r in requests])


def test_reference_float64_matches_loop_oracle():
    lens, BT = [37, 32, 5, 50], 16
    ins, cu, h0 = make_inputs(lens, H=1, HV=2, K=8, V=4, dtype=torch.float64)
    req = [(0, 0), (0, 2), (0, 3), (1, 2), (2, 1), (3, 4), (3, 1)]
    seq, chunk = [r[0] for r in req], [r[1] for r in req]
    o, ht, B = chunk_kda_round_reference(**ins, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                                         state_seq=seq, state_chunk=chunk, chunk_size=BT)
    o2, ht2, B2 = loop_oracle_f64(**ins, cu=cu, h0=h0, requests=req, BT=BT, scale=8 ** -0.5)
    for a, b in ((o, o2), (ht, ht2), (B, B2)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_reference_grads_match_prefix_recompute_with_fla_naive():
    """Boundary-state gradients: each B_j equals the final state of a prefix run (fla's naive)."""
    from fla.ops.kda.naive import naive_recurrent_kda

    lens, BT = [40, 20], 16
    ins, cu, h0 = make_inputs(lens, H=1, HV=2, K=8, V=4)
    req = [(0, 1), (0, 3), (1, 0), (1, 2)]
    seq, chunk = [r[0] for r in req], [r[1] for r in req]
    _, grads = run_with_grads(lambda *a, **kw: chunk_kda_round_reference(*a, chunk_size=BT, **kw),
                              ins, cu, h0, seq, chunk)

    def prefix_fn(q, k, v, g, beta, cu_seqlens, initial_state, output_final_state, state_seq, state_chunk):
        o, finals, Bs = [], [], []
        for n in range(len(lens)):
            s, e = int(cu[n]), int(cu[n + 1])
            sl = (slice(None), slice(s, e))
            on, hn = naive_recurrent_kda(q[sl], k[sl], v[sl], g[sl], beta[sl], initial_state=initial_state[n:n + 1],
                                         output_final_state=True)
            o.append(on)
            finals.append(hn[0])
        for n, c in zip(state_seq, state_chunk):
            s, e = int(cu[n]), min(int(cu[n]) + c * BT, int(cu[n + 1]))
            if e == s:
                Bs.append(initial_state[n])
            else:
                sl = (slice(None), slice(s, e))
                Bs.append(naive_recurrent_kda(q[sl], k[sl], v[sl], g[sl], beta[sl],
                                              initial_state=initial_state[n:n + 1], output_final_state=True)[1][0])
        return torch.cat(o, 1), torch.stack(finals), torch.stack(Bs)
    _, grads2 = run_with_grads(prefix_fn, ins, cu, h0, seq, chunk)
    for n in grads:
        assert rel_rmse(grads[n], grads2[n]) < 1e-5, n


def _tree_case(fn, BT, dtype, device="cpu", H=1, HV=2, K=16, V=8):
    """Parent P (length 70) and two children forking inside the same chunk of P, vs flat sequences."""
    Lp, f1, f2, L1, L2 = 3 * BT + 22, 2 * BT + 5, 2 * BT + 8, 23, 9
    c = f1 // BT
    assert f2 // BT == c
    ins, _, _ = make_inputs([Lp + L1 + L2], H=H, HV=HV, K=K, V=V, dtype=dtype, h0=False, seed=3, device=device)
    leaves = {n: x.detach().clone().requires_grad_() for n, x in ins.items()}
    P = {n: x[:, :Lp] for n, x in leaves.items()}
    C1 = {n: x[:, Lp:Lp + L1] for n, x in leaves.items()}
    C2 = {n: x[:, Lp + L1:] for n, x in leaves.items()}
    gen = torch.Generator().manual_seed(7)
    doP = torch.randn(1, Lp, HV, V, generator=gen, dtype=torch.float64).to(device, dtype)
    do1 = torch.randn(1, L1, HV, V, generator=gen, dtype=torch.float64).to(device, dtype)
    do2 = torch.randn(1, L2, HV, V, generator=gen, dtype=torch.float64).to(device, dtype)

    def cat(*parts):
        return {n: torch.cat([p[n] for p in parts], 1) for n in leaves}

    def cu_of(*ls):
        return torch.tensor([0] + torch.tensor(ls).cumsum(0).tolist(), dtype=torch.long, device=device)

    def sl(d, a, b):
        return {n: x[:, a:b] for n, x in d.items()}
    # flat: P | P[:f1] C1 | P[:f2] C2
    flat = cat(P, sl(P, 0, f1), C1, sl(P, 0, f2), C2)
    o, _, _ = fn(**flat, cu_seqlens=cu_of(Lp, f1 + L1, f2 + L2))
    oP, o1, o2 = o[:, :Lp], o[:, Lp + f1:Lp + f1 + L1], o[:, Lp + f1 + L1 + f2:]
    loss = (oP * doP).sum() + (o1 * do1).sum() + (o2 * do2).sum()
    flat_grads = torch.autograd.grad(loss, list(leaves.values()))
    # two rounds: parent requests S_start(c); both children replay P[c*BT:f] from it
    oP_t, _, B = fn(**P, cu_seqlens=cu_of(Lp), state_seq=[0], state_chunk=[c])
    r1, r2 = f1 - c * BT, f2 - c * BT
    kids = cat(sl(P, c * BT, f1), C1, sl(P, c * BT, f2), C2)
    ok, _, _ = fn(**kids, cu_seqlens=cu_of(r1 + L1, r2 + L2), initial_state=B[[0, 0]])
    o1_t, o2_t = ok[:, r1:r1 + L1], ok[:, r1 + L1 + r2:]
    loss_t = (oP_t * doP).sum() + (o1_t * do1).sum() + (o2_t * do2).sum()
    tree_grads = torch.autograd.grad(loss_t, list(leaves.values()))
    return (oP, o1, o2, *flat_grads), (oP_t, o1_t, o2_t, *tree_grads)


def test_tree_two_rounds_equal_flat_reference_float64():
    flat, tree = _tree_case(lambda *a, **kw: chunk_kda_round_reference(*a, chunk_size=16, **kw), 16, torch.float64)
    for a, b in zip(flat, tree):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_bad_requests_are_named():
    ins, cu, h0 = make_inputs([20, 64], H=1, HV=1, K=8, V=4)
    with pytest.raises(ValueError, match="request 1: chunk 3 of sequence 0"):
        chunk_kda_round_reference(**ins, cu_seqlens=cu, state_seq=[0, 0], state_chunk=[0, 3], chunk_size=16)
    with pytest.raises(ValueError, match="requests 0 and 2 both ask for"):
        chunk_kda_round_reference(**ins, cu_seqlens=cu, state_seq=[1, 0, 1], state_chunk=[4, 0, 4], chunk_size=16)


# ----------------------------------------------------------------------------------------------
# Triton path (TRITON_INTERPRET=1 on CPU, float32): few small cases, each ~10 s in the interpreter
# ----------------------------------------------------------------------------------------------

def _fast(**fixed):
    from harts.ops.kda_round import chunk_kda_round

    return lambda *a, **kw: chunk_kda_round(*a, **fixed, **kw)


def _ref(**fixed):
    return lambda *a, **kw: chunk_kda_round_reference(*a, **fixed, **kw)


def _compare(out, grads, out_r, grads_r, tol_out, tol_grad):
    errs = {}
    for n in out:
        if out_r[n] is not None:
            errs[n] = rel_rmse(out[n], out_r[n])
    for n in grads_r:
        errs[n] = rel_rmse(grads[n], grads_r[n])
    bad = {n: e for n, e in errs.items() if not e <= (tol_out if n in out else tol_grad)}  # NaN is bad too
    return errs, bad


# lens: T mod 32 == 0 (64), != 0 (40), T < 32 (20); requests: chunk 0 with h0, interior, end states
INTERP_LENS, INTERP_BT = [40, 64, 20], 32
INTERP_REQ = [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (2, 1)]
GVA = dict(H=1, HV=2, K=32, V=16)  # the inputs of several interpreter tests (with h0, seed 0)


@functools.cache
def _gva_runs():
    """Interpreted Triton round and reference, outputs and gradients, on the GVA inputs with the INTERP_REQ
    requests: computed once (the interpreter takes seconds per run), only read by the tests."""
    ins, cu, h0 = make_inputs(INTERP_LENS, **GVA)
    seq, chunk = [r[0] for r in INTERP_REQ], [r[1] for r in INTERP_REQ]
    return (run_with_grads(_fast(chunk_size=INTERP_BT), ins, cu, h0, seq, chunk),
            run_with_grads(_ref(chunk_size=INTERP_BT), ins, cu, h0, seq, chunk))


@pytest.mark.skipif(CUDA, reason="interpreter case; the GPU runs the compiled variants below")
@pytest.mark.parametrize("H,HV,K,seed", [
    (1, 2, 32, 0),  # h0 with GVA
    (1, 1, 96, 7),  # the scans hold the state as two 64-row tiles, the second partly masked
], ids=["h0_gva", "several_state_row_tiles"])
def test_triton_interpreter_boundaries(H, HV, K, seed):
    if dict(H=H, HV=HV, K=K, V=16) == GVA and seed == 0:
        (out, grads), (out_r, grads_r) = _gva_runs()
    else:
        ins, cu, h0 = make_inputs(INTERP_LENS, H=H, HV=HV, K=K, V=16, seed=seed)
        seq, chunk = [r[0] for r in INTERP_REQ], [r[1] for r in INTERP_REQ]
        out, grads = run_with_grads(_fast(chunk_size=INTERP_BT), ins, cu, h0, seq, chunk)
        out_r, grads_r = run_with_grads(_ref(chunk_size=INTERP_BT), ins, cu, h0, seq, chunk)
    errs, bad = _compare(out, grads, out_r, grads_r, 1e-5, 1e-4)
    assert not bad, errs


@pytest.mark.skipif(CUDA, reason="interpreter case; the GPU runs the compiled variants below")
def test_host_copy_of_cu_seqlens_is_checked_and_changes_nothing():
    """``cu_seqlens_cpu`` (what the runtime passes to avoid a stream sync per call) must describe the same
    packing: one of the wrong shape (or not ending at T) is an error naming it; a correct one gives
    bit-identical results. Values are not compared with the device tensor: that would be the sync."""
    ins, cu, h0 = make_inputs(INTERP_LENS, **GVA)
    seq, chunk = [r[0] for r in INTERP_REQ], [r[1] for r in INTERP_REQ]
    a = _gva_runs()[0]
    b = run_with_grads(_fast(chunk_size=INTERP_BT, cu_seqlens_cpu=cu.clone()), ins, cu, h0, seq, chunk)
    for d_a, d_b in zip(a, b):
        for n in d_a:
            assert torch.equal(d_a[n], d_b[n]), n
    stale = cu.clone()
    stale[-1] -= 1
    for fn in (_fast, _ref):
        for bad in (cu[:-1].clone(), stale):
            with pytest.raises(ValueError, match="cu_seqlens_cpu"):
                fn(chunk_size=INTERP_BT, cu_seqlens_cpu=bad)(
                    ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"], cu, state_seq=seq, state_chunk=chunk)


@pytest.mark.skipif(CUDA, reason="interpreter case; the GPU runs the compiled variants below")
def test_triton_interpreter_gate_in_kernel_l2norm_no_h0():
    ins, cu, _ = make_inputs(INTERP_LENS, H=2, HV=2, K=32, V=16, raw_gate=True, seed=5)
    gen = torch.Generator().manual_seed(9)
    kw = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
              A_log=torch.rand(2, generator=gen).log(), dt_bias=torch.randn(64, generator=gen) * 0.1)
    seq, chunk = [0, 1, 2, 2], [0, 2, 0, 1]  # chunk 0 without h0 (a zero state) still gets a gradient path
    out, grads = run_with_grads(_fast(chunk_size=INTERP_BT), ins, cu, None, seq, chunk, **dict(kw))
    out_r, grads_r = run_with_grads(_ref(chunk_size=INTERP_BT), ins, cu, None, seq, chunk, **dict(kw))
    errs, bad = _compare(out, grads, out_r, grads_r, 1e-5, 1e-4)
    assert "dA_log" in errs and "ddt_bias" in errs
    assert not bad, errs


@pytest.mark.skipif(CUDA, reason="interpreter case; the GPU runs the compiled variants below")
def test_triton_interpreter_wrong_placement_fails():
    """Negative control: adding dB_c at the top of iteration c (gradient of S_end(c)) must be caught."""
    ins, cu, h0 = make_inputs(INTERP_LENS, **GVA)
    seq, chunk = [r[0] for r in INTERP_REQ], [r[1] for r in INTERP_REQ]
    out, grads = run_with_grads(_fast(chunk_size=INTERP_BT, _inject_at_top=True), ins, cu, h0, seq, chunk)
    out_r, grads_r = _gva_runs()[1]
    errs, bad = _compare(out, grads, out_r, grads_r, 1e-5, 1e-4)
    assert {"dk", "dv", "dg", "dbeta"} <= set(bad), errs
    assert min(errs[n] for n in ("dk", "dv", "dg")) > 0.05, errs


def test_out_of_the_wrong_shape_or_dtype_is_named():
    """``chunk_kda_round(out=)`` takes the [T, HV, V] rows of the caller's output in q's dtype, contiguous; anything
    else is refused before a kernel runs, naming what it got (no silent copy into a scratch tensor)."""
    from harts.ops.kda_round import chunk_kda_round

    ins, cu, h0 = make_inputs(INTERP_LENS, **GVA)
    T = sum(INTERP_LENS)
    strided = torch.empty(2, T, 16).transpose(0, 1)
    for bad in (torch.empty(T, 2, 8), torch.empty(T, 2, 16, dtype=torch.float64), strided):
        with pytest.raises(ValueError, match=r"out must be a contiguous \(124, 2, 16\)"):
            chunk_kda_round(ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"], cu, initial_state=h0,
                            chunk_size=INTERP_BT, out=bad)


@pytest.mark.skipif(CUDA, reason="interpreter case; the GPU runs the compiled variants below")
def test_triton_interpreter_output_needs_no_zero_fill(monkeypatch):
    """The round's output buffer is allocated unfilled (``chunk_fwd_o``: fla's output kernel without its wrapper's
    zero fill): with every unfilled allocation NaN from the start, outputs and gradients still match the
    reference, so every row is written (lengths 40, 64, 20 at chunk 32: partial last chunks, a sequence shorter
    than a chunk)."""
    import harts.ops.kda_round.chunk as chunk_mod

    empty_like = torch.empty_like
    filled = []

    def nan_empty_like(x, *a, **kw):
        out = empty_like(x, *a, **kw)
        if out.is_floating_point():
            out.fill_(float("nan"))
            filled.append(out.shape)
        return out

    monkeypatch.setattr(torch, "empty_like", nan_empty_like)
    ins, cu, h0 = make_inputs(INTERP_LENS, **GVA)
    seq, chunk = [r[0] for r in INTERP_REQ], [r[1] for r in INTERP_REQ]
    out, grads = run_with_grads(_fast(chunk_size=INTERP_BT), ins, cu, h0, seq, chunk)
    assert chunk_mod.torch.empty_like is nan_empty_like and filled
    errs, bad = _compare(out, grads, *_gva_runs()[1], 1e-5, 1e-4)
    assert not bad, errs


@pytest.mark.skipif(CUDA, reason="interpreter case; the GPU runs the compiled variants below")
def test_triton_interpreter_no_requests_matches_fla_chunk_kda():
    from fla.ops.kda import chunk_kda

    ins, cu, h0 = make_inputs(INTERP_LENS, H=1, HV=2, K=32, V=16)
    out, grads = run_with_grads(_fast(chunk_size=INTERP_BT), ins, cu, h0, None, None)

    def fla_fn(q, k, v, g, beta, cu_seqlens, initial_state, output_final_state, state_seq, state_chunk):
        o, ht = chunk_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                          cu_seqlens=cu_seqlens, chunk_size=INTERP_BT)
        return o, ht, None
    out_f, grads_f = run_with_grads(fla_fn, ins, cu, h0, None, None)
    assert out["B"] is None
    for n in ("o", "ht"):
        assert (out[n] - out_f[n]).abs().max().item() < 1e-5, n
    for n in grads_f:
        assert rel_rmse(grads[n], grads_f[n]) < 1e-5, n


# ----------------------------------------------------------------------------------------------
# GPU (compiled Triton): fla's tolerances in bf16, K = 64 and 128, speed-shaped edge cases
# ----------------------------------------------------------------------------------------------

# fla tests/ops/test_kda.py::test_chunk thresholds (relative RMSE)
FLA_TOL = {"o": 0.005, "ht": 0.005, "B": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dg": 0.02, "dbeta": 0.02,
           "dh0": 0.008, "dA_log": 0.02, "ddt_bias": 0.02}


# GPU cases use ling3-tiny's head shapes (H = HV = 16, K = V = 128, bf16), and H = HV = 8 (one rank's heads
# under TP2, a shape whose A_log gradient once came out halved on the GPU): fla 0.6.0 compiles every autotune
# config per (H, HV, K, dtype), 1-2 minutes per new shape family. K = 64 and GVA are covered by the
# interpreter cases.
@pytest.mark.gpu
@pytest.mark.parametrize("K,H,HV,gate", [(128, 16, 16, False), (128, 16, 16, True), (128, 8, 8, True)])
def test_gpu_bf16_vs_fp32_reference(K, H, HV, gate):
    lens = [150, 64, 200, 17, 128]
    BT = 64
    ins, cu, h0 = make_inputs(lens, H=H, HV=HV, K=K, V=K, dtype=torch.bfloat16, device="cuda", raw_gate=gate)
    req = [(0, 0), (0, 1), (0, 3), (1, 1), (2, 0), (2, 2), (2, 4), (3, 1), (4, 2), (4, 1)]
    seq, chunk = [r[0] for r in req], [r[1] for r in req]
    kw = {}
    if gate:
        kw = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                  A_log=torch.rand(HV, device="cuda").log(), dt_bias=torch.randn(HV * K, device="cuda") * 0.1)
    out, grads = run_with_grads(_fast(chunk_size=BT), ins, cu, h0, seq, chunk, **dict(kw))
    ins32 = {n: x.float() for n, x in ins.items()}
    out_r, grads_r = run_with_grads(_ref(chunk_size=BT), ins32, cu, h0, seq, chunk, **dict(kw))
    errs = {n: rel_rmse(out[n], out_r[n]) for n in out}
    errs.update({n: rel_rmse(grads[n], grads_r[n]) for n in grads_r})
    print(f"K={K} H={H} HV={HV} gate={gate} rel-RMSE vs fp32 reference:",
          {n: f"{e:.2e}" for n, e in errs.items()})
    assert all(errs[n] <= FLA_TOL[n] for n in errs), errs


@pytest.mark.gpu
def test_gpu_wrong_placement_fails():
    ins, cu, h0 = make_inputs([150, 64, 200], H=16, HV=16, K=128, V=128, dtype=torch.bfloat16, device="cuda")
    seq, chunk = [0, 0, 1, 2, 2, 2], [1, 2, 1, 0, 3, 1]  # the boundaries of fla-kda-internals.md section 3
    out, grads = run_with_grads(_fast(_inject_at_top=True), ins, cu, h0, seq, chunk)
    out_r, grads_r = run_with_grads(_ref(), {n: x.float() for n, x in ins.items()}, cu, h0, seq, chunk)
    errs = {n: rel_rmse(grads[n], grads_r[n]) for n in grads_r}
    print("wrong placement rel-RMSE:", {n: f"{e:.2e}" for n, e in errs.items()})
    assert max(errs[n] for n in ("dk", "dv", "dg")) > 0.1, errs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_gpu_no_requests_matches_fla(dtype):
    from fla.ops.kda import chunk_kda

    ins, cu, h0 = make_inputs([150, 64, 200, 1000], H=16, HV=16, K=128, V=128, dtype=dtype, device="cuda")
    out, grads = run_with_grads(_fast(), ins, cu, h0, None, None)

    def fla_fn(q, k, v, g, beta, cu_seqlens, initial_state, output_final_state, state_seq, state_chunk):
        o, ht = chunk_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                          cu_seqlens=cu_seqlens)
        return o, ht, None
    out_f, grads_f = run_with_grads(fla_fn, ins, cu, h0, None, None)
    diffs = {n: (out[n].float() - out_f[n].float()).abs().max().item() for n in ("o", "ht")}
    diffs.update({n: (grads[n].float() - grads_f[n].float()).abs().max().item() for n in grads_f})
    rel = {n: rel_rmse(grads[n], grads_f[n]) for n in grads_f}
    print(f"{dtype} no requests vs fla chunk_kda: max|diff|", {n: f"{d:.2e}" for n, d in diffs.items()},
          "rel-RMSE", {n: f"{e:.1e}" for n, e in rel.items()})
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    assert max(rel.values()) < tol and rel_rmse(out["o"], out_f["o"]) < tol


@pytest.mark.gpu
def test_gpu_tree_two_rounds_equal_flat():
    # bf16 both ways: the only difference is where bf16 rounding of h happens (different chunk grids)
    flat, tree = _tree_case(_fast(chunk_size=64), 64, torch.bfloat16, device="cuda", H=16, HV=16, K=128, V=128)
    errs = [rel_rmse(b, a) for a, b in zip(flat, tree)]
    print("tree vs flat rel-RMSE (oP, o1, o2, dq, dk, dv, dg, dbeta):", [f"{e:.1e}" for e in errs])
    assert max(errs) < 2e-2, errs
