"""Packed bottom-right-causal attention: SDPA reference vs brute-force softmax, and the GPU fast path."""
import pytest
import torch

from harts.ops.attention import varlen_attention, varlen_attention_reference


def brute_force(q, k, v, cu_q, cu_k, scale):
    out = []
    for n in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[n]:cu_q[n + 1]], k[cu_k[n]:cu_k[n + 1]], v[cu_k[n]:cu_k[n + 1]]
        lq, lk = qs.shape[0], ks.shape[0]
        for i in range(lq):
            s = torch.einsum("hd,jhd->hj", qs[i], ks[: i + (lk - lq) + 1]) * scale
            out.append(torch.einsum("hj,jhd->hd", s.softmax(-1), vs[: i + (lk - lq) + 1]))
    return torch.stack(out)


def _packed(lq, lk, H=3, D=12, Dv=8, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
    cq = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), device=device, dtype=torch.int32)
    ck = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), device=device, dtype=torch.int32)
    return r(sum(lq), H, D), r(sum(lk), H, D), r(sum(lk), H, Dv), cq, ck


@pytest.mark.parametrize("lq,lk", [([5, 9, 1], [5, 9, 1]), ([3, 9, 2], [7, 9, 6]), ([0, 4], [3, 4])])
def test_reference_matches_brute_force(lq, lk):
    q, k, v, cq, ck = _packed(lq, lk)
    o = varlen_attention_reference(q, k, v, cq, ck, 0.3)
    torch.testing.assert_close(o, brute_force(q, k, v, cq.tolist(), ck.tolist(), 0.3), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("lq,lk", [([5, 9, 1], [5, 9, 1]), ([3, 9, 2], [7, 9, 6])])
def test_reference_query_blocks_match_brute_force(lq, lk, monkeypatch):
    """Long sequences run in query blocks with recomputation in backward (bounded score memory in both
    passes); force tiny blocks here and check values and all three gradients against autograd through the
    brute force."""
    import harts.ops.attention.reference as ref

    monkeypatch.setattr(ref, "_SCORE_ELEMS", 2 * 3 * 9)  # 2 queries per block at Lk = 9, 3 heads
    q, k, v, cq, ck = (t.requires_grad_(t.is_floating_point()) for t in _packed(lq, lk))
    o = varlen_attention_reference(q, k, v, cq, ck, 0.3)
    o_bf = brute_force(q, k, v, cq.tolist(), ck.tolist(), 0.3)
    torch.testing.assert_close(o, o_bf, rtol=1e-12, atol=1e-12)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(5), dtype=o.dtype)
    grads = torch.autograd.grad((o * w).sum(), (q, k, v))
    grads_bf = torch.autograd.grad((o_bf * w).sum(), (q, k, v))
    for name, a, b in zip("qkv", grads, grads_bf):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12, msg=lambda m: f"d{name}: {m}")


def test_more_queries_than_keys_is_an_error():
    q, k, v, cq, ck = _packed([4, 3], [4, 2])
    with pytest.raises(ValueError, match="sequence 1"):
        varlen_attention_reference(q, k, v, cq, ck, 0.3)


def test_auto_on_cpu_is_reference_and_fast_refuses():
    q, k, v, cq, ck = _packed([4], [4])
    torch.testing.assert_close(varlen_attention(q, k, v, cq, ck, 0.3), varlen_attention_reference(q, k, v, cq, ck, 0.3))
    with pytest.raises(RuntimeError, match="fast backend for attention"):
        varlen_attention(q, k, v, cq, ck, 0.3, backend="fast")


@pytest.mark.gpu
@pytest.mark.parametrize("lq,lk", [([700, 1, 300], [700, 1, 300]), ([100, 5, 300], [900, 5, 1000])])
def test_fast_matches_sdpa_bottom_right_gpu(lq, lk):
    q, k, v, cq, ck = _packed(lq, lk, H=4, D=192, Dv=128, dtype=torch.bfloat16, device="cuda")
    for t in (q, k, v):
        t.requires_grad_(True)
    o = varlen_attention(q, k, v, cq, ck, 192 ** -0.5, backend="fast")
    do = torch.randn_like(o)
    g = torch.autograd.grad((o * do).sum(), (q, k, v))
    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    o_ref = varlen_attention_reference(qf, kf, vf, cq, ck, 192 ** -0.5)  # SDPA + explicit bottom-right mask
    g_ref = torch.autograd.grad((o_ref * do.float()).sum(), (qf, kf, vf))
    torch.testing.assert_close(o.float(), o_ref, rtol=2e-2, atol=2e-2)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a.float(), b, rtol=5e-2, atol=5e-2)


