"""HF-layout checkpoint I/O: bit-exact round trip, official names, clear errors."""
import json
import re

import pytest
import torch

from harts.models.ling import LingConfig, LingForCausalLM
from harts.models.ling.checkpoint import (
    CheckpointError,
    load_hf_state_dict,
    load_pretrained,
    read_hf_tensors,
    save_pretrained,
    to_hf_state_dict,
)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = LingForCausalLM(LingConfig.preset("ling3-tiny-debug")).cast_(torch.bfloat16)
    for l in m.moe_layers():
        l.gate.expert_bias.normal_()
    return m


@pytest.mark.parametrize("shard", [1 << 30, 20_000])
def test_round_trip_bit_exact(tmp_path, model, shard):
    save_pretrained(model, tmp_path, max_shard_bytes=shard)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    nfiles = len(set(index["weight_map"].values()))
    assert (nfiles == 1) == (shard == 1 << 30)
    back = load_pretrained(tmp_path)
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    assert back.config.to_hf_dict() == model.config.to_hf_dict()


def test_official_names(model):
    keys = set(to_hf_state_dict(model))
    for k in ("model.word_embeddings.weight", "model.norm.weight", "lm_head.weight",
              "model.layers.0.attention.q_conv1d.weight", "model.layers.0.attention.A_log",
              "model.layers.0.attention.o_norm.weight", "model.layers.0.mlp.gate_proj.weight",
              "model.layers.3.attention.q_a_proj.weight", "model.layers.3.attention.q_a_layernorm.weight",
              "model.layers.3.attention.kv_a_proj_with_mqa.weight", "model.layers.3.attention.dense.weight",
              "model.layers.3.attention.g_proj.weight", "model.layers.1.mlp.gate.weight",
              "model.layers.1.mlp.gate.expert_bias", "model.layers.1.mlp.experts.15.down_proj.weight",
              "model.layers.1.mlp.shared_experts.up_proj.weight"):
        assert k in keys, k
    assert not any(re.search(r"\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj)$", k) for k in keys)


def test_errors_list_missing_unexpected_and_shapes(tmp_path, model):
    sd = dict(to_hf_state_dict(model))
    sd.pop("model.layers.2.attention.f_proj.weight")
    sd.pop("model.layers.1.mlp.experts.3.up_proj.weight")
    sd["model.layers.0.attention.bogus"] = torch.zeros(1)
    sd["model.norm.weight"] = torch.zeros(7)
    target = LingForCausalLM(LingConfig.preset("ling3-tiny-debug"))
    with pytest.raises(CheckpointError) as e:
        load_hf_state_dict(target, sd)
    msg = str(e.value)
    for s in ("missing keys (2)", "model.layers.2.attention.f_proj.weight",
              "model.layers.1.mlp.experts.3.up_proj.weight",
              "unexpected keys (1)", "model.layers.0.attention.bogus", "model.norm.weight: (7,) vs (64,)"):
        assert s in msg, s


def test_reads_transformers_style_single_file(tmp_path, model):
    from safetensors.torch import save_file

    save_pretrained(model, tmp_path / "a")
    sd = read_hf_tensors(tmp_path / "a")
    (tmp_path / "b").mkdir()
    save_file(sd, str(tmp_path / "b" / "model.safetensors"))
    (tmp_path / "b" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    back = load_pretrained(tmp_path / "b")
    assert all(torch.equal(x, y) for x, y in zip(model.state_dict().values(), back.state_dict().values()))
