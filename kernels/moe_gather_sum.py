"""Gather-sum of routed rows: ``out[t] = sum_{k<K} src[idx[t, k]]``, fp32 accumulation in k order.

Why a kernel: the MoE combine (expert-sorted rows back to tokens, summed over the K slots) and the
backward of the slot gather are this one operation; the slot gather and the combine's backward are its
K = 1 case. Inductor lowered the gather-then-sum at a fifth of the memory bandwidth on the H200 (T=65536,
K=8, D=1536 bf16: 1.90 ms, 0.96 TB/s). Here each program reads the K indices of a few tokens, then the K
source rows as contiguous 16-byte loads of BD columns, adds them in fp32 in slot order and writes the
rounded row once: 0.42 ms, 4.3 TB/s, the speed of a device copy (``python -m benchmarks.kernels --only
moe_gather``). No atomics, so the result is deterministic, and it is the fp32 sum in k order bitwise.

``moe_gather_sum`` is the launcher, the differentiable op ``harts::moe_gather_sum`` (registered on first
access). Interpreter-safe (no data-dependent Python control flow), so CPU CI runs it in float32 (eager only: the
interpreter's kernels cannot be traced by torch.compile).
Legend: T tokens, K slots per token, M source rows, D hidden; BT tokens and BD columns per program.
"""
import triton
import triton.language as tl

from harts.kernels import launchable, lazy_op

# Columns per program, and the tokens of a program's tile (BT * BD elements, 16 per thread at 4 warps):
# 512 bf16 columns are 8 x 16-byte loads per warp per row; D = 1536 / 2048 / 4096 split evenly. A fixed
# choice, no autotuning: on the H200 it was within 1% of the best of 45 (BT, BD, warps) configurations at
# D = 1536, 2048 and 4096 (K = 8, T = 65536), all at 4.3 TB/s.
MAX_BD = 512
TILE = 2048
NUM_WARPS = 4


@triton.jit
def moe_gather_sum_fwd_kernel(src, idx, out, T, D, stride_src, stride_out, K: tl.constexpr, BT: tl.constexpr,
                              BD: tl.constexpr):
    """Program (i_t, i_d): tokens [i_t * BT, +BT) x columns [i_d * BD, +BD)."""
    i_t, i_d = tl.program_id(0), tl.program_id(1)
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_t = o_t < T
    m_td = m_t[:, None] & (o_d < D)[None, :]
    b_acc = tl.zeros([BT, BD], dtype=tl.float32)
    for k in tl.static_range(K):
        # int64 row offsets: M * D passes 2^31 at T = 65536, K = 8, D = 4096
        b_row = tl.load(idx + o_t * K + k, mask=m_t, other=0).to(tl.int64)
        b_src = tl.load(src + b_row[:, None] * stride_src + o_d[None, :], mask=m_td, other=0.0)
        b_acc += b_src.to(tl.float32)
    tl.store(out + o_t[:, None] * stride_out + o_d[None, :], b_acc.to(out.dtype.element_ty), mask=m_td)


def block_sizes(D: int) -> tuple[int, int]:
    """(BT, BD) for width D: BD covers D up to MAX_BD columns, BT fills the tile (at most 64 tokens)."""
    BD = min(MAX_BD, triton.next_power_of_2(max(D, 1)))
    return min(64, TILE // BD), BD


def grid(T: int, D: int) -> tuple[int, int]:
    BT, BD = block_sizes(D)
    return triton.cdiv(T, BT), triton.cdiv(D, BD)


def _register_op():
    """The launcher as the differentiable torch op ``harts::moe_gather_sum``. A triton_op enters
    torch.compile graphs without a break: AOTAutograd decomposes it into this body, so Inductor sees the
    Triton launch as a user-defined kernel; the fake implementation is the body itself, on fake tensors."""
    import torch

    @torch.library.triton_op("harts::moe_gather_sum", mutates_args=())
    def moe_gather_sum(src_MD: torch.Tensor, idx_TK: torch.Tensor, inv_MJ: torch.Tensor) -> torch.Tensor:
        """out_TD[t] = sum_k src_MD[idx_TK[t, k]]; ``inv_MJ`` (the transpose of ``idx_TK``, see
        ``harts.ops.moe.experts.gather_sum``) is only read by the backward."""
        src_MD, idx_TK = src_MD.contiguous(), idx_TK.contiguous()
        T, K = idx_TK.shape
        D = src_MD.shape[1]
        out_TD = src_MD.new_empty(T, D)
        if T > 0 and D > 0:
            BT, BD = block_sizes(int(D))
            launchable(moe_gather_sum_fwd_kernel)[grid(T, int(D))](
                src_MD, idx_TK, out_TD, T, D, src_MD.stride(0), out_TD.stride(0), K=int(K), BT=BT, BD=BD,
                num_warps=NUM_WARPS)
        return out_TD

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[1:])

    def backward(ctx, grad_TD):
        """The same gather-sum with the indices swapped (harts.ops.moe.experts.gather_sum says why)."""
        idx_TK, inv_MJ = ctx.saved_tensors
        return torch.ops.harts.moe_gather_sum(grad_TD, inv_MJ, idx_TK), None, None

    moe_gather_sum.register_autograd(backward, setup_context=setup_context)
    return moe_gather_sum


__getattr__ = lazy_op(__name__, "moe_gather_sum", _register_op)
