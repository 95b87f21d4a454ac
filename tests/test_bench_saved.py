"""benchmarks.saved counts what autograd keeps for backward, by layer, each storage once and parameters never; the
model benchmark's census covers every decoder layer kind."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.saved import SavedCensus


def test_saved_census_counts_each_storage_once_by_the_layer_that_saved_it():
    torch.manual_seed(0)
    l1, l2 = nn.Linear(8, 16), nn.Linear(16, 4)
    x = torch.randn(32, 8)  # no gradient: the layers save their inputs for the weights' gradients only
    with SavedCensus({"first": l1, "second": l2}, nn.ModuleList([l1, l2])) as census:
        h = torch.relu(l1(x))  # l1 saves x; relu (outside the layers) saves its output h
        y = l2(h)  # l2 saves h again: the same storage, already counted
        z = y[:, :2] * y[:, 2:]  # two views of one tensor saved by one op: its storage, once
    z.sum().backward()
    f32 = 4
    assert census.by_layer() == {"first": 32 * 8 * f32, None: 32 * 16 * f32 + 32 * 4 * f32}
    assert census.total_bytes == (32 * 8 + 32 * 16 + 32 * 4) * f32
    kinds = {(g, s) for g, s, _, _, _ in census.by_shape()}
    assert kinds == {("first", (32, 8)), (None, (32, 16)), (None, (32, 4))}  # a view as the tensor it views
    # the hooks are gone after the block: a later forward counts nothing and keeps its output
    n = len(census.entries)
    assert torch.equal(l2(torch.relu(l1(x))), y)
    assert len(census.entries) == n


def _census(ac: str) -> dict:
    from benchmarks.common import build_model
    from benchmarks.model import saved_census
    from harts.models.ling import LingConfig
    from harts.train.parallelize import apply_ac

    cfg = LingConfig.preset("ling3-tiny-debug")
    model = build_model(cfg, "cpu", torch.float32, recompute=False)
    apply_ac(model, ac)
    lens = [40, 60]
    ids = torch.randint(0, cfg.vocab_size, (sum(lens),))
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0, 40, 100], dtype=torch.int32)
    r = saved_census(model, ids, pos, cu, max(lens))
    kinds = {"+".join(layer.region_kind) for layer in model.decoder_layers()}
    assert set(r["by_kind"]) == kinds | {"outside layers"}
    assert r["total_gib"] == pytest.approx(sum(v["gib"] for v in r["by_kind"].values()))
    assert sum(v["layers"] for v in r["by_kind"].values()) == len(list(model.decoder_layers()))
    return r


def test_model_census_without_checkpointing_sees_every_layer_kind():
    r = _census("none")
    assert all(v["gib"] > 0 for v in r["by_kind"].values()), r["by_kind"]


def test_model_census_under_full_checkpointing_sees_no_layer_activations():
    """Full recomputation keeps what a layer needs inside its checkpoint, which the census cannot see into: it
    finds nothing in the layers (what it counts is outside them, e.g. the layer outputs the stack keeps)."""
    r = _census("full")
    assert all(v["gib"] == 0 for kind, v in r["by_kind"].items() if kind != "outside layers"), r["by_kind"]
    assert r["by_kind"]["outside layers"]["gib"] > 0
