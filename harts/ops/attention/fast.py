"""GPU varlen attention: flash-attn's varlen kernel if importable, else torch's varlen_attn.

Both are bottom-right causal for Lq != Lk (flash-attn >= 2.1 convention; torch's wrapper calls the same
kernel with window (-1, 0)). FA2 kernels need q/k/v to share one head dim, so V is zero-padded from Dv
to D and the padding columns are cut from the output (they are exactly zero).
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from harts.ops.backend import attention_fast_impl


def _max_len(cu: torch.Tensor) -> int:
    return int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0


def varlen_attention_fast(q_TqHD, k_TkHD, v_TkHDv, cu_q_N1, cu_k_N1, scale: float,
                          max_q: int | None = None, max_k: int | None = None) -> torch.Tensor:
    D, Dv = q_TqHD.shape[-1], v_TkHDv.shape[-1]
    v = F.pad(v_TkHDv, (0, D - Dv)) if Dv < D else v_TkHDv
    cu_q, cu_k = cu_q_N1.to(torch.int32), cu_k_N1.to(torch.int32)
    max_q = _max_len(cu_q) if max_q is None else max_q
    max_k = _max_len(cu_k) if max_k is None else max_k
    impl = attention_fast_impl()
    if impl == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        o = flash_attn_varlen_func(q_TqHD, k_TkHD, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True)
    elif impl == "torch_varlen":
        from torch.nn.attention.varlen import varlen_attn

        if "window_size" in inspect.signature(varlen_attn).parameters:
            o = varlen_attn(q_TqHD, k_TkHD, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0))
        else:  # torch 2.10 spelling
            o = varlen_attn(q_TqHD, k_TkHD, v, cu_q, cu_k, max_q, max_k, scale=scale, is_causal=True)
    else:
        raise RuntimeError("no fast varlen attention implementation available")
    return o[..., :Dv] if Dv < D else o
