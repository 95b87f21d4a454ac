"""External reference: transformers' own Qwen3_5MoeForCausalLM (text model, ``qwen3_5_moe``), both ways.

- transformers saves (``save_pretrained``, per-expert tensors), ``Qwen35ForCausalLM.from_pretrained`` reads
  the folder: the weights arrive bit-identical and the logits match, including several packed sequences
  (each compared with its own transformers forward, so the GDN state, the convolution and attention must reset
  at every sequence boundary);
- we save, transformers' ``from_pretrained`` loads with no missing, unexpected or mismatched key and the
  logits match.

transformers computes in float32 whatever the model dtype in a few places: the zero-centred RMSNorms and the
gated output norm, the decay (``A_log.float()``), its torch GDN functions (q, k, v, g, beta cast to float32),
the router softmax and the RoPE angles; so the float64 comparison is float32-level (measured up to 6e-7 relative),
and float32 is held to 1e-4 relative. Its GDN and convolution functions prefer kernels when importable; they
are pointed at transformers' own pure-torch implementations, so the reference shares no kernel code with us.
"""
import json

import pytest
import torch

from harts.models.qwen35 import Qwen35Config, Qwen35ForCausalLM

# the test extra pins transformers 5.23.0, so CI always runs this file; it skips only where an older
# transformers is installed (the GPU image has 5.17, whose classes differ)
transformers = pytest.importorskip("transformers", minversion="5.23.0")


@pytest.fixture()
def hf_torch_kernels(monkeypatch):
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as mq

    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        f = getattr(mq, name)
        monkeypatch.setattr(mq, name, getattr(f, "__wrapped__", f))
    return mq


TOL = {torch.float32: 1e-4, torch.float64: 5e-6}


def _cfg(**kw):
    return Qwen35Config.preset("qwen3.5-debug", backend="reference", **kw)


def _hf_config(cfg: Qwen35Config):
    from transformers import Qwen3_5MoeTextConfig

    d = cfg.to_hf_dict()
    return Qwen3_5MoeTextConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type", "harts")})


def _perturb(model):
    """Non-trivial norms, decay biases and shared-expert gates, so naming or (1 + w) mistakes show."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("norm.weight", "dt_bias", "shared_expert_gate.weight")):
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(input_ids=ids[None]).logits[0].double()


def _seqs(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g) for n in lens]


def _our_logits(model, seqs):
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    with torch.no_grad():
        return model.logits(model(ids, pos, cu)).double(), cu.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_transformers_checkpoint_loads_into_ours(tmp_path, hf_torch_kernels, dtype):
    from safetensors.torch import load_file
    from transformers import Qwen3_5MoeForCausalLM

    cfg = _cfg()
    torch.manual_seed(0)
    hf = Qwen3_5MoeForCausalLM._from_config(_hf_config(cfg), dtype=dtype, attn_implementation="eager",
                                            experts_implementation="eager").eval()
    _perturb(hf)
    hf.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in saved  # transformers writes per-expert tensors
    ours = Qwen35ForCausalLM.from_pretrained(tmp_path, backend="reference")
    assert ours.config.layer_types == cfg.layer_types and ours.config.rotary_dim == 4
    hf_sd, our_sd = hf.state_dict(), ours.state_dict()
    assert hf_sd.keys() == our_sd.keys()
    for k in hf_sd:
        assert our_sd[k].dtype == dtype and torch.equal(our_sd[k], hf_sd[k]), k
    seqs = _seqs([37, 1, 70, 5])
    got, cu = _our_logits(ours, seqs)
    for n, s in enumerate(seqs):
        rel = _rel(got[cu[n]:cu[n + 1]], _hf_logits(hf, s))
        assert rel <= TOL[dtype], f"sequence {n}: logits differ by {rel:.2e} relative ({dtype})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_our_checkpoint_loads_in_transformers(tmp_path, hf_torch_kernels, dtype):
    from transformers import Qwen3_5MoeForCausalLM

    ours = Qwen35ForCausalLM(_cfg()).init_weights(seed=3).to(dtype)
    _perturb(ours)
    ours.save_pretrained(tmp_path)
    cfg_json = json.loads((tmp_path / "config.json").read_text())
    assert cfg_json["model_type"] == "qwen3_5_moe_text" and cfg_json["dtype"] == str(dtype).removeprefix("torch.")
    hf, info = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path, output_loading_info=True, dtype=dtype,
                                                     attn_implementation="eager", experts_implementation="eager")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    hf.eval()
    seqs = _seqs([29, 66], seed=1)
    got, cu = _our_logits(ours, seqs)
    for n, s in enumerate(seqs):
        rel = _rel(got[cu[n]:cu[n + 1]], _hf_logits(hf, s))
        assert rel <= TOL[dtype], f"sequence {n}: logits differ by {rel:.2e} relative ({dtype})"
    back = Qwen35ForCausalLM.from_pretrained(tmp_path)  # and our own round trip is bit-exact
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_config_round_trip_and_released_layout():
    cfg = _cfg(gdn_chunk_size=8)
    again = Qwen35Config.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict())))
    assert again == cfg
    released = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                "vision_config": {"depth": 2},
                "text_config": {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 4, "eos_token_id": [7, 8],
                                "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                                    "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                                    "mrope_interleaved": True}}}
    c = Qwen35Config.from_hf_dict(released)
    assert (c.num_hidden_layers, c.rope_theta, c.eos_token_id, c.hidden_size) == (4, 1e7, 7, 2048)
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    with pytest.raises(ValueError, match="attention_bias"):
        Qwen35Config.from_hf_dict({"attention_bias": True})
    with pytest.raises(ValueError, match="rope_type"):
        Qwen35Config.from_hf_dict({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="layer_types"):
        Qwen35Config.from_hf_dict({"num_hidden_layers": 2, "layer_types": ["linear_attention"]})


def test_released_names_and_refusals(tmp_path):
    """The multimodal folders' prefix maps; vision / MTP tensors are refused unless dropped; a missing
    expert is named."""
    from harts.models.qwen35.checkpoint import CheckpointError, from_hf_names

    ours = Qwen35ForCausalLM(_cfg()).init_weights(seed=1)
    sd = {("model.language_model." + k.removeprefix("model.")) if k.startswith("model.") else k: v
          for k, v in ours.state_dict().items()}
    sd["model.visual.patch_embed.proj.weight"] = torch.zeros(2)
    sd["mtp.fc.weight"] = torch.zeros(2)
    with pytest.raises(CheckpointError, match="drop_vision"):
        from_hf_names(sd, 8, drop_mtp=True)
    with pytest.raises(CheckpointError, match="drop_mtp"):
        from_hf_names(sd, 8, drop_vision=True)
    mapped = from_hf_names(sd, 8, drop_vision=True, drop_mtp=True)
    assert mapped.keys() == ours.state_dict().keys()
    per_expert = {k: v for k, v in ours.state_dict().items() if ".mlp.experts." not in k}
    per_expert.update({f"model.layers.{i}.mlp.experts.{e}.{p}.weight": torch.zeros(1)
                       for i in range(8) for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")
                       if (i, e, p) != (2, 5, "up_proj")})
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        from_hf_names(per_expert, 8)
