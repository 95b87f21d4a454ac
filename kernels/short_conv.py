"""Causal depthwise short convolution (width 4) over packed sequences, optionally with ancestor windows, whose
backward recomputes the pre-activation in registers, once per row.

fla's ``causal_conv1d`` backward for a SiLU convolution first runs its forward again without the activation
(writing the pre-activation y to memory), then a backward kernel that reads x, dy and y back; on an H100 at
[65,536 x 2,048] that kernel moves its bytes at about a third of the memory bandwidth and the pair costs 1.26 ms
against 0.23 ms for the forward. A tiled backward that recomputes the pre-activation instead (each program
loading its rows' x shifted seven times and dy four times, the SiLU derivative of every row computed four
times) did four times the forward's work per row and ran at a quarter of the bandwidth too. So each program here
walks its rows in order with a sliding window in registers: per row it reads one x row and one dy row, computes
the pre-activation and its gradient once, and emits dx of the row three back, whose four consumers are then
known. Every x and dy row is read once (plus three rows of halo per chunk); no pre-activation in memory.

The sequences are chunked as fla's varlen kernels chunk them: one program per (sequence, chunk of BT rows,
block of BD channels), ``chunks_N2`` listing (sequence, chunk). With ``HAS_CONTEXT`` a sequence's window reaches
back into ``ctx_Q3``: the physical rows 3, 2 and 1 steps before its first row along its path (oldest first,
-1 = none, read as zeros), which the tree convolution passes for each compact block (``harts.ops.tree_conv``);
the gradient of those rows is written per sequence to ``dctx_Q3P`` for the caller to add into dx. The context
only redirects the three halo rows of a sequence's first chunk (scalar index arithmetic), so a tree costs what
the trajectory-wise convolution costs per row.

Convention as ``harts.ops.conv``: w[:, 3] multiplies the current row, w[:, 3 - s] the row s steps back.
Legend: T rows, P channels, Q sequences, N chunks, BT rows per chunk, BD channels per program.
"""
from __future__ import annotations

import triton
import triton.language as tl

from harts.env import ENV

__all__ = ["short_conv_fwd_kernel", "short_conv_bwd_kernel", "WIDTH", "BT"]

WIDTH = 4  # the kernels unroll the window: Ling-3.0's and Qwen3.5's short convolutions
BT = 64  # rows per program (the host's chunk list is built for it, so it is not autotuned)


def _configs():
    if ENV.triton_interpret:
        return [triton.Config({'BD': 32}, num_warps=1, num_stages=1)]
    # a program's channels are one [BD] vector: 2-8 contiguous bf16 per thread
    return [triton.Config({'BD': bd}, num_warps=w) for bd, w in ((64, 1), (128, 1), (128, 2), (256, 1), (256, 2),
                                                                  (512, 2), (512, 4))]


@triton.jit
def _program(cu, chunks_N2, P, BT: tl.constexpr, BD: tl.constexpr):
    """This program's chunk: sequence i_n, chunk i_t, its first row t0, its row count n (at most BT), channels
    o_d (in range where m_d)."""
    i_d, i_c = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunks_N2 + i_c * 2).to(tl.int64)
    i_t = tl.load(chunks_N2 + i_c * 2 + 1).to(tl.int64)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    t0 = bos + i_t * BT
    n = tl.minimum(eos - t0, BT).to(tl.int32)
    o_d = i_d * BD + tl.arange(0, BD)
    return i_c, i_n, i_t, bos, eos, t0, n, o_d, o_d < P


@triton.jit
def _taps(w, o_d, m_d):
    """The four taps of the [P, 4] fp32 weight for channels o_d, oldest row's tap first."""
    w0 = tl.load(w + o_d * 4, mask=m_d, other=0.0)
    w1 = tl.load(w + o_d * 4 + 1, mask=m_d, other=0.0)
    w2 = tl.load(w + o_d * 4 + 2, mask=m_d, other=0.0)
    w3 = tl.load(w + o_d * 4 + 3, mask=m_d, other=0.0)
    return w0, w1, w2, w3


@triton.jit
def _halos(x, ctx_Q3, i_n, t0, bos, o_d, m_d, P, HAS_CONTEXT: tl.constexpr):
    """The x rows 3, 2 and 1 before the chunk's first row t0 (``_halo``)."""
    return (_halo(x, ctx_Q3, i_n, t0 - 3, bos, o_d, m_d, P, HAS_CONTEXT),
            _halo(x, ctx_Q3, i_n, t0 - 2, bos, o_d, m_d, P, HAS_CONTEXT),
            _halo(x, ctx_Q3, i_n, t0 - 1, bos, o_d, m_d, P, HAS_CONTEXT))


@triton.jit
def _halo(x, ctx_Q3, i_n, r, bos, o_d, m_d, P, HAS_CONTEXT: tl.constexpr):
    """x row r (before the chunk's first row) as [BD] fp32: a row of the sequence (r >= bos) as stored; before
    bos the context row bos - r steps back along the path (``HAS_CONTEXT``; -1 none), else zeros."""
    src = r
    ok = r >= bos
    if HAS_CONTEXT:
        k = bos - r  # steps before the sequence's first row; ctx_Q3 lists 3, 2, 1 steps back
        c = tl.load(ctx_Q3 + i_n * 3 + 3 - k, mask=(k >= 1) & (k <= 3), other=-1).to(tl.int64)
        src = tl.where(ok, r, c)
        ok = ok | (c >= 0)
    return tl.load(x + src * P + o_d, mask=m_d & ok, other=0.0).to(tl.float32)