def test_cudnn_length_buckets_bound_padding_and_shapes():
    """Each sequence is padded to a bucket so cuDNN plans are reused across trajectory lengths: at least
    the length, at most 1/16 (or 127 rows) more, and a bounded number of distinct shapes per octave."""
    from harts.ops.attention.fast import _bucket

    for L in range(1, 70_000, 7):
        b = _bucket(L)
        assert L <= b <= L + max(127, L // 16), L
    assert len({_bucket(L) for L in range(8193, 16385)}) == 16


def _errors_vs_flash(lens, D, Dv, seed, attend, G=4):
    """Max errors relative to the largest value (o, dq, dk, dv) of ``attend(q, k, v, cu, scale)`` and of the
    flash varlen kernel (reached with a copy of cu_seqlens for the keys) against the float64 truth
    (brute-force causal softmax via the SDPA reference, key / value heads repeated); bf16 on CUDA, 4 query
    heads, G key / value heads."""
    q, k, v, cq, _ = _packed(lens, lens, H=4, D=D, Dv=Dv, dtype=torch.bfloat16, device="cuda", seed=seed)
    k, v = k[:, :G].contiguous(), v[:, :G].contiguous()
    for t in (q, k, v):
        t.requires_grad_(True)
    do = torch.randn(q.shape[0], 4, Dv, device="cuda", dtype=torch.bfloat16)
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    o_ref = varlen_attention(qd, kd, vd, cq, cq, D ** -0.5, backend="reference")
    truth = [o_ref, *torch.autograd.grad((o_ref * do.double()).sum(), (qd, kd, vd))]

    def errors(run):
        o = run()
        got = [o, *torch.autograd.grad((o * do).sum(), (q, k, v))]
        return [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, truth)]

    return (errors(lambda: attend(q, k, v, cq, D ** -0.5)),
            errors(lambda: varlen_attention(q, k, v, cq, cq.clone(), D ** -0.5, backend="fast")))


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[2100, 1, 300, 6000], [128, 0, 8200]])
def test_packed_self_attention_cudnn_within_flash_error_gpu(lens):
    """Queries and keys over the same rows (one cu_seqlens tensor, sequences long enough on average) take
    cuDNN per sequence, padded to a length bucket; the same call with a copy of cu_seqlens for the keys takes
    the flash varlen kernel. Both against the float64 truth (brute-force causal softmax via the SDPA
    reference): cuDNN's output and gradients are as close as flash's (within 2x, plus a bf16 rounding)."""
    from harts.ops.attention.fast import packed_self_attention_impl

    q, k, v, _, _ = _packed(lens, lens, H=4, D=192, Dv=128, dtype=torch.bfloat16, device="cuda", seed=1)
    assert packed_self_attention_impl(q, k, v, len(lens))[0] == "cudnn_sdpa"
    cudnn, flash = _errors_vs_flash(lens, 192, 128, 1, lambda q, k, v, cu, scale: varlen_attention(
        q, k, v, cu, cu, scale, backend="fast"))
    for name, e_c, e_f in zip(("o", "dq", "dk", "dv"), cudnn, flash):
        assert e_c <= 2 * e_f + 2 ** -8, (name, e_c, e_f)


@pytest.mark.gpu
@pytest.mark.parametrize("G", [4, 2])
def test_cudnn_per_sequence_at_equal_head_dims_within_flash_error_gpu(G):
    """cuDNN per sequence at Qwen3.5's gated-attention head dims (256 / 256), as the dispatcher sends them:
    output and gradients against the float64 truth, within 2x of the flash varlen kernel's error; with
    grouped key / value heads (G = 2 of 4) too, which cuDNN reads unrepeated."""
    from harts.ops.attention.fast import packed_self_attention_impl

    lens = [2100, 1, 300, 6000]
    q, k, v, _, _ = _packed(lens, lens, H=4, D=256, Dv=256, dtype=torch.bfloat16, device="cuda", seed=2)
    assert packed_self_attention_impl(q, k[:, :G], v[:, :G], len(lens))[0] == "cudnn_sdpa"
    cudnn, flash = _errors_vs_flash(lens, 256, 256, 2, lambda q, k, v, cu, scale: varlen_attention(
        q, k, v, cu, cu, scale, backend="fast"), G=G)
    for name, e_c, e_f in zip(("o", "dq", "dk", "dv"), cudnn, flash):
        assert e_c <= 2 * e_f + 2 ** -8, (name, e_c, e_f)


