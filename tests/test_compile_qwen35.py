"""torch.compile and selective activation checkpointing for Qwen3.5-MoE (harts.models.common.compile), on CPU in
float64 on the reference ops, the qwen3.5-debug model (3 Gated DeltaNet layers + 1 gated attention layer, every
layer a SparseMoE).

Each decoder layer runs as a compiled ``pre`` region (norm + the mixer's ``project``), the eager mixer ``core`` on
the layout and a compiled ``post`` region (``output`` + residual + norm + ``SparseMoE.compute`` + residual), the
same modules' ops in the same order as ``DecoderLayer.forward``; so the reference is the eager, uncheckpointed
model itself: compiled and selectively checkpointed runs must give its log-probs, every parameter gradient
(with the router loss's z and balance terms joined in the layers' backward) and its router statistics to
rounding, on a prefix-shared CompactBatch and on packed trajectories. That "selective" saves the matrix products
and recomputes the elementwise work is observed at the dispatcher (tests/test_activation_checkpoint.py's op
counter), and the number of graphs is bounded by the layer signatures, not by row counts.
"""
import numpy as np
import pytest
import torch

from harts.models.ling import compile_model
from harts.runtime import logprobs, pack
from harts.train.parallelize import apply_ac
from tests.helpers import fork_tree
from tests.test_activation_checkpoint import _assert_equal, _executed_ops, _packed, _rel, _step
from tests.test_qwen35_tree import make_model

CHUNK = 16


def _compact(model, B: int, prefix_sharing: bool = True):
    return pack(fork_tree(B, np.random.default_rng(B)), config=model.config, prefix_sharing=prefix_sharing)


def _signatures(model) -> int:
    """Graphs one (dtype, grad mode, with / without row multiplicities) needs: a pre region per mixer kind and a
    post region per mixer kind (every layer is MoE), whatever the number of layers and row counts."""
    return 2 * len({l.region_kind[0] for l in model.decoder_layers()})


def _same_model(model):
    """A fresh model with ``model``'s (seeded) weights."""
    other = make_model(CHUNK)
    assert all(torch.equal(p, q) for p, q in zip(other.parameters(), model.parameters(), strict=True))
    return other


def _run(model, batch, adv_S):
    model.zero_grad(set_to_none=True)
    lp = logprobs(model, batch)
    (adv_S * lp).sum().backward()
    return lp.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def setup():
    """The eager model, its uncheckpointed reference results (packed trajectories, a CompactBatch) and the
    batches."""
    model = make_model(CHUNK)
    assert {l.kind for l in model.decoder_layers()} == {"gdn", "attention"}
    batches = {"packed": _packed(model.config.vocab_size), "compact": _compact(model, 5)}
    ref = {k: _step(model, b) for k, b in batches.items()}
    return model, batches, ref


