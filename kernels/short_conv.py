"""Backward of the packed causal short convolution (width <= 4, optional SiLU) in one pass.

Why a kernel: fla's ``causal_conv1d`` backward first recomputes the pre-activation output with its forward
kernel (a full read of x and write of y), then reads y and dy once per tap and writes the weight gradient
per chunk; on the H200 it took 1.13 ms per call at T = 65,536, C = 2,048 (bf16), five times the time to
read x and dy and write dx. Here each program owns a tile of rows and channels, loads x at the seven row
shifts its four taps need and dy at four, recomputes the pre-activation in fp32 in registers (never stored),
and writes dx and its tile's weight-gradient partial sums; a small sum over tiles finishes dw.

Sequences are packed: every row carries the bounds of its sequence (``bos_T``, ``eos_T``), so tiles may
straddle sequence ends and no host-side chunk index is needed (nothing to sync under torch.compile).
Widths below 4 are zero-padded on the left (earlier taps) by the launcher.

``short_conv_bwd`` is the launcher, the torch op ``harts::short_conv_bwd`` (registered on first access).
Interpreter-safe, so CPU CI runs it in float32 (eager only).
Legend: T rows, C channels, W = 4 taps (tap j multiplies x[t - (3 - j)]), NT row tiles; BT rows and BC
channels per program; x_m3 .. x_p3 are x at rows t - 3 .. t + 3, g0 .. g3 the pre-activation gradient
at rows t .. t + 3.
"""
import threading

import triton
import triton.language as tl

W = 4  # taps the kernel is written for; narrower convolutions are zero-padded


