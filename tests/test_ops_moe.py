"""Router and routed experts against brute-force definitions."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from harts.ops.moe import moe_experts, moe_experts_grouped_mm, moe_experts_reference, route, router_stats

E, G, TG, K = 16, 4, 2, 4


def brute_route(x, W, b):
    """Enumerate all allowed group subsets per token; pick the top-K biased experts of the best subset."""
    s = torch.sigmoid(x @ W.T)
    idx, wts = [], []
    for t in range(x.shape[0]):
        sb = s[t] + b
        gscore = [sorted(sb[g * 4:(g + 1) * 4].tolist())[-2:] for g in range(G)]
        gscore = [sum(v) for v in gscore]
        best = max(itertools.combinations(range(G), TG), key=lambda c: sum(gscore[g] for g in c))
        allowed = [e for g in best for e in range(g * 4, (g + 1) * 4)]
        top = sorted(allowed, key=lambda e: -sb[e].item())[:K]
        w = s[t, top] / s[t, top].sum() * 2.5
        order = sorted(range(K), key=lambda i: top[i])
        idx.append([top[i] for i in order])
        wts.append(w[order])
    return torch.tensor(idx), torch.stack(wts)


def test_router_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    x, W = torch.randn(40, 8, generator=g, dtype=torch.float64), torch.randn(E, 8, generator=g, dtype=torch.float64)
    b = 0.2 * torch.randn(E, generator=g, dtype=torch.float64)
    _, _, idx, w = route(x, W, b, n_group=G, topk_group=TG, top_k=K, routed_scaling_factor=2.5)
    bi, bw = brute_route(x, W, b)
    assert torch.equal(idx, bi)
    torch.testing.assert_close(w, bw, rtol=1e-12, atol=1e-12)


def test_router_matches_brute_force_with_ties():
    """Integer logits and biases make many equal scores, at the group boundary and at the k-th expert: the
    router takes the lower group / expert index among equals, as the brute force's first best subset and
    its stable sort do (a defined rule on every device, which ``topk`` does not promise)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 2, (200, 8), generator=g).double()
    W = torch.randint(-1, 2, (E, 8), generator=g).double()
    b = 0.5 * torch.randint(0, 2, (E,), generator=g).double()
    _, _, idx, w = route(x, W, b, n_group=G, topk_group=TG, top_k=K, routed_scaling_factor=2.5)
    bi, bw = brute_route(x, W, b)
    s = torch.sigmoid(x @ W.T) + b
    assert (s[:, :, None] == s[:, None, :]).sum() > 200 * E  # ties are common
    assert torch.equal(idx, bi)
    torch.testing.assert_close(w, bw, rtol=1e-12, atol=1e-12)


def test_router_runs_in_fp32_for_bf16_input():
    x, W = torch.randn(5, 8).bfloat16(), torch.randn(E, 8).bfloat16()
    logits, scores, idx, w = route(x, W, torch.zeros(E), n_group=G, topk_group=TG, top_k=K, routed_scaling_factor=2.5)
    assert logits.dtype == torch.float32 and w.dtype == torch.float32


def test_router_stats_multiplicity_equals_duplication():
    g = torch.Generator().manual_seed(1)
    x, W = torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randn(E, 8, generator=g, dtype=torch.float64)
    mult = torch.tensor([1, 3, 1, 2, 1, 1], dtype=torch.float64)
    dup = x.repeat_interleave(mult.long(), 0)
    a = router_stats(*(lambda r: (r[0], r[1], r[2]))(route(x, W, torch.zeros(E), n_group=G, topk_group=TG, top_k=K,
                                                            routed_scaling_factor=2.5)), mult)
    b = router_stats(*(lambda r: (r[0], r[1], r[2]))(route(dup, W, torch.zeros(E), n_group=G, topk_group=TG, top_k=K,
                                                            routed_scaling_factor=2.5)))
    for f in ("counts_E", "z_loss", "f_E", "P_E", "weight_sum"):
        torch.testing.assert_close(getattr(a, f), getattr(b, f), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.aux_loss, b.aux_loss)
    assert a.counts_E.sum().item() == mult.sum().item() * K


