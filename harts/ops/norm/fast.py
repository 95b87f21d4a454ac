"""fla-core's fused Triton norm kernels (RMSNorm, sigmoid-gated RMSNorm, L2 norm) behind our own launchers.

Why our own launchers: fla 0.6.0's wrappers pass the kernels ``NB = cdiv(rows, 2048)`` (layernorm) or
``cdiv(rows, 2048 * 32)`` (gated norm, l2norm) as a ``tl.constexpr`` that the kernel bodies never read; it
is there as an autotune key, so each size class of row counts gets its own tuned config. Being a
constexpr, every new NB value also compiles every autotune config again (byte-identical binaries) and
re-runs autotuning. Our microbatch row counts change every step, so on the H200 the first step at each new
size spent tens of seconds compiling. Here NB is rounded up to a power of two (``bucket_nb``): fla's
size-aware autotuning is kept per size class, but over a run at most ~log2(max rows / 2048) NB values ever
compile (6 for up to 65536 rows), instead of one per distinct size.

The non-gated backward kernels also take the rows per program ``BS = cdiv(rows, programs)`` and the
group size ``GS`` (= programs with one group) as constexprs, so they recompiled (the tuned config only)
at every new size too; GS is passed as one constant (any value >= the program count is the same kernel
math); the gated ones specialise on BS by divisibility. The blocked kernels (D <= 512) walk their BS
rows in tiles of BT rows (fla's configs: 32 or 64; gated 16-64), so BS is rounded up to a multiple of
the smallest BT: each program runs as many tiles as with fla's BS, and there are fewer programs. The
per-row kernels (D > 512) loop row by row; there BS keeps its top three bits (rounded down: no program
gets more rows than with fla's BS, up to 25% more programs), about 4 values per octave.

Rounding differs from the torch reference in one place: the weight multiplies in fp32 before the single
cast back (the reference rounds the normalised row first, as HF does); the gated norm is the same math.
"""
from __future__ import annotations

import torch
import triton

from harts.ops._fla import (
    IS_INTEL,
    get_multiprocessor_count,
    input_guard,
    l2norm_bwd_kernel,
    l2norm_bwd_kernel_row,
    l2norm_fwd_kernel,
    l2norm_fwd_kernel_row,
    layer_norm_bwd_kernel,
    layer_norm_bwd_kernel_row,
    layer_norm_fwd_kernel,
    layer_norm_fwd_kernel_row,
    layer_norm_gated_bwd_kernel,
    layer_norm_gated_bwd_kernel_row,
    layer_norm_gated_fwd_kernel,
    layer_norm_gated_fwd_kernel_row,
)
from harts.ops.tuning import tuned

__all__ = ["bucket_nb", "rms_norm_fast", "gated_rms_norm_fast", "l2norm_fwd_bucketed", "l2norm_bwd_bucketed"]

LN_ROWS_PER_NB = 2048  # fla's NB divisor in layernorm.py
GATED_ROWS_PER_NB = L2_ROWS_PER_NB = 2048 * 32  # in fused_norm_gate.py and l2norm.py


def bucket_nb(nb: int) -> int:
    """fla's NB size class rounded up to a power of two."""
    return triton.next_power_of_2(max(nb, 1))


def _nb(T: int, rows_per_nb: int) -> int:
    return bucket_nb(triton.cdiv(T, rows_per_nb))


