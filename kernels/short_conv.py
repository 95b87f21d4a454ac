"""Causal depthwise short convolution (width 4) over packed sequences, optionally with ancestor windows, whose
backward recomputes the pre-activation in registers.

fla's ``causal_conv1d`` backward for a SiLU convolution first runs its forward again without the activation
(writing the pre-activation y to memory), then a backward kernel that reads x, dy and y back; on an H100 at
[65,536 x 2,048] that kernel moves its bytes at about a third of the memory bandwidth and the pair costs 1.26 ms
against 0.23 ms for the forward. Here one backward program reads the x rows its window needs (seven shifted
tiles, from cache after the first) and dy, recomputes the pre-activation of its rows and of the three after
them in fp32, and writes dx and its rows' share of dw: no pre-activation in memory, no bf16 rounding of it.

The sequences are chunked as fla's varlen kernels chunk them: one program per (sequence, chunk of BT rows,
block of BD channels), ``chunks_N2`` listing (sequence, chunk). With ``HAS_CONTEXT`` a sequence's window reaches
back into ``ctx_Q3``: the physical rows 3, 2 and 1 steps before its first row along its path (oldest first,
-1 = none, read as zeros), which the tree convolution passes for each compact block (``harts.ops.tree_conv``);
the gradient of those rows is written per sequence to ``dctx_Q3P`` for the caller to add into dx.

Convention as ``harts.ops.conv``: w[:, 3] multiplies the current row, w[:, 3 - s] the row s steps back.
Legend: T rows, P channels, Q sequences, N chunks, BT rows per chunk, BD channels per program.
"""
from __future__ import annotations

import triton
import triton.language as tl

from harts.env import ENV

__all__ = ["short_conv_fwd_kernel", "short_conv_bwd_kernel", "WIDTH", "BT"]

WIDTH = 4  # the kernels unroll the window: Ling-3.0's and Qwen3.5's short convolutions
BT = 32  # rows per program (the host's chunk list is built for it, so it is not autotuned)


def _configs():
    if ENV.triton_interpret:
        return [triton.Config({'BD': 32}, num_warps=4, num_stages=1)]
    return [triton.Config({'BD': bd}, num_warps=w) for bd in (32, 64, 128) for w in (2, 4, 8)]


@triton.jit
def _x_tile(x, rows, bos, eos, o_d, m_d, P, c1, c2, c3, HAS_CONTEXT: tl.constexpr):
    """x[rows] [BT, BD] in fp32: rows of the sequence [bos, eos) as stored, the three rows before bos from the
    context vectors c1 (1 step back), c2, c3 (zeros without context), anything else zero."""
    m = ((rows >= bos) & (rows < eos))[:, None] & m_d[None, :]
    v = tl.load(x + rows[:, None] * P + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_CONTEXT:
        v += tl.where((rows == bos - 1)[:, None], c1[None, :], 0.0)
        v += tl.where((rows == bos - 2)[:, None], c2[None, :], 0.0)
        v += tl.where((rows == bos - 3)[:, None], c3[None, :], 0.0)
    return v


@triton.jit
def _program(cu, chunks_N2, BT: tl.constexpr, BD: tl.constexpr):
    i_d, i_c = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunks_N2 + i_c * 2).to(tl.int64)
    i_t = tl.load(chunks_N2 + i_c * 2 + 1).to(tl.int64)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    o_t = bos + i_t * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    return i_c, i_n, i_t, bos, eos, o_t, o_d


@triton.jit
def _taps(w, o_d, m_d):
    """The four taps of the [P, 4] fp32 weight for channels o_d, oldest row's tap first."""
    w0 = tl.load(w + o_d * 4, mask=m_d, other=0.0)
    w1 = tl.load(w + o_d * 4 + 1, mask=m_d, other=0.0)
    w2 = tl.load(w + o_d * 4 + 2, mask=m_d, other=0.0)
    w3 = tl.load(w + o_d * 4 + 3, mask=m_d, other=0.0)
    return w0, w1, w2, w3


