"""HARTS's short-convolution kernels (``harts.ops.conv.fused``, kernel choice ``conv="harts"``) against the float64
torch references: the trajectory-wise convolution (``short_conv_reference``) and the tree-path convolution
(``tree_short_conv_reference`` on the predecessor rows the context implies). The kernels run in float32 under
the Triton interpreter on CPU (the bounds: float32 rounding of values of order one); the GPU test runs them in
bf16 beside fla's kernels."""
import pytest
import torch

from harts.ops.conv import short_conv_reference
from harts.ops.conv.fused import _device_chunks, short_conv_harts, tree_short_conv_harts
from harts.ops.tree_conv import tree_short_conv_reference

LENS = (70, 33, 5, 1, 2, 3, 64, 130, 65)  # across and at chunk edges (64 rows per chunk), and shorter than the window


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])


def _grads(fn, x, w, dy):
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(xs, ws)
    torch.autograd.backward([y], [dy])
    return y.detach(), xs.grad, ws.grad


def _close(a, b, what):
    err = ((a.double() - b).abs().max() / b.abs().max()).item()
    assert err < 2e-6, f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("activation", ["silu", None])
def test_trajectory_wise_matches_float64_reference(activation):
    g = torch.Generator().manual_seed(0)
    cu = _cu(LENS)
    T, P = int(cu[-1]), 40  # 40 channels: a partial channel block
    x, w, dy = torch.randn(T, P, generator=g), torch.randn(P, 4, generator=g) * 0.5, torch.randn(T, P, generator=g)
    got = _grads(lambda a, b: short_conv_harts(a, b, cu, activation, cu_seqlens_cpu=cu), x, w, dy)
    ref = _grads(lambda a, b: short_conv_reference(a, b, cu, activation), x.double(), w.double(), dy.double())
    for name, a, b in zip(("y", "dx", "dw"), got, ref):
        _close(a, b, name)


def _pred_from_context(lens, context_Q3):
    """pred_CW[c, s]: the row s steps back along c's path: inside its sequence block, else the context row."""
    rows = []
    start = 0
    for q, n in enumerate(lens):
        for i in range(n):
            rows.append([start + i - s if s <= i else int(context_Q3[q, 3 - (s - i)]) for s in range(4)])
        start += n
    return torch.tensor(rows)


@pytest.mark.parametrize("activation", ["silu", None])
def test_tree_paths_match_float64_reference(activation):
    g = torch.Generator().manual_seed(1)
    cu = _cu(LENS)
    C, P = int(cu[-1]), 24
    Q = len(LENS)
    # each block's ancestors: rows of earlier blocks (a tree's trunk and branches), some paths shorter than 3
    ctx = torch.full((Q, 3), -1, dtype=torch.long)
    for q in range(1, Q):
        anc = torch.randint(0, int(cu[q]), (3,), generator=g).sort().values
        ctx[q] = anc
    ctx[2, 0] = -1  # a path with two ancestor rows
    ctx[5, :2] = -1  # one
    ctx[6, 1:] = ctx[4, 1:]  # two blocks sharing ancestor rows (their gradients add)
    x, w, dy = torch.randn(C, P, generator=g), torch.randn(P, 4, generator=g) * 0.5, torch.randn(C, P, generator=g)
    got = _grads(lambda a, b: tree_short_conv_harts(a, b, cu, ctx, activation), x, w, dy)
    pred = _pred_from_context(LENS, ctx)
    ref = _grads(lambda a, b: tree_short_conv_reference(a, b, pred, activation), x.double(), w.double(), dy.double())
    for name, a, b in zip(("y", "dx", "dw"), got, ref):
        _close(a, b, name)


def test_chunk_list_covers_every_row_once():
    from harts.kernels.short_conv import BT

    cu = _cu((2 * BT + 6, 0, BT + 1, 1))
    pairs = _device_chunks(cu, None).tolist()
    assert pairs == [[0, 0], [0, 1], [0, 2], [2, 0], [2, 1], [3, 0]]


def test_other_widths_and_activations_are_refused():
    cu = _cu((8,))
    with pytest.raises(ValueError, match="width 3"):
        short_conv_harts(torch.randn(8, 4), torch.randn(4, 3), cu)
    with pytest.raises(ValueError, match="'gelu'"):
        short_conv_harts(torch.randn(8, 4), torch.randn(4, 4), cu, "gelu")
    with pytest.raises(ValueError, match="context"):
        tree_short_conv_harts(torch.randn(8, 4), torch.randn(4, 4), cu, torch.zeros(2, 3, dtype=torch.long))


