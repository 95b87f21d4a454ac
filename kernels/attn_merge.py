"""Triton kernel for the view split's merge: attention outputs of disjoint key sets joined by log-sum-exp.

A view's attention runs as pieces over disjoint keys (``harts.ops.attention.split``); each piece returns its
output o_i and log-sum-exp lse_i per query row, and the view's output is sum_i o_i * exp(lse_i - lse) with
lse = logsumexp_i lse_i. ``attn_merge_fwd_kernel`` reads every piece once and writes the merged output (in
the output's dtype) and lse straight into the packed rows: as torch ops the merge is an fp32 copy of each
piece, a stack, a logsumexp, and an exp, a product and a sum per piece, each a pass over [L, H, Dv].

Pieces come in groups, each a tensor [B, H, rows, Dv] of B partial outputs with its lse [B, H, rows] (a group
of B > 1: one cuDNN call over B key chunks) and the row ``r0`` where the view's query rows start in it (the
causal piece's queries sit behind R dropped rows). One launch folds up to ``MAX_GROUPS`` groups (a kernel
argument slot each); a view with more (a long shared prefix cut into key segments at its branch points) is
folded ``MAX_GROUPS`` at a time into a float32 partial that leads the next launch, so no precision is lost to the
output's dtype on the way. Online rescaling as in flash attention: a running max m, a rescaled sum s and the
rescaled weighted sum of outputs.
Interpreter-safe (no data-dependent Python control flow).

Legend: L the view's query rows, H heads, Dv value head dim, B partial outputs of a group.
"""
import torch
import triton
import triton.language as tl

MAX_GROUPS = 4


