"""Padded [N, L] batches (the layout RL frameworks hand around) in and out of a prefix-shared ``CompactBatch``.

``pack_padded(input_ids, attention_mask, completion_mask=... | prompt_lengths=..., config=model.config)`` turns
each row's attended tokens into one trajectory (its padding dropped, left or right), packs the rows with ``pack``
(the trie then computes every prefix the rows share once: the prompt of a group's G completions, and a common
first part of two completions) and keeps only the completion tokens as scored positions. ``unpack_padded`` puts
values over those positions (log-probs, entropies) back into an [N, Lc] tensor aligned to the completion tokens,
Hugging Face style: entry j of row i belongs to input column ``layout.column_offset + j`` and is the value of that
token given every token before it; padding entries are 0.

``logprobs_and_entropies(model, batch)``: per-token log-probs and entropies of the scored positions from one
forward, computed from chunked fp32 logits (``CausalLM.logprobs(batch, return_entropies=True)``).

Legend: N rows, L padded width, Lc completion width (L - column_offset), S_c scored (completion) positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from harts.data.trajectory import Trajectory
from harts.runtime.batch import CompactBatch, pack

__all__ = ["PaddedBatch", "PaddedLayout", "pack_padded", "unpack_padded", "logprobs_and_entropies"]


@dataclass(frozen=True, eq=False)
class PaddedBatch(CompactBatch):
    """A ``CompactBatch`` whose scored positions are the completion tokens of padded rows only (``pack_padded``):
    ``logprob_rows``/``logprob_targets`` and ``split`` cover those positions, and ``semantic`` returns the
    trajectories' metadata at them."""

    scored_index: np.ndarray | None = None  # [S_c] index of each scored position among all nonterminal positions

    def semantic(self, name: str, *, dtype=torch.float64, default: float | None = None) -> torch.Tensor:
        full = super().semantic(name, dtype=dtype, default=default)
        return full.index_select(0, torch.as_tensor(self.scored_index, device=full.device))


@dataclass(frozen=True, eq=False)
class PaddedLayout:
    """How a ``pack_padded`` batch maps back to the padded rows.

    ``completion_mask`` [N, Lc] bool: the completion tokens of input columns ``column_offset`` ..
    ``column_offset + Lc - 1``; ``row_start`` / ``row_lengths`` / ``prompt_lengths`` per row: the first attended
    column, the attended tokens and how many of them are prompt."""

    num_rows: int
    width: int  # L
    column_offset: int  # input column of output column 0
    completion_mask: torch.Tensor  # [N, Lc] bool
    row_start: tuple[int, ...]
    row_lengths: tuple[int, ...]
    prompt_lengths: tuple[int, ...]

    @property
    def completion_width(self) -> int:
        return self.width - self.column_offset

    @property
    def num_scored(self) -> int:
        return sum(n - p for n, p in zip(self.row_lengths, self.prompt_lengths))


def _as_2d(name: str, t, like: torch.Tensor | None = None) -> np.ndarray:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"pack_padded: {name} must be a torch.Tensor [N, L], got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"pack_padded: {name} must be 2-D [N, L], got shape {tuple(t.shape)}")
    if like is not None and t.shape != like.shape:
        raise ValueError(f"pack_padded: {name} has shape {tuple(t.shape)} but input_ids has {tuple(like.shape)}; "
                         f"give one {name} entry per input_ids entry")
    return t.detach().cpu().numpy()


def _mask_01(name: str, m: np.ndarray) -> np.ndarray:
    if m.dtype == np.bool_:
        return m
    bad = (m != 0) & (m != 1)
    if bad.any():
        i, j = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(f"pack_padded: {name} row {i} column {j} is {m[i, j].item()!r}; a mask holds 0/1 only")
    return m.astype(bool)