def test_compiled_equals_eager_float64_and_compilations_bounded(setup):
    eager = setup[0]
    compiled = _same_model(eager)
    report = compiled.compile(backend="aot_eager")
    assert compiled.compile_report is report
    assert len(report.regions) == 2 * len(compiled.decoder_layers())
    bound = _signatures(compiled)
    # compact (prefix-shared) and trajectory-wise batches with different row counts
    batches = [_compact(eager, 8), _compact(eager, 6), _compact(eager, 8, prefix_sharing=False)]
    assert len({b.input_ids.shape[0] for b in batches}) == len(batches)
    for i, b in enumerate(batches):
        adv = torch.randn(b.logprob_rows.shape[0], generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        lp_e, g_e = _run(eager, b, adv)
        lp_c, g_c = _run(compiled, b, adv)
        assert _rel(lp_c, lp_e) <= 1e-12, f"batch {i}: log-probs"
        assert g_c.keys() == g_e.keys() == {n for n, _ in eager.named_parameters()}
        for name in g_e:
            assert _rel(g_c[name], g_e[name]) <= 1e-12, f"batch {i}: grad {name}"
        for a, c in zip(eager.router_stats(), compiled.router_stats(), strict=True):
            assert torch.equal(a.counts_E, c.counts_E)
            assert _rel(c.z_loss, a.z_loss) <= 1e-12 and _rel(c.P_E, a.P_E) <= 1e-12
        if i == 0:
            first = report.compilations
            assert first == bound, report.summary()
    assert report.compilations == first, f"recompiled for new row counts: {report.summary(len(batches))}"
    assert set(report.by_region) == {"pre_gdn", "pre_gated_attention", "post_sparse_moe"}, report.summary()
    with pytest.raises(ValueError, match="already compiled"):
        compiled.compile()


def test_inductor_equals_eager_float64(setup):
    """Inductor's CPU code generation on one CompactBatch (the regions' generated kernels, not just the
    traced graphs)."""
    eager, batches, ref = setup
    compiled = _same_model(eager)
    report = compile_model(compiled, backend="inductor")
    _assert_equal(_step(compiled, batches["compact"]), ref["compact"], "inductor, compact")
    assert report.compilations == _signatures(compiled), report.summary()


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_eager_policy_gradients_equal_no_checkpointing(setup, policy):
    model, batches, ref = setup
    apply_ac(model, policy)
    try:
        for kind, b in batches.items():
            _assert_equal(_step(model, b), ref[kind], f"{policy} eager, {kind}")
    finally:
        model.model.checkpoint_policy = "none"


def test_compiled_selective_gradients_equal_no_checkpointing(setup):
    """aot_eager runs the partitioner that applies the selective policy to the traced regions. Selective
    only: the compiled regions without checkpointing are test_compiled_equals_eager_float64's, and "full"
    wraps the same compiled regions in the decoder stack's checkpoint (DecoderStack.run_layers, shared with
    Ling), compiled under every policy in tests/test_activation_checkpoint.py."""
    model, batches, ref = setup
    compiled = _same_model(model)
    report = compile_model(compiled, backend="aot_eager")
    compiled.model.checkpoint_policy = "selective"
    for kind, b in batches.items():
        _assert_equal(_step(compiled, b), ref[kind], f"selective compiled, {kind}")
    # selective graphs per layer signature: post per mixer kind x with / without row multiplicities
    # (compact / packed), not per layer or per row count
    assert set(report.by_region) == {"pre_gdn_sac", "pre_gated_attention_sac", "post_sparse_moe_sac"}, \
        report.summary()
    assert report.by_region["post_sparse_moe_sac"] == 4, report.summary()
    assert report.by_region["pre_gdn_sac"] == report.by_region["pre_gated_attention_sac"] == 1, report.summary()


def test_selective_saves_matmuls_and_recomputes_elementwise(setup):
    model, batches, _ = setup
    b = batches["compact"]
    none, sel, full = (_executed_ops(model, b, p) for p in ("none", "selective", "full"))
    # matrix products (forward and backward): never rerun by "selective", rerun by "full"
    assert sel["mm"] == none["mm"] and sel["bmm"] == none["bmm"]
    assert full["mm"] > none["mm"]
    # the norms' squares, the SwiGLU / gate activations and the decay's softplus are recomputed by "selective";
    # the norms' 1 / rms (one number per row) is saved
    for op in ("pow", "silu", "sigmoid", "softplus"):
        assert none[op] < sel[op] <= full[op], (op, none[op], sel[op], full[op])
    assert 0 < sel["rsqrt"] == none["rsqrt"] < full["rsqrt"], (none["rsqrt"], sel["rsqrt"], full["rsqrt"])
    # the mixer cores are not: the attention's softmax and the GDN rounds' chunk masks run as often as without
    # checkpointing, and again under "full"
    for op in ("_safe_softmax", "tril"):
        assert 0 < sel[op] == none[op] < full[op], (op, none[op], sel[op], full[op])


def test_region_split_refusals_and_submodule_hooks_run_in_the_regions():
    """Hooks on the modules the regions call (norms, MoE, the mixer's projections: where tensor parallelism
    puts its boundaries) run under selective checkpointing; hooks on the mixer module itself, whose code
    the regions call in pieces, are refused."""
    model = make_model(CHUNK)
    h = model.decoder_layers()[3].attention.register_forward_hook(lambda m, a, o: None)
    with pytest.raises(ValueError, match="layer 3: the sequence mixer module has forward hooks"):
        apply_ac(model, "selective")
    with pytest.raises(ValueError, match="layer 3: the sequence mixer module has forward hooks"):
        compile_model(model)
    h.remove()
    calls = []
    layer = model.decoder_layers()[3]
    hooks = [layer.mlp.register_forward_hook(lambda m, a, o: calls.append("mlp")),
             layer.post_attention_layernorm.register_forward_hook(lambda m, a, o: calls.append("norm"))]
    apply_ac(model, "selective")
    ids = torch.randint(0, model.config.vocab_size, (12,))
    model(ids, torch.arange(12), torch.tensor([0, 12]))
    assert calls == ["norm", "mlp"], calls
    for hk in hooks:
        hk.remove()
    assert model.model.checkpoint_policy == "selective" and not model.model.checkpoint_layers
    with pytest.raises(TypeError, match="region_kind"):
        compile_model(_NoRegions())


class _NoRegions(torch.nn.Module):
    """A model whose layers declare no region split."""

    def decoder_layers(self):
        return [torch.nn.Linear(2, 2)]