@triton.autotune(configs=_configs(), key=['P', 'SILU', 'HAS_CONTEXT'])
@triton.jit
def short_conv_fwd_kernel(x, w, y, cu, chunks_N2, ctx_Q3, P, BT: tl.constexpr, BD: tl.constexpr,
                          SILU: tl.constexpr, HAS_CONTEXT: tl.constexpr):
    i_c, i_n, i_t, bos, eos, t0, n, o_d, m_d = _program(cu, chunks_N2, P, BT, BD)
    w0, w1, w2, w3 = _taps(w, o_d, m_d)
    xm3, xm2, xm1 = _halos(x, ctx_Q3, i_n, t0, bos, o_d, m_d, P, HAS_CONTEXT)
    for i in range(0, n):
        r = t0 + i
        x0 = tl.load(x + r * P + o_d, mask=m_d, other=0.0).to(tl.float32)
        acc = w3 * x0 + w2 * xm1 + w1 * xm2 + w0 * xm3
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(y + r * P + o_d, acc.to(y.dtype.element_ty), mask=m_d)
        xm3, xm2, xm1 = xm2, xm1, x0


@triton.autotune(configs=_configs(), key=['P', 'SILU', 'HAS_CONTEXT'])
@triton.jit
def short_conv_bwd_kernel(x, w, dy, dx, dw_NP4, dctx_Q3P, cu, chunks_N2, ctx_Q3, P, BT: tl.constexpr,
                          BD: tl.constexpr, SILU: tl.constexpr, HAS_CONTEXT: tl.constexpr):
    i_c, i_n, i_t, bos, eos, t0, n, o_d, m_d = _program(cu, chunks_N2, P, BT, BD)
    w0, w1, w2, w3 = _taps(w, o_d, m_d)
    xm3, xm2, xm1 = _halos(x, ctx_Q3, i_n, t0, bos, o_d, m_d, P, HAS_CONTEXT)
    # g(r) = dL/d(pre-activation at r); gm1..gm3 the last three, dw0..dw3 this chunk's share of dw[:, j]
    gm3 = tl.zeros([BD], dtype=tl.float32)
    gm2 = tl.zeros([BD], dtype=tl.float32)
    gm1 = tl.zeros([BD], dtype=tl.float32)
    dw0 = tl.zeros([BD], dtype=tl.float32)
    dw1 = tl.zeros([BD], dtype=tl.float32)
    dw2 = tl.zeros([BD], dtype=tl.float32)
    dw3 = tl.zeros([BD], dtype=tl.float32)
    p_c = dctx_Q3P + i_n * 3 * P + o_d
    # rows t0 .. t0 + n + 2: the last three (the next chunk's, or past eos: zero) only complete dx of this
    # chunk's last rows, since row r feeds rows r .. r + 3
    for i in range(0, n + 3):
        r = t0 + i
        m = m_d & (r < eos)
        x0 = tl.load(x + r * P + o_d, mask=m, other=0.0).to(tl.float32)
        g = tl.load(dy + r * P + o_d, mask=m, other=0.0).to(tl.float32)
        if SILU:
            pre = w3 * x0 + w2 * xm1 + w1 * xm2 + w0 * xm3
            s = tl.sigmoid(pre)
            g = g * s * (1.0 + pre * (1.0 - s))
        own = tl.where(i < n, g, 0.0)
        dw0 += own * xm3
        dw1 += own * xm2
        dw2 += own * xm1
        dw3 += own * x0
        # dx(r - 3) = sum_s w[3 - s] g(r - 3 + s)
        tl.store(dx + (r - 3) * P + o_d, (w3 * gm3 + w2 * gm2 + w1 * gm1 + w0 * g).to(dx.dtype.element_ty),
                 mask=m_d & (i >= 3))
        if HAS_CONTEXT:
            # the context rows' gradient, from the sequence's first three g (first chunk, once): row bos - k
            # feeds row bos + j through w[3 - k - j]
            mc = m_d & (i == 3) & (i_t == 0)
            tl.store(p_c + 2 * P, w2 * gm3 + w1 * gm2 + w0 * gm1, mask=mc)  # 1 step back
            tl.store(p_c + P, w1 * gm3 + w0 * gm2, mask=mc)  # 2 steps back
            tl.store(p_c, w0 * gm3, mask=mc)  # 3 steps back
        xm3, xm2, xm1 = xm2, xm1, x0
        gm3, gm2, gm1 = gm2, gm1, g
    p_dw = dw_NP4 + i_c.to(tl.int64) * P * 4 + o_d * 4
    tl.store(p_dw, dw0, mask=m_d)
    tl.store(p_dw + 1, dw1, mask=m_d)
    tl.store(p_dw + 2, dw2, mask=m_d)
    tl.store(p_dw + 3, dw3, mask=m_d)