def test_short_sequences_keep_the_packed_varlen_launch():
    from harts.ops.attention.fast import CUDNN_MIN_MEAN_LEN, packed_self_attention_impl

    q = torch.zeros(3 * CUDNN_MIN_MEAN_LEN - 1, 2, 8)
    kernel, why = packed_self_attention_impl(q, q, q, num_sequences=3)
    assert kernel != "cudnn_sdpa" and "shorter than" in why


def test_packed_kernel_switch():
    """The kernel choice packed_attention='varlen' sends packed self-attention to the varlen kernel whatever
    cuDNN could take (the reason names the choice); an unknown value is refused with the value named."""
    import harts.ops
    from harts.ops.attention.fast import CUDNN_MIN_MEAN_LEN, packed_self_attention_impl

    q = torch.zeros(2 * CUDNN_MIN_MEAN_LEN, 2, 8)
    with harts.ops.use_kernel_choices(packed_attention="varlen"):
        kernel, why = packed_self_attention_impl(q, q, q, num_sequences=1)
    assert kernel != "cudnn_sdpa" and why == "cuDNN not used: kernel choice packed_attention='varlen'"
    assert packed_self_attention_impl(q, q, q, num_sequences=1)[1] == "cuDNN not used: not on CUDA"
    with pytest.raises(ValueError, match="packed_attention='flash'"):
        harts.ops.set_kernel_choices(packed_attention="flash")


@pytest.mark.parametrize("checkpointed,G", [(False, 2), (True, 2), (False, 1)])
def test_per_sequence_attention_plumbing_float64(checkpointed, G):
    """The cuDNN path's per-sequence plumbing (bucket padding, one autograd node writing each sequence's
    gradient rows once) with SDPA's math backend on the CPU: the reference attention in float64, values and
    q/k/v gradients, also when the call is recomputed under non-reentrant activation checkpointing (the
    model's full-recompute policy)."""
    from torch.nn.attention import SDPBackend
    from torch.utils.checkpoint import checkpoint

    from harts.ops.attention.fast import _cudnn_per_sequence

    lens = [130, 0, 1, 300]
    q, k, v, cq, _ = _packed(lens, lens, H=2, D=12, Dv=8, seed=3)
    k, v = k[:, :G].contiguous(), v[:, :G].contiguous()  # G = 1: both query heads read one key / value head
    leaves = [t.requires_grad_(True) for t in (q, k, v)]

    def f(q, k, v):
        return _cudnn_per_sequence(q, k, v, cq, 0.3, sdpa_backend=SDPBackend.MATH) * 1.5

    o = checkpoint(f, *leaves, use_reentrant=False) if checkpointed else f(*leaves)
    o_ref = varlen_attention(q, k, v, cq, cq, 0.3, backend="reference") * 1.5
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for name, a, b in zip("qkv", torch.autograd.grad((o * w).sum(), leaves),
                          torch.autograd.grad((o_ref * w).sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"d{name}: {m}")
    with torch.no_grad():
        torch.testing.assert_close(f(q, k, v), o_ref, rtol=1e-12, atol=1e-12)


def test_cudnn_shapes_are_reported_once():
    """Benchmarks tell plan-building runs from steady-state ones by the cuDNN shapes met for the first time."""
    from harts.ops.attention import fast

    a, b = ("causal", 128, 128, 4, 192, 128, "test-a"), ("full", 128, 256, 4, 200, 128, "test-b")
    seen = []
    fast.CUDNN_SHAPE_HOOKS.append(seen.append)
    try:
        for key in (a, a, b, a):
            fast.note_cudnn_shape(*key)
    finally:
        fast.CUDNN_SHAPE_HOOKS.remove(seen.append)
    assert seen == [a, b]