def _expert_inputs(T=30, D=16, Fw=8, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=g).to(device, dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(device)
    return r(T, D), idx, torch.rand(T, K, generator=g).to(device, torch.float32), r(E, Fw, D), r(E, Fw, D), r(E, D, Fw)


def dense_experts(x, idx, w, wg, wu, wd):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            out[t] += w[t, j].to(x.dtype) * (wd[e] @ (F.silu(wg[e] @ x[t]) * (wu[e] @ x[t])))
    return out


def test_reference_experts_match_dense():
    x, idx, w, wg, wu, wd = _expert_inputs()
    torch.testing.assert_close(moe_experts_reference(x, idx, w, wg, wu, wd), dense_experts(x, idx, w, wg, wu, wd),
                               rtol=1e-12, atol=1e-12)


def test_grouped_mm_matches_reference_fp32_cpu():
    """The grouped-GEMM path and the reference loop, both in float32, against the float64 reference: the
    output and the gradients of x and the three expert weights are as close to it as the float32 reference
    (within 2x, plus 4 float32 ulps of the largest value: the two sum in different orders)."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.fail("torch._grouped_mm missing")
    x, idx, w, wg, wu, wd = _expert_inputs()
    idx[:, 0] = 3  # one crowded expert, several empty ones

    def run(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x, wg, wu, wd)]
        y = fn(leaves[0], idx, w.to(dtype), *leaves[1:])
        return [y, *torch.autograd.grad(y.square().sum(), leaves)]

    truth = run(moe_experts_reference, torch.float64)
    fast, ref = run(moe_experts_grouped_mm, torch.float32), run(moe_experts_reference, torch.float32)
    for name, t, a, b in zip(("y", "dx", "dw_gate", "dw_up", "dw_down"), truth, fast, ref):
        err, err_ref = (a.double() - t).abs().max().item(), (b.double() - t).abs().max().item()
        assert err <= 2 * err_ref + 4 * torch.finfo(torch.float32).eps * t.abs().max().item(), (name, err, err_ref)


@pytest.mark.parametrize("swiglu", ["torch", "harts"])  # harts: harts::moe_swiglu_down under the interpreter
def test_stacked_gate_up_equals_two_weights_fp32_cpu(swiglu):
    """``grouped_experts_stacked`` (gate and up as one [E, 2F, D] weight, Qwen3.5's layout): its reference is
    ``grouped_experts`` on the two halves, bit for bit in float64 with the gradient of each half in its rows of
    the stacked weight; its fast path (one grouped GEMM with N = 2F, the SwiGLU as torch ops or as the fused op)
    is as close to the float64 truth as the two-GEMM fast path (within 2x, plus 4 float32 ulps of the largest
    value). A weight that is not [E, 2F, D] is refused with its shape."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.fail("torch._grouped_mm missing")
    import harts.ops
    from harts.ops.moe import grouped_experts, grouped_experts_stacked
    from harts.ops.moe.experts import _grouped_swiglu, _grouped_swiglu_stacked

    x, idx, w, wg, wu, wd = _expert_inputs()
    idx[:, 0] = 3  # one crowded expert, several empty ones
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    x_MD = x.repeat_interleave(K, 0)[torch.argsort(idx.reshape(-1), stable=True)]
    weight_M = torch.rand(x_MD.shape[0], generator=torch.Generator().manual_seed(5))

    def run(fn, dtype, stacked):
        ws = [torch.cat([wg, wu], 1)] if stacked else [wg, wu]
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x_MD, *ws, wd)]
        y = fn(leaves[0], counts, *leaves[1:], weight_M.double() if dtype == torch.float64 else weight_M)
        grads = torch.autograd.grad(y.square().sum(), leaves)
        if not stacked:
            grads = (grads[0], torch.cat(grads[1:3], 1), grads[3])
        return [y, *grads]

    def ref(stacked):
        op = grouped_experts_stacked if stacked else grouped_experts
        return lambda *a: op(*a[:-1], "reference", a[-1])

    def fast(stacked):
        op = _grouped_swiglu_stacked if stacked else _grouped_swiglu
        return lambda x_, c, *r: op(x_, c.cumsum(0).to(torch.int32), *r)

    for a, b in zip(run(ref(True), torch.float64, True), run(ref(False), torch.float64, False)):
        assert torch.equal(a, b)
    truth = run(ref(False), torch.float64, False)
    with harts.ops.use_kernel_choices(swiglu=swiglu):
        stacked = run(fast(True), torch.float32, True)
    for name, t, a, b in zip(("y", "dx", "dw_gate_up", "dw_down"), truth, stacked,
                             run(fast(False), torch.float32, False)):
        err, err_two = (a.double() - t).abs().max().item(), (b.double() - t).abs().max().item()
        assert err <= 2 * err_two + 4 * torch.finfo(torch.float32).eps * t.abs().max().item(), (name, err, err_two)
    with pytest.raises(ValueError, match=r"\[E, 2F, D\] with F = 8 .*\(4, 12, 16\)"):
        grouped_experts_stacked(x_MD, counts, torch.zeros(4, 12, 16), wd)


