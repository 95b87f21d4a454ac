"""HARTS's short-convolution kernels (``harts.kernels.short_conv``), trajectory-wise and on tree paths.

The kernel choice ``conv`` (``harts.ops.set_kernel_choices``; default from ``HARTS_CONV``) says where these run
instead of fla's ``causal_conv1d`` (``harts``: always, ``auto``: wherever they take the convolution; ``use_harts``
decides), the same way in both places the models convolve: the trajectory-wise path
(``harts.ops.conv.short_conv``) and the compact tree path (``harts.ops.tree_conv``), so that a HARTS-versus-
baseline comparison runs one implementation on both sides. Why a second implementation: fla's SiLU backward
writes the pre-activation to memory in an extra forward and reads it back (rounded to the input dtype); ours
recomputes it in fp32 registers inside the backward (see the kernel module). Same math, rounded differently:
the pre-activation's gradient is exact in fp32 here.

Width 4 only (both model families); other widths raise. Legend: T rows, P channels, W width, Q sequences, N
chunks of ``BT`` rows.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["short_conv_harts", "tree_short_conv_harts", "use_harts"]


def _device_chunks(cu: torch.Tensor, cu_host: torch.Tensor | None) -> torch.Tensor:
    """fla's chunk list ([N, 2] (sequence, chunk) of every chunk of ``BT`` rows; none for an empty sequence),
    built on the host from ``cu_host`` when given (no sync; else one read of ``cu``) and sent to ``cu``'s device
    in one non-blocking copy."""
    from harts.kernels.short_conv import BT
    from harts.ops._fla import prepare_chunk_indices

    pairs = prepare_chunk_indices((cu if cu_host is None else cu_host).to("cpu", torch.long), BT)
    if cu.device.type == "cuda":  # from pageable memory a "non_blocking" copy still blocks the host
        pairs = pairs.pin_memory()
    return pairs.to(cu.device, non_blocking=True)


@functools.cache
def _cached_device_chunks():
    """``_device_chunks`` behind fla's identity cache of its last few tensor arguments (a layer's three
    convolutions and all layers of a step share one cu_seqlens tensor)."""
    from harts.ops._fla import tensor_cache

    return tensor_cache(_device_chunks)


def _unsupported(weight_PW, activation) -> str | None:
    """Why these kernels do not take a convolution of this weight and activation (None: they do)."""
    from harts.kernels.short_conv import WIDTH

    if weight_PW.shape[-1] != WIDTH:
        return f"width {weight_PW.shape[-1]}, the kernels unroll width {WIDTH}"
    if activation not in (None, "silu", "swish"):
        return f"activation {activation!r}"
    return None


def use_harts(weight_PW: torch.Tensor, activation: str | None) -> bool:
    """Whether the fast entry points run these kernels under the current kernel choice ``conv``: always for
    ``harts`` (what they do not take raises), never for ``fla``; for ``auto`` wherever they take the
    convolution, the rest on fla's kernels, logged once per reason."""
    from harts.ops.backend import log_once
    from harts.ops.choices import kernel_choices

    choice = kernel_choices().conv
    if choice != "auto":
        return choice == "harts"
    why = _unsupported(weight_PW, activation)
    if why is not None:
        log_once(("conv_kernel", why), "harts conv kernel -> fla causal_conv1d (%s; kernel choice conv='auto')", why)
    return why is None


def _check(x_TP, weight_PW, activation):
    if x_TP.dim() != 2 or weight_PW.dim() != 2 or x_TP.shape[1] != weight_PW.shape[0]:
        raise ValueError(f"short_conv (harts kernels): x {tuple(x_TP.shape)} must be [T, P] and weight "
                         f"{tuple(weight_PW.shape)} [P, W]")
    why = _unsupported(weight_PW, activation)
    if why is not None:
        raise ValueError(f"short_conv (harts kernels): unsupported {why}; choose conv='auto' or 'fla' "
                         "(harts.ops.set_kernel_choices) for it")