@triton.jit
def _load_rows(ptr, o_t, shift, bos, eos, o_c, m_c, stride):
    """x[t + shift] for the tile's rows t (zero outside the row's own sequence), in fp32."""
    r = o_t + shift
    m = ((r >= bos) & (r < eos))[:, None] & m_c[None, :]
    return tl.load(ptr + r[:, None] * stride + o_c[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _dsilu(g, pre, SILU: tl.constexpr):
    if SILU:
        s = tl.sigmoid(pre)
        g = g * s * (1 + pre * (1 - s))
    return g


@triton.jit
def short_conv_bwd_kernel(x, w, dy, bos_T, eos_T, dx, dw_part, T, C, stride_x, stride_dy, stride_dx,
                          SILU: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Program (i_t, i_c): rows [i_t * BT, +BT) x channels [i_c * BC, +BC)."""
    i_t, i_c = tl.program_id(0), tl.program_id(1)
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_t, m_c = o_t < T, o_c < C
    bos = tl.load(bos_T + o_t, mask=m_t, other=0).to(tl.int64)
    eos = tl.load(eos_T + o_t, mask=m_t, other=0).to(tl.int64)  # rows past T: an empty sequence
    w0 = tl.load(w + o_c * 4 + 0, mask=m_c, other=0.0).to(tl.float32)[None, :]
    w1 = tl.load(w + o_c * 4 + 1, mask=m_c, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w + o_c * 4 + 2, mask=m_c, other=0.0).to(tl.float32)[None, :]
    w3 = tl.load(w + o_c * 4 + 3, mask=m_c, other=0.0).to(tl.float32)[None, :]
    x_m3 = _load_rows(x, o_t, -3, bos, eos, o_c, m_c, stride_x)
    x_m2 = _load_rows(x, o_t, -2, bos, eos, o_c, m_c, stride_x)
    x_m1 = _load_rows(x, o_t, -1, bos, eos, o_c, m_c, stride_x)
    x_0 = _load_rows(x, o_t, 0, bos, eos, o_c, m_c, stride_x)
    x_p1 = _load_rows(x, o_t, 1, bos, eos, o_c, m_c, stride_x)
    x_p2 = _load_rows(x, o_t, 2, bos, eos, o_c, m_c, stride_x)
    x_p3 = _load_rows(x, o_t, 3, bos, eos, o_c, m_c, stride_x)
    # the output gradient at rows t .. t+3 of the row's own sequence, through the SiLU at that row
    g0 = _dsilu(_load_rows(dy, o_t, 0, bos, eos, o_c, m_c, stride_dy),
                w0 * x_m3 + w1 * x_m2 + w2 * x_m1 + w3 * x_0, SILU)
    g1 = _dsilu(_load_rows(dy, o_t, 1, bos, eos, o_c, m_c, stride_dy),
                w0 * x_m2 + w1 * x_m1 + w2 * x_0 + w3 * x_p1, SILU)
    g2 = _dsilu(_load_rows(dy, o_t, 2, bos, eos, o_c, m_c, stride_dy),
                w0 * x_m1 + w1 * x_0 + w2 * x_p1 + w3 * x_p2, SILU)
    g3 = _dsilu(_load_rows(dy, o_t, 3, bos, eos, o_c, m_c, stride_dy),
                w0 * x_0 + w1 * x_p1 + w2 * x_p2 + w3 * x_p3, SILU)
    b_dx = w3 * g0 + w2 * g1 + w1 * g2 + w0 * g3
    m_tc = m_t[:, None] & m_c[None, :]
    tl.store(dx + o_t[:, None] * stride_dx + o_c[None, :], b_dx.to(dx.dtype.element_ty), mask=m_tc)
    p_dw = dw_part + (i_t.to(tl.int64) * C + o_c) * 4
    tl.store(p_dw + 0, tl.sum(g0 * x_m3, 0), mask=m_c)
    tl.store(p_dw + 1, tl.sum(g0 * x_m2, 0), mask=m_c)
    tl.store(p_dw + 2, tl.sum(g0 * x_m1, 0), mask=m_c)
    tl.store(p_dw + 3, tl.sum(g0 * x_0, 0), mask=m_c)


# Rows and channels per program: 64 x 64 fp32 values per loaded shift, 11 shifts live at 4 warps.
BT, BC, NUM_WARPS = 64, 64, 4


def _register_op():
    """The launcher as the torch op ``harts::short_conv_bwd`` (a triton_op: it enters torch.compile graphs
    without a break, its fake implementation is the body on fake tensors)."""
    import os

    import torch

    interpreting = os.environ.get("TRITON_INTERPRET") == "1"

    @torch.library.triton_op("harts::short_conv_bwd", mutates_args=())
    def short_conv_bwd(x_TC: torch.Tensor, weight_CW: torch.Tensor, dy_TC: torch.Tensor, cu_seqlens: torch.Tensor,
                       silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(dx_TC, dw_CW) of y = act(conv(x)) for packed sequences (``cu_seqlens``); dw in fp32."""
        T, C = x_TC.shape
        Wd = weight_CW.shape[1]
        if x_TC.stride(1) != 1:
            x_TC = x_TC.contiguous()
        if dy_TC.stride(1) != 1:
            dy_TC = dy_TC.contiguous()
        w_C4 = torch.nn.functional.pad(weight_CW.float(), (W - Wd, 0)).contiguous()  # earlier taps are zero
        cu = cu_seqlens.to(torch.int64)
        seq_T = torch.searchsorted(cu[1:], torch.arange(T, device=cu.device), right=True)
        bos_T, eos_T = cu[seq_T], cu[seq_T + 1]
        nt = triton.cdiv(T, BT)
        dx_TC = torch.empty_like(x_TC)
        dw_part = torch.empty(nt, C, W, device=x_TC.device, dtype=torch.float32)
        if T > 0 and C > 0:
            kernel = short_conv_bwd_kernel if interpreting else torch.library.wrap_triton(short_conv_bwd_kernel)
            kernel[(nt, triton.cdiv(C, BC))](
                x_TC, w_C4, dy_TC, bos_T, eos_T, dx_TC, dw_part, T, C, x_TC.stride(0), dy_TC.stride(0),
                dx_TC.stride(0), SILU=silu, BT=BT, BC=BC, num_warps=NUM_WARPS)
        return dx_TC, dw_part.sum(0)[:, W - Wd:]

    return short_conv_bwd


def __getattr__(name):
    """``short_conv_bwd`` is registered on first access (registering a triton_op imports torch._inductor)."""
    if name != "short_conv_bwd":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _register_lock:
        if "short_conv_bwd" not in globals():
            globals()["short_conv_bwd"] = _register_op()
    return globals()["short_conv_bwd"]


_register_lock = threading.Lock()
