"""Tree-path short convolution: reference vs per-trajectory conv1d, and fla's varlen causal_conv1d with
ancestor windows (interpreted on CPU in fp32, compiled on the GPU) vs a float64 reference, values and gradients,
in both implementations of ``harts.ops.tree_conv.fast`` (``IMPL``: split chunks, initial states), under the kernel
choice conv="fla" (HARTS's own kernels: tests/test_ops_conv_harts.py)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harts.ops.tree_conv import tree_short_conv, tree_short_conv_reference
from harts.runtime import pack
from tests.helpers import fork_tree


@pytest.fixture(autouse=True)
def _fla_kernels():
    import harts.ops

    with harts.ops.use_kernel_choices(conv="fla"):
        yield


def _batch(B=4, seed=0):
    return pack(fork_tree(B, np.random.default_rng(seed)), chunk_size=B)


def test_reference_equals_per_trajectory_conv1d():
    b = _batch()
    C, P, W = b.num_rows, 6, 4
    g = torch.Generator().manual_seed(1)
    x = torch.randn(C, P, generator=g, dtype=torch.float64)
    w = torch.randn(P, W, generator=g, dtype=torch.float64)
    y = tree_short_conv_reference(x, w, b.conv_pred)
    # Independent: expand each trajectory's rows, convolve it alone, compare row by row.
    o = b.logprob_offsets
    for i in range(b.num_trajectories):
        rows = b.logprob_rows[o[i]:o[i + 1]]  # rows of positions 0..L-2 of trajectory i
        if rows.shape[0] == 0:
            continue
        xs = x[rows].T[None]
        ref = F.silu(F.conv1d(xs, w[:, None, :], padding=W - 1, groups=P)[0, :, : rows.shape[0]].T)
        torch.testing.assert_close(y[rows], ref, rtol=1e-12, atol=1e-12)


IMPLS = ["split_chunks", "initial_state"]  # harts.ops.tree_conv.fast.IMPL


def _rel_err(a, truth):
    return ((a.double() - truth).abs().max() / truth.abs().max().clamp_min(1e-300)).item()


def _check_against_float64(run_fast, run_ref, x, w, gy):
    """Values and x/w gradients of ``run_fast`` (float32) against the float64 truth ``run_ref`` on the same
    inputs: each within 10x the error of ``run_ref`` itself in float32 (floored at 1e-6, about 8 float32 unit
    roundoffs), relative to the truth's largest entry."""
    x64, w64 = (t.detach().double().requires_grad_(True) for t in (x, w))
    y64 = run_ref(x64, w64)
    truth = (y64.detach(), *torch.autograd.grad((y64 * gy.double()).sum(), (x64, w64)))
    x32, w32 = (t.detach().float().requires_grad_(True) for t in (x, w))
    y32 = run_ref(x32, w32)
    ref32 = (y32.detach(), *torch.autograd.grad((y32 * gy).sum(), (x32, w32)))
    y = run_fast(x, w)
    got = (y.detach(), *torch.autograd.grad((y * gy).sum(), (x, w)))
    for name, a, r, t in zip(("y", "dx", "dw"), got, ref32, truth, strict=True):
        bound = 10 * max(_rel_err(r, t), 1e-6)
        assert _rel_err(a, t) <= bound, f"{name}: relative error {_rel_err(a, t):.3g} > {bound:.3g}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", [0, 3])
def test_fla_varlen_with_ancestor_windows_matches_reference(seed, impl, monkeypatch):
    """Trees whose sequences have full, partial (-1) and no ancestor windows, every implementation."""
    from harts.ops.tree_conv import fast

    monkeypatch.setattr(fast, "IMPL", impl)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    b = _batch(seed=seed).to(dev)
    ctx = b.conv_context
    assert bool(((ctx < 0).any(1) & (ctx >= 0).any(1)).any()) and bool((ctx < 0).all(1).any())
    C, P, W = b.num_rows, 16, 4
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(C, P, generator=g).to(dev).requires_grad_(True)
    w = torch.randn(P, W, generator=g).to(dev).requires_grad_(True)
    gy = torch.randn(C, P, generator=g).to(dev)
    if dev == "cuda":
        def run_fast(x, w):
            return tree_short_conv(x, w, b.conv_pred, seq_cu=b.conv_cu_seqlens, context=ctx, backend="fast")
    else:
        def run_fast(x, w):
            return _fast_cpu(x, w, b)
    _check_against_float64(run_fast, lambda x, w: tree_short_conv_reference(x, w, b.conv_pred), x, w, gy)


def _expanded_reference(x, w, seq_cu, context, activation):
    """Independent of the tree code: each sequence's rows after its context rows (zeros for -1), convolved
    alone with conv1d; the outputs of the sequence's own rows, concatenated."""
    W1 = context.shape[1]
    out = []
    for q in range(context.shape[0]):
        anc = [x[c] if c >= 0 else x.new_zeros(x.shape[1]) for c in context[q].tolist()]
        xs = torch.cat([torch.stack(anc), x[seq_cu[q]:seq_cu[q + 1]]]) if W1 else x[seq_cu[q]:seq_cu[q + 1]]
        pre = F.conv1d(xs.T[None], w[:, None, :], groups=x.shape[1])[0].T
        out.append(F.silu(pre) if activation == "silu" else pre)
    return torch.cat(out)


