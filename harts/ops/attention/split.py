"""Bottom-right causal attention of the HARTS views as dense pieces per view, merged by log-sum-exp.

A view's keys are its ancestors' rows (La of them) followed by its own L rows, which are also its queries
(``tree_attention_views``). Bottom-right causal over [ancestors, own] is a sum of softmax pieces over disjoint
keys: every query over a set of ancestors (no mask), for each of a few ancestor sets, and the queries over the
remaining ancestors and the own rows (causal, with one dropped query row in front per remaining ancestor, so
that the piece is square and top-left equals bottom-right). Each piece is one dense attention call that returns
its rows' log-sum-exp; the output is the pieces' outputs weighted by exp(lse_piece - lse) with lse = logsumexp
of the pieces'. The backward of each piece, given the merged output and the merged lse instead of its own, is
exactly that piece's share of the merged attention's gradient (it forms P = exp(S - lse) and D = rowsum(dO * O)
from them), so the gradients are the pieces' backward calls summed: the same identity that merges ring
attention's blocks.

Keys in place. In a compact layout a view's ancestors are a few runs of contiguous physical rows (shared
prefixes are DFS ranges of the trie), so ``split_plan`` gives each long run its own unmasked piece on a slice of
the key rows: no per-view copy of the shared keys and values, and their gradients accumulate into the slice, no
index_add scatter. Short runs and the remainders are gathered (one unmasked piece of them and the causal piece).
A causal piece whose key rows are contiguous (a view's own rows, behind its parent's tail when it is a first
child) reads them in place too, its padding keys being the rows that follow (see ``_View``).
A run read by several views (a shared prompt under many branches) is one piece for all their queries, stacked:
its keys are read once, where a piece per view would read them once per view and leave most of the GPU idle
for a short branch. Views that branch off one trunk at different depths read runs from one row of different
lengths; those are cut at each run's end into key segments, each one piece for the queries of every view
that reads it (``_segments``): the piece over the trunk's first rows has the queries of all the branches, not
one branch's few, and the backward of an unmasked piece is fast per FLOP only with many queries (see
UNMASKED_BWD_AS_CAUSAL).

Key chunks and the merge. An unmasked piece with few queries over many keys (a short branch under a long
shared prefix) leaves most SMs idle in the forward, whose programs are (query tile, head) pairs; its forward
runs as one batched call over key chunks (``key_chunks``), each chunk's partial output one more term of the
same merge. On the cuDNN path the merge is one Triton kernel (``harts.kernels.attn_merge``) that reads each
piece once and writes the view's rows of the output and lse; the math path merges with tensor ops.

Why dense pieces: the flash varlen kernel behind the views needs one head dim (V zero-padded 128 -> 192 in
Ling-3.0's MLA), and cuDNN's fused attention, which takes the two head dims as they are, aligns its causal
diagonal top-left; the split leaves cuDNN only the masks it has. Shapes are bucketed like the packed path's
(``harts.ops.attention.fast._bucket``) so that cuDNN builds one plan per bucket, not per view: the causal piece
is padded at its end (invisible under the causal mask); an unmasked piece has no mask, so it takes exactly a
bucket's number of keys (the largest bucket <= its run or gathered set), and the rest, fewer than
max(128, n / 16) of n, go to the causal piece. Nothing is padded where a mask would be needed to hide it, so
the head dims are cuDNN's own limits (q/k and v up to 256: Ling-3.0's 192 / 128 and Qwen3.5's 256 / 256).

``piece`` implementations: ``cudnn`` (torch's cuDNN SDPA ops, GPU) and ``math`` (plain matmuls in the
inputs' dtype; the CPU path of the tests, exact in float64).

Grouped-query attention: k and v may have G heads, a divisor of q's H, each serving H / G consecutive query
heads. The pieces read them as they are (cuDNN takes G < H; the math piece repeats them), so the gathers, the
gradient scatter and the zero-filled gradients are over G heads, not H.

Legend: C view query rows (all views packed), X key rows the plan indexes (physical rows, or keys packed per
view), Tk view key rows, H query heads, G key / value heads, D q/k head dim, Dv value head dim, L a view's own
rows (Lq), R the ancestors in its causal piece.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F

from harts.ops.attention.api import check_heads
from harts.ops.attention.fast import _bucket, note_cudnn_shape


# ------------------------------------------------------------------------------------------ pieces
def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _scores(q_1HLD, k_1HSD, causal: bool, scale: float):
    """Scaled scores in the accumulation dtype, -inf above the diagonal when causal (top-left: query i sees
    keys j <= i, as cuDNN aligns it)."""
    s = torch.matmul(q_1HLD, k_1HSD.transpose(-1, -2)).to(_acc(q_1HLD)) * scale
    if causal:
        L, S = s.shape[-2:]
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _expand_heads(x_1GSX, H: int):
    """Key / value heads [1, G, S, X] repeated to the H query heads (as ``repeat_heads`` does on [T, G, X])."""
    G = x_1GSX.shape[1]
    return x_1GSX if G == H else x_1GSX.repeat_interleave(H // G, dim=1)


def _sum_heads(dx_1HSX, G: int):
    """The gradient of ``_expand_heads``: each key / value head sums its H / G query heads' gradients."""
    H = dx_1HSX.shape[1]
    return dx_1HSX if G == H else dx_1HSX.unflatten(1, (G, H // G)).sum(2)


def _math_fwd(q_1HLD, k_1HSD, v_1HSDv, causal: bool, scale: float):
    H = q_1HLD.shape[1]
    k_1HSD, v_1HSDv = _expand_heads(k_1HSD, H), _expand_heads(v_1HSDv, H)
    s = _scores(q_1HLD, k_1HSD, causal, scale)
    lse_1HL = torch.logsumexp(s, -1)
    o = torch.matmul(torch.exp(s - lse_1HL[..., None]).to(v_1HSDv.dtype), v_1HSDv)
    return o, lse_1HL, None


def _math_bwd(do_1HLDv, q_1HLD, k_1HSD, v_1HSDv, o_1HLDv, lse_1HL, aux, causal: bool, scale: float):
    H, G = q_1HLD.shape[1], k_1HSD.shape[1]
    k_1HSD, v_1HSDv = _expand_heads(k_1HSD, H), _expand_heads(v_1HSDv, H)
    acc = _acc(q_1HLD)
    p = torch.exp(_scores(q_1HLD, k_1HSD, causal, scale) - lse_1HL[..., None])  # exp(-inf) = 0 where masked
    dt = q_1HLD.dtype
    dv = torch.matmul(p.to(dt).transpose(-1, -2), do_1HLDv)
    dp = torch.matmul(do_1HLDv, v_1HSDv.transpose(-1, -2)).to(acc)
    ds = p * (dp - (do_1HLDv.to(acc) * o_1HLDv.to(acc)).sum(-1, keepdim=True))
    dq = torch.matmul(ds.to(dt), k_1HSD) * scale
    dk = torch.matmul(ds.to(dt).transpose(-1, -2), q_1HLD) * scale
    return dq, _sum_heads(dk, G), _sum_heads(dv, G)


def _cudnn_fwd(q_1HLD, k_1HSD, v_1HSDv, causal: bool, scale: float):
    B = q_1HLD.shape[0]  # > 1: key chunks of one piece (_chunked)
    note_cudnn_shape("causal" if causal else "full", q_1HLD.shape[2], k_1HSD.shape[2], q_1HLD.shape[1],
                     q_1HLD.shape[3], v_1HSDv.shape[3], q_1HLD.dtype, k_1HSD.shape[1], *((B,) if B > 1 else ()))
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q_1HLD, k_1HSD, v_1HSDv, None, True, 0.0, causal, False,
                                                           scale=scale)
    o, lse = r[0], r[1]
    return o, lse.reshape(o.shape[:3]).float(), (r[6], r[7])  # lse [1, H, L(, 1)]; philox seed / offset


def _cudnn_bwd(do_1HLDv, q_1HLD, k_1HSD, v_1HSDv, o_1HLDv, lse_1HL, aux, causal: bool, scale: float):
    """torch <= 2.11 caches cuDNN's backward graphs by the q/k/v shapes and strides only, with the strides of o,
    dO and lse baked in: a graph built by ``F.scaled_dot_product_attention`` for the same q/k/v (the packed path
    builds them for the same buckets) is reused here and reads dO with its strides. So dO comes contiguous
    heads-first (what SDPA's autograd hands its backward after a slice), o and lse in the layouts the forward
    returns (measured on the H200: after packed-path calls, dO in o's layout gave a dq error of 0.67 of its largest
    value)."""
    seed, offset = aux
    L, S = q_1HLD.shape[2], k_1HSD.shape[2]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do_1HLDv, q_1HLD, k_1HSD, v_1HSDv, o_1HLDv, lse_1HL[..., None].contiguous(), seed, offset, None, None, None,
        L, S, 0.0, causal, scale=scale)
    return dq, dk, dv


