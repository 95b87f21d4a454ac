"""MLA over a whole rollout tree's compact rows, reading shared-prefix keys and values in place.

Every physical row is a query and a key. Trie rows are a DFS preorder, so the subtree of trie row c is the
range [c, end[c]); with c_p the trie row of physical row p (-1 for padding), key k is visible to query q iff
c_k >= 0 and c_k <= c_q < end[c_k]: k is an ancestor-or-self of q. That is exactly the bottom-right causal
view of paper Eq. 22 (positions along a path are causal by construction), without a per-sequence copy of
the ancestors' keys and values.

Two implementations of the same attention:

- ``tree_attention_views`` (the exact reference and the default fast path): Q = the sequences' own rows; the
  reference and the varlen kernel materialise K/V per sequence by ``index_select`` over ``mla_kv_rows`` (each
  shared prefix copied once per sequence reading it) for one packed bottom-right causal call, whose backward
  scatters into the shared rows with index_add; the cuDNN split (``harts.ops.attention.split``, the default on
  Hopper) reads each sequence's long runs of contiguous ancestor rows in place.
- ``tree_attention_flex`` (the fast path): one FlexAttention call over all physical rows with a block-sparse
  mask. ``tree_mask`` builds the ``BlockMask`` from ``mla_block_counts`` (visible pairs per block pair of
  ``BLOCK`` rows, computed from the layout on the host, never a dense P x P mask): blocks with every pair
  visible run unmasked, blocks with some run with the ancestry ``mask_mod``, the rest are skipped. Q/K and V
  head dims may differ (192 / 128 in Ling-3.0), so V is not padded. Inductor's flex kernels round each head
  dim up to a power of two with masked lanes (192 -> 256 for QK^T, 128 for PV), so per visible pair the
  arithmetic equals the view path's (192 + 192, V padded for the flash varlen kernel); what the flex path
  saves is the per-sequence copy of the shared keys and values (``mla_kv_rows`` is several times the rows on
  real trees), the index_add scatter of their gradients, and the memory of both. Block sparsity wastes
  little when a branch's ancestors are a few long runs of physical rows, as on the swe-step workload's
  planned microbatches (visible / computed pairs about 0.99 at 128-row blocks; ``benchmarks.tree_attention``
  prints it as the mask density).

Compilation (CUDA): FlexAttention is fast only compiled. Rows are padded to a multiple of ``BLOCK`` (the
padding rows see nothing, are seen by nothing, and their blocks are skipped) and the call is compiled with
dynamic shapes (``dynamic=True``): the row count changes every microbatch, and a dynamic graph keeps the
number of compilations at one per (dtype, head count, head dims) instead of one per row count or bucket.
On the CPU FlexAttention is not differentiable through its public function; there the higher-order op runs
in its eager (math) implementation, which applies the ``mask_mod`` densely: an exact float32/float64 check
of the mask and the plumbing, not a fast path.

Legend: P physical rows, Pp rows padded to a multiple of the block, H heads, D q/k head dim, Dv value
head dim, nb = Pp / block row blocks, C queries of the views, Tk keys of the views.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harts.ops.backend import log_once
from harts.ops.choices import ALLOWED, kernel_choices

__all__ = ["BLOCK", "TreeMask", "tree_mask", "tree_attention_flex", "tree_attention_views", "view_kernel"]

BLOCK = 128  # rows per BlockMask block: FlexAttention's default, a multiple of its kernels' tiles


# ------------------------------------------------------------------------------------------ reference
VIEW_KERNELS = ALLOWED["view_attention"]


def view_kernel() -> str:
    """The requested fast kernel of the view path, ``harts.ops.kernel_choices().view_attention`` (default from
    ``HARTS_VIEW_ATTENTION``): ``cudnn_split`` (the default: cuDNN per view, split into unmasked ancestor pieces
    (long shared runs read in place) and a causal own piece merged by log-sum-exp, ``harts.ops.attention.split``;
    no V padding, 1.76x the varlen path's fwd+bwd on Ling-3.0's MLA views of a real microbatch on the H200,
    ``python -m benchmarks.tree_attention``) or ``varlen`` (one packed bottom-right causal flash call, V padded
    to the q/k head dim). ``view_attention_impl`` says where the split applies."""
    return kernel_choices().view_attention


def view_attention_impl(q_CHD: torch.Tensor, v_TkHDv: torch.Tensor, kernel: str | None = None) -> tuple[str, str]:
    """(kernel, reason) of the fast view path: ``cudnn_split`` where cuDNN takes the head dims (multiples of 8 up
    to 256: Ling-3.0's 192 / 128, Qwen3.5's 256 / 256), bf16/fp16 on sm90+; else ``varlen``. ``kernel``: the
    requested one, ``view_kernel()`` when None."""
    from harts.ops.attention.fast import cudnn_attention_unsupported

    kernel = view_kernel() if kernel is None else kernel
    if kernel not in VIEW_KERNELS:
        raise ValueError(f"view kernel {kernel!r}: expected one of {VIEW_KERNELS}")
    if kernel == "varlen":
        return "varlen", "requested"
    why = cudnn_attention_unsupported(q_CHD, v_TkHDv.shape[-1])
    if why is None:
        return "cudnn_split", "ancestor and own pieces per view on cuDNN, merged by log-sum-exp"
    return "varlen", f"cuDNN split not used: {why}"


def tree_attention_views(q_PHD, k_PHD, v_PHDv, q_rows_C, q_is_identity: bool, kv_rows_Tk, cu_q, cu_k,
                         scale: float, backend: str = "reference", max_seqlen_q: int | None = None,
                         max_seqlen_k: int | None = None, kernel: str | None = None, plan=None) -> torch.Tensor:
    """Per-sequence views: Q = ``q[q_rows]``, K/V = ``k[kv_rows]``, ``v[kv_rows]``, one packed bottom-right causal
    call on materialised K/V (``backend`` of ``varlen_attention``) or, on the fast backend, the cuDNN split
    (``kernel``, see ``view_attention_impl``), which reads each view's long runs of contiguous ancestor rows in
    place and gathers only the rest (``plan``: the layout's ``harts.ops.attention.split.split_plan``, or a function
    that returns it, called only when the split runs; built here when None); outputs scatter back to their rows
    (rows no sequence queries, i.e. padding, are zero). Returns [P, H, Dv]."""
    from harts.ops.attention.api import varlen_attention
    from harts.ops.backend import resolve

    P = q_PHD.shape[0]
    q = q_PHD if q_is_identity else q_PHD.index_select(0, q_rows_C)
    requested, kernel = kernel, "varlen"
    if resolve("attention", backend, q.device, q.dtype) == "fast":
        kernel, why = view_attention_impl(q, v_PHDv, requested)
        log_once(("view_kernel", kernel, why), "harts MLA view attention kernel -> %s (%s)", kernel, why)
    if kernel == "cudnn_split":
        from harts.ops.attention.split import split_attention, split_plan

        plan = split_plan(cu_q, cu_k, kv_rows_Tk, num_keys=P) if plan is None else plan() if callable(plan) else plan
        o = split_attention(q, k_PHD, v_PHDv, plan, scale, piece="cudnn")
    else:  # (k and v with fewer heads than q are repeated by varlen_attention where its kernel needs it)
        k, v = k_PHD.index_select(0, kv_rows_Tk), v_PHDv.index_select(0, kv_rows_Tk)
        o = varlen_attention(q, k, v, cu_q, cu_k, scale, backend=backend, max_seqlen_q=max_seqlen_q,
                             max_seqlen_k=max_seqlen_k)
    if q_is_identity and o.shape[0] == P:
        return o
    return torch.zeros((P,) + o.shape[1:], dtype=o.dtype, device=o.device).index_copy(0, q_rows_C, o)


# ------------------------------------------------------------------------------------------ block mask
def _ancestry_mask_mod(row_Pp: torch.Tensor, end_Pp: torch.Tensor):
    """mask_mod of the ancestry view: key k visible to query q iff row[k] >= 0 and row[k] <= row[q] < end[k].
    One code object for every microbatch (the tensors are its only closure), so compiled kernels are reused."""

    def ancestry(b, h, q_idx, kv_idx):
        ck, cq = row_Pp[kv_idx], row_Pp[q_idx]
        return (ck >= 0) & (ck <= cq) & (cq < end_Pp[kv_idx])

    return ancestry


@dataclass(frozen=True, eq=False)
class TreeMask:
    """The FlexAttention block mask of one microbatch's ancestry view (built once, shared by all MLA layers)."""

    block_mask: object  # torch.nn.attention.flex_attention.BlockMask over Pp x Pp rows
    num_rows: int  # P
    num_padded: int  # Pp
    block: int
    partial_blocks: int  # block pairs computed with the mask_mod
    full_blocks: int  # block pairs computed without it
    visible_pairs: int  # (query, key) pairs that are visible

    @property
    def density(self) -> float:
        """Visible pairs over the pairs the kernel computes (1.0: no work on masked-out pairs)."""
        done = (self.partial_blocks + self.full_blocks) * self.block * self.block
        return self.visible_pairs / done if done else 1.0