@pytest.mark.parametrize("long", [True, False], ids=["long", "all_short"])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("impl", IMPLS)
def test_fla_varlen_short_sequences_and_partial_contexts(impl, activation, long, monkeypatch):
    """Sequences of 1 and 2 rows (fewer than W-1: only their rows are head rows), context rows -1 at the front,
    inside and throughout, shared ancestors (siblings), ancestors that are head rows of other sequences, against
    a float64 expansion of each sequence. ``long``: sequence 5 spans three of fla's chunks of rows (CHUNK), the
    last partial, and a last sequence of exactly two chunks reads ancestors on both sides of sequence 5's first
    chunk boundary and its last row (so the split implementation's ``rest`` has several chunks per sequence);
    else every sequence is shorter than a chunk (``rest`` is empty)."""
    from harts.ops.tree_conv import fast

    monkeypatch.setattr(fast, "IMPL", impl)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    K = fast.CHUNK
    lens = [5, 1, 2, 3, 1, 2 * K + 6 if long else 6, 2, 4, 1] + ([2 * K] if long else [])
    seq_cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), device=dev)
    # rows: seq 0 = 0..4, seq 1 = 5, seq 2 = 6..7, seq 3 = 8..10, seq 4 = 11, seq 5 = 12.., then seqs 6, 7, 8, (9)
    context = [[-1, -1, -1],   # a root: no ancestor
               [2, 3, 4],      # 1 row, full window
               [-1, 3, 4],     # 2 rows, sibling of seq 1 (shared ancestors 3, 4)
               [-1, -1, 5],    # ancestor = seq 1's only (head) row
               [4, -1, 7],     # 1 row, a -1 inside; ancestor 7 is a head row of seq 2
               [8, 9, 10],     # long (or not) sequence, ancestors = all of seq 3 (its head rows)
               [-1, -1, -1],   # 2 rows, no ancestor
               [11, 11, 11],   # the same ancestor row three times
               [-1, 6, 7]]     # 1 row
    if long:
        context.append([12 + K - 1, 12 + K, 12 + lens[5] - 1])  # seq 5's rows around its chunk 0 / 1 boundary, last
    context = torch.tensor(context, device=dev)
    C, P, W = int(seq_cu[-1]), 8, 4
    g = torch.Generator().manual_seed(11)
    x = torch.randn(C, P, generator=g).to(dev).requires_grad_(True)
    w = torch.randn(P, W, generator=g).to(dev).requires_grad_(True)
    gy = torch.randn(C, P, generator=g).to(dev)
    _check_against_float64(lambda x, w: fast.tree_short_conv_fast(x, w, seq_cu, context, activation),
                           lambda x, w: _expanded_reference(x, w, seq_cu.tolist(), context, activation), x, w, gy)


def test_split_chunks_lists_are_flas_chunk_indices():
    """The split implementation's ``rest`` and ``first`` lists are fla's ``prepare_chunk_indices``, partitioned
    by chunk == 0 (rest in fla's order), also for a sequence of exactly one and two chunks, and built once per
    seq_cu tensor."""
    from harts.ops._fla import prepare_chunk_indices
    from harts.ops.tree_conv import fast

    K = fast.CHUNK
    seq_cu = torch.tensor(np.concatenate([[0], np.cumsum([3, K, 2 * K, 2 * K + 1, 1, 3 * K - 1])]))
    cu, rest, first = fast._cached_chunk_split()(seq_cu)
    chunks = prepare_chunk_indices(seq_cu, K)
    assert torch.equal(rest, chunks[chunks[:, 1] > 0]) and torch.equal(first, chunks[chunks[:, 1] == 0])
    assert fast._cached_chunk_split()(seq_cu)[1] is rest


def test_split_chunks_without_sequences(monkeypatch):
    """Q == 0 (no rows): no launch, an empty output, a zero weight gradient."""
    from harts.ops.tree_conv import fast

    monkeypatch.setattr(fast, "IMPL", "split_chunks")
    x = torch.zeros(0, 8, requires_grad=True)
    w = torch.randn(8, 4, requires_grad=True)
    y = fast.tree_short_conv_fast(x, w, torch.zeros(1, dtype=torch.long), torch.zeros(0, 3, dtype=torch.long))
    assert y.shape == (0, 8)
    dx, dw = torch.autograd.grad(y.sum(), (x, w))
    assert dx.shape == (0, 8) and torch.equal(dw, torch.zeros_like(w))


def test_unknown_impl_is_refused(monkeypatch):
    from harts.ops.tree_conv import fast

    monkeypatch.setattr(fast, "IMPL", "fixup")
    with pytest.raises(ValueError, match="'fixup'"):
        fast.tree_short_conv_fast(torch.zeros(1, 8), torch.zeros(8, 4), torch.tensor([0, 1]),
                                  torch.full((1, 3), -1))


def _fast_cpu(x, w, b):
    """The fast path's code under the Triton interpreter (backend resolution would pick the reference on CPU)."""
    from harts.ops.tree_conv.fast import tree_short_conv_fast

    return tree_short_conv_fast(x, w, b.conv_cu_seqlens, b.conv_context)


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("width", [1, 2, 4, 7])
def test_predecessor_index_walks_the_parent_pointers(width, kind):
    """Against a plain walk up the parent pointers, on a random forest (parents precede their children) whose
    paths are both shorter and longer than the window; from a tensor (the reference convolution) and from a
    numpy array (pack)."""
    from harts.ops.tree_conv import predecessor_index

    rng = np.random.default_rng(width)
    C = 200
    parent = np.array([-1 if c == 0 or rng.random() < 0.05 else int(rng.integers(max(0, c - 5), c))
                       for c in range(C)])
    want = np.full((C, width), -1)
    for c in range(C):
        r = c
        for s in range(width):
            want[c, s] = r
            r = parent[r] if r >= 0 else -1
    if kind == "torch":
        got = predecessor_index(torch.as_tensor(parent), width)
        assert isinstance(got, torch.Tensor)
        got = got.numpy()
    else:
        got = predecessor_index(parent, width)
        assert isinstance(got, np.ndarray) and got.flags.c_contiguous
    np.testing.assert_array_equal(got, want)