PIECES = {"math": (_math_fwd, _math_bwd), "cudnn": (_cudnn_fwd, _cudnn_bwd)}


# ------------------------------------------------------------------------------------------ the plan
def _heads_first(x_LHX):
    return x_LHX.transpose(0, 1).unsqueeze(0)  # [1, H, L, X], a view


def _rows(x_LHX, front: int, total: int, value: float = 0.0):
    """x after ``front`` rows of ``value``, then such rows up to ``total`` rows (x itself when there are none)."""
    if front == 0 and total == x_LHX.shape[0]:
        return x_LHX
    return F.pad(x_LHX, (0, 0, 0, 0, front, total - front - x_LHX.shape[0]), value=value)


def _window(x_CHX, q0: int, L: int, front: int, total: int):
    """A piece's rows of the queries (or of the merged output): x's L rows from q0 behind ``front`` rows, ``total``
    rows in all. Read in place (a view of x's rows) where x has the rows around them; otherwise the L rows between
    zero rows (a copy). The rows around the L are the piece's padding, in place other views' rows: their outputs
    are dropped, and in the backward their output gradient is zero and their lse +inf (``_lse_rows``), so that
    they add nothing to any gradient whatever they hold."""
    a = q0 - front
    if a >= 0 and a + total <= x_CHX.shape[0]:
        return x_CHX[a:a + total]
    return _rows(x_CHX[q0:q0 + L], front, total)


def _lse_rows(lse_CH, ranges, front: int, total: int):
    """The merged lse at a piece's rows, heads-first [1, H, total]: +inf on its padding rows, where P = exp(S - lse)
    is then 0 for any query the padding row holds (see ``_window``)."""
    x = _stacked(lse_CH[..., None], ranges, total - front, float("inf"))
    return _heads_first(_rows(x, front, total, float("inf")))[..., 0]


def _gather_rows(x_XHX, idx, total: int):
    """Rows ``idx`` of x, then zero rows up to ``total``: gathered straight into the padded buffer."""
    out = x_XHX.new_empty(total, *x_XHX.shape[1:])
    torch.index_select(x_XHX, 0, idx, out=out[:idx.shape[0]])
    out[idx.shape[0]:].zero_()
    return out


def _bucket_floor(n: int) -> int:
    """The largest length bucket <= n (0 below the smallest): n rounded down to the step ``_bucket`` uses at
    n, a multiple of the step at every smaller length, so ``_bucket`` maps it to itself."""
    g = max(128, 1 << max(0, n.bit_length() - 5))
    return n // g * g


