"""torch.compile as the execution engine (harts.models.common.compile) on CPU, inductor's CPU backend.

The compiled model runs the same modules in the same order as the eager one, so in float64 its log-probs
and gradients equal the eager model's to rounding (both HARTS's compact layout and packed trajectories);
in float32 both stay within a float32-sized distance of the float64 truth. Row counts vary per
microbatch without recompiling: the number of compilations is bounded by the layer signatures.
"""
import copy

import numpy as np
import pytest
import torch

from harts.models.ling import compile_model
from harts.runtime import logprobs, pack
from tests.helpers import fork_tree, make_model

CHUNK = 16


def _signatures(model) -> int:
    """Graphs one (dtype, grad mode) needs: a pre region per mixer kind, a post region per (mixer kind,
    MLP kind) present; independent of the number of layers and of row counts."""
    layers = model.decoder_layers()
    return len({l.kind for l in layers}) + len({(l.kind, type(l.mlp).__name__) for l in layers})


def _run(model, batch, adv_S):
    model.zero_grad(set_to_none=True)
    lp = logprobs(model, batch)
    (adv_S * lp).sum().backward()
    return lp.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


@pytest.fixture(scope="module")
def models():
    eager = make_model(CHUNK)
    compiled = copy.deepcopy(eager)
    report = compile_model(compiled, backend="inductor", dynamic=True)
    return eager, compiled, report


def _batches(sizes, prefix_sharing):
    return [pack(fork_tree(b, np.random.default_rng(b)), chunk_size=CHUNK, prefix_sharing=prefix_sharing)
            for b in sizes]


