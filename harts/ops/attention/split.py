"""Bottom-right causal attention of the HARTS views as two dense pieces per view, merged by log-sum-exp.

A view's keys are its ancestors' rows (La of them) followed by its own Lq rows, which are also its queries
(``tree_attention_views``). Bottom-right causal over [ancestors, own] is the sum of two softmax pieces over
disjoint keys: every query over the first A ancestors (no mask), and the queries over the remaining La - A
ancestors and the own rows (causal, with La - A dropped query rows in front so that the piece is square and
top-left equals bottom-right). Each piece is one dense attention call that returns its rows'
log-sum-exp; the output is the pieces' outputs weighted by exp(lse_piece - lse) with lse = logaddexp of the
two. The backward of each piece, given the merged output and the merged lse instead of its own, is exactly
that piece's share of the merged attention's gradient (it forms P = exp(S - lse) and D = rowsum(dO * O)
from them), so the gradients are the two pieces' backward calls summed: the same identity that merges ring
attention's blocks.

Why: the flash varlen kernel behind the views needs one head dim (V zero-padded 128 -> 192 in Ling-3.0's
MLA), and cuDNN's fused attention, which takes the two head dims as they are, aligns its causal diagonal
top-left; the split leaves cuDNN only the masks it has. Shapes are bucketed like the packed path's
(``harts.ops.attention.fast._bucket``) so that cuDNN builds one plan per bucket, not per view: the causal
piece is padded at its end (invisible under the causal mask); the ancestor piece has no mask, so it takes
exactly a bucket's number of keys, A = the largest bucket <= La, and the other La - A < max(128, La / 16)
ancestors go to the causal piece. Nothing is padded where a mask would be needed to hide it, so the head
dims are cuDNN's own limits (q/k and v up to 256: Ling-3.0's 192 / 128 and Qwen3.5's 256 / 256).

``piece`` implementations: ``cudnn`` (torch's cuDNN SDPA ops, GPU) and ``math`` (plain matmuls in the
inputs' dtype; the CPU path of the tests, exact in float64).

Legend: C view query rows (all views packed), Tk view key rows, H heads, D q/k head dim, Dv value head dim,
L a view's own rows (Lq), La its ancestor rows, A of them in the ancestor piece, R = La - A.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harts.ops.attention.fast import _bucket, note_cudnn_shape


# ------------------------------------------------------------------------------------------ pieces
def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _scores(q_1HLD, k_1HSD, causal: bool, scale: float):
    """Scaled scores in the accumulation dtype, -inf above the diagonal when causal (L == S)."""
    s = torch.matmul(q_1HLD, k_1HSD.transpose(-1, -2)).to(_acc(q_1HLD)) * scale
    if causal:
        L = s.shape[-2]
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _math_fwd(q_1HLD, k_1HSD, v_1HSDv, causal: bool, scale: float):
    s = _scores(q_1HLD, k_1HSD, causal, scale)
    lse_1HL = torch.logsumexp(s, -1)
    o = torch.matmul(torch.exp(s - lse_1HL[..., None]).to(v_1HSDv.dtype), v_1HSDv)
    return o, lse_1HL, None


def _math_bwd(do_1HLDv, q_1HLD, k_1HSD, v_1HSDv, o_1HLDv, lse_1HL, aux, causal: bool, scale: float):
    acc = _acc(q_1HLD)
    p = torch.exp(_scores(q_1HLD, k_1HSD, causal, scale) - lse_1HL[..., None])  # exp(-inf) = 0 where masked
    dt = q_1HLD.dtype
    dv = torch.matmul(p.to(dt).transpose(-1, -2), do_1HLDv)
    dp = torch.matmul(do_1HLDv, v_1HSDv.transpose(-1, -2)).to(acc)
    ds = p * (dp - (do_1HLDv.to(acc) * o_1HLDv.to(acc)).sum(-1, keepdim=True))
    dq = torch.matmul(ds.to(dt), k_1HSD) * scale
    dk = torch.matmul(ds.to(dt).transpose(-1, -2), q_1HLD) * scale
    return dq, dk, dv


def _cudnn_fwd(q_1HLD, k_1HSD, v_1HSDv, causal: bool, scale: float):
    note_cudnn_shape("causal" if causal else "full", q_1HLD.shape[2], k_1HSD.shape[2], q_1HLD.shape[1],
                     q_1HLD.shape[3], v_1HSDv.shape[3], q_1HLD.dtype)
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


# ------------------------------------------------------------------------------------------ one view
def _heads_first(x_LHX):
    return x_LHX.transpose(0, 1).unsqueeze(0)  # [1, H, L, X], a view


def _rows(x_LHX, front: int, total: int):
    """x after ``front`` zero rows, then zero rows up to ``total`` rows (x itself when there are none)."""
    if front == 0 and total == x_LHX.shape[0]:
        return x_LHX
    return F.pad(x_LHX, (0, 0, 0, 0, front, total - front - x_LHX.shape[0]))


def _bucket_floor(n: int) -> int:
    """The largest length bucket <= n (0 below the smallest): n rounded down to the step ``_bucket`` uses at
    n, a multiple of the step at every smaller length, so ``_bucket`` maps it to itself."""
    g = max(128, 1 << max(0, n.bit_length() - 5))
    return n // g * g


@dataclass(frozen=True)
class _Layout:
    """Where one view's rows go in its two pieces (keys = La ancestors, then the L own rows):
    - ancestor piece (when A > 0): the first A = ``_bucket_floor(La)`` ancestors, exactly (no padded keys);
      the L queries padded at the end to ``anc_rows``;
    - causal piece: the other R = La - A ancestors and the own rows as keys, the L queries after R zero
      rows (their outputs are dropped; zero output gradient makes them add nothing in the backward), padded
      at the end to ``own_rows``; top-left causal over that square is bottom-right causal for the real rows."""
    L: int
    A: int
    R: int

    @property
    def own_rows(self) -> int:
        return _bucket(self.R + self.L)

    @property
    def anc_rows(self) -> int:
        return _bucket(self.L)


def _layout(L: int, La: int) -> _Layout:
    A = _bucket_floor(La)
    return _Layout(L, A, La - A)


def _view_pieces(q_LHD, k_SHD, v_SHDv, lay: _Layout):
    """The padded pieces of one view: (q, k, v) of the causal piece and, when A > 0, of the ancestor piece."""
    n = lay.own_rows
    own = (_rows(q_LHD, lay.R, n), _rows(k_SHD[lay.A:], 0, n), _rows(v_SHDv[lay.A:], 0, n))
    if lay.A == 0:
        return own, None
    return own, (_rows(q_LHD, 0, lay.anc_rows), k_SHD[:lay.A], v_SHDv[:lay.A])


class _SplitViews(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_CHD, k_TkHD, v_TkHDv, cq: list, ck: list, scale: float, piece: str):
        fwd = PIECES[piece][0]
        o_CHDv = v_TkHDv.new_empty(q_CHD.shape[0], q_CHD.shape[1], v_TkHDv.shape[-1])
        lse_CH = torch.empty(q_CHD.shape[:2], dtype=_acc(q_CHD), device=q_CHD.device)
        auxes = []
        for n in range(len(cq) - 1):
            L, La = cq[n + 1] - cq[n], (ck[n + 1] - ck[n]) - (cq[n + 1] - cq[n])
            if L == 0:
                auxes.append((None, None))
                continue
            lay = _layout(L, La)
            own, anc = _view_pieces(q_CHD[cq[n]:cq[n + 1]], k_TkHD[ck[n]:ck[n + 1]], v_TkHDv[ck[n]:ck[n + 1]], lay)
            o_b, lse_b, aux_b = fwd(*(_heads_first(t) for t in own), True, scale)
            o_b, lse_b = o_b[0, :, lay.R:lay.R + L].to(lse_CH.dtype), lse_b[0, :, lay.R:lay.R + L]
            aux_a = None
            if anc is not None:
                o_a, lse_a, aux_a = fwd(*(_heads_first(t) for t in anc), False, scale)
                o_a, lse_a = o_a[0, :, :L].to(lse_CH.dtype), lse_a[0, :, :L]
                lse = torch.logaddexp(lse_a, lse_b)
                o = o_a * torch.exp(lse_a - lse)[..., None] + o_b * torch.exp(lse_b - lse)[..., None]
            else:
                o, lse = o_b, lse_b
            o_CHDv[cq[n]:cq[n + 1]] = o.transpose(0, 1).to(o_CHDv.dtype)
            lse_CH[cq[n]:cq[n + 1]] = lse.transpose(0, 1)
            auxes.append((aux_b, aux_a, lay))
        ctx.save_for_backward(q_CHD, k_TkHD, v_TkHDv, o_CHDv, lse_CH)
        ctx.cq, ctx.ck, ctx.scale, ctx.piece, ctx.auxes = cq, ck, scale, piece, auxes
        return o_CHDv

    @staticmethod
    def backward(ctx, do_CHDv):
        q_CHD, k_TkHD, v_TkHDv, o_CHDv, lse_CH = ctx.saved_tensors
        cq, ck, scale, bwd = ctx.cq, ctx.ck, ctx.scale, PIECES[ctx.piece][1]
        dq, dk, dv = torch.zeros_like(q_CHD), torch.zeros_like(k_TkHD), torch.zeros_like(v_TkHDv)
        do_CHDv = do_CHDv.contiguous()
        for n in range(len(cq) - 1):
            L = cq[n + 1] - cq[n]
            if L == 0:
                continue
            aux_b, aux_a, lay = ctx.auxes[n]
            k0 = ck[n] + lay.A  # the causal piece's key rows start here
            own, anc = _view_pieces(q_CHD[cq[n]:cq[n + 1]], k_TkHD[ck[n]:ck[n + 1]], v_TkHDv[ck[n]:ck[n + 1]], lay)
            # the merged output gradient, output and lse at each piece's query rows (zero on dropped rows). dO
            # heads-first contiguous, o and lse in the forward's layouts: the layouts torch's own SDPA backward
            # passes (see _cudnn_bwd)
            merged = (do_CHDv[cq[n]:cq[n + 1]], o_CHDv[cq[n]:cq[n + 1]], lse_CH[cq[n]:cq[n + 1], :, None])
            go, o, lse = (_heads_first(_rows(t, lay.R, lay.own_rows)) for t in merged)
            g = bwd(go.contiguous(), *(_heads_first(t) for t in own), o, lse[..., 0], aux_b, True, scale)
            dq[cq[n]:cq[n + 1]] += g[0][0, :, lay.R:lay.R + L].transpose(0, 1)
            dk[k0:ck[n + 1]] += g[1][0, :, :lay.R + L].transpose(0, 1)
            dv[k0:ck[n + 1]] += g[2][0, :, :lay.R + L].transpose(0, 1)
            if anc is not None:
                go, o, lse = (_heads_first(_rows(t, 0, lay.anc_rows)) for t in merged)
                g = bwd(go.contiguous(), *(_heads_first(t) for t in anc), o, lse[..., 0], aux_a, False, scale)
                dq[cq[n]:cq[n + 1]] += g[0][0, :, :L].transpose(0, 1)
                dk[ck[n]:k0] += g[1][0].transpose(0, 1)
                dv[ck[n]:k0] += g[2][0].transpose(0, 1)
        return dq, dk, dv, None, None, None, None


def split_views_attention(q_CHD, k_TkHD, v_TkHDv, cu_q_N1, cu_k_N1, scale: float, piece: str = "cudnn"):
    """Bottom-right causal attention of packed views (query rows = the last Lq of each view's keys) by the
    two-piece split; [C, H, Dv]. ``cu_q_N1`` / ``cu_k_N1``: host lists or tensors."""
    cq = cu_q_N1.tolist() if torch.is_tensor(cu_q_N1) else list(cu_q_N1)
    ck = cu_k_N1.tolist() if torch.is_tensor(cu_k_N1) else list(cu_k_N1)
    if len(cq) != len(ck) or cq[-1] != q_CHD.shape[0] or ck[-1] != k_TkHD.shape[0]:
        raise ValueError(f"split_views_attention: cu_seqlens_q ({len(cq)} entries, ends at {cq[-1]}) and cu_seqlens_k "
                         f"({len(ck)}, ends at {ck[-1]}) do not describe {q_CHD.shape[0]} query and "
                         f"{k_TkHD.shape[0]} key rows")
    for n in range(len(cq) - 1):
        if cq[n + 1] - cq[n] > ck[n + 1] - ck[n]:
            raise ValueError(f"split_views_attention: view {n} has {cq[n + 1] - cq[n]} queries and only "
                             f"{ck[n + 1] - ck[n]} keys")
    if piece not in PIECES:
        raise ValueError(f"split_views_attention: piece {piece!r}, expected one of {sorted(PIECES)}")
    return _SplitViews.apply(q_CHD, k_TkHD, v_TkHDv, cq, ck, scale, piece)