def test_kernel_choice_routes_both_paths():
    """Under conv='harts' the trajectory-wise and tree fast entry points run these kernels (the dispatch the models
    go through), with the same result as calling them directly."""
    import harts.ops
    from harts.ops.conv.fast import short_conv_fast
    from harts.ops.tree_conv.fast import tree_short_conv_fast

    g = torch.Generator().manual_seed(2)
    cu = _cu((40, 9))
    x, w = torch.randn(49, 8, generator=g), torch.randn(8, 4, generator=g)
    ctx = torch.tensor([[-1, -1, -1], [3, 7, 20]])
    with harts.ops.use_kernel_choices(conv="harts"):
        assert torch.equal(short_conv_fast(x, w, cu, "silu", cu_seqlens_cpu=cu), short_conv_harts(x, w, cu, "silu", cu))
        assert torch.equal(tree_short_conv_fast(x, w, cu, ctx, "silu"), tree_short_conv_harts(x, w, cu, ctx, "silu"))
    with pytest.raises(ValueError, match="conv='sometimes'"):
        harts.ops.set_kernel_choices(conv="sometimes")


def test_auto_takes_these_kernels_where_they_apply_else_fla(caplog):
    """conv='auto': width 4 runs these kernels (bitwise what conv='harts' gives), another width
    fla's (bitwise what conv='fla' gives), and the log says so, naming the width."""
    import harts.ops
    from harts.ops import backend
    from harts.ops.conv.fast import short_conv_fast
    from harts.ops.tree_conv.fast import tree_short_conv_fast

    g = torch.Generator().manual_seed(4)
    cu = _cu((40, 9))
    ctx = torch.tensor([[-1, -1, -1], [3, 7, 20]])
    x = torch.randn(49, 8, generator=g)
    for width, same_as in ((4, "harts"), (3, "fla")):
        w = torch.randn(8, width, generator=g)
        with harts.ops.use_kernel_choices(conv=same_as):
            want = short_conv_fast(x, w, cu, "silu", cu_seqlens_cpu=cu)
            want_tree = tree_short_conv_fast(x, w, cu, ctx[:, 4 - width:], "silu") if width == 4 else None
        backend._logged.clear()
        with harts.ops.use_kernel_choices(conv="auto"), caplog.at_level("INFO", logger="harts.ops.backend"):
            assert torch.equal(short_conv_fast(x, w, cu, "silu", cu_seqlens_cpu=cu), want)
            if want_tree is not None:
                assert torch.equal(tree_short_conv_fast(x, w, cu, ctx, "silu"), want_tree)
        if same_as == "fla":
            assert "fla causal_conv1d (width 3, the kernels unroll width 4; kernel choice conv='auto')" in caplog.text
        else:
            assert "harts.kernels.short_conv (trajectory-wise; kernel choice conv='auto')" in caplog.text


@pytest.mark.gpu
def test_bf16_gpu_within_rounding_of_float64_beside_fla():
    """bf16 on the GPU at a model-like width, trajectory-wise and on tree paths: the outputs and both gradients
    within bf16 rounding of the float64 reference (fla's kernels, run on the same inputs, are held to the same
    bound)."""
    from harts.ops.conv.fast import short_conv_fast
    from harts.ops.tree_conv.fast import tree_short_conv_fast

    g = torch.Generator(device="cuda").manual_seed(3)
    lens = (700, 333, 5, 1, 64, 2000)
    cu = _cu(lens)
    T, P = int(cu[-1]), 2048
    x = torch.randn(T, P, device="cuda", generator=g)
    w = torch.randn(P, 4, device="cuda", generator=g) * 0.5
    dy = torch.randn(T, P, device="cuda", generator=g)
    ctx = torch.tensor([[-1, -1, -1], [5, 80, 699], [-1, 10, 20], [400, 401, 402], [1000, 1001, 1002],
                        [-1, -1, 1040]], device="cuda")
    pred = _pred_from_context(lens, ctx.cpu()).cuda()
    cases = {
        "trajectory-wise": (lambda a, b: short_conv_fast(a, b, cu.cuda(), "silu", cu_seqlens_cpu=cu),
                            lambda a, b: short_conv_reference(a, b, cu.cuda(), "silu")),
        "tree": (lambda a, b: tree_short_conv_fast(a, b, cu.cuda(), ctx, "silu"),
                 lambda a, b: tree_short_conv_reference(a, b, pred, "silu")),
    }
    import harts.ops

    for where, (fast, reference) in cases.items():
        ref = _grads(reference, x.double(), w.double(), dy.double())
        for impl in ("harts", "fla"):
            with harts.ops.use_kernel_choices(conv=impl):
                got = _grads(fast, x.bfloat16(), w, dy.bfloat16())
            for name, a, b in zip(("y", "dx", "dw"), got, ref):
                err = ((a.double() - b).abs().max() / b.abs().max()).item()
                assert err < 1e-2, f"{where} {impl} {name}: relative error {err:.2e}"