def _int_tensor(name: str, t, ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tree_mask: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"tree_mask: {name} must be an integer tensor of rank {ndim}, got {t.dtype} "
                         f"{tuple(t.shape)}")
    return t


def tree_mask(row_P: torch.Tensor, row_end_P: torch.Tensor, block_counts: torch.Tensor,
              block: int = BLOCK) -> TreeMask:
    """BlockMask of the ancestry view (``_tree_mask``), built eagerly even when called from a compiled region
    (it reads its block statistics on the host). The eager wrapper is made on first use: wrapping at import
    would import torch._dynamo into every reference-path user of harts.ops."""
    return _eager_tree_mask()(row_P, row_end_P, block_counts, block)


@functools.cache
def _eager_tree_mask():
    return torch.compiler.disable(_tree_mask)


def _tree_mask(row_P: torch.Tensor, row_end_P: torch.Tensor, block_counts: torch.Tensor,
              block: int = BLOCK) -> TreeMask:
    """BlockMask of the ancestry view from per-row trie rows ``row_P`` (-1 for padding), subtree ends
    ``row_end_P`` and ``block_counts`` [nb, nb] visible pairs per block pair
    (``harts.planning.layout.mla_block_counts`` at the same ``block``). Runs on the tensors' device; no
    P x P tensor is formed. Built once per microbatch, eagerly even inside a compiled region (it reads its
    block statistics on the host)."""
    row_P, row_end_P = _int_tensor("row_P", row_P, 1), _int_tensor("row_end_P", row_end_P, 1)
    block_counts = _int_tensor("block_counts", block_counts, 2)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"tree_mask: block must be a positive int, got {block!r}")
    P = row_P.shape[0]
    if row_end_P.shape != (P,):
        raise ValueError(f"tree_mask: row_end_P has shape {tuple(row_end_P.shape)}, row_P {(P,)}")
    nb = -(-P // block)
    if block_counts.shape != (nb, nb):
        raise ValueError(f"tree_mask: block_counts has shape {tuple(block_counts.shape)}, expected ({nb}, {nb}) "
                         f"for P = {P} rows in blocks of {block}")
    from torch.nn.attention.flex_attention import BlockMask

    Pp = nb * block
    pad = Pp - P
    row_Pp = F.pad(row_P.long(), (0, pad), value=-1)
    end_Pp = F.pad(row_end_P.long(), (0, pad), value=-1)
    counts = block_counts.long()
    full_nn = counts == block * block
    partial_nn = (counts > 0) & ~full_nn

    def lists(sel_nn):
        # Selected kv blocks first, ascending (a stable sort of the unselected flag), and their number.
        idx_nn = torch.argsort((~sel_nn).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return sel_nn.sum(-1).to(torch.int32)[None, None], idx_nn[None, None]

    kv_num, kv_idx = lists(partial_nn)
    full_num, full_idx = lists(full_nn)
    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
                                  mask_mod=_ancestry_mask_mod(row_Pp, end_Pp), seq_lengths=(Pp, Pp))
    n_partial, n_full = int(partial_nn.sum()), int(full_nn.sum())
    return TreeMask(block_mask=bm, num_rows=P, num_padded=Pp, block=block, partial_blocks=n_partial,
                    full_blocks=n_full, visible_pairs=int(counts.sum()))


# ------------------------------------------------------------------------------------------ flex
@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


_CPU_KERNEL_OPTIONS = {"PRESCALE_QK": False, "ROWS_GUARANTEED_SAFE": False, "BLOCKS_ARE_CONTIGUOUS": False,
                       "WRITE_DQ": True, "OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": False}


def _flex_hop(q, k, v, score_mod, block_mask_tuple, scale, kernel_options):
    from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_hop

    return flex_attention_hop(q, k, v, score_mod, block_mask_tuple, scale, kernel_options)


@functools.cache
def _cpu_flex():
    # The public flex_attention refuses backward on the CPU; its higher-order op differentiates (math
    # implementation) when traced, as the public function itself does for the forward.
    return torch.compile(_flex_hop, backend="eager", fullgraph=True)


def _flex(q_1HPD, k_1HPD, v_1HPDv, mask: TreeMask, scale: float) -> torch.Tensor:
    if q_1HPD.device.type == "cuda":
        return _compiled_flex()(q_1HPD, k_1HPD, v_1HPDv, block_mask=mask.block_mask, scale=scale)
    from torch.nn.attention.flex_attention import _identity

    out = _cpu_flex()(q_1HPD, k_1HPD, v_1HPDv, _identity, mask.block_mask.as_tuple(), scale,
                      dict(_CPU_KERNEL_OPTIONS))
    return out[0]


def tree_attention_flex(q_PHD: torch.Tensor, k_PHD: torch.Tensor, v_PHDv: torch.Tensor, mask: TreeMask,
                        scale: float) -> torch.Tensor:
    """Ancestry attention of every physical row over all physical rows: q, k [P, H, D], v [P, H, Dv] ->
    [P, H, Dv] (padding rows: zero)."""
    if not isinstance(mask, TreeMask):
        raise TypeError(f"tree_attention_flex: mask must be a TreeMask (from tree_mask), got {type(mask).__name__}")
    for name, t in (("q", q_PHD), ("k", k_PHD), ("v", v_PHDv)):
        if t.dim() != 3 or t.shape[0] != mask.num_rows:
            raise ValueError(f"tree_attention_flex: {name} must be [P={mask.num_rows}, H, D], got {tuple(t.shape)}")
    if q_PHD.shape[1:] != k_PHD.shape[1:] or v_PHDv.shape[1] != q_PHD.shape[1]:
        raise ValueError(f"tree_attention_flex: q {tuple(q_PHD.shape)}, k {tuple(k_PHD.shape)} and v "
                         f"{tuple(v_PHDv.shape)} disagree on heads or the q/k head dim")
    dev = mask.block_mask.kv_num_blocks.device
    if q_PHD.device != dev:
        raise ValueError(f"tree_attention_flex: inputs on {q_PHD.device}, mask on {dev}")
    pad = mask.num_padded - mask.num_rows

    def heads_first(x_PHX):
        x_PHX = F.pad(x_PHX, (0, 0, 0, 0, 0, pad)) if pad else x_PHX
        return x_PHX.transpose(0, 1).unsqueeze(0)  # [1, H, Pp, X], a view: flex takes the strides

    o_1HPDv = _flex(heads_first(q_PHD), heads_first(k_PHD), heads_first(v_PHDv), mask, scale)
    log_once(("flex", q_PHD.device.type), "harts MLA tree attention -> flex (%s, %s)",
             "compiled" if q_PHD.device.type == "cuda" else "eager math", q_PHD.device.type)
    return o_1HPDv[0, :, : mask.num_rows].transpose(0, 1)
