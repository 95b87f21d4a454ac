"""GDN rounds (harts.ops.gdn_round): boundary states and their gradients with the per-head scalar gate.

Oracles: ``harts.ops.gdn.gated_delta_rule_reference`` (the padded per-token GDN recurrence, itself checked
against a brute-force loop in tests/test_ops_gdn.py) run on whole sequences and on prefixes (a boundary state
is the final state of the prefix that ends at it), in float64. The fast path (fla's GDN pieces + our scans,
Triton interpreter, float32) is judged against the float64 truth with a tolerance set by the float32
reference's own error on the same inputs. The loss is L = <o, do> + <S_T, dS_T> + sum_j <B_j, dB_j>, so
every boundary state carries an incoming gradient.
"""
import functools
import os

import pytest
import torch
import torch.nn.functional as F

from harts.ops.gdn import gated_delta_rule_reference
from harts.ops.gdn_round import chunk_gdn_round_reference

CUDA = torch.cuda.is_available()
# These build their inputs on the CPU for the Triton interpreter (float32). On a GPU the compiled kernels are
# checked against a float64 truth by tests/test_qwen35_tree.py's gpu test (the model with both GDN round
# implementations), python -m benchmarks.gdn_round (outputs and input gradients) and benchmarks.gdn_gate_grad.
INTERPRETER_ONLY = ("interpreter case (CPU inputs); on CUDA the compiled kernels are checked by the gpu test in "
                    "tests/test_qwen35_tree.py and by benchmarks.gdn_round / gdn_gate_grad against float64")
H, HV, K, V = 2, 4, 32, 16  # grouped value attention: each key head serves two value heads


def rel_rmse(x, y):
    x, y = x.double(), y.double()
    return ((x - y).square().mean().sqrt() / y.square().mean().sqrt().clamp_min(1e-30)).item()


def make_inputs(lens, seed=0, h0=True):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)
    ins = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, HV, V), g=F.logsigmoid(r(1, T, HV) + 2),
               beta=torch.rand(1, T, HV, generator=gen, dtype=torch.float64))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return ins, cu, (0.1 * r(len(lens), HV, K, V) if h0 else None)


def run_with_grads(fn, ins, cu, h0, seq, chunk, dtype, seed=1, **kw):
    """Outputs and gradients of L = <o,do> + <S_T,dS_T> + sum_j <B_j,dB_j> (inputs cast to ``dtype``, the
    states to fp32 unless float64)."""
    leaves = {n: x.to(dtype).detach().requires_grad_() for n, x in ins.items()}
    sd = torch.float64 if dtype == torch.float64 else torch.float32
    h = h0.to(sd).detach().requires_grad_() if h0 is not None else None
    o, ht, B = fn(**leaves, cu_seqlens=cu, initial_state=h, output_final_state=True, state_seq=seq,
                  state_chunk=chunk, use_qk_l2norm_in_kernel=True, **kw)
    gen = torch.Generator().manual_seed(seed)

    def rnd(x):
        return torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype)
    loss = (o * rnd(o)).sum() + (ht * rnd(ht)).sum() + (0 if B is None else (B * rnd(B)).sum())
    loss.backward()
    out = {"o": o, "ht": ht, "B": B, **{f"d{n}": x.grad for n, x in leaves.items()}}
    if h is not None:
        out["dh0"] = h.grad
    return out


def _gdn(ins, cu, h0):
    """gated_delta_rule_reference in the round's [1, T, ...] layout (q/k L2-normed inside, as the rounds)."""
    o, ht = gated_delta_rule_reference(*(ins[n][0] for n in ("q", "k", "v", "g", "beta")), cu,
                                       initial_state_NHKV=h0, output_final_state=True)
    return o[None], ht


# ----------------------------------------------------------------------------------------------
# Reference path (pure torch, float64) against the GDN recurrence
# ----------------------------------------------------------------------------------------------

