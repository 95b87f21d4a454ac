"""MLA over all compact rows with the ancestry block mask (harts.ops.attention.tree) against the exact
per-sequence view path: the block mask's kernel semantics against the views' dense visibility, and the flex
path's outputs and q/k/v gradients against the views in float64 and float32 on the CPU; on the GPU, bf16
flex against a float64 truth, next to the bf16 view path's own error."""
import numpy as np
import pytest
import torch

from harts.ops.attention import varlen_attention_reference
from harts.ops.attention.tree import tree_attention_flex, tree_attention_views, tree_mask
from harts.runtime import pack
from harts.runtime.compact import mla_tree_attention, mla_tree_mask
from tests.helpers import trajectories_from_spec


def _trees(B: int, seed: int):
    """Forks at B-1, B, B+1 and 2B+1, a duplicate, a prefix that ends inside a path, a second tree."""
    rng = np.random.default_rng(seed)
    spec = [(B - 1, [(1, [(2 * B + 3, []), (B, [])]), (B + 2, []), (int(rng.integers(1, 2 * B)), [])]),
            (B + 1, [(B, [(3, []), (B + 1, [])]), (2, [])])]
    return trajectories_from_spec(spec, extra_prefixes=[(1, 2 * B)], duplicates=[0])


def _view_visibility(batch) -> np.ndarray:
    """[P, P] visibility of the reference views (bottom-right causal per sequence), an independent truth."""
    P = batch.num_phys
    vis = np.zeros((P, P), dtype=bool)
    q_rows, kv_rows = batch.mla_q_rows.numpy(), batch.mla_kv_rows.numpy()
    cq, ck = batch.cu_seqlens_q.tolist(), batch.cu_seqlens_k.tolist()
    for s in range(len(cq) - 1):
        qs, kv = q_rows[cq[s]:cq[s + 1]], kv_rows[ck[s]:ck[s + 1]]
        h = len(kv) - len(qs)
        for i, row in enumerate(qs):
            vis[row, kv[: h + i + 1]] = True
    return vis