# An ancestor run is read in place (its own unmasked piece on a slice of the key rows) when it gives at least
# this many keys; shorter runs are gathered with the view's other ancestors. Each in-place piece adds one
# dense call and one merge pass over the view's queries, while copying a run costs in proportion to its length,
# so short runs are cheaper to copy. Both limits are set by that argument, not tuned: on the Ling-3.0-tiny
# bench microbatch every view's ancestors are at most two long runs (python -m benchmarks.tree_attention
# prints how many key rows are read in place).
IN_PLACE_MIN_ROWS = 1024
IN_PLACE_MAX_PIECES = 2  # per view, the longest runs first


# Key chunks of an unmasked piece's forward. A dense call runs one program per (query tile, head): a view with
# few queries over many keys (a short branch below a long shared prefix) gives fewer programs than the GPU has
# SMs, and the forward's programs each walk all the keys. Cut into B chunks of keys, the piece is one batched
# call with B times the programs, whose B partial outputs join the view's merge (the backward keeps one call
# per piece: given the merged output and lse its gradients are the chunks' summed). B is the fewest whole
# 128-key chunks, each at least MIN_CHUNK_KEYS, that fill the SMs' waves to FILL_TARGET (or fill them best).
QUERY_TILE = 128  # query rows per program of cuDNN's Hopper forward
MIN_CHUNK_KEYS = 512
FILL_TARGET = 0.9
DEFAULT_SMS = 132  # an H100 / H200: the chunking the tests run on the CPU is the GPU's