@triton.jit
def _context(x, ctx_Q3, i_n, i_t, o_d, m_d, P, BD: tl.constexpr, HAS_CONTEXT: tl.constexpr):
    """The three context rows of sequence i_n as [BD] fp32 vectors (1, 2, 3 steps back); read only by a
    sequence's first chunk (other chunks never reach before bos), zeros otherwise."""
    c1 = tl.zeros([BD], dtype=tl.float32)
    c2 = tl.zeros([BD], dtype=tl.float32)
    c3 = tl.zeros([BD], dtype=tl.float32)
    if HAS_CONTEXT:
        first = i_t == 0
        r3 = tl.load(ctx_Q3 + i_n * 3).to(tl.int64)
        r2 = tl.load(ctx_Q3 + i_n * 3 + 1).to(tl.int64)
        r1 = tl.load(ctx_Q3 + i_n * 3 + 2).to(tl.int64)
        c1 = tl.load(x + r1 * P + o_d, mask=m_d & first & (r1 >= 0), other=0.0).to(tl.float32)
        c2 = tl.load(x + r2 * P + o_d, mask=m_d & first & (r2 >= 0), other=0.0).to(tl.float32)
        c3 = tl.load(x + r3 * P + o_d, mask=m_d & first & (r3 >= 0), other=0.0).to(tl.float32)
    return c1, c2, c3


@triton.autotune(configs=_configs(), key=['P', 'SILU', 'HAS_CONTEXT'])
@triton.jit
def short_conv_fwd_kernel(x, w, y, cu, chunks_N2, ctx_Q3, P, BT: tl.constexpr, BD: tl.constexpr,
                          SILU: tl.constexpr, HAS_CONTEXT: tl.constexpr):
    i_c, i_n, i_t, bos, eos, o_t, o_d = _program(cu, chunks_N2, BT, BD)
    m_d = o_d < P
    c1, c2, c3 = _context(x, ctx_Q3, i_n, i_t, o_d, m_d, P, BD, HAS_CONTEXT)
    w0, w1, w2, w3 = _taps(w, o_d, m_d)
    acc = w3[None, :] * _x_tile(x, o_t, bos, eos, o_d, m_d, P, c1, c2, c3, HAS_CONTEXT)
    acc += w2[None, :] * _x_tile(x, o_t - 1, bos, eos, o_d, m_d, P, c1, c2, c3, HAS_CONTEXT)
    acc += w1[None, :] * _x_tile(x, o_t - 2, bos, eos, o_d, m_d, P, c1, c2, c3, HAS_CONTEXT)
    acc += w0[None, :] * _x_tile(x, o_t - 3, bos, eos, o_d, m_d, P, c1, c2, c3, HAS_CONTEXT)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    m = (o_t < eos)[:, None] & m_d[None, :]
    tl.store(y + o_t[:, None] * P + o_d[None, :], acc.to(y.dtype.element_ty), mask=m)