def test_reference_equals_gdn_recurrence_float64():
    ins, cu, h0 = make_inputs([15, 16, 17, 37], seed=2)
    got = run_with_grads(chunk_gdn_round_reference, ins, cu, h0, None, None, torch.float64, chunk_size=16)

    def gdn(q, k, v, g, beta, cu_seqlens, initial_state, **_):
        return (*_gdn(dict(q=q, k=k, v=v, g=g, beta=beta), cu_seqlens, initial_state), None)
    want = run_with_grads(gdn, ins, cu, h0, None, None, torch.float64)
    for n in want:
        if want[n] is not None:
            torch.testing.assert_close(got[n], want[n], rtol=1e-12, atol=1e-12, msg=n)


def test_reference_boundary_states_are_prefix_final_states_float64():
    """B_j is the final state of the prefix of length BT * chunk_j (capped at the sequence), and the gradient
    that dB_j sends into the inputs is that prefix's final-state gradient."""
    BT, lens = 16, [15, 16, 33]
    ins, cu, h0 = make_inputs(lens, seed=4)
    seq, chunk = [0, 0, 1, 1, 2, 2, 2], [0, 1, 0, 1, 1, 2, 3]
    leaves = {n: x.detach().requires_grad_() for n, x in ins.items()}
    _, _, B = chunk_gdn_round_reference(**leaves, cu_seqlens=cu, initial_state=h0, state_seq=seq, state_chunk=chunk,
                                        use_qk_l2norm_in_kernel=True, chunk_size=BT)
    dB = torch.randn(B.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    # q does not reach the states: the inputs that do are k, v, g, beta
    states_in = [leaves[n] for n in ("k", "v", "g", "beta")]
    got = torch.autograd.grad((B * dB).sum(), states_in)
    want_B, loss = [], 0
    for j, (n, c) in enumerate(zip(seq, chunk)):
        a = int(cu[n])
        b = a + min(BT * c, lens[n])
        pre = {m: x[:, a:b] for m, x in leaves.items()}
        _, ht = _gdn(pre, torch.tensor([0, b - a]), h0[n:n + 1])
        want_B.append(ht[0])
        loss = loss + (ht[0] * dB[j]).sum()
    torch.testing.assert_close(B, torch.stack(want_B), rtol=1e-12, atol=1e-12)
    want = torch.autograd.grad(loss, states_in)
    for name, a, b in zip(("k", "v", "g", "beta"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_validation_names_the_argument():
    from harts.ops.gdn_round.chunk import chunk_gdn_round

    ins, cu, _ = make_inputs([20, 12])
    f32 = {n: x.float() for n, x in ins.items()}
    bad_g = dict(f32, g=f32["g"][..., None].expand(1, 32, HV, K))
    for fn in (chunk_gdn_round_reference, chunk_gdn_round):
        with pytest.raises(ValueError, match=r"g must be the per-head log decay \[1, T, HV\]"):
            fn(**bad_g, cu_seqlens=cu)
        with pytest.raises(ValueError, match="multiple of query/key heads"):
            fn(**dict(f32, v=f32["v"][:, :, :3], g=f32["g"][:, :, :3], beta=f32["beta"][:, :, :3]), cu_seqlens=cu)
        with pytest.raises(ValueError, match="request 0: chunk 3 of sequence 1"):
            fn(**f32, cu_seqlens=cu, state_seq=[1], state_chunk=[3], chunk_size=16)
    with pytest.raises(ValueError, match="chunk_size in"):
        chunk_gdn_round(**f32, cu_seqlens=cu, chunk_size=128)
    with pytest.raises(ValueError, match="float64"):
        chunk_gdn_round(**ins, cu_seqlens=cu, chunk_size=16)
    # out: the [T, HV, V] rows of the caller's output in q's dtype, contiguous; grad_out only with the l2norm
    strided = torch.empty(V, 32, HV).permute(1, 2, 0)
    for bad in (torch.empty(32, HV, V + 1), torch.empty(32, HV, V, dtype=torch.float64), strided):
        with pytest.raises(ValueError, match=rf"chunk_gdn_round: out must be a contiguous \(32, {HV}, {V}\)"):
            chunk_gdn_round(**f32, cu_seqlens=cu, chunk_size=16, out=bad)
    with pytest.raises(ValueError, match="grad_out needs use_qk_l2norm_in_kernel=True"):
        chunk_gdn_round(**f32, cu_seqlens=cu, chunk_size=16, grad_out=(None, None))


def test_fla_640_guard_is_narrow():
    """The dqkwg refusal covers exactly fla #640's miscompile: Hopper, 3.4 <= Triton < 3.7.1, BK = 64."""
    from harts.kernels.gdn_round import fla_640_affected

    assert fla_640_affected(True, "3.6.0", 64) and fla_640_affected(True, "3.4.0", 64)
    assert not fla_640_affected(True, "3.6.0", 128)  # Hopper's tiling at K = 128
    assert not fla_640_affected(True, "3.6.0", 32)
    assert not fla_640_affected(True, "3.7.1", 64) and not fla_640_affected(True, "3.3.1", 64)
    assert not fla_640_affected(False, "3.6.0", 64)


# ----------------------------------------------------------------------------------------------
# Triton path (TRITON_INTERPRET=1 on CPU, float32) against the float64 truth
# ----------------------------------------------------------------------------------------------

def _need_kernels():
    if os.environ.get("TRITON_INTERPRET") != "1" and not CUDA:
        pytest.fail("the fast path needs CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it on CPU)")


def _fast(**fixed):
    from harts.ops.gdn_round import chunk_gdn_round

    return lambda *a, **kw: chunk_gdn_round(*a, **fixed, **kw)


def _ref(**fixed):
    return lambda *a, **kw: chunk_gdn_round_reference(*a, **fixed, **kw)


def _judge(fast, ref32, truth, slack=20.0, floor=1e-7):
    """Per quantity: the fast path's error to the float64 truth must stay within ``slack`` times the float32
    reference's own error (rounding of the per-token recurrence; the chunked form reorders sums)."""
    errs = {n: (rel_rmse(fast[n], truth[n]), max(rel_rmse(ref32[n], truth[n]), floor))
            for n in truth if truth[n] is not None}
    bad = {n: e for n, e in errs.items() if e[0] > slack * e[1]}
    return errs, bad


def _lens(BT):
    return [BT - 1, BT, BT + 1, 2 * BT + 5]  # sequence ends at B-1, B, B+1 and inside a later chunk


REQ = ([0, 0, 1, 1, 2, 2, 3, 3, 3], [0, 1, 0, 1, 1, 2, 1, 2, 3])  # chunk 0 (h0), interior and end states


@functools.cache
def _single_round(BT, inject_at_top=False):
    _need_kernels()
    ins, cu, h0 = make_inputs(_lens(BT), seed=BT)
    fast = run_with_grads(_fast(chunk_size=BT, _inject_at_top=inject_at_top), ins, cu, h0, *REQ, torch.float32)
    ref32 = run_with_grads(_ref(chunk_size=BT), ins, cu, h0, *REQ, torch.float32)
    truth = run_with_grads(_ref(chunk_size=BT), ins, cu, h0, *REQ, torch.float64)
    return fast, ref32, truth


def _chunk_grads_float64(q, k, v_new, g2, h, do, dh, dv, scale):
    """Autograd of one chunk of the chunked gated delta rule at one value head (g2: chunk-local cumulative log2
    decays): o = scale (2^g q S + (M * q k^T) v_new), S_end = 2^g_L S + (2^(g_L - g) k)^T v_new, loss
    <o, do> + <S_end, dS>. Returns dq, dk, dw = -(dv S^T) (v_new = u - w S) and dg with respect to g2 ln 2."""
    x = [t.detach().clone().requires_grad_() for t in (q, k, g2)]
    qq, kk, gg = x
    M = torch.tril(torch.exp2(gg[:, None] - gg[None, :]))
    o = scale * (torch.exp2(gg)[:, None] * (qq @ h) + (M * (qq @ kk.T)) @ v_new)
    S_end = torch.exp2(gg[-1]) * h + (torch.exp2(gg[-1] - gg)[:, None] * kk).T @ v_new
    dq, dk, dg2 = torch.autograd.grad((o * do).sum() + (S_end * dh).sum(), x)
    return dq, dk, -(dv @ h.T), dg2 / torch.log(torch.tensor(2.0, dtype=torch.float64))


@pytest.mark.skipif(CUDA, reason=INTERPRETER_ONLY)
@pytest.mark.parametrize("log_decay", [-0.3, -20.0])
def test_dqkwg_kernel_matches_float64_chunk_autograd(log_decay):
    """harts.kernels.gdn_round's dqkwg step alone, at two key blocks (K = 48, BK = 32 off-GPU) and two value
    blocks (V = 40), grouped heads and ragged chunks, against float64 autograd of each chunk's equations."""
    _need_kernels()
    from fla.ops.utils.index import prepare_chunk_indices

    from harts.kernels.gdn_round import gdn_round_bwd_dqkwg

    BT, Hk, Hv, Kd, Vd, scale = 16, 2, 4, 48, 40, 0.3
    lens = [21, 16, 5]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    chunks = prepare_chunk_indices(cu, BT)
    T, NT = sum(lens), chunks.shape[0]
    gen = torch.Generator().manual_seed(5)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)
    q, k = r(1, T, Hk, Kd), r(1, T, Hk, Kd)
    v_new, do, dv = r(1, T, Hv, Vd), r(1, T, Hv, Vd), r(1, T, Hv, Vd)
    h, dh = r(1, NT, Hv, Kd, Vd), r(1, NT, Hv, Kd, Vd)
    step2 = (log_decay * (1 + 0.5 * torch.rand(1, T, Hv, generator=gen, dtype=torch.float64))) / 0.6931471805599453
    g2 = torch.empty_like(step2)  # chunk-local cumulative log2 decays, computed from float32 steps exactly
    for n, i in chunks.tolist():
        a, b = cu[n] + i * BT, min(cu[n] + (i + 1) * BT, cu[n + 1])
        g2[:, a:b] = step2[:, a:b].float().cumsum(1)
    args32 = [x.float() for x in (q, k, v_new, do, h, dh, dv, g2)]
    dq, dk, dw, dg = gdn_round_bwd_dqkwg(*args32, scale, cu, chunks, BT)

    ref = {n: torch.zeros(1, T, Hk if n in ("dq", "dk") else Hv, *([] if n == "dg" else [Kd]), dtype=torch.float64)
           for n in ("dq", "dk", "dw", "dg")}
    g2f = g2.float().double()
    for c, (n, i) in enumerate(chunks.tolist()):
        a, b = cu[n] + i * BT, min(cu[n] + (i + 1) * BT, cu[n + 1])
        for j in range(Hv):
            jk = j // (Hv // Hk)
            gq, gk, gw, gg = _chunk_grads_float64(q[0, a:b, jk], k[0, a:b, jk], v_new[0, a:b, j], g2f[0, a:b, j],
                                                  h[0, c, j], do[0, a:b, j], dh[0, c, j], dv[0, a:b, j], scale)
            ref["dq"][0, a:b, jk] += gq
            ref["dk"][0, a:b, jk] += gk
            ref["dw"][0, a:b, j] = gw
            ref["dg"][0, a:b, j] = gg
    for n, x in (("dq", dq), ("dk", dk), ("dw", dw), ("dg", dg)):
        assert rel_rmse(x, ref[n]) < 1e-5, (n, rel_rmse(x, ref[n]))
    # at fast decays the gate gradient is tiny next to the O(1) terms that cancel in it: still resolved per token
    assert ((dg.double() - ref["dg"]).abs() <= 1e-4 * ref["dg"].abs() + 1e-6 * ref["dg"].abs().max()).all()


@pytest.mark.skipif(CUDA, reason=INTERPRETER_ONLY)
@pytest.mark.parametrize("BT", [16, 64])  # 64: fla's fused kkt + solve_tril; 16: kkt then solve_tril
def test_fast_round_matches_float64_truth(BT):
    errs, bad = _judge(*_single_round(BT))
    assert set(errs) == {"o", "ht", "B", "dq", "dk", "dv", "dg", "dbeta", "dh0"}
    assert not bad, errs


@pytest.mark.skipif(CUDA, reason=INTERPRETER_ONLY)
def test_fast_round_wrong_boundary_gradient_placement_fails():
    """Negative control: adding dB_c at the top of iteration c (the gradient of S_end(c)) must be caught."""
    fast, ref32, truth = _single_round(16, inject_at_top=True)
    errs, bad = _judge(fast, ref32, truth)
    assert {"dk", "dv", "dg", "dbeta", "dh0"} <= set(bad), errs  # dq reads S, not dS
    assert min(errs[n][0] for n in ("dk", "dv", "dg")) > 0.05, errs


@pytest.mark.skipif(CUDA, reason=INTERPRETER_ONLY)
def test_fast_two_rounds_with_forks_equal_flat_truth():
    """A parent round emits S_start(c); children forked at B-1, B, B+1 replay from it in a second round (the
    state fed back as initial_state, differentiable). Outputs and gradients equal each child run as one whole
    sequence (parent prefix + own tokens) by the float64 reference."""
    _need_kernels()
    BT, Lc = 16, 9
    Lp = 2 * BT + 7
    forks = [BT - 1, BT, BT + 1]
    ins, _, _ = make_inputs([Lp + len(forks) * Lc], seed=11, h0=False)
    gen = torch.Generator().manual_seed(12)
    doP = torch.randn(1, Lp, HV, V, generator=gen, dtype=torch.float64)
    doC = [torch.randn(1, Lc, HV, V, generator=gen, dtype=torch.float64) for _ in forks]

    def cu_of(*ls):
        return torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()])

    def flat(fn, dtype):
        x = {n: t.to(dtype).detach().requires_grad_() for n, t in ins.items()}
        P = {n: t[:, :Lp] for n, t in x.items()}
        kids = [{n: t[:, Lp + i * Lc:Lp + (i + 1) * Lc] for n, t in x.items()} for i in range(len(forks))]
        seqs = [P] + [{n: torch.cat([P[n][:, :f], c[n]], 1) for n in x} for f, c in zip(forks, kids)]
        o, _, _ = fn(**{n: torch.cat([s[n] for s in seqs], 1) for n in x},
                     cu_seqlens=cu_of(Lp, *(f + Lc for f in forks)), use_qk_l2norm_in_kernel=True, chunk_size=BT)
        ends = cu_of(Lp, *(f + Lc for f in forks)).tolist()
        loss = (o[:, :Lp] * doP.to(dtype)).sum()
        outs = [o[:, :Lp]]
        for i, e in enumerate(ends[2:]):
            outs.append(o[:, e - Lc:e])
            loss = loss + (outs[-1] * doC[i].to(dtype)).sum()
        return [*outs, *torch.autograd.grad(loss, list(x.values()))]

    def tree(fn, dtype):
        x = {n: t.to(dtype).detach().requires_grad_() for n, t in ins.items()}
        P = {n: t[:, :Lp] for n, t in x.items()}
        starts = [f // BT for f in forks]  # the chunk each child replays from
        emit = sorted(set(starts))
        oP, _, B = fn(**P, cu_seqlens=cu_of(Lp), state_seq=[0] * len(emit), state_chunk=emit,
                      use_qk_l2norm_in_kernel=True, chunk_size=BT)
        parts = [{n: torch.cat([P[n][:, c * BT:f], x[n][:, Lp + i * Lc:Lp + (i + 1) * Lc]], 1) for n in x}
                 for i, (f, c) in enumerate(zip(forks, starts))]
        lens = [f - c * BT + Lc for f, c in zip(forks, starts)]
        init = B[[emit.index(c) for c in starts]]
        oK, _, _ = fn(**{n: torch.cat([p[n] for p in parts], 1) for n in x}, cu_seqlens=cu_of(*lens),
                      initial_state=init, use_qk_l2norm_in_kernel=True, chunk_size=BT)
        ends = cu_of(*lens).tolist()[1:]
        outs = [oP] + [oK[:, e - Lc:e] for e in ends]
        loss = (oP * doP.to(dtype)).sum() + sum((o * d.to(dtype)).sum() for o, d in zip(outs[1:], doC))
        return [*outs, *torch.autograd.grad(loss, list(x.values()))]

    names = ["oP", *(f"o_fork{f}" for f in forks), "dq", "dk", "dv", "dg", "dbeta"]
    truth = dict(zip(names, flat(_ref(), torch.float64)))
    ref32 = dict(zip(names, flat(_ref(), torch.float32)))
    fast = dict(zip(names, tree(_fast(), torch.float32)))
    errs, bad = _judge(fast, ref32, truth)
    assert not bad, errs
