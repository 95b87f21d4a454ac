"""compact_logprobs: Triton fast path (interpreter on CPU, fp32) and the pure-torch reference.

Independent oracle: expand the compact rows to the S semantic positions and take log_softmax over
the full vocabulary (what a trainer without prefix sharing computes).
"""
import pytest
import torch

from harts.ops.logprobs import compact_logprobs, compact_logprobs_reference


def _expand_oracle(h_CD, w_VD, rows_S, tgts_S):
    logits_SV = h_CD[rows_S] @ w_VD.T
    return torch.log_softmax(logits_SV, dim=-1).gather(-1, tgts_S[:, None])[:, 0]


def _problem(C, V, D, S, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(C, D, generator=g, dtype=dtype) * 0.5
    w = torch.randn(V, D, generator=g, dtype=dtype) * 0.5
    rows = torch.randint(0, C, (S,), generator=g)
    rows[:C] = torch.arange(C)  # every row read at least once; several read many times
    tgts = torch.randint(0, V, (S,), generator=g)
    up = torch.randn(S, generator=g, dtype=dtype)
    return h, w, rows, tgts, up


def _grads(fn, h, w, rows, tgts, up):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(h, w, rows, tgts)
    (out * up.to(out.dtype)).sum().backward()
    return out.detach(), h.grad, w.grad


def test_reference_float64_matches_expand_oracle():
    h, w, rows, tgts, up = _problem(C=37, V=101, D=16, S=150, dtype=torch.float64)
    ref = _grads(lambda *a: compact_logprobs_reference(*a, block_rows=8), h, w, rows, tgts, up)
    exp = _grads(_expand_oracle, h, w, rows, tgts, up)
    for a, b in zip(ref, exp):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_triton_fp32_matches_expand_oracle():
    # Small blocks so several row and vocabulary blocks (including ragged last ones) are exercised.
    h, w, rows, tgts, up = _problem(C=21, V=300, D=32, S=80, dtype=torch.float32, seed=1)
    fast = _grads(lambda *a: compact_logprobs(*a, block_rows=8, block_vocab=128), h, w, rows, tgts, up)
    exp = _grads(_expand_oracle, h.double(), w.double(), rows, tgts, up.double())
    for a, b in zip(fast, exp):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def test_bad_indices_are_named():
    h, w, rows, tgts, _ = _problem(C=4, V=10, D=8, S=6, dtype=torch.float32)
    rows[3] = 4
    with pytest.raises(ValueError, match=r"rows_S\[3\] = 4"):
        compact_logprobs_reference(h, w, rows, tgts)
    rows[3] = 0
    tgts[5] = -1
    with pytest.raises(ValueError, match=r"targets_S\[5\] = -1"):
        compact_logprobs(h, w, rows, tgts)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_matches_reference(dtype):
    h, w, rows, tgts, up = _problem(C=3000, V=40000, D=256, S=17000, dtype=torch.float32, seed=2)
    h, w = h.to(dtype), w.to(dtype)
    dev = [x.cuda() for x in (h, w, rows, tgts, up)]
    fast = _grads(lambda *a: compact_logprobs(*a, block_rows=1024, block_vocab=8192), *dev)
    ref = _grads(compact_logprobs_reference, *dev)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fast[0], ref[0], **tol)
    for a, b in zip(fast[1:], ref[1:]):
        err = (a.float() - b.float()).norm() / b.float().norm()
        assert err < (1e-4 if dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sub_mm_accumulates_the_product_in_place_within_fp32_rounding(dtype):
    """``_sub_mm_`` (the backward's ``dh -= P W`` / ``dW -= P^T h``): c - a @ b in c's fp32 storage, in place,
    with a transposed operand as the backward passes it, within fp32 rounding of the float64 value (the operands
    rounded to ``dtype`` first, as the kernel sees them)."""
    from harts.ops.logprobs.fused import _sub_mm_

    g = torch.Generator().manual_seed(4)
    a = torch.randn(40, 24, generator=g).to(dtype)
    b = torch.randn(40, 33, generator=g).to(dtype)
    c = torch.randn(24, 33, generator=g)
    truth = c.double() - a.double().T @ b.double()
    out = c.clone()
    ptr = out.data_ptr()
    assert _sub_mm_(out, a.T, b).data_ptr() == ptr and out.data_ptr() == ptr and out.dtype == torch.float32
    bound = 8 * torch.finfo(torch.float32).eps * (c.double().abs() + a.double().abs().T @ b.double().abs()).max()
    assert (out.double() - truth).abs().max() <= bound


@pytest.mark.gpu
def test_sub_mm_bf16_gpu_within_fp32_rounding_either_way():
    """On the GPU with bf16 operands ``_sub_mm_`` runs the GEMM with an fp32 accumulator in its epilogue if this
    torch's addmm takes one (the check is logged and printed), else the product and a subtraction; either way
    the result is the float64 value within fp32 rounding, also on a row slice of a larger accumulator."""
    from harts.ops.logprobs.fused import _epilogue_accumulates, _sub_mm_

    g = torch.Generator().manual_seed(5)
    a = torch.randn(4096, 512, generator=g).to(torch.bfloat16).cuda()
    b = torch.randn(4096, 768, generator=g).to(torch.bfloat16).cuda()
    c = torch.randn(1024, 768, generator=g).cuda()
    print("epilogue accumulation:", _epilogue_accumulates(a.device))
    truth = c.double()
    truth[256:768] -= a.double().T @ b.double()
    out = c.clone()
    _sub_mm_(out[256:768], a.T, b)
    bound = 8 * torch.finfo(torch.float32).eps * (c.double().abs()[256:768]
                                                   + a.double().abs().T @ b.double().abs()).max()
    assert (out.double() - truth).abs().max() <= bound and torch.equal(out[:256], c[:256])
