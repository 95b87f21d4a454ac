"""Triton kernels for compact log-probs: the epilogues of a row x vocab blocked LM-head GEMM.

The GEMMs themselves go through cuBLAS (``torch.mm`` with an fp32 output); these kernels fuse what
happens to each fp32 logits block so it is read exactly once:

* ``logprobs_fwd_kernel_lse``: online log-sum-exp across vocabulary blocks (running max ``m`` and
  rescaled sum ``s`` per row, updated in place).
* ``logprobs_bwd_kernel_p``: the softmax part of the gradient, ``P = gsum * exp(logits - lse)``,
  written in the GEMM input dtype for the dh / dW products (Eq. 19: ``gsum`` already sums the
  upstream gradients of all semantic positions that read the row).

Both are interpreter-safe (one config, no data-dependent Python control flow).
Legend: R rows of the block, NV vocabulary columns of the block.
"""
import triton
import triton.language as tl


@triton.jit
def logprobs_fwd_kernel_lse(logits, m, s, NV, stride_r, BN: tl.constexpr):
    """One program per row: fold logits[row, :NV] into (m[row], s[row])."""
    i_r = tl.program_id(0).to(tl.int64)
    p_row = logits + i_r * stride_r
    b_m = tl.load(m + i_r)
    b_s = tl.load(s + i_r)
    for i_n in range(0, tl.cdiv(NV, BN)):
        o_n = i_n * BN + tl.arange(0, BN)
        b_x = tl.load(p_row + o_n, mask=o_n < NV, other=float('-inf')).to(tl.float32)
        b_mn = tl.maximum(b_m, tl.max(b_x, axis=0))
        b_s = b_s * tl.exp(b_m - b_mn) + tl.sum(tl.exp(b_x - b_mn), axis=0)
        b_m = b_mn
    tl.store(m + i_r, b_m)
    tl.store(s + i_r, b_s)


@triton.jit
def logprobs_bwd_kernel_p(logits, lse, gsum, p, NV, stride_r, stride_pr, BN: tl.constexpr):
    """One program per row: p[row, :NV] = gsum[row] * exp(logits[row, :NV] - lse[row])."""
    i_r = tl.program_id(0).to(tl.int64)
    b_lse = tl.load(lse + i_r)
    b_g = tl.load(gsum + i_r)
    for i_n in range(0, tl.cdiv(NV, BN)):
        o_n = i_n * BN + tl.arange(0, BN)
        m_n = o_n < NV
        b_x = tl.load(logits + i_r * stride_r + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_p = b_g * tl.exp(b_x - b_lse)
        tl.store(p + i_r * stride_pr + o_n, b_p.to(p.dtype.element_ty), mask=m_n)


def logprobs_fwd_lse(logits_RN, m_R, s_R):
    """Update the running (max, sum-exp) of each row with one fp32 logits block, in place."""
    R, NV = logits_RN.shape
    if R == 0 or NV == 0:
        return
    assert logits_RN.stride(1) == 1 and logits_RN.dtype == m_R.dtype == s_R.dtype
    BN = min(4096, triton.next_power_of_2(NV))
    logprobs_fwd_kernel_lse[(R,)](logits_RN, m_R, s_R, NV, logits_RN.stride(0), BN=BN)


def logprobs_bwd_p(logits_RN, lse_R, gsum_R, out_RN):
    """out = gsum[:, None] * exp(logits - lse[:, None]), cast to out's dtype."""
    R, NV = logits_RN.shape
    if R == 0 or NV == 0:
        return out_RN
    assert logits_RN.stride(1) == 1 and out_RN.stride(1) == 1
    BN = min(4096, triton.next_power_of_2(NV))
    logprobs_bwd_kernel_p[(R,)](logits_RN, lse_R, gsum_R, out_RN, NV, logits_RN.stride(0), out_RN.stride(0), BN=BN)
    return out_RN