def _fwd_bwd(fn, x, idx, w, wg, wu, wd, dy):
    """Output and the gradients of x, the routing weights and the three expert weights for <y, dy>."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, wg, wu, wd)]
    y = fn(leaves[0], idx, *leaves[1:])
    return y.detach(), torch.autograd.grad((y.float() * dy).sum(), leaves)


@pytest.mark.gpu
def test_grouped_mm_bf16_gpu_deterministic():
    """Routing is an input here, so fast and reference paths use the same experts: any gradient gap is
    rounding or a wrong kernel (e.g. grouped weight-gradient GEMMs over unaligned group sizes)."""
    x, idx, w, wg, wu, wd = _expert_inputs(T=4096, D=256, Fw=128, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).cuda()
    fast = lambda *a: moe_experts(*a, backend="fast")
    runs = [_fwd_bwd(fast, x, idx, w, wg, wu, wd, dy) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    # Elementwise tolerances do not fit bf16 here: outputs are sums of 128 products of O(100) bf16-rounded
    # activations, so single elements that nearly cancel carry absolute errors of O(10). Compare (a) with
    # the reference loop in bf16 on the same device (same rounding points, other GEMM kernels) and (b) with
    # the fp32 reference, by relative RMS error; a wrong group/offset would give O(1).
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
    ref_bf16 = moe_experts_reference(x, idx, w, wg, wu, wd)
    ref_fp32 = moe_experts_reference(*(t.float() if t.is_floating_point() else t for t in (x, idx, w, wg, wu, wd)))
    e_bf16, e_fp32, e_floor = rel(runs[0][0], ref_bf16), rel(runs[0][0], ref_fp32), rel(ref_bf16, ref_fp32)
    print(f"grouped_mm vs bf16 loop {e_bf16:.2e}, vs fp32 loop {e_fp32:.2e} (bf16 loop vs fp32 loop {e_floor:.2e})")
    assert e_bf16 < 1e-2 and e_fp32 < 2 * e_floor + 1e-3, (e_bf16, e_fp32, e_floor)
    _, g_loop = _fwd_bwd(moe_experts_reference, x, idx, w, wg, wu, wd, dy)
    _, g_f32 = _fwd_bwd(moe_experts_reference, *(t.float() if t.is_floating_point() else t
                                                 for t in (x, idx, w, wg, wu, wd)), dy)
    for name, a, b, c in zip(("x", "w", "w_gate", "w_up", "w_down"), runs[0][1], g_loop, g_f32):
        e, floor = rel(a, c), rel(b, c)
        print(f"grad {name}: grouped_mm vs fp32 loop {e:.2e} (bf16 loop {floor:.2e})")
        assert e < 2 * floor + 1e-3, (name, e, floor)


def _routing_indices(T, K, E=5, seed=7):
    """The grouped path's two index sets for a random routing: the sorted row of every (token, slot) and the
    token of every sorted row (each the transpose of the other, as gather_sum's backward needs)."""
    flat_M = torch.randint(0, E, (T * K,), generator=torch.Generator().manual_seed(seed))
    order_M = torch.sort(flat_M, stable=True).indices
    inv_M = torch.empty_like(order_M).scatter_(0, order_M, torch.arange(T * K))
    return inv_M.view(T, K), (order_M // K)[:, None]


def _sequential_sum(src_MD, idx_TK):
    """The kernel's arithmetic spelled out: fp32 adds in k order, one cast at the end."""
    acc = src_MD[idx_TK[:, 0]].float()
    for k in range(1, idx_TK.shape[1]):
        acc = acc + src_MD[idx_TK[:, k]].float()
    return acc.to(src_MD.dtype)


def test_gather_sum_reference_is_the_row_movers_and_gradcheck():
    """The grouped path's row movers on the reference: the slot gather is plain indexing, the combine is the
    permutation back to (token, slot) order summed over K (bitwise); the op passes gradcheck and
    gradgradcheck (float64), its backward being the same op with the indices swapped."""
    from harts.ops.moe.experts import gather_sum

    T, K, D = 6, 3, 4
    slot_TK, token_M1 = _routing_indices(T, K)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(T, D, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(T * K, D, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.equal(gather_sum(x, token_M1, slot_TK), x[token_M1[:, 0]])
    assert torch.equal(gather_sum(y, slot_TK, token_M1), y[slot_TK.reshape(-1)].view(T, K, D).sum(1))
    y32 = y.detach().float()
    assert torch.equal(gather_sum(y32, slot_TK, token_M1), y32[slot_TK.reshape(-1)].view(T, K, D).sum(1))
    for fn, a in ((lambda x: gather_sum(x, token_M1, slot_TK), x), (lambda y: gather_sum(y, slot_TK, token_M1), y)):
        assert torch.autograd.gradcheck(fn, (a,)) and torch.autograd.gradgradcheck(fn, (a,))


@pytest.mark.parametrize("D", [40, 520])  # under one column block (masked), and two blocks (the second masked)
def test_gather_sum_triton_kernel_interpreted_equals_reference(D):
    """The Triton kernel (under TRITON_INTERPRET on CPU, float32) equals the reference bitwise, both ways
    round (K = 3 combine, K = 1 gather), with int64 and int32 indices, forward and backward."""
    from harts.ops.moe.experts import gather_sum

    T, K = 5, 3
    slot_TK, token_M1 = _routing_indices(T, K)
    g = torch.Generator().manual_seed(9)
    y = torch.randn(T * K, D, generator=g, requires_grad=True)
    gy = torch.randn(T, D, generator=g)
    out, ref = (gather_sum(y, slot_TK, token_M1, backend=b) for b in ("fast", "reference"))
    assert torch.equal(out, ref) and torch.equal(out, _sequential_sum(y.detach(), slot_TK))
    (g_fast,), (g_ref,) = (torch.autograd.grad(o, y, gy) for o in (out, ref))
    assert torch.equal(g_fast, g_ref) and torch.equal(g_fast, gy[token_M1[:, 0]])
    assert torch.equal(gather_sum(y.detach(), slot_TK.int(), token_M1.int(), backend="fast"), ref)
    x = y.detach()[:T]
    assert torch.equal(gather_sum(x, token_M1, slot_TK, backend="fast"), x[token_M1[:, 0]])


def test_gather_sum_fast_refuses_float64_and_cpu_without_interpreter(monkeypatch):
    from harts.ops.moe.experts import gather_sum

    slot_TK, token_M1 = _routing_indices(2, 2)
    with pytest.raises(RuntimeError, match="float64"):
        gather_sum(torch.zeros(4, 3, dtype=torch.float64), slot_TK, token_M1, backend="fast")
    import dataclasses

    import harts.env

    monkeypatch.setattr(harts.env, "ENV", dataclasses.replace(harts.env.ENV, triton_interpret=False))
    with pytest.raises(RuntimeError, match="kernels need CUDA"):
        gather_sum(torch.zeros(4, 3), slot_TK, token_M1, backend="fast")
    assert torch.equal(gather_sum(torch.ones(4, 3), slot_TK, token_M1), torch.full((2, 3), 2.0))  # auto: reference


@pytest.mark.gpu
@pytest.mark.parametrize("D", [1536, 2880])  # Ling-3.0-tiny's width, and one that is no multiple of the block
def test_gather_sum_bf16_gpu_exact_deterministic_and_compiles(D):
    """The bf16 kernel on the GPU: inside torch.compile(fullgraph=True) (first, so that in a fresh process the
    op registers while Dynamo traces), bitwise the fp32 sum in k order, close to the reference (torch's
    reduction may add the K rows in another order), deterministic, and equal to eager, forward and backward."""
    from harts.ops.moe.experts import gather_sum

    T, K = 4096, 8
    slot_TK, token_M1 = (t.cuda() for t in _routing_indices(T, K, E=128))
    g = torch.Generator().manual_seed(10)
    y = torch.randn(T * K, D, generator=g).cuda().bfloat16().requires_grad_()
    gy = torch.randn(T, D, generator=g).cuda().bfloat16()
    # a neighbour for Inductor to fuse around the op; the backward is compiled with the forward
    out_c = torch.compile(lambda y: gather_sum(y, slot_TK, token_M1) * 2, fullgraph=True)(y)
    (g_c,) = torch.autograd.grad(out_c, y, gy)
    runs = [gather_sum(y, slot_TK, token_M1, backend="fast") for _ in range(2)]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], _sequential_sum(y.detach(), slot_TK))
    assert torch.equal(gather_sum(y, slot_TK.int(), token_M1.int(), backend="fast"), runs[0])
    torch.testing.assert_close(runs[0], gather_sum(y, slot_TK, token_M1, backend="reference"), rtol=1e-2, atol=1e-2)
    (g_eager,) = torch.autograd.grad(runs[0], y, gy)
    assert torch.equal(g_eager, gy[token_M1[:, 0]])
    assert torch.equal(out_c, runs[0] * 2) and torch.equal(g_c, (gy * 2)[token_M1[:, 0]])


def test_group_score_top2_sum_equals_topk_bitwise_with_ties():
    from harts.ops.moe.router import _top2_sum

    g = torch.Generator().manual_seed(3)
    for x in (torch.randn(512, 8, 16, generator=g, dtype=torch.float64),
              torch.randint(0, 3, (512, 8, 16), generator=g).float()):  # many ties, all-equal groups
        assert torch.equal(_top2_sum(x), x.topk(2, dim=-1).values.sum(-1))


def test_bf16x3_parts_sum_to_the_float32_value_exactly():
    """The router backward's split of a float32 gradient into three bfloat16 parts: summed in float64 they
    give the float32 value bit for bit, over gradients of many magnitudes (1e-30 to 1e30, both signs, exact
    powers of two and values halfway between bfloat16 numbers)."""
    from harts.ops.moe.router import bf16x3

    g = torch.Generator().manual_seed(5)
    t = torch.randn(1 << 16, generator=g) * torch.logspace(-30, 30, 1 << 16)
    halfway = (torch.randn(1024, generator=g).to(torch.bfloat16).float() * (1 + 2.0 ** -8))
    t = torch.cat([t, -t, halfway, torch.tensor([0.0, 1.0, -2.0 ** -100, 3.0 * 2 ** 90])])
    parts = bf16x3(t)
    assert all(p.dtype == torch.bfloat16 for p in parts)
    total = sum(p.double() for p in parts)
    assert torch.equal(total, t.double()), (total - t.double()).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_router_logits_16bit_gpu_within_fp32_rounding_and_compiles(dtype):
    """The tensor-core router GEMM against the float64 product of the same 16-bit values: the products are
    exact, so its error is fp32 summation error, bounded as for the fp32 GEMM of the upcast operands (a
    16-bit output or a TF32 GEMM would be off by ~1e-3 relative). The gradients equal autograd's through
    the upcast within the same bound, eager and inside torch.compile(fullgraph=True)."""
    from harts.ops.moe import router_logits

    T, D, E = 8192, 1536, 128
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, D, generator=g).to(dtype).cuda().requires_grad_()
    w = (torch.randn(E, D, generator=g) / D ** 0.5).to(dtype).cuda().requires_grad_()
    dl = torch.randn(T, E, generator=g).cuda()
    truth = x.detach().double() @ w.detach().double().t()
    upcast = lambda x, w: x.float() @ w.float().t()
    bound = 4 * D * torch.finfo(torch.float32).eps * (x.detach().double().abs() @ w.detach().double().abs().t())
    for fn in (router_logits, torch.compile(router_logits, fullgraph=True)):
        out = fn(x, w)
        assert out.dtype == torch.float32
        assert bool(((out.double() - truth).abs() <= bound).all()), (out.double() - truth).abs().max()
        gx, gw = torch.autograd.grad(out, (x, w), dl)
        rx, rw = torch.autograd.grad(upcast(x, w), (x, w), dl)
        assert gx.dtype == dtype and gw.dtype == dtype
        for a, b, name in ((gx, rx, "dx"), (gw, rw, "dw")):
            rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
            assert rel < 4 * torch.finfo(dtype).eps, (name, rel)
    if dtype == torch.bfloat16:  # the backward's GEMMs before the cast: fp32 sums of exact products
        from harts.ops.moe.router import bf16x3

        parts = torch.cat(bf16x3(dl), dim=1)
        for got, a, b in ((torch.mm(parts, w.detach().repeat(3, 1), out_dtype=torch.float32), dl, w.detach()),
                          (torch.mm(parts.t(), x.detach(), out_dtype=torch.float32).view(3, E, D).sum(0), dl.t(),
                           x.detach())):
            exact = a.double() @ b.double()
            bound = 4 * a.shape[1] * torch.finfo(torch.float32).eps * (a.double().abs() @ b.double().abs())
            assert bool(((got.double() - exact).abs() <= bound).all()), (got.double() - exact).abs().max()


def _swiglu_down_inputs(M, Fw, D=16, n_exp=4, dtype=torch.float32, device="cpu", seed=11):
    """Pre-activations [M, 2F], routing weights, a down weight [E, D, F] and the groups' ends (expert 1 empty),
    and the incoming gradient of the output."""
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(M, 2 * Fw, generator=g) * 2
    scale = torch.rand(M, generator=g)
    w_down = torch.randn(n_exp, D, Fw, generator=g) / Fw ** 0.5
    dy = torch.randn(M, D, generator=g)
    cuts = sorted(torch.randint(0, M + 1, (n_exp - 2,), generator=g).tolist())
    offs = torch.tensor([cuts[0], cuts[0], *cuts[1:], M], dtype=torch.int32)
    to = lambda t: t.to(device=device, dtype=dtype)
    return to(gu), scale.to(device), to(w_down), offs.to(device), to(dy)


def _swiglu_down_loop(gu, scale, w_down, offs, dy):
    """The definition, expert by expert in the inputs' dtype: y = (silu(g) u s) @ w_down[e].T; returns y and the
    gradients of <y, dy> w.r.t. gu, scale and w_down."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (gu, scale, w_down)]
    gu_, s_, wd_ = leaves
    Fw = wd_.shape[-1]
    h = F.silu(gu_[:, :Fw]) * gu_[:, Fw:] * s_.to(gu_.dtype)[:, None]
    ends = [0, *offs.tolist()]
    y = torch.cat([h[a:b] @ wd_[e].T for e, (a, b) in enumerate(zip(ends[:-1], ends[1:]))])
    return [y.detach(), *torch.autograd.grad((y * dy).sum(), leaves)]


@pytest.mark.parametrize("M,Fw", [(37, 40), (21, 264)])  # one masked column block; two, the second masked
def test_moe_swiglu_down_interpreted_matches_float64(M, Fw):
    """``harts::moe_swiglu_down`` (Triton under the interpreter, float32) against the float64 definition: output
    and the gradients of the pre-activations, the routing weights and the down weight are as close to it as the
    float32 definition (within 2x, plus 4 float32 ulps of the largest value); rows not a multiple of the block,
    an expert without rows. The backward's rebuilt activation (the down weight's gradient input) is bitwise the
    forward's."""
    import triton

    from harts.kernels import moe_swiglu
    from harts.kernels.moe_swiglu import moe_swiglu_down

    gu, scale, w_down, offs, dy = _swiglu_down_inputs(M, Fw)
    leaves = [t.detach().clone().requires_grad_(True) for t in (gu, scale, w_down)]
    y = moe_swiglu_down(*leaves, offs)
    fast = [y.detach(), *torch.autograd.grad((y * dy).sum(), leaves)]
    truth = _swiglu_down_loop(*(t.double() if t.is_floating_point() else t for t in (gu, scale, w_down, offs, dy)))
    plain = _swiglu_down_loop(gu, scale, w_down, offs, dy)
    for name, t, a, b in zip(("y", "dgu", "dscale", "dw_down"), truth, fast, plain):
        assert a.dtype == b.dtype and a.shape == t.shape, name
        err, err_plain = (a.double() - t).abs().max().item(), (b.double() - t).abs().max().item()
        assert err <= 2 * err_plain + 4 * torch.finfo(torch.float32).eps * t.abs().max().item(), (name, err, err_plain)
    h_fwd = torch.empty(M, Fw)
    moe_swiglu.moe_swiglu_fwd_kernel[(triton.cdiv(M, moe_swiglu.BM), triton.cdiv(Fw, moe_swiglu.BF))](
        gu, scale, h_fwd, M, Fw, gu.stride(0), h_fwd.stride(0), BM=moe_swiglu.BM, BF=moe_swiglu.BF)
    dh = torch.randn(M, Fw, generator=torch.Generator().manual_seed(3))
    _, _, h_bwd = torch.ops.harts.moe_swiglu_bwd(gu, scale, dh)
    assert torch.equal(h_bwd, h_fwd)


