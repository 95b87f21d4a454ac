"""Per-token log-probabilities through the LM head without materialising [S, V] in fp32 for backward.

Legend: C hidden rows, D hidden, V vocab, S selected (row, target) pairs, B rows per chunk.

Pure-torch chunked reference with the signature of the fused ``harts.ops.compact_logprobs``: rows are
processed B at a time, each chunk under non-reentrant activation checkpointing, so autograd keeps only
the chunk's hidden rows and targets; the [B, V] logits are rebuilt in backward. Peak extra memory is one
chunk's logits (B x V x 4 bytes), never S x V.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from harts.ops.recompute import recompute_in_backward


def _chunk_logprobs(h_BD: torch.Tensor, weight_VD: torch.Tensor, targets_B: torch.Tensor) -> torch.Tensor:
    dt = torch.promote_types(h_BD.dtype, torch.float32)
    logits_BV = F.linear(h_BD, weight_VD).to(dt)
    return logits_BV.gather(1, targets_B[:, None]).squeeze(1) - torch.logsumexp(logits_BV, dim=-1)


def compact_logprobs_reference(hidden_CD: torch.Tensor, weight_VD: torch.Tensor, rows_S: torch.Tensor,
                               targets_S: torch.Tensor, chunk_size: int = 4096) -> torch.Tensor:
    if rows_S.shape != targets_S.shape or rows_S.dim() != 1:
        raise ValueError(f"rows {tuple(rows_S.shape)} and targets {tuple(targets_S.shape)} must be equal 1-D shapes")
    if hidden_CD.shape[-1] != weight_VD.shape[1]:
        raise ValueError(f"hidden dim {hidden_CD.shape[-1]} != LM head input dim {weight_VD.shape[1]}")
    V = weight_VD.shape[0]
    if targets_S.numel() and (int(targets_S.min()) < 0 or int(targets_S.max()) >= V):
        raise ValueError(f"targets out of range [0, {V}): min {int(targets_S.min())}, max {int(targets_S.max())}")
    out = []
    need_grad = torch.is_grad_enabled() and (hidden_CD.requires_grad or weight_VD.requires_grad)
    for s0 in range(0, rows_S.numel(), chunk_size):
        h = hidden_CD[rows_S[s0:s0 + chunk_size]]
        t = targets_S[s0:s0 + chunk_size]
        if need_grad:
            out.append(recompute_in_backward(_chunk_logprobs, h, weight_VD, t))
        else:
            out.append(_chunk_logprobs(h, weight_VD, t))
    if not out:
        return hidden_CD.new_zeros(0, dtype=torch.promote_types(hidden_CD.dtype, torch.float32))
    return torch.cat(out)