def test_compiled_equals_eager_float64_and_compilations_bounded(models):
    eager, compiled, report = models
    bound = _signatures(compiled)
    # compact (prefix-shared) and packed (trajectory-wise) batches with different row counts
    batches = _batches([8, 5], True) + _batches([8], False)
    assert len({b.input_ids.shape[0] for b in batches}) == len(batches)
    for i, b in enumerate(batches):
        adv = torch.randn(b.logprob_rows.shape[0], generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        lp_e, g_e = _run(eager, b, adv)
        lp_c, g_c = _run(compiled, b, adv)
        assert _rel(lp_c, lp_e) <= 1e-12, f"batch {i}: log-probs"
        assert g_c.keys() == g_e.keys()
        for name in g_e:
            assert _rel(g_c[name], g_e[name]) <= 1e-12, f"batch {i}: grad {name}"
        st_e, st_c = eager.router_stats(), compiled.router_stats()
        for a, c in zip(st_e, st_c):
            assert torch.equal(a.counts_E, c.counts_E)
            assert abs(a.z_loss.item() - c.z_loss.item()) <= 1e-12 * max(1.0, abs(a.z_loss.item()))
        if i == 0:
            first = report.compilations
            assert first == bound, report.summary()
    assert report.compilations == first, f"recompiled for new row counts: {report.summary(len(batches))}"
    assert len(report.regions) == 2 * len(compiled.decoder_layers())
    # activation checkpointing wraps each compiled layer: recomputation reruns the same graphs
    b = batches[0]
    adv = torch.randn(b.logprob_rows.shape[0], generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    for m in (eager, compiled):
        m.model.checkpoint_layers = True
    try:
        (lp_e, g_e), (lp_c, g_c) = _run(eager, b, adv), _run(compiled, b, adv)
    finally:
        for m in (eager, compiled):
            m.model.checkpoint_layers = False
    assert _rel(lp_c, lp_e) <= 1e-12
    for name in g_e:
        assert _rel(g_c[name], g_e[name]) <= 1e-12, f"checkpointed: grad {name}"
    assert report.compilations == first, report.summary()


def test_compiled_float32_close_to_float64_truth():
    truth = make_model(CHUNK)
    eager32 = copy.deepcopy(truth).float()
    comp32 = copy.deepcopy(eager32)
    report = compile_model(comp32)
    b = _batches([6], True)[0]
    adv = torch.randn(b.logprob_rows.shape[0], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    lp_t, g_t = _run(truth, b, adv)
    lp_e, g_e = _run(eager32, b, adv.float())
    lp_c, g_c = _run(comp32, b, adv.float())
    assert report.compilations == _signatures(comp32)
    # float32 rounding through 8 layers: well under 1e-5 relative; a wrong op would be O(1)
    assert _rel(lp_c.double(), lp_t) <= 1e-5 and _rel(lp_e.double(), lp_t) <= 1e-5
    for name in g_t:
        assert _rel(g_c[name].double(), g_t[name]) <= 1e-3, f"compiled grad {name}"
        assert _rel(g_e[name].double(), g_t[name]) <= 1e-3, f"eager grad {name}"


def test_grouped_mm_path_traces_without_breaks_and_matches_reference():
    """The bf16 GPU MoE path (torch._grouped_mm) has no data-dependent shapes: it compiles fullgraph with
    dynamic rows (bf16 on CPU under aot_eager: the CPU backend has no grouped-GEMM lowering to test), and
    forward and gradients stay within bf16 rounding of the float64 reference."""
    from harts.ops.moe import moe_experts_grouped_mm, moe_experts_reference

    g = torch.Generator().manual_seed(0)
    E, K, D, F = 8, 2, 16, 8
    w64 = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in ((E, F, D), (E, F, D), (E, D, F))]
    fn = torch.compile(moe_experts_grouped_mm, backend="aot_eager", dynamic=True, fullgraph=True)
    for T in (5, 13):
        x64 = torch.randn(T, D, generator=g, dtype=torch.float64)
        idx = torch.stack([torch.randperm(E, generator=g)[:K].sort().values for _ in range(T)])
        idx[0] = torch.tensor([0, E - 1])  # first and last expert used, some experts empty
        wk = torch.rand(T, K, generator=g)
        leaves = [t.bfloat16().requires_grad_() for t in (x64, *w64)]
        # the truth from the bf16-rounded inputs: what is left is the path's own rounding
        ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
        ref = moe_experts_reference(ref_leaves[0], idx, wk.double(), *ref_leaves[1:])
        out = fn(leaves[0], idx, wk, *leaves[1:])
        assert _rel(out.double(), ref) <= 2e-2
        gy = torch.randn(T, D, generator=g, dtype=torch.float64)
        for a, b in zip(torch.autograd.grad(out, leaves, gy.bfloat16()), torch.autograd.grad(ref, ref_leaves, gy)):
            assert _rel(a.double(), b) <= 3e-2


def test_refuses_hooked_submodules_and_double_compile():
    model = make_model(CHUNK)
    h = model.decoder_layers()[1].attention.register_forward_pre_hook(lambda m, a: None)
    with pytest.raises(ValueError, match="layer 1: the sequence mixer module has forward hooks"):
        compile_model(model)
    h.remove()
    compile_model(model, backend="eager")
    with pytest.raises(ValueError, match="already compiled"):
        compile_model(model)
    with pytest.raises(TypeError, match="backend"):
        compile_model(make_model(CHUNK), backend="")


@pytest.mark.parametrize("op", ["norm", "moe_experts", "moe_gather_sum", "logprobs", "kda", "conv"])
def test_backend_resolution_traces_inside_compiled_regions(op):
    """The ops that run inside compiled regions resolve their backend while Dynamo traces (for a CUDA device,
    the branch the GPU takes): the resolver reads only constants there, no importlib call, which torch
    2.11's Dynamo refuses. (Attention is resolved by the mixer core, which runs outside the regions.)"""
    from harts.ops.backend import resolve

    def f(x):
        return x + (1 if resolve(op, "auto", torch.device("cuda", 0), torch.bfloat16) == "fast" else 2)

    torch._dynamo.reset()
    torch.compile(f, backend="eager", fullgraph=True)(torch.zeros(2))