def test_stacked_experts_fast_path_runs_the_fused_swiglu_op_and_checkpointing_saves_it():
    """Under the kernel choice swiglu="harts", with routing weights, the stacked fast path is
    ``harts::moe_swiglu_down`` after the gate-up GEMM (bitwise); under swiglu="torch" it is the torch ops
    (within float32 rounding of it); selective checkpointing keeps that op's output (a matrix product's) instead
    of recomputing it."""
    from torch.utils.checkpoint import CheckpointPolicy

    import harts.ops
    from harts.kernels.moe_swiglu import moe_swiglu_down
    from harts.models.common.compile import _sac_policy
    from harts.ops.moe.experts import _grouped_swiglu_stacked

    gu, scale, w_down, offs, _ = _swiglu_down_inputs(29, 40)
    g = torch.Generator().manual_seed(4)
    x, w_gate_up = torch.randn(29, 16, generator=g), torch.randn(4, 80, 16, generator=g)
    with harts.ops.use_kernel_choices(swiglu="harts"):
        out = _grouped_swiglu_stacked(x, offs, w_gate_up, w_down, scale)
    gu_ = torch._grouped_mm(x, w_gate_up.transpose(-2, -1), offs=offs)
    assert torch.equal(out, moe_swiglu_down(gu_, scale, w_down, offs))
    with harts.ops.use_kernel_choices(swiglu="torch"):
        torch.testing.assert_close(_grouped_swiglu_stacked(x, offs, w_gate_up, w_down, scale), out)
    assert _sac_policy(None, torch.ops.harts.moe_swiglu_down.default) == CheckpointPolicy.MUST_SAVE
    assert _sac_policy(None, torch.ops.harts.moe_swiglu_bwd.default) == CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.gpu