@triton.jit
def _grad_pre(dy, pre, rows, eos, o_d, m_d, P, SILU: tl.constexpr):
    """dL/d(pre-activation) at ``rows`` (zero past the sequence's end)."""
    m = (rows < eos)[:, None] & m_d[None, :]
    g = tl.load(dy + rows[:, None] * P + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    if SILU:
        s = tl.sigmoid(pre)
        g = g * s * (1.0 + pre * (1.0 - s))
    return g


@triton.jit
def _row(tile, i, BT: tl.constexpr):
    """Row i of a [BT, BD] tile as [BD]."""
    return tl.sum(tl.where((tl.arange(0, BT) == i)[:, None], tile, 0.0), axis=0)


@triton.autotune(configs=_configs(), key=['P', 'SILU', 'HAS_CONTEXT'])
@triton.jit
def short_conv_bwd_kernel(x, w, dy, dx, dw_NP4, dctx_Q3P, cu, chunks_N2, ctx_Q3, P, BT: tl.constexpr,
                          BD: tl.constexpr, SILU: tl.constexpr, HAS_CONTEXT: tl.constexpr):
    i_c, i_n, i_t, bos, eos, o_t, o_d = _program(cu, chunks_N2, BT, BD)
    m_d = o_d < P
    c1, c2, c3 = _context(x, ctx_Q3, i_n, i_t, o_d, m_d, P, BD, HAS_CONTEXT)
    w0, w1, w2, w3 = _taps(w, o_d, m_d)
    # x at rows t - 3 .. t + 3, named by the shift, loaded as the pre-activation gradients g(t + s), s = 0..3 (the
    # rows whose windows read row t), need them: each tile is dead after its last use, so at most six are live
    xm3 = _x_tile(x, o_t - 3, bos, eos, o_d, m_d, P, c1, c2, c3, HAS_CONTEXT)
    xm2 = _x_tile(x, o_t - 2, bos, eos, o_d, m_d, P, c1, c2, c3, HAS_CONTEXT)
    xm1 = _x_tile(x, o_t - 1, bos, eos, o_d, m_d, P, c1, c2, c3, HAS_CONTEXT)
    x0 = _x_tile(x, o_t, bos, eos, o_d, m_d, P, c1, c2, c3, HAS_CONTEXT)
    g0 = _grad_pre(dy, w0[None, :] * xm3 + w1[None, :] * xm2 + w2[None, :] * xm1 + w3[None, :] * x0,
                   o_t, eos, o_d, m_d, P, SILU)
    # this program's rows' share of dw[:, j] = sum_t g(t) x(t - 3 + j); g0 is zero past eos
    p_dw = dw_NP4 + i_c.to(tl.int64) * P * 4 + o_d * 4
    tl.store(p_dw, tl.sum(g0 * xm3, axis=0), mask=m_d)
    tl.store(p_dw + 1, tl.sum(g0 * xm2, axis=0), mask=m_d)
    tl.store(p_dw + 2, tl.sum(g0 * xm1, axis=0), mask=m_d)
    tl.store(p_dw + 3, tl.sum(g0 * x0, axis=0), mask=m_d)
    if HAS_CONTEXT:
        # the context rows' gradient, from the first three rows' pre-activation gradient (first chunk only):
        # row bos - k feeds row bos + i through w[3 - k - i]
        if i_t == 0:
            r0, r1, r2 = _row(g0, 0, BT), _row(g0, 1, BT), _row(g0, 2, BT)
            p_c = dctx_Q3P + i_n * 3 * P + o_d
            tl.store(p_c + 2 * P, w2 * r0 + w1 * r1 + w0 * r2, mask=m_d)  # 1 step back
            tl.store(p_c + P, w1 * r0 + w0 * r1, mask=m_d)  # 2 steps back
            tl.store(p_c, w0 * r0, mask=m_d)  # 3 steps back
    # dx(t) = sum_s w[3 - s] g(t + s)
    b_dx = w3[None, :] * g0
    xp1 = _x_tile(x, o_t + 1, bos, eos, o_d, m_d, P, c1, c2, c3, HAS_CONTEXT)
    b_dx += w2[None, :] * _grad_pre(dy, w0[None, :] * xm2 + w1[None, :] * xm1 + w2[None, :] * x0 + w3[None, :] * xp1,
                                    o_t + 1, eos, o_d, m_d, P, SILU)
    xp2 = _x_tile(x, o_t + 2, bos, eos, o_d, m_d, P, c1, c2, c3, HAS_CONTEXT)
    b_dx += w1[None, :] * _grad_pre(dy, w0[None, :] * xm1 + w1[None, :] * x0 + w2[None, :] * xp1 + w3[None, :] * xp2,
                                    o_t + 2, eos, o_d, m_d, P, SILU)
    xp3 = _x_tile(x, o_t + 3, bos, eos, o_d, m_d, P, c1, c2, c3, HAS_CONTEXT)
    b_dx += w0[None, :] * _grad_pre(dy, w0[None, :] * x0 + w1[None, :] * xp1 + w2[None, :] * xp2 + w3[None, :] * xp3,
                                    o_t + 3, eos, o_d, m_d, P, SILU)
    m = (o_t < eos)[:, None] & m_d[None, :]
    tl.store(dx + o_t[:, None] * P + o_d[None, :], b_dx.to(dx.dtype.element_ty), mask=m)