def pack_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                prompt_lengths=None, completion_mask: torch.Tensor | None = None, config=None,
                prefix_sharing: bool = True, **pack_kw) -> tuple[PaddedBatch, PaddedLayout]:
    """(batch, layout) of padded rows: ``input_ids`` [N, L] with ``attention_mask`` [N, L] (1 = token, 0 = padding;
    each row's tokens one contiguous run, so left and right padding both work, detected per row).

    The prompt/completion split: ``completion_mask`` [N, L] (1 on completion tokens: a non-empty suffix of the row's
    tokens, as in TRL's concatenated prompt_ids + completion_ids) or ``prompt_lengths`` [N] (prompt tokens at the
    start of each row's tokens). Only completion tokens are scored. ``config=model.config`` and the other keywords
    go to ``harts.pack``; ``prefix_sharing=False`` gives the trajectory-wise batch. The batch is on
    ``input_ids.device``."""
    if attention_mask is None:
        raise TypeError("pack_padded: attention_mask is required with 2-D input_ids (1 = token, 0 = padding): pass "
                        "attention_mask=(input_ids != pad_id).long() or the tokenizer's attention_mask")
    if (prompt_lengths is None) == (completion_mask is None):
        raise TypeError("pack_padded: give exactly one of completion_mask= ([N, L], 1 on completion tokens) or "
                        "prompt_lengths= ([N] prompt tokens per row)")
    ids = _as_2d("input_ids", input_ids)
    if input_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"pack_padded: input_ids must be int32/int64 token ids, got {input_ids.dtype}")
    am = _mask_01("attention_mask", _as_2d("attention_mask", attention_mask, input_ids))
    N, L = ids.shape
    if N == 0:
        raise ValueError("pack_padded: input_ids has no rows")
    if completion_mask is not None:
        cm = _mask_01("completion_mask", _as_2d("completion_mask", completion_mask, input_ids))
    else:
        pl = np.asarray(prompt_lengths.detach().cpu() if isinstance(prompt_lengths, torch.Tensor) else prompt_lengths)
        if pl.shape != (N,) or not np.issubdtype(pl.dtype, np.integer):
            raise ValueError(f"pack_padded: prompt_lengths must be {N} integers (one per row), got "
                             f"{pl.dtype} of shape {pl.shape}")
    trajs, starts, lengths, prompts = [], [], [], []
    cols = np.arange(L)
    for i in range(N):
        on = np.flatnonzero(am[i])
        if on.size == 0:
            raise ValueError(f"pack_padded: row {i} has no tokens (attention_mask all 0); drop the row")
        s, n = int(on[0]), int(on.size)
        if int(on[-1]) - s + 1 != n:
            gap = int(np.flatnonzero(~am[i, s:on[-1] + 1])[0]) + s
            raise ValueError(f"pack_padded: row {i} has padding in the middle (column {gap}); padding may only lead "
                             "or trail a row's tokens")
        if completion_mask is not None:
            outside = np.flatnonzero(cm[i] & ~am[i])
            if outside.size:
                raise ValueError(f"pack_padded: row {i} column {int(outside[0])} is a completion token under "
                                 "attention_mask 0; mark completion tokens only where attention_mask is 1")
            c = np.flatnonzero(cm[i])
            if c.size == 0:
                raise ValueError(f"pack_padded: row {i} has no completion token; every row needs at least one "
                                 "(drop the row)")
            p = int(c[0]) - s
            if int(c[-1]) != s + n - 1 or c.size != n - p:
                raise ValueError(f"pack_padded: row {i}'s completion tokens (columns {int(c[0])}..{int(c[-1])}, "
                                 f"{c.size} of them) are not the end of its tokens (columns {s}..{s + n - 1}); the "
                                 "completion must be one run ending at the row's last token")
        else:
            p = int(pl[i])
            if not 0 <= p < n:
                raise ValueError(f"pack_padded: row {i}: prompt_lengths[{i}] = {p} leaves no completion token "
                                 f"(the row has {n} tokens); use 1 .. {n - 1}")
        if p < 1:
            raise ValueError(f"pack_padded: row {i}'s completion starts at its first token; a completion needs at "
                             "least one prompt token before it")
        toks = ids[i, s:s + n].astype(np.int64)
        mask = (cols[s:s + n] >= s + p).astype(np.float64)
        trajs.append(Trajectory(tokens=toks, loss_mask=mask))
        starts.append(s), lengths.append(n), prompts.append(p)
    batch = pack(trajs, config=config, prefix_sharing=prefix_sharing, **pack_kw)
    batch = _scored_completions(batch, prompts)
    if input_ids.device.type != "cpu":
        batch = batch.to(input_ids.device)
    offset = min(s + p for s, p in zip(starts, prompts))
    cmask = np.zeros((N, L - offset), dtype=bool)
    for i, (s, n, p) in enumerate(zip(starts, lengths, prompts)):
        cmask[i, s + p - offset:s + n - offset] = True
    layout = PaddedLayout(num_rows=N, width=L, column_offset=offset,
                          completion_mask=torch.as_tensor(cmask, device=input_ids.device),
                          row_start=tuple(starts), row_lengths=tuple(lengths), prompt_lengths=tuple(prompts))
    return batch, layout