def test_moe_swiglu_down_bf16_gpu_close_to_fp32_and_compiles():
    """bf16 on the GPU at a model width (F = 512): output and gradients against the fp32 definition by relative
    RMS error, no worse than the bf16 definition plus 1e-3; deterministic; inside torch.compile(fullgraph=True)
    bitwise the eager op, forward and backward."""
    from harts.kernels.moe_swiglu import moe_swiglu_down

    gu, scale, w_down, offs, dy = _swiglu_down_inputs(6000, 512, D=256, n_exp=8, dtype=torch.bfloat16,
                                                      device="cuda")

    def run(fn):
        leaves = [t.detach().clone().requires_grad_(True) for t in (gu, scale, w_down)]
        y = fn(*leaves, offs)
        return [y.detach(), *torch.autograd.grad((y.float() * dy.float()).sum(), leaves)]

    eager = run(moe_swiglu_down)
    again = run(moe_swiglu_down)
    compiled = run(torch.compile(lambda *a: moe_swiglu_down(*a) * 1, fullgraph=True))
    f32 = _swiglu_down_loop(*(t.float() if t.is_floating_point() else t for t in (gu, scale, w_down, offs, dy)))
    b16 = _swiglu_down_loop(gu, scale, w_down, offs, dy)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
    for name, a, a2, c, t, b in zip(("y", "dgu", "dscale", "dw_down"), eager, again, compiled, f32, b16):
        assert torch.equal(a, a2) and torch.equal(a, c), name
        e, floor = rel(a, t), rel(b, t)
        print(f"moe_swiglu_down {name}: vs fp32 {e:.2e} (bf16 definition {floor:.2e})")
        assert e <= floor + 1e-3, (name, e, floor)


