"""Causal depthwise short convolution over the paths of a compact trie.

In the compact layout a row's causal-convolution window is not the previous physical rows but its
true ancestors on the trajectory path: ``pred_CW[c, s]`` is the physical row s steps back from row c
along its path (``pred_CW[c, 0] = c``), or -1 where the path is shorter (zero contribution, exactly
like the start of a sequence in ``harts.ops.conv.short_conv``). The convolution therefore runs once per
compact row and replayed KDA positions reuse the already convolved values (paper 4.2).

Convention as ``short_conv``: weight[:, W-1] multiplies the current row, weight[:, W-1-s] the row s
steps back. Legend: C compact rows, P channels, W kernel width.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["tree_short_conv", "tree_short_conv_reference", "predecessor_index"]


def predecessor_index(parent_C, width: int):
    """[C, W] rows 0..W-1 steps back along each row's path (-1 past the root), from parent pointers; a tensor
    for a tensor, a numpy array for a numpy array (pack builds it with numpy on its thread pool, where torch's
    own intra-op threads would contend with the pool's). The parent array gets a trailing -1, so stepping back
    from -1 (index -1, its last entry) stays at -1: one gather per step and no masks."""
    if isinstance(parent_C, np.ndarray):
        parent_ext = np.append(parent_C, -1)
        steps = [np.arange(parent_C.shape[0], dtype=parent_C.dtype)]
    else:
        parent_ext = torch.cat([parent_C, parent_C.new_full((1,), -1)])
        steps = [torch.arange(parent_C.shape[0], device=parent_C.device)]
    for _ in range(1, width):
        steps.append(parent_ext[steps[-1]])
    return np.stack(steps, 1) if isinstance(parent_C, np.ndarray) else torch.stack(steps, 1)


def tree_short_conv(x_CP: torch.Tensor, weight_PW: torch.Tensor, pred_CW: torch.Tensor,
                    activation: str | None = "silu", *, seq_cu: torch.Tensor | None = None,
                    context: torch.Tensor | None = None, num_rows: int | None = None,
                    backend: str = "auto") -> torch.Tensor:
    """Dispatch (``harts.ops.backend.resolve("conv", ...)``, logged): fla's varlen causal_conv1d over the
    sequences' output blocks with ancestor windows as initial states (needs ``seq_cu`` [Q+1] and
    ``context`` [Q, W-1]; rows >= ``num_rows`` are alignment padding and give zeros), or the gather
    reference over ``pred_CW``."""
    from harts.ops.backend import resolve

    if seq_cu is not None and context is not None and resolve("conv", backend, x_CP.device, x_CP.dtype) == "fast":
        from harts.ops.tree_conv.fast import tree_short_conv_fast

        C = x_CP.shape[0] if num_rows is None else num_rows
        y = tree_short_conv_fast(x_CP[:C], weight_PW, seq_cu, context, activation)
        if C < x_CP.shape[0]:
            y = torch.cat([y, y.new_zeros(x_CP.shape[0] - C, y.shape[1])])
        return y
    return tree_short_conv_reference(x_CP, weight_PW, pred_CW, activation)


def tree_short_conv_reference(x_CP: torch.Tensor, weight_PW: torch.Tensor, pred_CW: torch.Tensor,
                              activation: str | None = "silu") -> torch.Tensor:
    """Gather-based path convolution; exact in float64 and differentiable (index_select backward
    accumulates each row's gradient from every descendant window that reads it)."""
    if x_CP.dim() != 2 or weight_PW.dim() != 2 or x_CP.shape[1] != weight_PW.shape[0]:
        raise ValueError(f"tree_short_conv: x {tuple(x_CP.shape)} must be [C, P], "
                         f"weight {tuple(weight_PW.shape)} [P, W]")
    W = weight_PW.shape[1]
    if pred_CW.shape != (x_CP.shape[0], W):
        raise ValueError(f"tree_short_conv: pred must be [C={x_CP.shape[0]}, W={W}], got {tuple(pred_CW.shape)}")
    w = weight_PW.to(x_CP.dtype)
    y_CP = x_CP * w[:, W - 1]
    for s in range(1, W):
        idx = pred_CW[:, s]
        valid = (idx >= 0).to(x_CP.dtype)[:, None]
        y_CP = y_CP + x_CP.index_select(0, idx.clamp_min(0)) * valid * w[:, W - 1 - s]
    if activation in ("silu", "swish"):
        return F.silu(y_CP)
    if activation is not None:
        raise ValueError(f"tree_short_conv: unsupported activation {activation!r}")
    return y_CP