def _block_d(x: torch.Tensor, D: int) -> int:
    BD = min(65536 // x.element_size(), triton.next_power_of_2(D))
    if D > BD:
        raise RuntimeError(f"fla's norm kernels take rows under 64 KB, got D={D} of {x.dtype}")
    return BD


# The non-gated backward kernels split programs into G groups of GS (fla passes GS = programs / G, one more
# constexpr that changes with the row count); with one group any GS >= the program count indexes the same
# rows and dw partials, so a constant keeps it from recompiling.
_GS = 1 << 16


def _round_bs(bs: int, multiple: int | None) -> int:
    """Rows per program: up to a multiple of ``multiple``, or (None) down to its top three bits."""
    if multiple is not None:
        return triton.cdiv(bs, multiple) * multiple
    step = max(1, triton.next_power_of_2(bs + 1) // 8)
    return bs // step * step


def _programs(T: int, device: torch.device, multiple: int | None) -> tuple[int, int]:
    """(programs NS, rows per program BS) for the backward kernels; fla's split is one program per SM."""
    BS = _round_bs(triton.cdiv(T, min(get_multiprocessor_count(device.index or 0), T)), multiple)
    return triton.cdiv(T, BS), BS


def _ln_blocked(D: int) -> bool:
    """fla's layernorm blocks rows up to D = 512, except D = 512 on Intel GPUs (gated and l2norm: D <= 512)."""
    return D <= 512 and not (D == 512 and IS_INTEL)


def _grid_T(T: int):
    return lambda meta: (triton.cdiv(T, meta["BT"]),)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    @input_guard
    def forward(ctx, x_TD, w_D, eps):
        T, D = x_TD.shape
        y_TD, rstd_T = torch.empty_like(x_TD), x_TD.new_empty(T, dtype=torch.float)
        args = dict(x=x_TD, y=y_TD, w=w_D, b=None, res=None, res_out=None, mean=None, rstd=rstd_T, eps=eps, G=1,
                    D=D, BD=_block_d(x_TD, D), IS_RMS_NORM=True, HAS_RESIDUAL=False, STORE_RESIDUAL_OUT=False,
                    HAS_WEIGHT=True, HAS_BIAS=False)
        if _ln_blocked(D):
            layer_norm_fwd_kernel[_grid_T(T)](T=T, NB=_nb(T, LN_ROWS_PER_NB), **args)
        else:
            layer_norm_fwd_kernel_row[(T,)](**args)
        ctx.save_for_backward(x_TD, w_D, rstd_T)
        return y_TD

    @staticmethod
    @input_guard
    def backward(ctx, dy_TD):
        x_TD, w_D, rstd_T = ctx.saved_tensors
        T, D = x_TD.shape
        NS, BS = _programs(T, x_TD.device, 32 if _ln_blocked(D) else None)  # fla's BT: 32, 64
        assert NS <= _GS, (NS, _GS)
        dx_TD, dw_SD = torch.empty_like(x_TD), x_TD.new_empty(NS, D, dtype=torch.float)
        args = dict(x=x_TD, w=w_D, b=None, y=None, dy=dy_TD, dx=dx_TD, dw=dw_SD, db=None, dres=None, dres_in=None,
                    mean=None, rstd=rstd_T, T=T, G=1, D=D, BS=BS, BD=_block_d(x_TD, D), GS=_GS, IS_RMS_NORM=True,
                    HAS_DRESIDUAL=False, STORE_DRESIDUAL=False, HAS_WEIGHT=True, HAS_BIAS=False)
        if _ln_blocked(D):
            layer_norm_bwd_kernel[(NS,)](NB=_nb(T, LN_ROWS_PER_NB), **args)
        else:
            layer_norm_bwd_kernel_row[(NS,)](**args)
        return dx_TD, dw_SD.sum(0).to(w_D.dtype), None


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    @input_guard
    def forward(ctx, x_TD, g_TD, w_D, eps):
        T, D = x_TD.shape
        y_TD, rstd_T = torch.empty_like(x_TD), x_TD.new_empty(T, dtype=torch.float)
        args = dict(x=x_TD, g=g_TD, y=y_TD, w=w_D, b=None, residual=None, residual_out=None, mean=None, rstd=rstd_T,
                    eps=eps, D=D, BD=_block_d(x_TD, D), ACTIVATION="sigmoid", IS_RMS_NORM=True)
        if D <= 512:
            layer_norm_gated_fwd_kernel[_grid_T(T)](T=T, NB=_nb(T, GATED_ROWS_PER_NB), **args)
        else:
            layer_norm_gated_fwd_kernel_row[(T,)](**args)
        ctx.save_for_backward(x_TD, g_TD, w_D, rstd_T)
        return y_TD

    @staticmethod
    @input_guard
    def backward(ctx, dy_TD):
        x_TD, g_TD, w_D, rstd_T = ctx.saved_tensors
        T, D = x_TD.shape
        NS, BS = _programs(T, x_TD.device, 16 if D <= 512 else None)  # fla's BT: 16, 32, 64
        # dx and dg in x's dtype, as fla's wrapper
        dx_TD, dg_TD, dw_SD = torch.empty_like(x_TD), torch.empty_like(x_TD), x_TD.new_empty(NS, D, dtype=torch.float)
        args = dict(x=x_TD, g=g_TD, w=w_D, b=None, y=None, dy=dy_TD, dx=dx_TD, dg=dg_TD, dw=dw_SD, db=None,
                    dresidual=None, dresidual_in=None, mean=None, rstd=rstd_T, T=T, BS=BS, D=D, BD=_block_d(x_TD, D),
                    ACTIVATION="sigmoid", IS_RMS_NORM=True, STORE_DRESIDUAL=False)
        if D <= 512:
            layer_norm_gated_bwd_kernel[(NS,)](NB=_nb(T, GATED_ROWS_PER_NB), **args)
        else:
            layer_norm_gated_bwd_kernel_row[(NS,)](**args)
        return dx_TD, dg_TD, dw_SD.sum(0).to(w_D.dtype), None


@tuned()
def rms_norm_fast(x_TD: torch.Tensor, w_D: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (any leading dims, strided rows allowed: copied as fla does)."""
    D = x_TD.shape[-1]
    return _RMSNorm.apply(x_TD.reshape(-1, D), w_D, eps).view(x_TD.shape)


@tuned()
def gated_rms_norm_fast(x_TD: torch.Tensor, g_TD: torch.Tensor, w_D: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * w * sigmoid(g) over the last dim."""
    D = x_TD.shape[-1]
    return _GatedRMSNorm.apply(x_TD.reshape(-1, D), g_TD.reshape(-1, D), w_D, eps).view(x_TD.shape)


@tuned()
def l2norm_fwd_bucketed(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None):
    """fla's ``l2norm_fwd`` (same arguments and returns: y like x, rstd [*x.shape[:-1]] fp32), bucketed NB."""
    D = x.shape[-1]
    x_TD = x.contiguous().view(-1, D)
    T = x_TD.shape[0]
    y_TD = torch.empty_like(x_TD, dtype=output_dtype or x.dtype)
    rstd_T = x_TD.new_empty(T, dtype=torch.float)
    args = dict(x=x_TD, y=y_TD, rstd=rstd_T, eps=eps, D=D, BD=_block_d(x_TD, D))
    if D <= 512:
        l2norm_fwd_kernel[_grid_T(T)](T=T, NB=_nb(T, L2_ROWS_PER_NB), **args)
    else:
        l2norm_fwd_kernel_row[(T,)](**args)
    return y_TD.view(x.shape), rstd_T.view(x.shape[:-1])


def l2norm_bwd_bucketed(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, eps: float = 1e-6,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """fla's ``l2norm_bwd``: dx in y's dtype, bucketed NB; written into ``out`` (contiguous, y's dtype and number
    of elements) when given."""
    D = y.shape[-1]
    y_TD, dy_TD = y.contiguous().view(-1, D), dy.contiguous().view(-1, D)
    T = y_TD.shape[0]
    if out is not None and (out.dtype != y.dtype or out.numel() != y.numel() or not out.is_contiguous()):
        raise ValueError(f"l2norm_bwd_bucketed: out must be a contiguous {y.dtype} tensor of {y.numel()} elements, "
                         f"got {tuple(out.shape)} {out.dtype} (contiguous: {out.is_contiguous()})")
    dx_TD = torch.empty_like(y_TD) if out is None else out.view(-1, D)
    args = dict(y=y_TD, rstd=rstd.contiguous(), dy=dy_TD, dx=dx_TD, eps=eps, D=D, BD=_block_d(y_TD, D))
    if D <= 512:
        l2norm_bwd_kernel[_grid_T(T)](T=T, NB=_nb(T, L2_ROWS_PER_NB), **args)
    else:
        l2norm_bwd_kernel_row[(T,)](**args)
    return dx_TD.view(y.shape)


class _L2Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        y, rstd = l2norm_fwd_bucketed(x, eps)
        ctx.save_for_backward(y, rstd)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, dy):
        y, rstd = ctx.saved_tensors
        return l2norm_bwd_bucketed(y, rstd, dy, ctx.eps), None


@tuned()
def l2_norm_fast(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / ||x|| over the last dim, differentiable: what fla's ``chunk_kda`` does inside with
    ``use_qk_l2norm_in_kernel`` (same kernels, same saved tensors), with the bucketed size classes, so a
    new sequence length does not compile and autotune the L2 norm again."""
    return _L2Norm.apply(x, eps)