def test_moe_swiglu_down_frozen_down_weight_gets_no_gradient(monkeypatch):
    """With the down weight and the routing weights frozen, the op's backward runs no weight-gradient GEMM (one
    grouped GEMM, the data gradient, instead of two) and the pre-activations' gradient is bitwise the full
    backward's."""
    from harts.kernels.moe_swiglu import moe_swiglu_down

    gu, scale, w_down, offs, dy = _swiglu_down_inputs(21, 40)
    calls = []
    grouped_mm = torch._grouped_mm

    def counting(*a, **k):
        calls.append(a[0].shape)
        return grouped_mm(*a, **k)

    def backward_gemms(leaves):
        y = moe_swiglu_down(*leaves, offs)
        monkeypatch.setattr(torch, "_grouped_mm", counting)
        calls.clear()
        grads = torch.autograd.grad((y * dy).sum(), [t for t in leaves if t.requires_grad])
        monkeypatch.setattr(torch, "_grouped_mm", grouped_mm)
        return grads, len(calls)

    (g_gu, _, _), n_full = backward_gemms([t.detach().clone().requires_grad_(True) for t in (gu, scale, w_down)])
    (g,), n_frozen = backward_gemms([gu.detach().clone().requires_grad_(True), scale, w_down])
    assert (n_full, n_frozen) == (2, 1) and torch.equal(g, g_gu)