def _fill(programs: int, sms: int) -> float:
    """Busy share of the SMs over the waves ``programs`` take."""
    return programs / (-(-programs // sms) * sms)


def key_chunks(query_rows: int, keys: int, heads: int, sms: int = DEFAULT_SMS) -> int:
    """How many key chunks the forward of an unmasked piece of ``query_rows`` x ``keys`` runs as (1: one call)."""
    tiles = heads * -(-query_rows // QUERY_TILE)
    best = 1
    for b in range(1, keys // MIN_CHUNK_KEYS + 1):
        if _fill(tiles * best, sms) >= FILL_TARGET:
            break
        if keys % (b * 128) == 0 and _fill(tiles * b, sms) > _fill(tiles * best, sms) + 1e-9:
            best = b
    return best


# The backward of an unmasked piece as causal calls. cuDNN's backward of an unmasked call runs at about 0.6 of the
# rate per FLOP of its causal backward, whatever the shape (square or not, few or many queries: measured by
# ``python -m benchmarks.split_pieces``), while the forwards run at one rate. So an unmasked piece's backward
# runs as two causal calls that cover its pairs once: its keys cut into B chunks of c <= L keys, the "lower" call
# is each chunk's top-left causal L x c (query i over the chunk's keys j <= i, every key for i >= c - 1), the
# "upper" call each chunk's remaining pairs j > i of the first c - 1 queries, which are top-left causal c x c
# over the chunk's keys and those queries in reverse order (query row r is query c - 2 - r, row c - 1 a zero
# row whose zero output gradient adds nothing). Both take the merged output and lse, as every piece does, so
# their gradients sum to the unmasked call's. The price is copies: the queries, output gradient and output
# repeated per chunk and the chunks' keys reversed. Per piece implementation (the math piece is exact either
# way; the tests run it with the causal calls too).
# The causal calls pay only on pieces with many queries: on Ling-3.0-tiny's MLA (benchmarks/results,
# split_pieces-h200-seed9002) they took 0.75 of the unmasked call's time at 11,776 queries and 1.02-1.2 at 3,072
# and fewer, where the causal calls are small (so slower per FLOP) and the copies weigh more. Calls one chunk at
# a time (the lower and upper calls reading the queries in place, or queries behind c zero rows so that one
# top-left causal call per chunk covers it whole) were slower than the batched calls on every such piece.
UNMASKED_BWD_AS_CAUSAL = {"cudnn": True, "math": False}
AS_CAUSAL_MIN_QUERY_ROWS = 8192
MAX_BWD_QUERY_REPEATS = 4  # at most this many more chunks than keys / queries (each repeats the queries once)


def causal_key_chunks(query_rows: int, keys: int, min_query_rows: int | None = None) -> int:
    """How many key chunks of at most ``query_rows`` keys, each whole 128-key tiles, the backward of an unmasked
    piece of ``query_rows`` x ``keys`` runs its causal calls over (0: the piece runs unmasked: fewer than
    ``min_query_rows`` queries, AS_CAUSAL_MIN_QUERY_ROWS by default, or no chunking fits)."""
    if query_rows < (AS_CAUSAL_MIN_QUERY_ROWS if min_query_rows is None else min_query_rows):
        return 0
    if keys <= query_rows:
        return 1
    fewest = -(-keys // query_rows)
    for b in range(fewest, MAX_BWD_QUERY_REPEATS * fewest + 1):
        if keys % (b * 128) == 0:
            return b
    return 0


def _bwd_unmasked(bwd, B: int, do_1HLDv, q_1HLD, k_SGD, v_SGDv, o_1HLDv, lse_1HL, aux, scale: float, dk_XGD,
                  dv_XGDv, rows, first: bool = False):
    """The backward of an unmasked piece (keys and values [S, G, X] rows): adds the key and value gradients into
    ``rows`` (a slice of the S key rows read in place, or their index tensor) of dk / dv and returns dq
    [1, H, L, D] (the piece's own, to be added by the caller); one unmasked call for B = 0, else causal calls over B
    key chunks (``causal_key_chunks``, see UNMASKED_BWD_AS_CAUSAL). The chunked operands keep the layouts the
    single call gets (see ``_cudnn_bwd``): queries and output rows-first, output gradient heads-first. Each call's
    key and value gradients are added where they belong (the upper call's after a flip of each chunk's rows), not
    summed into a piece-sized tensor first: each pass over the piece's key rows is memory traffic of its own.
    ``first``: no earlier piece wrote ``rows`` (a slice) of dk / dv, so the first call's gradients are copied there.
    """
    S, G = k_SGD.shape[:2]
    if not B:
        dq, dk, dv = bwd(do_1HLDv, q_1HLD, _heads_first(k_SGD), _heads_first(v_SGDv), o_1HLDv, lse_1HL, aux, False,
                         scale)
        _add_rows(dk_XGD, rows, dk[0].transpose(0, 1), first)
        _add_rows(dv_XGDv, rows, dv[0].transpose(0, 1), first)
        return dq
    c = S // B

    def rows_first(x_1HRX):  # [B, H, R, X] over rows-first storage, the rows repeated per chunk (a view for B = 1)
        x = x_1HRX.transpose(1, 2)
        return x.expand(B, *x.shape[1:]).contiguous().transpose(1, 2)

    k_BcGD, v_BcGDv = (x.view(B, c, G, x.shape[-1]) for x in (k_SGD, v_SGDv))
    q, o, do, lse = rows_first(q_1HLD), rows_first(o_1HLDv), do_1HLDv.expand(B, -1, -1, -1).contiguous(), \
        lse_1HL.expand(B, -1, -1)
    dq_lo, dk_lo, dv_lo = bwd(do, q, k_BcGD.transpose(1, 2), v_BcGDv.transpose(1, 2), o, lse, aux, True, scale)
    for dx, g in ((dk_XGD, dk_lo), (dv_XGDv, dv_lo)):  # chunk b's keys are the piece's rows b * c, ..., b * c + c - 1
        _add_rows(dx, rows, g.transpose(1, 2).reshape(S, G, g.shape[-1]), first)
    # the upper pairs: queries c - 2, ..., 0 and a zero row over each chunk's keys reversed
    rev = torch.arange(c - 2, -1, -1, device=q_1HLD.device)
    q, o, do = _rows_up(q_1HLD, rev, B, False), _rows_up(o_1HLDv, rev, B, False), _rows_up(do_1HLDv, rev, B, True)
    lse = F.pad(lse_1HL[:, :, rev], (0, 1)).expand(B, -1, -1)
    k_up, v_up = (x.flip(1).transpose(1, 2) for x in (k_BcGD, v_BcGDv))
    dq_up, dk_up, dv_up = bwd(do, q, k_up, v_up, o, lse, aux, True, scale)
    # each chunk's key rows back in order: a flip and an add (a bf16 index_add_ through a reversed index ran at a
    # quarter of their bandwidth on an H100)
    for dx, g in ((dk_XGD, dk_up), (dv_XGDv, dv_up)):
        _add_rows(dx, rows, g.transpose(1, 2).flip(1).reshape(S, G, g.shape[-1]))
    up = dq_up[:, :, :c - 1]
    if B == 1:  # the lower call's dq is this function's own: the upper rows are added into it
        dq = dq_lo
        dq[:, :, :c - 1] += up.flip(2)
    else:
        acc = _acc(dq_lo)
        dq = dq_lo.sum(0, keepdim=True, dtype=acc)
        dq[:, :, :c - 1] += up.sum(0, keepdim=True, dtype=acc).flip(2)
    return dq


def _rows_up(x_1HLX, rev, B: int, heads_first: bool):
    """The upper causal calls' rows (see ``_bwd_unmasked``): the rows ``rev`` of x, then one zero row, repeated for
    the B chunks, [B, H, c, X]: over rows-first storage (queries, output) or contiguous heads-first (output
    gradient). The rows are gathered straight into place (rows-first), and copied once more per further chunk."""
    _, H, _, X = x_1HLX.shape
    c = rev.numel() + 1
    if heads_first:
        out = x_1HLX.new_empty(B, H, c, X)
        out[0, :, :c - 1] = x_1HLX[0].index_select(1, rev)
        out[0, :, c - 1].zero_()
    else:
        buf = x_1HLX.new_empty(B, c, H, X)
        torch.index_select(x_1HLX[0].transpose(0, 1), 0, rev, out=buf[0, :c - 1])
        buf[0, c - 1].zero_()
        out = buf.transpose(1, 2)
    if B > 1:
        out[1:] = out[:1]
    return out


def _chunked(q_LHD, k_SGD, v_SGDv, B: int):
    """The dense operands [B, heads, rows, dim] of an unmasked piece cut into B key chunks (views of the key
    rows; the queries repeated per chunk)."""
    q = _heads_first(q_LHD)
    if B == 1:
        return q, _heads_first(k_SGD), _heads_first(v_SGDv)
    S = k_SGD.shape[0]
    k, v = (x.view(B, S // B, *x.shape[1:]).transpose(1, 2) for x in (k_SGD, v_SGDv))
    return q.expand(B, *q.shape[1:]).contiguous(), k, v


def _merge_math(out_LHDv, lse_LH, groups) -> None:
    """The log-sum-exp merge of ``groups`` ((o [B, H, rows, Dv], lse [B, H, rows], r0): the L rows from r0)
    into ``out_LHDv`` and ``lse_LH``, as tensor ops in the accumulation dtype (``harts.kernels.attn_merge``
    is the fused kernel of the cuDNN path)."""
    L = out_LHDv.shape[0]
    if len(groups) == 1 and groups[0][0].shape[0] == 1:
        o, lse, r0 = groups[0]
        out_LHDv.copy_(o[0, :, r0:r0 + L].transpose(0, 1))
        lse_LH.copy_(lse[0, :, r0:r0 + L].transpose(0, 1))
        return
    lses = torch.cat([lse[:, :, r0:r0 + L] for _, lse, r0 in groups])
    lse = torch.logsumexp(lses, 0)
    o = sum((o[:, :, r0:r0 + L].to(lse.dtype) * torch.exp(lse_i[:, :, r0:r0 + L] - lse)[..., None]).sum(0)
            for (o, lse_i, r0) in groups)
    out_LHDv.copy_(o.transpose(0, 1))
    lse_LH.copy_(lse.transpose(0, 1))


def _merge_fused(out_LHDv, lse_LH, groups) -> None:
    from harts.kernels.attn_merge import attn_merge

    attn_merge(out_LHDv, lse_LH, groups)


MERGES = {"math": _merge_math, "cudnn": _merge_fused}


@dataclass(frozen=True)
class _View:
    """One view's pieces, as key rows of the keys/values handed to ``split_attention``:
    - ``slices``: the shared in-place pieces it reads, (index into the plan's ``shared``, row of its first
      query among that piece's queries);
    - ``gather``: (offset, A) into the plan's ``index``: the unmasked piece of A gathered ancestors (A a length
      bucket, or 0);
    - ``causal``: (offset, R + L) into ``index``: the other R ancestors, then the L own rows; the L queries go
      behind R dropped query rows (their outputs are cut, their zero output gradient adds nothing), padded at
      the end to ``own_rows``, so top-left causal over the square is bottom-right causal for the real rows;
    - ``causal_start``: where those R + L key rows are contiguous (a first child's rows follow its parent's tail)
      and ``own_rows`` of them fit in the key rows, the first of them, read in place (-1: gathered). Its padding
      keys are then the rows that follow, which only the padding queries see (top-left causal) and whose output
      gradient is zero, so they change neither outputs nor gradients."""
    q0: int
    L: int
    slices: tuple
    gather: tuple
    causal: tuple
    causal_start: int = -1

    @property
    def R(self) -> int:
        return self.causal[1] - self.L

    @property
    def own_rows(self) -> int:
        return _bucket(self.causal[1])

    @property
    def anc_rows(self) -> int:
        return _bucket(self.L)


@dataclass(frozen=True)
class _Shared:
    """An unmasked piece over the key rows [start, start + keys) read in place, for the queries of every view
    that reads that run: the views' query rows ``ranges`` ((q0, L) each, in view order) stacked, padded at the end
    to ``query_rows`` (a length bucket)."""
    start: int
    keys: int
    ranges: tuple

    @property
    def rows(self) -> int:
        return sum(L for _, L in self.ranges)

    @property
    def query_rows(self) -> int:
        return _bucket(self.rows)

    @property
    def spans(self) -> tuple:
        """``ranges`` with adjacent ones joined (views that follow each other read one slice of the queries)."""
        out = []
        for q0, L in self.ranges:
            if out and out[-1][0] + out[-1][1] == q0:
                out[-1] = (out[-1][0], out[-1][1] + L)
            else:
                out.append((q0, L))
        return tuple(out)


@dataclass(frozen=True, eq=False)
class SplitPlan:
    """Where each view's keys come from (built on the host once per layout, shared by every layer):
    ``index`` the gathered key rows of all views (int64, host), ``views`` the pieces of each view with queries,
    ``shared`` the in-place pieces (each for all the views that read its run), ``num_queries`` C, ``num_keys``
    the key rows the plan indexes into."""
    views: tuple
    index: np.ndarray
    num_queries: int
    num_keys: int
    shared: tuple = ()
    _device_index: dict = field(default_factory=dict, repr=False, compare=False)
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def index_on(self, device) -> torch.Tensor:
        device = torch.device(device)
        t = self._device_index.get(device)
        if t is None:
            t = self._device_index[device] = torch.as_tensor(self.index).to(device)
        return t

    def key_grad_writes(self) -> tuple:
        """Which pieces' backward writes its key / value gradient into rows of dk / dv that no earlier piece wrote,
        in the order the backward runs them (each view's causal piece, its gathered piece, then the shared pieces):
        ``(causal_first per view, shared_first per shared piece, zero_ranges)``. A first writer of a slice copies
        its gradient there; the rows outside every first writer's slice (written only by index adds, or by no
        piece) are zeroed before: each row of dk / dv is written once or zeroed once, not zeroed and then read
        back by an add."""
        if "key_grad_writes" not in self._memo:
            self._memo["key_grad_writes"] = _first_key_writes(self)
        return self._memo["key_grad_writes"]

    @property
    def in_place_rows(self) -> int:
        """Key rows read in place (not copied), summed over views."""
        return sum(p.keys * len(p.ranges) for p in self.shared)


def _first_key_writes(plan: SplitPlan) -> tuple:
    """``SplitPlan.key_grad_writes``: a host walk over the pieces' key rows in backward order."""
    written = np.zeros(plan.num_keys, dtype=bool)
    copied = np.zeros(plan.num_keys, dtype=bool)

    def write(a: int, b: int) -> bool:  # a slice: first when none of its rows is written yet
        first = not written[a:b].any()
        written[a:b] = True
        copied[a:b] |= first
        return first

    causal_first = []
    for view in plan.views:
        o0, m = view.causal
        if view.causal_start >= 0:
            causal_first.append(write(view.causal_start, view.causal_start + m))
        else:
            causal_first.append(False)
            written[plan.index[o0:o0 + m]] = True
        g0, A = view.gather
        written[plan.index[g0:g0 + A]] = True
    shared_first = tuple(write(sp.start, sp.start + sp.keys) for sp in plan.shared)
    d = np.diff(np.r_[0, (~copied).astype(np.int8), 0])  # runs of the rows that no first writer copies into
    zero_ranges = tuple((int(a), int(b)) for a, b in zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1)))
    return tuple(causal_first), shared_first, zero_ranges


def _host(x) -> np.ndarray:
    return (x.cpu().numpy() if torch.is_tensor(x) else np.asarray(x)).astype(np.int64)


def split_plan(cu_q_N1, cu_k_N1, kv_rows_Tk=None, num_keys: int | None = None,
               min_in_place: int | None = None) -> SplitPlan:
    """The split of bottom-right causal views whose keys are ``kv_rows_Tk[cu_k[n]:cu_k[n+1]]`` (rows of the key
    tensor; the identity, i.e. keys packed per view, when None) and whose queries are the last
    ``cu_q[n+1] - cu_q[n]`` of them. Ancestors that are contiguous key rows (a shared prefix in a compact layout)
    are read in place: up to ``IN_PLACE_MAX_PIECES`` runs of at least ``min_in_place`` bucketed rows per view
    (``IN_PLACE_MIN_ROWS`` by default; any bucket when the keys are packed per view: each view's ancestors are
    then one run, and gathering them would copy a copy); the other ancestors are gathered."""
    cq, ck = _host(cu_q_N1), _host(cu_k_N1)
    if cq.ndim != 1 or cq.shape != ck.shape or cq.size == 0 or cq[0] != 0 or ck[0] != 0:
        raise ValueError(f"split_plan: cu_seqlens_q {cq.tolist()[:8]} and cu_seqlens_k {ck.tolist()[:8]} must be "
                         f"1-D offsets of equal length starting at 0")
    kv = np.arange(ck[-1], dtype=np.int64) if kv_rows_Tk is None else _host(kv_rows_Tk)
    if kv.shape != (ck[-1],):
        raise ValueError(f"split_plan: {kv.shape[0]} key rows, cu_seqlens_k ends at {ck[-1]}")
    if min_in_place is None:
        min_in_place = 1 if kv_rows_Tk is None else IN_PLACE_MIN_ROWS
    num_keys = int(kv.max(initial=-1)) + 1 if num_keys is None else num_keys
    if kv.size and (kv.min() < 0 or kv.max() >= num_keys):
        raise ValueError(f"split_plan: key rows in [{kv.min()}, {kv.max()}], outside [0, {num_keys})")
    views, index, at, runs = [], [], 0, {}  # runs: (first key row, keys) -> [(view, q0, L)]
    for n in range(cq.size - 1):
        L, Lk = int(cq[n + 1] - cq[n]), int(ck[n + 1] - ck[n])
        if L < 0 or L > Lk:
            raise ValueError(f"split_plan: view {n} has {L} queries and {Lk} keys (0 <= queries <= keys)")
        if L == 0:
            continue
        rows = kv[ck[n]:ck[n + 1]]
        anc = rows[:Lk - L]
        cuts = np.flatnonzero(np.diff(anc) != 1) + 1
        starts, ends = np.r_[0, cuts], np.r_[cuts, anc.size]
        order = np.argsort(starts - ends, kind="stable")[:IN_PLACE_MAX_PIECES]  # longest runs first
        rest, slices = np.ones(anc.size, dtype=bool), []
        for r in sorted(order.tolist()):
            B = _bucket_floor(int(ends[r] - starts[r]))
            if B >= max(min_in_place, 1):
                slices.append((int(anc[starts[r]]), B))
                runs.setdefault(slices[-1], []).append((len(views), int(cq[n]), L))
                rest[starts[r]:starts[r] + B] = False
        rest_rows = anc[rest]
        A = _bucket_floor(rest_rows.size)
        piece_rows = [rest_rows[:A], rest_rows[A:], rows[Lk - L:]]
        index += piece_rows
        gather = (at, A)
        causal = (at + A, rest_rows.size - A + L)
        at += rest_rows.size + L
        cr = np.r_[piece_rows[1], piece_rows[2]]  # the causal piece's key rows: read in place when contiguous
        in_place = np.all(np.diff(cr) == 1) and cr[0] + _bucket(cr.size) <= num_keys
        views.append(_View(int(cq[n]), L, tuple(slices), gather, causal, int(cr[0]) if in_place else -1))
    # one in-place piece per key segment, for the queries of all the views whose runs cover it: each key row is
    # read once per layer
    shared, where = [], collections.defaultdict(list)
    for run_start, start, keys, readers in _segments(runs):
        offset = 0
        for view, _, L in readers:
            where[view, run_start].append((len(shared), offset))
            offset += L
        shared.append(_Shared(start, keys, tuple((q0, L) for _, q0, L in readers)))
    views = [replace(v, slices=tuple(p for s, _ in v.slices for p in where[i, s])) for i, v in enumerate(views)]
    idx = np.concatenate(index) if index else np.zeros(0, dtype=np.int64)
    return SplitPlan(tuple(views), idx, int(cq[-1]), int(num_keys), tuple(shared))


def _segments(runs: dict):
    """The in-place pieces of the ancestor runs ``runs`` ((first key row, keys) -> readers (view, q0, L), in view
    order): (the run's first key row, the segment's first key row, keys, readers) per key segment. Runs that
    start at one row (prefixes of one shared trunk, read by views that branch off it at different depths) are cut
    at each of their ends, and each segment is read by every view whose run covers it, so a key row is one
    piece's, whatever number of views read it, and the piece has all their queries (runs that start at different
    rows do not overlap in a compact layout's DFS order; any that do stay pieces of their own). A segment whose
    length is not a length bucket is cut into buckets, the longest first, so that cuDNN builds plans per bucket
    only."""
    by_start = collections.defaultdict(dict)  # first row -> {end: readers}
    for (start, keys), readers in runs.items():
        by_start[start][start + keys] = readers
    out = []
    for start, ends in by_start.items():
        a = start
        for end in sorted(ends):
            readers = sorted((r for e, rs in ends.items() if e >= end for r in rs), key=lambda r: r[0])
            while a < end:
                n = _bucket_floor(end - a)
                if n <= 0:
                    raise ValueError(f"split_plan: the key segment [{a}, {end}) of the runs from row {start} is not "
                                     f"a whole number of 128-row tiles (run lengths {sorted(e - start for e in ends)})")
                out.append((start, a, n, tuple(readers)))
                a += n
    return out


# ------------------------------------------------------------------------------------------ the function
def _pieces(q_CHD, k_XHD, v_XHDv, idx, view: _View):
    """(causal, gathered) pieces of one view, each (q, k, v, key rows) with key rows an index tensor (or a slice,
    for a causal piece read in place) for the backward's accumulation; gathered is None when the view has no
    gathered unmasked piece."""
    o0, m = view.causal
    n = view.own_rows
    s = view.causal_start
    qc = _window(q_CHD, view.q0, view.L, view.R, n)
    if s >= 0:
        causal = (qc, k_XHD[s:s + n], v_XHDv[s:s + n], slice(s, s + m))
    else:
        ci = idx[o0:o0 + m]
        causal = (qc, _gather_rows(k_XHD, ci, n), _gather_rows(v_XHDv, ci, n), ci)
    g0, A = view.gather
    if not A:
        return causal, None
    gi = idx[g0:g0 + A]
    return causal, (_window(q_CHD, view.q0, view.L, 0, view.anc_rows), k_XHD.index_select(0, gi),
                    v_XHDv.index_select(0, gi), gi)


def _stacked(x_CHX, ranges, total: int, fill: float | None = None):
    """The rows ``ranges`` ((first, count) each) of x one after the other, then padding rows up to ``total``: one
    range read in place where x has the rows (``_window``) when ``fill`` is None, else a copy padded with ``fill``
    rows (zero rows for None)."""
    if len(ranges) == 1:
        q0, L = ranges[0]
        if fill is None:
            return _window(x_CHX, q0, L, 0, total)
        return _rows(x_CHX[q0:q0 + L], 0, total, fill)
    out = x_CHX.new_empty(total, *x_CHX.shape[1:])
    at = 0
    for q0, L in ranges:
        out[at:at + L] = x_CHX[q0:q0 + L]
        at += L
    out[at:].fill_(0.0 if fill is None else fill)
    return out


def _grad_heads_first(do_CHDv, ranges, front: int, total: int):
    """The output gradient of a piece, contiguous heads-first [1, H, total, Dv]: zero rows, then the rows ``ranges``
    ((first, count) each) of dO one after the other from row ``front``, then zero rows. One copy of the rows
    (padding rows first and then transposing would copy them twice)."""
    out = do_CHDv.new_empty(1, do_CHDv.shape[1], total, do_CHDv.shape[2])
    at = front
    if at:
        out[0, :, :at].zero_()
    for q0, L in ranges:
        out[0, :, at:at + L].copy_(do_CHDv[q0:q0 + L].transpose(0, 1))
        at += L
    if at < total:
        out[0, :, at:].zero_()
    return out


def _add_rows(dx_XHX, rows, g_RHX, first: bool = False) -> None:
    """Adds a piece's key / value gradient into its key rows: a slice (rows read in place) or an index tensor;
    copies it into a slice that no earlier piece wrote (``first``, see ``SplitPlan.key_grad_writes``)."""
    if isinstance(rows, slice):
        if first:
            dx_XHX[rows].copy_(g_RHX)
        else:
            dx_XHX[rows].add_(g_RHX)
    else:
        dx_XHX.index_add_(0, rows, g_RHX)


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_CHD, k_XHD, v_XHDv, plan: SplitPlan, scale: float, piece: str):
        fwd, merge = PIECES[piece][0], MERGES[piece]
        idx = plan.index_on(q_CHD.device)
        H = q_CHD.shape[1]
        sms = torch.cuda.get_device_properties(q_CHD.device).multi_processor_count if q_CHD.is_cuda else DEFAULT_SMS
        o_CHDv = v_XHDv.new_empty(q_CHD.shape[0], H, v_XHDv.shape[-1])
        lse_CH = q_CHD.new_empty(q_CHD.shape[:2], dtype=_acc(q_CHD))
        shared, auxes = [], []
        for sp in plan.shared:  # each in-place run once, for the queries of all the views that read it
            q = _stacked(q_CHD, sp.spans, sp.query_rows)
            k, v = k_XHD[sp.start:sp.start + sp.keys], v_XHDv[sp.start:sp.start + sp.keys]
            shared.append(fwd(*_chunked(q, k, v, key_chunks(sp.query_rows, sp.keys, H, sms)), False, scale))
        for view in plan.views:
            causal, gathered = _pieces(q_CHD, k_XHD, v_XHDv, idx, view)
            o, lse, aux = fwd(*(_heads_first(t) for t in causal[:3]), True, scale)
            groups, aux_v = [(o, lse, view.R)], [aux]
            groups += [(shared[i][0], shared[i][1], offset) for i, offset in view.slices]
            if gathered is not None:
                q, k, v, _ = gathered
                o, lse, aux = fwd(*_chunked(q, k, v, key_chunks(q.shape[0], k.shape[0], H, sms)), False, scale)
                groups.append((o, lse, 0))
                aux_v.append(aux)
            merge(o_CHDv[view.q0:view.q0 + view.L], lse_CH[view.q0:view.q0 + view.L], groups)
            auxes.append(aux_v)
        ctx.save_for_backward(q_CHD, k_XHD, v_XHDv, o_CHDv, lse_CH)
        ctx.plan, ctx.scale, ctx.piece, ctx.auxes = plan, scale, piece, auxes
        ctx.shared_auxes = [r[2] for r in shared]
        return o_CHDv

    @staticmethod
    def backward(ctx, do_CHDv):
        q_CHD, k_XHD, v_XHDv, o_CHDv, lse_CH = ctx.saved_tensors
        plan, scale, bwd = ctx.plan, ctx.scale, PIECES[ctx.piece][1]
        as_causal = UNMASKED_BWD_AS_CAUSAL[ctx.piece]

        def chunks(query_rows: int, keys: int) -> int:  # the unmasked backward's causal key chunks (0: unmasked)
            return causal_key_chunks(query_rows, keys) if as_causal else 0

        idx = plan.index_on(q_CHD.device)
        dq = torch.empty_like(q_CHD)  # every query row is one view's: its causal piece writes it, the others add
        # key rows: the first piece to write a slice of them copies its gradient there, the rest add; rows that no
        # such piece writes first are zeroed here
        causal_first, shared_first, zero_ranges = plan.key_grad_writes()
        dk, dv = torch.empty_like(k_XHD), torch.empty_like(v_XHDv)
        for a, b in zero_ranges:
            dk[a:b].zero_()
            dv[a:b].zero_()
        do_CHDv = do_CHDv.contiguous()
        # the merged output gradient, output and lse at each piece's query rows (dO zero and lse +inf on dropped and
        # padded rows): dO heads-first contiguous (_grad_heads_first), o and lse in the forward's layouts, the layouts
        # torch's own SDPA backward passes (see _cudnn_bwd)
        for view, aux_v, first in zip(plan.views, ctx.auxes, causal_first):
            L, R, q0 = view.L, view.R, view.q0
            causal, gathered = _pieces(q_CHD, k_XHD, v_XHDv, idx, view)
            go = _grad_heads_first(do_CHDv, ((q0, L),), R, view.own_rows)
            o = _heads_first(_window(o_CHDv, q0, L, R, view.own_rows))
            lse = _lse_rows(lse_CH, ((q0, L),), R, view.own_rows)
            g = bwd(go, *(_heads_first(t) for t in causal[:3]), o, lse, aux_v[0], True, scale)
            dq[q0:q0 + L] = g[0][0, :, R:R + L].transpose(0, 1)
            _add_rows(dk, causal[3], g[1][0, :, :R + L].transpose(0, 1), first)
            _add_rows(dv, causal[3], g[2][0, :, :R + L].transpose(0, 1), first)
            if gathered is not None:
                q, k, v, rows = gathered
                go = _grad_heads_first(do_CHDv, ((q0, L),), 0, view.anc_rows)
                o = _heads_first(_window(o_CHDv, q0, L, 0, view.anc_rows))
                lse = _lse_rows(lse_CH, ((q0, L),), 0, view.anc_rows)
                g = _bwd_unmasked(bwd, chunks(q.shape[0], k.shape[0]), go, _heads_first(q), k, v, o, lse, aux_v[1],
                                  scale, dk, dv, rows)
                dq[q0:q0 + L].add_(g[0, :, :L].transpose(0, 1))
        for sp, aux, first in zip(plan.shared, ctx.shared_auxes, shared_first):
            spans = sp.spans
            go = _grad_heads_first(do_CHDv, spans, 0, sp.query_rows)
            o, lse = _heads_first(_stacked(o_CHDv, spans, sp.query_rows)), _lse_rows(lse_CH, spans, 0, sp.query_rows)
            q = _stacked(q_CHD, spans, sp.query_rows)
            keys = slice(sp.start, sp.start + sp.keys)
            g = _bwd_unmasked(bwd, chunks(sp.query_rows, sp.keys), go, _heads_first(q), k_XHD[keys], v_XHDv[keys], o,
                              lse, aux, scale, dk, dv, keys, first)
            at = 0
            for q0, L in spans:
                dq[q0:q0 + L].add_(g[0, :, at:at + L].transpose(0, 1))
                at += L
        return dq, dk, dv, None, None, None


def split_attention(q_CHD, k_XHD, v_XHDv, plan: SplitPlan, scale: float, piece: str = "cudnn"):
    """Bottom-right causal attention of the views of ``plan`` (``split_plan``): queries q [C, H, D] packed per
    view, keys and values [X, H, D/Dv] indexed by the plan (a compact layout's physical rows, read in place
    where a view's ancestors are contiguous). Returns [C, H, Dv]."""
    if not isinstance(plan, SplitPlan):
        raise TypeError(f"split_attention: plan must be a SplitPlan (from split_plan), got {type(plan).__name__}")
    check_heads(q_CHD, k_XHD, v_XHDv, "split_attention")
    if q_CHD.shape[0] != plan.num_queries or k_XHD.shape[0] != plan.num_keys or v_XHDv.shape[0] != plan.num_keys:
        raise ValueError(f"split_attention: q has {q_CHD.shape[0]} rows and k/v {k_XHD.shape[0]}/{v_XHDv.shape[0]}; "
                         f"the plan is for {plan.num_queries} queries over {plan.num_keys} key rows")
    if piece not in PIECES:
        raise ValueError(f"split_attention: piece {piece!r}, expected one of {sorted(PIECES)}")
    # contiguous rows (a no-op for the projections' outputs, one copy of X rows for a value slice of a fused
    # projection): the dense pieces are strided views of these rows, in the layout of the packed path's calls
    return _Split.apply(q_CHD, k_XHD.contiguous(), v_XHDv.contiguous(), plan, scale, piece)


def split_views_attention(q_CHD, k_TkHD, v_TkHDv, cu_q_N1, cu_k_N1, scale: float, piece: str = "cudnn"):
    """Bottom-right causal attention of packed views (query rows = the last Lq of each view's keys, keys packed
    per view) by the split; [C, H, Dv]. ``cu_q_N1`` / ``cu_k_N1``: host lists or tensors."""
    cq = cu_q_N1.tolist() if torch.is_tensor(cu_q_N1) else list(cu_q_N1)
    ck = cu_k_N1.tolist() if torch.is_tensor(cu_k_N1) else list(cu_k_N1)
    if len(cq) != len(ck) or cq[-1] != q_CHD.shape[0] or ck[-1] != k_TkHD.shape[0]:
        raise ValueError(f"split_views_attention: cu_seqlens_q ({len(cq)} entries, ends at {cq[-1]}) and cu_seqlens_k "
                         f"({len(ck)}, ends at {ck[-1]}) do not describe {q_CHD.shape[0]} query and "
                         f"{k_TkHD.shape[0]} key rows")
    return split_attention(q_CHD, k_TkHD, v_TkHDv, split_plan(cq, ck, num_keys=k_TkHD.shape[0]), scale, piece)
