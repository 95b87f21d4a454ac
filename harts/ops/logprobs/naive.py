"""Pure-torch reference for compact log-probs (blocked over rows, float64-capable).

A compact row c (one per distinct token position of the rollout trie) is read by every semantic
position s with rows_S[s] == c. The log-prob of s is ``<h_c, W_t> - logsumexp_v <h_c, W_v>`` with
t = targets_S[s]; the log-sum-exp depends only on the row, so it is computed once per compact row.
Autograd then sums the gradient of each row over all its semantic positions (Eq. 19).

Legend: C compact rows, D hidden size, V vocabulary, S semantic positions.
"""
from __future__ import annotations

import torch


def check_logprobs_inputs(hidden_CD, weight_VD, rows_S, targets_S):
    """Validate shapes and index ranges; errors name the offending position."""
    if hidden_CD.dim() != 2 or weight_VD.dim() != 2 or hidden_CD.shape[1] != weight_VD.shape[1]:
        raise ValueError(f"hidden must be [C, D] and weight [V, D] with the same D, got "
                         f"{tuple(hidden_CD.shape)} and {tuple(weight_VD.shape)}")
    if rows_S.dim() != 1 or targets_S.shape != rows_S.shape:
        raise ValueError(f"rows_S and targets_S must be 1-D of the same length, got "
                         f"{tuple(rows_S.shape)} and {tuple(targets_S.shape)}")
    if rows_S.dtype not in (torch.int64, torch.int32) or targets_S.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"rows_S and targets_S must be integer tensors, got {rows_S.dtype}, {targets_S.dtype}")
    C, V = hidden_CD.shape[0], weight_VD.shape[0]
    for name, idx, hi in (("rows_S", rows_S, C), ("targets_S", targets_S, V)):
        if idx.numel():
            bad = (idx < 0) | (idx >= hi)
            if bool(bad.any()):
                s = int(bad.nonzero()[0, 0])
                raise ValueError(f"{name}[{s}] = {int(idx[s])} is out of range [0, {hi})")


def compact_logprobs_reference(hidden_CD, weight_VD, rows_S, targets_S, *, block_rows: int = 1024):
    """Log-probs [S] of the targets; float64 for float64 inputs, float32 otherwise. Differentiable."""
    check_logprobs_inputs(hidden_CD, weight_VD, rows_S, targets_S)
    acc = torch.float64 if hidden_CD.dtype == torch.float64 else torch.float32
    h_CD, w_VD = hidden_CD.to(acc), weight_VD.to(acc)
    lse_C = torch.cat([torch.logsumexp(h_CD[r:r + block_rows] @ w_VD.T, dim=-1)
                       for r in range(0, h_CD.shape[0], block_rows)]) if h_CD.shape[0] else h_CD.new_zeros(0)
    rows, tgts = rows_S.long(), targets_S.long()
    tgt_logit_S = (h_CD[rows] * w_VD[tgts]).sum(-1)
    return tgt_logit_S - lse_C[rows]
