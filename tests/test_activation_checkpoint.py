"""Activation checkpointing policies ("none" | "selective" | "full", ``LingModel.checkpoint_policy``).

Recomputation reruns the same ops on the same inputs, so in float64 every policy's log-probs and gradients
equal the un-checkpointed model's (the reference: no checkpointing at all), eager and compiled, on packed
trajectories and on a prefix-shared CompactBatch, with the router loss (z and balance terms) joined in the
layers' backward; so do the router statistics the layers record (they leave a compiled selective region
through its checkpoint, on torch 2.11 and 2.13). That
"selective" saves the matrix products and recomputes the elementwise work is observed at the dispatcher:
an outer TorchDispatchMode counts the aten ops that actually execute over forward + backward (ops whose
saved output is reused never reach it).
"""
import dataclasses
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harts.models.common.stack import AC_POLICIES
from harts.models.ling import compile_model
from harts.runtime import logprobs, pack
from harts.train.parallelize import apply_ac
from tests.helpers import fork_tree, make_model

CHUNK = 16


def _router(model) -> tuple:
    """(c_z, c_aux) and previous load fractions f_LE: the z and balance terms join each MoE layer's backward."""
    f_LE = torch.rand(len(model.moe_layers()), model.config.num_experts, generator=torch.Generator().manual_seed(4),
                      dtype=torch.float64)
    return torch.tensor([1e-3, 1e-2], dtype=torch.float64), f_LE


def _compact():
    return pack(fork_tree(5, np.random.default_rng(1)), chunk_size=CHUNK, prefix_sharing=True)


def _packed(vocab: int):
    g = torch.Generator().manual_seed(2)
    lens = [7, 19, 12]
    ids = torch.randint(0, vocab, (sum(lens),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return ids, pos, cu


def _step(model, batch):
    """Log-probs, parameter gradients of a fixed linear loss (plus the router term) and the router statistics
    recorded by the forward."""
    model.zero_grad(set_to_none=True)
    router = _router(model)
    if isinstance(batch, tuple):
        ids, pos, cu = batch
        h = model(ids, pos, cu, router=router)
        lp = model.token_logprobs(h, torch.roll(ids, -1))
    else:
        lp = logprobs(model, batch, router=router)
    w = torch.randn(lp.shape, generator=torch.Generator().manual_seed(3), dtype=lp.dtype)
    (w * lp).sum().backward()
    stats = [{f.name: getattr(st, f.name).detach().clone() for f in dataclasses.fields(st)}
             for st in model.router_stats()]
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, stats


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _assert_equal(got, ref, what):
    assert _rel(got[0], ref[0]) <= 1e-12, f"{what}: log-probs"
    assert got[1].keys() == ref[1].keys(), f"{what}: parameters with gradients"
    for name, g in ref[1].items():
        assert _rel(got[1][name], g) <= 1e-12, f"{what}: grad {name}"
    assert len(got[2]) == len(ref[2]) > 0, f"{what}: MoE layers with router statistics"
    for i, (st, st_ref) in enumerate(zip(got[2], ref[2])):
        assert st.keys() == st_ref.keys()
        for name, t in st_ref.items():
            assert st[name].shape == t.shape and _rel(st[name], t) <= 1e-12, f"{what}: MoE layer {i} {name}"


@pytest.fixture(scope="module")
def setup():
    model = make_model(CHUNK)
    batches = {"packed": _packed(model.config.vocab_size), "compact": _compact()}
    model.model.checkpoint_policy = "none"
    ref = {k: _step(model, b) for k, b in batches.items()}
    return model, batches, ref


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_eager_policy_gradients_equal_no_checkpointing(setup, policy):
    model, batches, ref = setup
    model.model.checkpoint_policy = policy
    try:
        for kind, b in batches.items():
            _assert_equal(_step(model, b), ref[kind], f"{policy} eager, {kind}")
    finally:
        model.model.checkpoint_policy = "none"


def test_compiled_policies_gradients_equal_no_checkpointing(setup):
    """aot_eager runs the partitioner that applies the selective policy to the traced regions (inductor's CPU
    code generation would only add minutes; tests/test_compile.py covers inductor)."""
    model, batches, ref = setup
    compiled = make_model(CHUNK)  # the same seeded weights
    assert all(torch.equal(p, q) for p, q in zip(compiled.parameters(), model.parameters()))
    report = compile_model(compiled, backend="aot_eager")
    for policy in AC_POLICIES:
        compiled.model.checkpoint_policy = policy
        for kind, b in batches.items():
            _assert_equal(_step(compiled, b), ref[kind], f"{policy} compiled, {kind}")
    # plain and selective graphs per layer signature: post_moe per mixer kind x with / without row
    # multiplicities (compact / packed), not per layer or per row count
    assert set(report.by_region) == {"pre_kda", "pre_mla", "post_dense", "post_moe", "pre_kda_sac", "pre_mla_sac",
                                     "post_dense_sac", "post_moe_sac"}, report.summary()
    assert report.by_region["post_moe_sac"] == report.by_region["post_moe"] == 4, report.summary()
    assert report.by_region["pre_kda_sac"] == report.by_region["pre_mla_sac"] == 1, report.summary()


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _executed_ops(model, batch, policy) -> Counter:
    model.model.checkpoint_policy = policy
    try:
        with _CountOps() as mode:
            _step(model, batch)
    finally:
        model.model.checkpoint_policy = "none"
    return mode.counts


def test_selective_saves_matmuls_and_recomputes_elementwise(setup):
    model, batches, _ = setup
    b = batches["compact"]
    none, sel, full = (_executed_ops(model, b, p) for p in ("none", "selective", "full"))
    # matrix products (forward and backward): never rerun by "selective", rerun by "full"
    assert sel["mm"] == none["mm"] and sel["bmm"] == none["bmm"]
    assert full["mm"] > none["mm"]
    # the norms' squares and the SwiGLU / gate activations are recomputed by "selective"; the norms' 1 / rms
    # (one number per row) is saved
    for op in ("pow", "silu", "sigmoid"):
        assert none[op] < sel[op] <= full[op], (op, none[op], sel[op], full[op])
    assert 0 < sel["rsqrt"] == none["rsqrt"] < full["rsqrt"], (none["rsqrt"], sel["rsqrt"], full["rsqrt"])
    # the mixer cores are not: the reference attention's softmax (MLA) and the chunk masks of the KDA
    # recurrence run as often as without checkpointing, and again under "full"
    for op in ("_safe_softmax", "tril"):
        assert 0 < sel[op] == none[op] < full[op], (op, none[op], sel[op], full[op])


def test_policy_validation_and_refusals():
    model = make_model(CHUNK)
    with pytest.raises(ValueError, match="checkpoint_policy = 'partial'"):
        model.model.checkpoint_policy = "partial"
    with pytest.raises(ValueError, match="checkpoint_policy = 'selctive'"):
        apply_ac(model, "selctive")
    apply_ac(model, "full")
    assert model.model.checkpoint_policy == "full" and model.model.checkpoint_layers
    model.model.checkpoint_layers = False
    assert model.model.checkpoint_policy == "none"
    h = model.decoder_layers()[2].attention.register_forward_hook(lambda m, a, o: None)
    with pytest.raises(ValueError, match="layer 2: the sequence mixer module has forward hooks"):
        apply_ac(model, "selective")
    h.remove()
    apply_ac(model, "selective")
    assert model.model.checkpoint_policy == "selective"