def _kernel_visibility(mask) -> np.ndarray:
    """[Pp, Pp] what a block-sparse kernel computes from the BlockMask: full blocks unmasked, partial blocks
    through the mask_mod, every other block skipped."""
    bm, blk, Pp = mask.block_mask, mask.block, mask.num_padded
    vis = np.zeros((Pp, Pp), dtype=bool)
    i = torch.arange(blk)
    for qb in range(Pp // blk):
        qi = qb * blk + i[:, None]
        for kb in bm.kv_indices[0, 0, qb, : int(bm.kv_num_blocks[0, 0, qb])].tolist():
            vis[qb * blk:(qb + 1) * blk, kb * blk:(kb + 1) * blk] = bm.mask_mod(0, 0, qi, kb * blk + i[None, :]).numpy()
        for kb in bm.full_kv_indices[0, 0, qb, : int(bm.full_kv_num_blocks[0, 0, qb])].tolist():
            vis[qb * blk:(qb + 1) * blk, kb * blk:(kb + 1) * blk] = True
    return vis


@pytest.mark.parametrize("B,block,pad", [(4, 4, 1), (4, 8, 5), (3, 16, 8), (5, 1, 1)])
def test_block_mask_is_the_views_visibility(B, block, pad):
    batch = pack(_trees(B, B + block), chunk_size=B, pad_to_multiple=pad, mla_block_size=block)
    mask = mla_tree_mask(batch, "cpu")
    P = batch.num_phys
    truth = _view_visibility(batch)
    got = _kernel_visibility(mask)
    assert not got[P:].any() and not got[:, P:].any(), "padding to the block is visible"
    assert np.array_equal(got[:P, :P], truth)
    assert mask.visible_pairs == int(truth.sum()) and mask.partial_blocks + mask.full_blocks > 0
    if block > 1:  # the classification is exercised: some blocks are skipped or run unmasked
        nb = mask.num_padded // block
        assert mask.partial_blocks + mask.full_blocks < nb * nb
    # The BlockMask's own dense view (what the kernel iterates) agrees with the kernel semantics block-wise.
    dense = mask.block_mask.to_dense()[0, 0].bool().numpy()
    nb = mask.num_padded // block
    any_vis = got.reshape(nb, block, nb, block).any(axis=(1, 3))
    assert np.array_equal(dense, any_vis)


def _qkv(P, H, D, Dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(P, H, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
            for d in (D, D, Dv)]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("B,block,pad", [(4, 8, 3), (3, 4, 1)])
def test_flex_matches_views_values_and_grads(dtype, tol, B, block, pad):
    batch = pack(_trees(B, 7 * B + block), chunk_size=B, pad_to_multiple=pad, mla_block_size=block)
    H, D, Dv, scale = 2, 12, 8, 0.37  # q/k and v head dims differ, as in MLA
    q, k, v = _qkv(batch.num_phys, H, D, Dv, dtype, seed=B)
    o_ref = mla_tree_attention(q, k, v, batch, scale, backend="reference")
    o = tree_attention_flex(q, k, v, mla_tree_mask(batch, "cpu"), scale)
    assert o.shape == o_ref.shape == (batch.num_phys, H, Dv) and o.dtype == dtype
    torch.testing.assert_close(o, o_ref, rtol=tol, atol=tol)
    assert not o[batch.num_rows:].any(), "alignment padding rows produce zeros"
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    g = torch.autograd.grad((o * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((o_ref * w).sum(), (q, k, v))
    for name, a, b in zip("qkv", g, g_ref):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"d{name}: {m}")


def _assert_same_float64(o, o_ref, inputs, generator):
    """o equals o_ref, and for random weights w (drawn from ``generator``) the gradients of sum(o * w) and
    sum(o_ref * w) with respect to q, k, v are equal, to float64 rounding."""
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    w = torch.randn(o.shape, generator=generator, dtype=torch.float64)
    for name, a, b in zip("qkv", torch.autograd.grad((o * w).sum(), inputs, retain_graph=True),
                          torch.autograd.grad((o_ref * w).sum(), inputs)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("B,pad", [(4, 3), (3, 1)])
def test_split_views_equal_views_float64(B, pad):
    """The views as two pieces merged by log-sum-exp, with the math pieces: the same attention as the reference
    views, values and q/k/v gradients to float64 rounding (the trees have forks at B-1, B, B+1, 2B+1,
    duplicates, a prefix that ends inside a path; every view has fewer than 128 ancestors, so all of them go to
    the causal piece; ``test_split_views_ancestor_piece_float64`` covers the ancestor piece)."""
    from harts.ops.attention.split import split_views_attention

    batch = pack(_trees(B, 11 * B), chunk_size=B, pad_to_multiple=pad)
    H, D, Dv, scale = 2, 12, 8, 0.37
    q, k, v = _qkv(batch.num_phys, H, D, Dv, torch.float64, seed=B)
    qv, kv, vv = q.index_select(0, batch.mla_q_rows), k.index_select(0, batch.mla_kv_rows), v.index_select(
        0, batch.mla_kv_rows)
    o = split_views_attention(qv, kv, vv, batch.cu_seqlens_q, batch.cu_seqlens_k, scale, piece="math")
    o_ref = varlen_attention_reference(qv, kv, vv, batch.cu_seqlens_q, batch.cu_seqlens_k, scale)
    _assert_same_float64(o, o_ref, (q, k, v), torch.Generator().manual_seed(1))


@pytest.mark.parametrize("La,L", [(0, 7), (5, 1), (128, 3), (128, 130), (300, 1), (300, 40), (1100, 9)])
def test_split_views_ancestor_piece_float64(La, L):
    """Views with enough ancestors for the ancestor piece: it takes exactly the largest length bucket <= La
    (128, 256 or 1024 here) and the causal piece the other La - A (0 at 128, 44 at 300, 76 at 1100) behind
    dropped query rows. Two such views (the second with L + 2 queries and La + 1 ancestors, so the plans differ)
    around one with keys and no queries (zero gradient), against brute-force bottom-right causal attention in
    float64: values and q/k/v gradients."""
    from harts.ops.attention.split import _bucket_floor, split_views_attention

    assert _bucket_floor(128) == 128 and _bucket_floor(300) == 256 and _bucket_floor(1100) == 1024
    H, D, Dv, scale = 2, 16, 8, 0.3
    lq, lk = [L, 0, L + 2], [La + L, 5, La + 1 + L + 2]  # the middle view has keys and no queries
    cu_q, cu_k = torch.tensor([0, *np.cumsum(lq)]), torch.tensor([0, *np.cumsum(lk)])
    g = torch.Generator().manual_seed(La + L)
    q = torch.randn(sum(lq), H, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lk), H, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lk), H, Dv, generator=g, dtype=torch.float64, requires_grad=True)
    o = split_views_attention(q, k, v, cu_q, cu_k, scale, piece="math")
    o_ref = varlen_attention_reference(q, k, v, cu_q, cu_k, scale)
    _assert_same_float64(o, o_ref, (q, k, v), g)


@pytest.mark.parametrize("H,G", [(2, 2), (6, 2)])
def test_split_reads_ancestor_runs_in_place_float64(monkeypatch, H, G):
    """The split over a compact layout's physical rows (``batch.mla_split_plan``): a view whose ancestors are
    three runs of rows (root, a second child, its second child: DFS order puts each after its elder siblings'
    subtrees) reads the two longest in place and gathers the third into an unmasked piece and the causal piece.
    Values and q/k/v gradients equal the reference views (keys gathered per view) to float64 rounding, also with
    grouped key / value heads (G < H: the split reads k and v as they are, the reference repeats them). The
    in-place threshold is lowered so that the test stays small; the pieces are the same code at any size."""
    import harts.ops.attention.split as split

    monkeypatch.setattr(split, "IN_PLACE_MIN_ROWS", 256)
    spec = [(700, [(600, [(300, []), (5, [])]), (300, [(280, []), (290, [(4, []), (6, [])])])])]
    batch = pack(trajectories_from_spec(spec, duplicates=[1]), chunk_size=16, pad_to_multiple=8)
    plan = batch.mla_split_plan
    assert plan is batch.mla_split_plan, "built once per batch"
    three = [v for v in plan.views if len(_in_place_runs(plan, v)) == 2 and v.gather[1] and v.R]
    assert three, [(v.slices, v.gather, v.R) for v in plan.views]
    assert plan.in_place_rows >= 640 + 256
    # causal pieces read in place, padding keys included (the rows that follow, seen by padding queries only)
    assert any(v.causal_start >= 0 and v.own_rows > v.causal[1] for v in plan.views), plan.views
    assert any(v.causal_start < 0 for v in plan.views), plan.views
    D, Dv, scale = 16, 8, 0.3
    q = _qkv(batch.num_phys, H, D, Dv, torch.float64, seed=7)[0]
    _, k, v = _qkv(batch.num_phys, G, D, Dv, torch.float64, seed=8)
    o = split.split_attention(q.index_select(0, batch.mla_q_rows), k, v, plan, scale, piece="math")
    k_ref, v_ref = (t.repeat_interleave(H // G, dim=1).index_select(0, batch.mla_kv_rows) for t in (k, v))
    o_ref = varlen_attention_reference(q.index_select(0, batch.mla_q_rows), k_ref, v_ref, batch.cu_seqlens_q,
                                       batch.cu_seqlens_k, scale)
    _assert_same_float64(o, o_ref, (q, k, v), torch.Generator().manual_seed(1))


def test_key_chunks_are_the_fewest_that_fill_the_sms():
    """Against an exhaustive search over the admissible chunk counts (whole 128-key chunks of at least
    MIN_CHUNK_KEYS): the fewest whose programs fill the SMs' waves to FILL_TARGET, else the best filling."""
    import harts.ops.attention.split as split

    def brute(rows, keys, heads, sms):
        tiles = heads * -(-rows // split.QUERY_TILE)

        def fill(b):
            return tiles * b / (-(-tiles * b // sms) * sms)

        ok = [b for b in range(1, keys // 128 + 1)
              if keys % (b * 128) == 0 and (b == 1 or keys // b >= split.MIN_CHUNK_KEYS)]
        good = [b for b in ok if fill(b) >= split.FILL_TARGET]
        return min(good) if good else max(ok, key=lambda b: (fill(b), -b))

    seen = set()
    for rows in (1, 128, 129, 300, 896, 1408, 4352, 25856):
        for keys in (128, 512, 1024, 4096, 9984, 10240, 24576):
            for heads in (2, 16, 64):
                b = split.key_chunks(rows, keys, heads, 132)
                assert b == brute(rows, keys, heads, 132), (rows, keys, heads)
                seen.add(b)
    assert 1 in seen and len(seen) > 3  # the search above exercises both outcomes
    assert split.key_chunks(25856, 24576, 16, 132) == 1  # many queries fill the SMs without chunks


@pytest.mark.parametrize("La,L", [(300, 1), (1100, 9), (1100, 130)])
def test_split_key_chunks_float64(monkeypatch, La, L):
    """Unmasked pieces run as batched key chunks (the chunk minimum lowered so that small views chunk): values
    and q/k/v gradients equal brute-force bottom-right causal attention in float64, and chunks did run."""
    import harts.ops.attention.split as split

    monkeypatch.setattr(split, "MIN_CHUNK_KEYS", 128)
    chunks, key_chunks = [], split.key_chunks
    monkeypatch.setattr(split, "key_chunks", lambda *a: chunks.append(key_chunks(*a)) or chunks[-1])
    H, D, Dv, scale = 2, 16, 8, 0.3
    lq, lk = [L, L + 2], [La + L, La + 1 + L + 2]
    cu_q, cu_k = torch.tensor([0, *np.cumsum(lq)]), torch.tensor([0, *np.cumsum(lk)])
    g = torch.Generator().manual_seed(La + L)
    q = torch.randn(sum(lq), H, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lk), H, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lk), H, Dv, generator=g, dtype=torch.float64, requires_grad=True)
    o = split.split_views_attention(q, k, v, cu_q, cu_k, scale, piece="math")
    assert max(chunks) > 1, chunks
    o_ref = varlen_attention_reference(q, k, v, cu_q, cu_k, scale)
    _assert_same_float64(o, o_ref, (q, k, v), g)


@pytest.mark.parametrize("H,G", [(2, 2), (4, 2)])
def test_split_unmasked_backward_as_causal_float64(monkeypatch, H, G):
    """The backward of unmasked pieces (in place and gathered) as causal calls over key chunks (the cuDNN
    path's way, here on the math pieces): q/k/v gradients equal brute-force bottom-right causal attention in
    float64, also with grouped key / value heads; pieces with more keys than queries (several chunks) and
    with fewer (one chunk) both ran."""
    import harts.ops.attention.split as split

    monkeypatch.setitem(split.UNMASKED_BWD_AS_CAUSAL, "math", True)
    monkeypatch.setattr(split, "AS_CAUSAL_MIN_QUERY_ROWS", 0)  # these pieces are small
    chunks, causal_key_chunks = [], split.causal_key_chunks
    monkeypatch.setattr(split, "causal_key_chunks", lambda *a: chunks.append((a, causal_key_chunks(*a))) or
                        chunks[-1][1])
    anc = [np.arange(1024), np.r_[np.arange(1024), np.arange(1100, 1612)],
           np.r_[np.arange(1650, 1800), np.arange(1900, 2050)]]
    own = [np.arange(1024, 1100), np.arange(1612, 1650), np.arange(2050, 2400)]
    kv_rows = np.concatenate([np.r_[a, o] for a, o in zip(anc, own)])
    cu_q = torch.tensor([0, *np.cumsum([len(o) for o in own])])
    cu_k = torch.tensor([0, *np.cumsum([len(a) + len(o) for a, o in zip(anc, own)])])
    X = 2400
    plan = split.split_plan(cu_q, cu_k, kv_rows, num_keys=X, min_in_place=1024)
    assert plan.shared and any(v.gather[1] for v in plan.views), (plan.shared, plan.views)
    D, Dv, scale = 16, 8, 0.3
    g = torch.Generator().manual_seed(H + G)
    q = torch.randn(int(cu_q[-1]), H, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(X, G, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(X, G, Dv, generator=g, dtype=torch.float64, requires_grad=True)
    o = split.split_attention(q, k, v, plan, scale, piece="math")
    rows = torch.as_tensor(kv_rows)
    k_ref, v_ref = (t.repeat_interleave(H // G, dim=1).index_select(0, rows) for t in (k, v))
    o_ref = varlen_attention_reference(q, k_ref, v_ref, cu_q, cu_k, scale)
    _assert_same_float64(o, o_ref, (q, k, v), g)
    ran = {((L, S), B) for (L, S), B in chunks}
    assert ((128, 1024), 8) in ran and ((128, 512), 4) in ran, ran  # the in-place run, the gathered run
    assert any(B == 1 and S < L for (L, S), B in ran), ran  # the third view: 350 queries over 256 keys


def test_causal_key_chunks():
    """The backward's key chunks hold at most the piece's query rows each, in whole 128-key tiles, and are the
    fewest that do, up to MAX_BWD_QUERY_REPEATS times the fewest possible; 0 when none fits or the piece has
    fewer queries than AS_CAUSAL_MIN_QUERY_ROWS."""
    import harts.ops.attention.split as split

    m = split.AS_CAUSAL_MIN_QUERY_ROWS
    assert split.causal_key_chunks(m - 1, 128) == 0 and split.causal_key_chunks(m, 128) == 1
    for L in (128, 200, 1000, 11776):
        for S in range(128, 40000, 128 * 7):
            B = split.causal_key_chunks(L, S, min_query_rows=0)
            if S <= L:
                assert B == 1, (L, S, B)
                continue
            fewest = -(-S // L)
            ok = [b for b in range(fewest, split.MAX_BWD_QUERY_REPEATS * fewest + 1) if S % (b * 128) == 0]
            assert B == (ok[0] if ok else 0), (L, S, B)
            if B:
                assert S // B <= L and S // B % 128 == 0


def _in_place_runs(plan, view) -> list:
    """The contiguous key ranges a view reads in place: its shared pieces' key segments, joined where they touch."""
    out = []
    for start, keys in sorted((plan.shared[i].start, plan.shared[i].keys) for i, _ in view.slices):
        if out and out[-1][1] == start:
            out[-1][1] = start + keys
        else:
            out.append([start, start + keys])
    return out


def test_split_shares_in_place_runs_between_views_float64():
    """Views that read runs of key rows from one row (a trunk they branch off at different depths) share its key
    segments: one unmasked piece per segment between consecutive run ends, for the stacked query rows of every
    view whose run covers it (here not adjacent: other views sit between them in query order), each segment a
    length bucket (4,224 rows are cut into 4,096 + 128). Every view reads its whole run in place, and values and
    q/k/v gradients equal the reference over each view's gathered keys in float64."""
    import harts.ops.attention.split as split

    anc = [np.arange(640), np.arange(900), np.r_[np.arange(640), np.arange(1000, 1040)], np.arange(900),
           np.arange(5300)]
    own = [np.arange(640, 700), np.arange(1000, 1040), np.arange(1040, 1100), np.arange(1100, 1110),
           np.arange(5300, 5310)]
    kv_rows = np.concatenate([np.r_[a, o] for a, o in zip(anc, own)])
    cu_q = torch.tensor([0, *np.cumsum([len(o) for o in own])])
    cu_k = torch.tensor([0, *np.cumsum([len(a) + len(o) for a, o in zip(anc, own)])])
    X = 5400
    plan = split.split_plan(cu_q, cu_k, kv_rows, num_keys=X, min_in_place=256)
    runs = {(p.start, p.keys): [q0 for q0, _ in p.ranges] for p in plan.shared}
    assert runs == {(0, 640): [0, 60, 100, 160, 170], (640, 256): [60, 160, 170], (896, 4096): [170],
                    (4992, 128): [170]}, runs  # runs of 640, 896 and 5,120 rows (bucketed) from row 0
    assert [_in_place_runs(plan, v) for v in plan.views] == [[[0, 640]], [[0, 896]], [[0, 640]], [[0, 896]],
                                                             [[0, 5120]]]
    H, D, Dv, scale = 2, 16, 8, 0.3
    g = torch.Generator().manual_seed(5)
    q = torch.randn(int(cu_q[-1]), H, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(X, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(X, H, Dv, generator=g, dtype=torch.float64, requires_grad=True)
    o = split.split_attention(q, k, v, plan, scale, piece="math")
    rows = torch.as_tensor(kv_rows)
    o_ref = varlen_attention_reference(q, k.index_select(0, rows), v.index_select(0, rows), cu_q, cu_k, scale)
    _assert_same_float64(o, o_ref, (q, k, v), g)


def _key_writes_brute_force(plan):
    """The key-row writes of the split's backward in its order, as sets: [(kind, rows)] with kind "slice" (a piece
    reading its keys in place) or "index" (gathered keys)."""
    out = []
    for view in plan.views:
        o0, m = view.causal
        if view.causal_start >= 0:
            out.append(("slice", set(range(view.causal_start, view.causal_start + m))))
        else:
            out.append(("index", set(plan.index[o0:o0 + m].tolist())))
        g0, A = view.gather
        if A:
            out.append(("index", set(plan.index[g0:g0 + A].tolist())))
    out += [("slice", set(range(sp.start, sp.start + sp.keys))) for sp in plan.shared]
    return out


def test_key_gradient_writes_copy_first_writers_and_zero_the_rest():
    """``SplitPlan.key_grad_writes`` against a walk over the pieces' key rows as sets: a slice piece copies its
    key / value gradient exactly when no earlier piece wrote any of its rows, and the rows zeroed up front are
    exactly those no copying piece writes (written by index adds only, or by no piece), so every row is written
    once or zeroed once before any add. On a compact layout's plan and on views over a trunk with unread rows."""
    import harts.ops.attention.split as split

    spec = [(700, [(600, [(300, []), (5, [])]), (300, [(280, []), (290, [(4, []), (6, [])])])])]
    batch = pack(trajectories_from_spec(spec, duplicates=[1]), chunk_size=16, pad_to_multiple=8)
    anc = [np.arange(640), np.arange(900), np.r_[np.arange(640), np.arange(1000, 1040)], np.arange(5300)]
    own = [np.arange(640, 700), np.arange(1000, 1040), np.arange(1040, 1100), np.arange(5300, 5310)]
    kv_rows = np.concatenate([np.r_[a, o] for a, o in zip(anc, own)])
    cu_q = [0, *np.cumsum([len(o) for o in own]).tolist()]
    cu_k = [0, *np.cumsum([len(a) + len(o) for a, o in zip(anc, own)]).tolist()]
    plans = [split.split_plan(batch.cu_seqlens_q, batch.cu_seqlens_k, batch.mla_kv_rows, num_keys=batch.num_phys,
                              min_in_place=256),
             split.split_plan(cu_q, cu_k, kv_rows, num_keys=5400, min_in_place=256)]
    for plan in plans:
        causal_first, shared_first, zero_ranges = plan.key_grad_writes()
        assert plan.key_grad_writes() is plan.key_grad_writes(), "built once per plan"
        flags = iter([f for view, f in zip(plan.views, causal_first) for f in ([f] + [False] * bool(view.gather[1]))]
                     + list(shared_first))
        written, copied = set(), set()
        for kind, rows in _key_writes_brute_force(plan):
            first = next(flags)
            assert first == (kind == "slice" and not rows & written), (kind, sorted(rows)[:4], first)
            if first:
                copied |= rows
            written |= rows
        zeroed = [r for a, b in zero_ranges for r in range(a, b)]
        assert len(zeroed) == len(set(zeroed)), zero_ranges
        assert set(zeroed) == set(range(plan.num_keys)) - copied, zero_ranges
        assert copied and zeroed, (causal_first, shared_first, zero_ranges)  # both kinds of row occur here


def test_split_plan_refuses_inconsistent_views():
    from harts.ops.attention.split import split_plan

    with pytest.raises(ValueError, match="view 1 has 4 queries and 3 keys"):
        split_plan([0, 2, 6], [0, 5, 8])
    with pytest.raises(ValueError, match="outside"):
        split_plan([0, 2], [0, 5], [0, 1, 2, 3, 9], num_keys=6)
    with pytest.raises(ValueError, match="5 key rows, cu_seqlens_k ends at 6"):
        split_plan([0, 2], [0, 6], [0, 1, 2, 3, 4])


def test_view_kernel_switch():
    import harts.ops
    from harts.ops.attention.tree import view_kernel

    assert view_kernel() == "cudnn_split"
    with harts.ops.use_kernel_choices(view_attention="varlen"):
        assert view_kernel() == "varlen"
    assert view_kernel() == "cudnn_split"
    with pytest.raises(ValueError, match="view_attention='flash'"):
        harts.ops.set_kernel_choices(view_attention="flash")
    assert view_kernel() == "cudnn_split"


def test_mask_is_built_once_per_batch_and_device():
    batch = pack(_trees(4, 0), chunk_size=4, mla_block_size=8)
    assert mla_tree_mask(batch, "cpu") is mla_tree_mask(batch, torch.device("cpu"))


def test_bad_arguments():
    batch = pack(_trees(4, 0), chunk_size=4, mla_block_size=8)
    row, end, counts = batch.mla_row, batch.mla_row_end, batch.mla_block_counts
    with pytest.raises(ValueError, match="block_counts has shape"):
        tree_mask(row, end, counts[:-1], 8)
    with pytest.raises(ValueError, match="row_end_P has shape"):
        tree_mask(row, end[:-1], counts, 8)
    with pytest.raises(ValueError, match="row_P must be an integer tensor"):
        tree_mask(row.double(), end, counts, 8)
    with pytest.raises(TypeError, match="row_P must be a torch.Tensor"):
        tree_mask(row.numpy(), end, counts, 8)
    with pytest.raises(ValueError, match="block must be a positive int"):
        tree_mask(row, end, counts, 0)
    mask = tree_mask(row, end, counts, 8)
    q, k, v = _qkv(batch.num_phys, 2, 6, 4, torch.float64, 0)
    with pytest.raises(ValueError, match=r"q must be \[P="):
        tree_attention_flex(q[:-1], k, v, mask, 0.5)
    with pytest.raises(ValueError, match="disagree"):
        tree_attention_flex(q, k[..., :4], v, mask, 0.5)
    with pytest.raises(TypeError, match="mask must be a TreeMask"):
        tree_attention_flex(q, k, v, mask.block_mask, 0.5)
    with pytest.raises(TypeError, match="mla_block_size must be an int"):
        pack(_trees(4, 0), chunk_size=4, mla_block_size=8.0)


def _gpu_trees(B, rng, n_branches=24):
    root = rng.integers(0, 1000, 6 * B + 9).tolist()
    out = [root]
    for j in range(n_branches):
        p = int(rng.choice([B - 1, B, B + 1, 3 * B, 5 * B + 1, int(rng.integers(1, 6 * B))]))
        out.append(root[:p] + [1000 + j] + rng.integers(0, 1000, int(rng.integers(1, 4 * B))).tolist())
    out.append(list(out[3]))  # a duplicate
    return out


@pytest.mark.gpu
def test_flex_bf16_within_bf16_noise_of_views_gpu():
    """bf16 flex and the bf16 view path (flash varlen kernel) against a float64 truth (view path, reference): flex is
    no further from exact arithmetic than the view path, for the outputs and all three gradients; and
    ``mla_tree_attention`` on CUDA bf16 runs the view path (measured faster, see its docstring)."""
    batch = pack(_gpu_trees(64, np.random.default_rng(0)), chunk_size=64, pad_to_multiple=8).to("cuda")
    H, D, Dv, scale = 4, 192, 128, 192 ** -0.5  # Ling-3.0 MLA head dims
    q, k, v = (t.detach().cuda() for t in _qkv(batch.num_phys, H, D, Dv, torch.float64, 3))
    do = torch.randn(batch.num_phys, H, Dv, dtype=torch.float64, device="cuda")

    def run(dtype, attend):
        x = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
        o = attend(*x)
        return [o.double()] + [g.double() for g in torch.autograd.grad((o * do.to(dtype)).sum(), x)]

    def views(backend, kernel=None):
        return lambda q, k, v: tree_attention_views(
            q, k, v, batch.mla_q_rows, batch.mla_q_is_identity, batch.mla_kv_rows, batch.cu_seqlens_q,
            batch.cu_seqlens_k, scale, backend=backend, max_seqlen_q=batch.max_seqlen_q,
            max_seqlen_k=batch.max_seqlen_k, kernel=kernel)

    truth = run(torch.float64, views("reference"))
    old = run(torch.bfloat16, views("fast", "varlen"))
    default = run(torch.bfloat16, views("fast"))
    got = run(torch.bfloat16, lambda q, k, v: tree_attention_flex(q, k, v, mla_tree_mask(batch, "cuda"), scale))
    auto = run(torch.bfloat16, lambda q, k, v: mla_tree_attention(q, k, v, batch, scale))
    for name, t, a, b, c, d in zip(("o", "dq", "dk", "dv"), truth, got, old, auto, default):
        err, err_old = (a - t).abs().max().item(), (b - t).abs().max().item()
        assert err <= 2 * err_old + 1e-3 * t.abs().max().item(), f"{name}: flex error {err:.3g}, views {err_old:.3g}"
        if name == "o":  # the forward is deterministic; the backward accumulates in no fixed order
            torch.testing.assert_close(c, d, rtol=0, atol=0, msg=lambda m: f"{name}: auto is not the view path: {m}")
        else:
            assert (c - d).abs().max().item() <= err_old, f"{name}: auto differs from the view path beyond its error"


@pytest.mark.gpu
@pytest.mark.parametrize("D,Dv,G", [(192, 128, 4), (256, 256, 4), (256, 256, 2)])  # Ling-3.0's MLA, Qwen3.5's GQA
def test_split_views_cudnn_bf16_within_flash_views_error_gpu(monkeypatch, D, Dv, G):
    """bf16 views through the cuDNN split (the default view kernel) against a float64 truth, next
    to the bf16 flash view path's own error: outputs and all three gradients within 2x of it (plus 1e-3 of
    the largest value). The trees' views have 0 to over 256 ancestors, so both pieces run, with and without
    ancestors in the causal piece. The packed path's cuDNN calls run first at the same buckets: torch <= 2.11
    shares cuDNN backward graphs between calls with equal q/k/v layouts. G < 4: grouped key / value heads, which
    cuDNN reads unrepeated (the truth and flash repeat them). Then with ancestor runs read in place (views reading
    one or two key segments of the root's rows); with the key-chunk minimum lowered, so that unmasked pieces run
    their forward as batched cuDNN calls over key chunks, merged by the Triton kernel; and with every unmasked
    piece's backward as causal cuDNN calls over key chunks."""
    import harts.ops.attention.split as split_mod
    from harts.ops.attention.fast import _cudnn_per_sequence
    from harts.ops.attention.split import split_plan
    from harts.ops.attention.tree import view_attention_impl

    batch = pack(_gpu_trees(64, np.random.default_rng(1)), chunk_size=64, pad_to_multiple=8).to("cuda")
    H, scale = 4, D ** -0.5
    La = (batch.cu_seqlens_k.diff() - batch.cu_seqlens_q.diff()).tolist()
    assert min(La) < 128 and max(La) > 256, (min(La), max(La))
    q = _qkv(batch.num_phys, H, D, Dv, torch.float64, 4)[0].detach().cuda()
    k, v = (t.detach().cuda() for t in _qkv(batch.num_phys, G, D, Dv, torch.float64, 5)[1:])
    do = torch.randn(batch.num_phys, H, Dv, dtype=torch.float64, device="cuda")

    def run(dtype, backend, kernel=None, plan=None):
        x = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
        o = tree_attention_views(*x, batch.mla_q_rows, batch.mla_q_is_identity, batch.mla_kv_rows,
                                 batch.cu_seqlens_q, batch.cu_seqlens_k, scale, backend=backend,
                                 max_seqlen_q=batch.max_seqlen_q, max_seqlen_k=batch.max_seqlen_k, kernel=kernel,
                                 plan=plan)
        return [o.double()] + [g.double() for g in torch.autograd.grad((o * do.to(dtype)).sum(), x)]

    truth = run(torch.float64, "reference")
    flash = run(torch.bfloat16, "fast", "varlen")
    cu = batch.cu_seqlens_q.long()
    x = [t.to(torch.bfloat16).requires_grad_(True) for t in (q[:cu[-1]], k[:cu[-1]], v[:cu[-1]])]
    _cudnn_per_sequence(*x, cu, scale).float().square().sum().backward()
    assert view_attention_impl(x[0], x[2])[0] == "cudnn_split"
    split = run(torch.bfloat16, "fast")
    # ancestor runs of 128+ rows read in place (the default threshold is above these trees' ancestors): runs of
    # 128 and 256 rows from the root's first row, so views read one or two key segments
    plan = split_plan(batch.cu_seqlens_q, batch.cu_seqlens_k, batch.mla_kv_rows, batch.num_phys, min_in_place=128)
    assert plan.in_place_rows > 0 and max(len(v.slices) for v in plan.views) == 2, plan.shared
    in_place = run(torch.bfloat16, "fast", plan=plan)
    # runs of 256+ rows in place, whose pieces have keys enough for the forward's key chunks
    plan_256 = split_plan(batch.cu_seqlens_q, batch.cu_seqlens_k, batch.mla_kv_rows, batch.num_phys,
                          min_in_place=256)
    monkeypatch.setattr(split_mod, "MIN_CHUNK_KEYS", 128)
    chunks, key_chunks = [], split_mod.key_chunks
    monkeypatch.setattr(split_mod, "key_chunks", lambda *a: chunks.append(key_chunks(*a)) or chunks[-1])
    chunked = run(torch.bfloat16, "fast", plan=plan_256)
    assert max(chunks) > 1, chunks
    # every unmasked piece's backward as causal calls (these pieces are below the query threshold)
    monkeypatch.setattr(split_mod, "AS_CAUSAL_MIN_QUERY_ROWS", 0)
    bwd_chunks, causal_key_chunks = [], split_mod.causal_key_chunks
    monkeypatch.setattr(split_mod, "causal_key_chunks",
                        lambda *a: bwd_chunks.append(causal_key_chunks(*a)) or bwd_chunks[-1])
    as_causal = run(torch.bfloat16, "fast", plan=plan)
    assert any(bwd_chunks), bwd_chunks  # causal calls ran
    for name, t, a, c, h, u, b in zip(("o", "dq", "dk", "dv"), truth, split, in_place, chunked, as_causal, flash):
        err, err_in_place, err_chunked, err_causal, err_flash = ((x - t).abs().max().item() for x in (a, c, h, u, b))
        bound = 2 * err_flash + 1e-3 * t.abs().max().item()
        assert err <= bound, f"{name}: split {err:.3g}, flash {err_flash:.3g}"
        assert err_in_place <= bound, f"{name}: split in place {err_in_place:.3g}, flash {err_flash:.3g}"
        assert err_chunked <= bound, f"{name}: split in key chunks {err_chunked:.3g}, flash {err_flash:.3g}"
        assert err_causal <= bound, f"{name}: backward as causal calls {err_causal:.3g}, flash {err_flash:.3g}"


@pytest.mark.parametrize("path", ["flex", "split_in_place"])
def test_model_on_fast_tree_attention_equals_trajectory_wise(monkeypatch, path):
    """The float64 debug Ling with every MLA layer on the flex path, or on the split reading ancestor runs in
    place (math pieces, with the in-place threshold lowered to the smallest bucket so that every run of 128+
    rows is a slice), swapped in for the view path, equals the trajectory-wise model: log-probs and every
    parameter gradient."""
    import harts.ops.attention.split as split
    import harts.runtime.compact as compact
    from harts.runtime import logprobs
    from tests.helpers import fork_tree, make_model

    B = 4
    trajs = fork_tree(B, np.random.default_rng(3))
    if path == "split_in_place":  # a shared 150-row prefix: ancestor runs of 128+ rows
        trajs = [[7] * 150 + t for t in trajs] + [[7] * 150 + [5] * 3]
    model = make_model(B)
    hb = pack(trajs, chunk_size=B, pad_to_multiple=3, mla_block_size=8)
    # the view path's arguments after q, k, v: q_rows, q_is_identity, kv_rows, cu_q, cu_k, scale
    if path == "flex":
        monkeypatch.setattr(compact, "tree_attention_views", lambda q, k, v, *a, **kw: tree_attention_flex(
            q, k, v, compact.mla_tree_mask(hb, q.device), a[5]))
    else:
        monkeypatch.setattr(split, "IN_PLACE_MIN_ROWS", 128)

        def in_place(q, k, v, q_rows, q_is_identity, *a, plan, **kw):
            o = split.split_attention(q.index_select(0, q_rows), k, v, plan(), a[3], piece="math")
            return torch.zeros((q.shape[0],) + o.shape[1:], dtype=o.dtype).index_copy(0, q_rows, o)

        monkeypatch.setattr(compact, "tree_attention_views", in_place)
    bb = pack(trajs, chunk_size=B, prefix_sharing=False)
    w = torch.randn(hb.logprob_rows.shape[0], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = []
    for batch in (hb, bb):
        model.zero_grad(set_to_none=True)
        lp = logprobs(model, batch)
        (lp * w).sum().backward()
        out.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    if path == "flex":
        assert any(key[0] == "mla_tree_mask" for key in hb.derived), "the flex path did not run"
    else:
        assert hb.mla_split_plan.in_place_rows > 0, "no ancestor run was read in place"
    (lp_h, g_h), (lp_b, g_b) = out
    torch.testing.assert_close(lp_h, lp_b, rtol=1e-10, atol=1e-10)
    assert g_h.keys() == g_b.keys()
    for name in g_b:
        scale = max(g_b[name].abs().max().item(), 1e-12)
        torch.testing.assert_close(g_h[name], g_b[name], rtol=1e-9, atol=1e-9 * scale,
                                   msg=lambda m: f"grad {name}: {m}")


def test_tree_attention_bench_counts_the_pairs_of_the_bottom_right_mask():
    """The bench's attention work per path: pairs counted from the lengths equal the visible entries of the
    bottom-right causal masks, built one by one."""
    from benchmarks.tree_attention import causal_pairs

    cu_q, cu_k = [0, 3, 3, 10, 11], [0, 5, 9, 16, 20]
    brute = 0
    for n in range(len(cu_q) - 1):
        lq, lk = cu_q[n + 1] - cu_q[n], cu_k[n + 1] - cu_k[n]
        brute += int((torch.arange(lk)[None, :] <= torch.arange(lk - lq, lk)[:, None]).sum())
    assert causal_pairs(cu_q, cu_k) == brute


def test_view_attention_impl_names_why_the_split_does_not_apply():
    import harts.ops
    from harts.ops.attention.tree import view_attention_impl

    q, v = torch.zeros(4, 2, 192, dtype=torch.bfloat16), torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    assert view_attention_impl(q, v) == ("varlen", "cuDNN split not used: not on CUDA")
    wide = torch.zeros(4, 2, 264, dtype=torch.bfloat16)
    assert view_attention_impl(wide, wide)[1].startswith("cuDNN split not used: head dims 264/264")
    assert view_attention_impl(q, v, "varlen") == ("varlen", "requested")
    with harts.ops.use_kernel_choices(view_attention="varlen"):
        assert view_attention_impl(q, v) == ("varlen", "requested")
    with pytest.raises(ValueError, match="view kernel 'flash'"):
        view_attention_impl(q, v, "flash")


@pytest.mark.parametrize("L,S,chunks", [(130, 512, 4), (200, 1024, 8), (100, 64, 1), (128, 384, 3)])
def test_unmasked_backward_as_causal_calls_float64(L, S, chunks):
    """An unmasked piece's backward as causal calls over key chunks gives the unmasked call's gradients in
    float64 (math pieces, grouped heads, padding query rows with zero output gradient), with one chunk (no more
    keys than queries) and with several, its key and value gradients added into the piece's rows of larger
    tensors (a slice, or an index); and both equal brute-force attention's gradients."""
    import harts.ops.attention.split as split

    H, G, D, Dv, scale = 4, 2, 16, 8, 0.3
    g = torch.Generator().manual_seed(L + S)
    q_LHD = torch.randn(L, H, D, generator=g, dtype=torch.float64)
    q_LHD[-3:] = 0  # padding rows, as the pieces have
    k, v = (torch.randn(S, G, x, generator=g, dtype=torch.float64) for x in (D, Dv))
    fwd, bwd = split.PIECES["math"]
    q = split._heads_first(q_LHD)
    o, lse, aux = fwd(q, split._heads_first(k), split._heads_first(v), False, scale)
    o = split._heads_first(o[0].transpose(0, 1).contiguous())
    do = torch.randn(1, H, L, Dv, generator=g, dtype=torch.float64)
    do[:, :, -3:] = 0
    B = split.causal_key_chunks(L, S, min_query_rows=0)
    assert B == chunks, B
    X = S + 50  # the piece's keys are rows of a larger key tensor: a slice of it, or rows gathered by an index

    def grads(B, rows):
        dk, dv = torch.zeros(X, G, D, dtype=torch.float64), torch.zeros(X, G, Dv, dtype=torch.float64)
        dq = split._bwd_unmasked(bwd, B, do, q, k, v, o, lse, aux, scale, dk, dv, rows)
        return dq, dk, dv

    for rows in (slice(30, 30 + S), torch.randperm(X, generator=g)[:S]):
        ref, got = grads(0, rows), grads(B, rows)
        for name, a, b in zip("qkv", got, ref):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"d{name}: {m}")
    # the unmasked call's gradients against brute force, placed in the piece's rows
    x = [t.clone().requires_grad_(True) for t in (q, k, v)]
    kk, vv = (t.repeat_interleave(H // G, dim=1).transpose(0, 1)[None] for t in x[1:])
    p = torch.softmax(x[0] @ kk.transpose(-1, -2) * scale, -1)
    (p @ vv * do).sum().backward()
    dq, dk, dv = grads(B, slice(30, 30 + S))
    torch.testing.assert_close(dq, x[0].grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dk[30:30 + S], x[1].grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dv[30:30 + S], x[2].grad, rtol=1e-12, atol=1e-12)
    assert not dk[:30].any() and not dk[30 + S:].any()