def _scored_completions(batch: CompactBatch, prompts: list[int]) -> PaddedBatch:
    """The batch with its log-prob positions cut to the completion tokens (position t of a trajectory predicts
    token t+1, so the completion of a row with prompt p is positions p-1 .. n-2); the distinct (row, target) pairs
    that no completion position reads are dropped."""
    o = batch.logprob_offsets
    keep = np.concatenate([np.arange(o[i] + p - 1, o[i + 1]) for i, p in enumerate(prompts)])
    offsets = np.zeros(len(prompts) + 1, dtype=np.int64)
    np.cumsum([o[i + 1] - o[i] - p + 1 for i, p in enumerate(prompts)], out=offsets[1:])
    keep_t = torch.as_tensor(keep, dtype=torch.long)
    changes = dict(logprob_rows=batch.logprob_rows[keep_t], logprob_targets=batch.logprob_targets[keep_t],
                   logprob_offsets=tuple(int(x) for x in offsets))
    if batch.logprob_pair_of is not None:
        pair_of = batch.logprob_pair_of[keep_t]
        used, new_of = torch.unique(pair_of, sorted=True, return_inverse=True)
        changes.update(logprob_pair_rows=batch.logprob_pair_rows[used], logprob_pair_targets=
                       batch.logprob_pair_targets[used], logprob_pair_of=new_of,
                       stats={**batch.stats, "logprob_pairs": int(used.numel())})
    fields = {f: getattr(batch, f) for f in CompactBatch.__dataclass_fields__}
    fields.update(changes)
    return PaddedBatch(**fields, scored_index=keep)


def unpack_padded(values_S: torch.Tensor, layout: PaddedLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [N, Lc], completion_mask [N, Lc]) from values over a ``pack_padded`` batch's scored positions
    (``model.logprobs(batch)``): entry j of row i is the value at input column ``layout.column_offset + j``;
    padding and prompt entries are 0. Differentiable in ``values_S``."""
    if not isinstance(layout, PaddedLayout):
        raise TypeError(f"unpack_padded: layout must be the PaddedLayout from pack_padded, got {type(layout).__name__}")
    if not isinstance(values_S, torch.Tensor) or values_S.dim() < 1 or values_S.shape[0] != layout.num_scored:
        got = tuple(values_S.shape) if isinstance(values_S, torch.Tensor) else type(values_S).__name__
        raise ValueError(f"unpack_padded: values has shape {got}, expected {layout.num_scored} entries along dim 0 "
                         "(one per completion token, as model.logprobs(batch) returns for the pack_padded batch)")
    mask = layout.completion_mask.to(values_S.device)
    out = values_S.new_zeros((*mask.shape, *values_S.shape[1:]))
    idx = mask.view(-1).nonzero().squeeze(1)
    out = out.view(-1, *values_S.shape[1:]).index_copy(0, idx, values_S).view(out.shape)
    return out, mask


def logprobs_and_entropies(model, batch: CompactBatch, *, return_router_stats: bool = False):
    """(log-probs [S'], entropies [S']) of a batch's scored positions from one forward (and the router statistics
    of that forward with ``return_router_stats=True``): ``model.logprobs(batch, return_entropies=True, ...)``."""
    return model.logprobs(batch, return_entropies=True, return_router_stats=return_router_stats)