class _ShortConv(torch.autograd.Function):
    """Forward and backward kernels over the chunk list; with ``ctx_Q3`` the windows of each sequence's first
    rows read its context rows, whose gradient (per sequence, [Q, 3, P] fp32) is added into dx here."""

    @staticmethod
    def forward(ctx, x_TP, weight_PW, cu, chunks_N2, ctx_Q3, silu):
        from harts.kernels.short_conv import BT, short_conv_fwd_kernel

        if chunks_N2.shape[0] > 65535:  # the grid's second dimension (CUDA's limit)
            raise ValueError(f"short_conv (harts kernels): {x_TP.shape[0]} rows make {chunks_N2.shape[0]} chunks, "
                             "more than the 65,535 one launch takes; split the call or choose conv='fla'")
        x = x_TP.contiguous()
        w = weight_PW.float().contiguous()
        y = torch.empty_like(x)
        P = x.shape[1]
        if chunks_N2.shape[0]:
            short_conv_fwd_kernel[lambda meta: (-(-P // meta["BD"]), chunks_N2.shape[0])](
                x, w, y, cu, chunks_N2, ctx_Q3 if ctx_Q3 is not None else cu, P, BT=BT, SILU=silu,
                HAS_CONTEXT=ctx_Q3 is not None)
        ctx.save_for_backward(x, w, cu, chunks_N2, ctx_Q3)
        ctx.silu, ctx.weight_dtype = silu, weight_PW.dtype
        return y

    @staticmethod
    def backward(ctx, dy_TP):
        from harts.kernels.short_conv import BT, short_conv_bwd_kernel

        x, w, cu, chunks_N2, ctx_Q3 = ctx.saved_tensors
        dy = dy_TP.contiguous()
        P = x.shape[1]
        N = chunks_N2.shape[0]
        dx = torch.empty_like(x)
        dw_NP4 = torch.empty(N, P, 4, device=x.device, dtype=torch.float32)
        Q = cu.shape[0] - 1
        dctx_Q3P = torch.zeros(Q, 3, P, device=x.device, dtype=torch.float32) if ctx_Q3 is not None else None
        if N:
            short_conv_bwd_kernel[lambda meta: (-(-P // meta["BD"]), N)](
                x, w, dy, dx, dw_NP4, dctx_Q3P if dctx_Q3P is not None else dw_NP4, cu, chunks_N2,
                ctx_Q3 if ctx_Q3 is not None else cu, P, BT=BT, SILU=ctx.silu, HAS_CONTEXT=ctx_Q3 is not None)
        else:
            dx.zero_()
        if ctx_Q3 is not None:
            rows = ctx_Q3.flatten().long()
            valid = rows >= 0
            dx.index_add_(0, rows.clamp_min(0), (dctx_Q3P.view(-1, P) * valid[:, None]).to(dx.dtype))
        dw = dw_NP4.sum(0).to(ctx.weight_dtype)
        return dx, dw, None, None, None, None


def _say(where: str) -> None:
    from harts.ops.backend import log_once
    from harts.ops.choices import kernel_choices

    choice = kernel_choices().conv
    log_once(("conv_kernel", where, choice),
             "harts conv kernel -> harts.kernels.short_conv (%s; kernel choice conv=%r)", where, choice)


def short_conv_harts(x_TP: torch.Tensor, weight_PW: torch.Tensor, cu_seqlens: torch.Tensor,
                     activation: str | None = "silu", cu_seqlens_cpu: torch.Tensor | None = None) -> torch.Tensor:
    """The trajectory-wise convolution (``harts.ops.conv.short_conv`` semantics) on HARTS's kernels."""
    _check(x_TP, weight_PW, activation)
    _say("trajectory-wise")
    cu = cu_seqlens.to(torch.long)
    chunks = _cached_device_chunks()(cu_seqlens, cu_seqlens_cpu)
    return _ShortConv.apply(x_TP, weight_PW, cu, chunks, None, activation is not None)


def tree_short_conv_harts(x_CP: torch.Tensor, weight_PW: torch.Tensor, seq_cu: torch.Tensor,
                          context_QW1: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
    """The tree-path convolution (``harts.ops.tree_conv.fast.tree_short_conv_fast`` semantics: each sequence's
    block of compact rows, its window reaching the W - 1 = 3 ancestor rows ``context_QW1`` (oldest first, -1
    none)) on HARTS's kernels."""
    _check(x_CP, weight_PW, activation)
    _say("tree paths")
    if context_QW1.shape != (seq_cu.shape[0] - 1, weight_PW.shape[1] - 1):
        raise ValueError(f"tree_short_conv (harts kernels): context {tuple(context_QW1.shape)} must be "
                         f"[Q={seq_cu.shape[0] - 1}, W-1={weight_PW.shape[1] - 1}]")
    cu = seq_cu.to(torch.long)
    chunks = _cached_device_chunks()(seq_cu, None)
    return _ShortConv.apply(x_CP, weight_PW, cu, chunks, context_QW1.to(torch.int32).contiguous(),
                            activation is not None)