@triton.jit
def _fold_group(acc, m, s, o, lse, B, r0, so_b, so_h, so_r, sl_b, sl_h, sl_r, i_h, rows, m_r, o_d, m_d):
    """Fold the B partials of one group into (acc, m, s) for the block's rows."""
    for b in range(B):
        p_l = lse + b * sl_b + i_h * sl_h + (r0 + rows) * sl_r
        b_l = tl.load(p_l, mask=m_r, other=float('-inf')).to(tl.float32)
        p_o = o + b * so_b + i_h * so_h + (r0 + rows)[:, None] * so_r + o_d[None, :]
        b_o = tl.load(p_o, mask=m_r[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        m_new = tl.maximum(m, b_l)
        m_safe = tl.where(m_new == float('-inf'), 0.0, m_new)  # rows no piece has reached yet
        alpha = tl.exp(m - m_safe)
        w = tl.exp(b_l - m_safe)
        acc = acc * alpha[:, None] + b_o * w[:, None]
        s = s * alpha + w
        m = m_new
    return acc, m, s


# Row counts, row offsets and chunk counts change with every view: compiled once, not per divisibility class
@triton.jit(do_not_specialize=['L', 'B0', 'r00', 'B1', 'r01', 'B2', 'r02', 'B3', 'r03'])
def attn_merge_fwd_kernel(out, out_lse, so_r, so_h, sl_r, sl_h,
                          o0, l0, B0, r00, s0b, s0h, s0r, t0b, t0h, t0r,
                          o1, l1, B1, r01, s1b, s1h, s1r, t1b, t1h, t1r,
                          o2, l2, B2, r02, s2b, s2h, s2r, t2b, t2h, t2r,
                          o3, l3, B3, r03, s3b, s3h, s3r, t3b, t3h, t3r,
                          L, DV, NG: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr):
    """Grid (cdiv(L, BL), H): one block of BL query rows of one head; out [L, H, Dv] (row / head strides
    so_r / so_h, unit stride in Dv), out_lse [L, H] fp32."""
    i_l, i_h = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows = (i_l * BL + tl.arange(0, BL)).to(tl.int64)
    m_r = rows < L
    o_d = tl.arange(0, BD)
    m_d = o_d < DV
    acc = tl.zeros([BL, BD], dtype=tl.float32)
    m = tl.full([BL], float('-inf'), dtype=tl.float32)
    s = tl.zeros([BL], dtype=tl.float32)
    acc, m, s = _fold_group(acc, m, s, o0, l0, B0, r00, s0b, s0h, s0r, t0b, t0h, t0r, i_h, rows, m_r, o_d, m_d)
    if NG > 1:
        acc, m, s = _fold_group(acc, m, s, o1, l1, B1, r01, s1b, s1h, s1r, t1b, t1h, t1r, i_h, rows, m_r, o_d, m_d)
    if NG > 2:
        acc, m, s = _fold_group(acc, m, s, o2, l2, B2, r02, s2b, s2h, s2r, t2b, t2h, t2r, i_h, rows, m_r, o_d, m_d)
    if NG > 3:
        acc, m, s = _fold_group(acc, m, s, o3, l3, B3, r03, s3b, s3h, s3r, t3b, t3h, t3r, i_h, rows, m_r, o_d, m_d)
    s = tl.where(m_r, s, 1.0)  # rows past L (not stored)
    b_o = acc / s[:, None]
    tl.store(out + rows[:, None] * so_r + i_h * so_h + o_d[None, :], b_o.to(out.dtype.element_ty),
             mask=m_r[:, None] & m_d[None, :])
    tl.store(out_lse + rows * sl_r + i_h * sl_h, m + tl.log(s), mask=m_r)


def attn_merge(out_LHDv, lse_LH, groups) -> None:
    """Write the log-sum-exp merge of ``groups`` into ``out_LHDv`` (any float dtype, unit stride in Dv) and
    ``lse_LH`` (fp32): ``groups`` a non-empty list of (o [B, H, rows, Dv], lse [B, H, rows], r0), the view's L
    query rows at rows r0 .. r0 + L - 1 of each."""
    L, H, Dv = out_LHDv.shape
    if not groups:
        raise ValueError("attn_merge: no groups of pieces to merge")
    if out_LHDv.stride(2) != 1 or lse_LH.dtype != torch.float32:
        raise ValueError(f"attn_merge: out needs unit stride in Dv (strides {out_LHDv.stride()}) and lse fp32 "
                         f"(got {lse_LH.dtype})")
    if len(groups) > MAX_GROUPS:  # the first MAX_GROUPS folded into a float32 partial, which leads the rest
        head, tail = groups[:MAX_GROUPS], groups[MAX_GROUPS:]
        part_LHDv = out_LHDv.new_empty(L, H, Dv, dtype=torch.float32)
        part_LH = lse_LH.new_empty(L, H)
        attn_merge(part_LHDv, part_LH, head)
        attn_merge(out_LHDv, lse_LH, [(part_LHDv.transpose(0, 1)[None], part_LH.t()[None], 0)] + tail)
        return
    args = []
    for o, lse, r0 in groups:
        if o.dim() != 4 or o.shape[1] != H or o.shape[3] != Dv or o.stride(3) != 1 or lse.shape != o.shape[:3] \
                or r0 + L > o.shape[2]:
            raise ValueError(f"attn_merge: a group o {tuple(o.shape)} (strides {o.stride()}), lse "
                             f"{tuple(lse.shape)}, rows from {r0}, does not hold {L} rows of {H} heads x {Dv}")
        args += [o, lse, o.shape[0], r0, o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
                 lse.stride(2)]
    for _ in range(MAX_GROUPS - len(groups)):  # unused slots (never read: NG is a constexpr)
        args += list(args[:10])
    if L == 0:
        return
    BD = triton.next_power_of_2(Dv)
    BL = max(1, min(64, 8192 // BD))
    attn_merge_fwd_kernel[(triton.cdiv(L, BL), H)](out_LHDv, lse_LH, out_LHDv.stride(0), out_LHDv.stride(1),
                                                   lse_LH.stride(0), lse_LH.stride(1), *args, L, Dv,
                                                   NG=len(groups), BL=BL, BD=BD, num_warps=4)
