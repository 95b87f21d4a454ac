"""External reference: transformers' own BailingHybridForCausalLM, both ways.

- transformers saves (``save_pretrained``), our ``load_pretrained`` reads the folder unchanged: the
  weights arrive bit-identical and the logits match;
- we save, transformers' ``from_pretrained`` loads with no missing, unexpected or mismatched key and the
  logits match.

Both run in float64. transformers computes a few things in float32 whatever the model dtype: the RMSNorms
and the KDA gated output norm (``hidden_states.to(torch.float32)``), the forget gate input (``.float()``),
the KDA core (its torch chunk/recurrent functions cast q, k, v, g, beta to float32), the router logits, the
MLA output gate's sigmoid and the RoPE angles; so agreement is float32-level (measured ~1e-6 on logits
of size ~1), not float64-level. transformers 5.23 supports only the direct ``q_proj`` (q_lora_rank=None,
the Flash layout). Its KDA/conv functions prefer fla when importable; we point them at transformers' own
pure-torch implementations so the reference shares no kernel code with us.
"""
import json

import pytest
import torch

from harts.models.ling import LingConfig, LingForCausalLM
from harts.models.ling.checkpoint import load_pretrained, read_hf_tensors, save_pretrained, to_hf_state_dict

# the test extra pins transformers 5.23.0, so CI always runs this file; it skips only where an older
# transformers is installed (the GPU image has 5.17, whose classes differ)
transformers = pytest.importorskip("transformers", minversion="5.23.0")


@pytest.fixture()
def hf_torch_kernels(monkeypatch):
    import transformers.models.bailing_hybrid.modeling_bailing_hybrid as mb

    if not hasattr(mb, "BailingHybridDeltaAttention"):
        pytest.fail("this transformers has the old Ling-2.6 bailing_hybrid, not Ling 3.0 (pin 5.23.0)")
    for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        f = getattr(mb, name)
        monkeypatch.setattr(mb, name, getattr(f, "__wrapped__", f))
    return mb


TOL = 2e-5  # float32-level: transformers' internal float32 casts (module docstring)


def _perturb(named_parameters, biases):
    """Non-trivial norms and expert biases, so naming mistakes show in the logits."""
    with torch.no_grad():
        for n, p in named_parameters:
            if n.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
        for b in biases:
            b.copy_(0.05 * torch.randn_like(b))


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(input_ids=ids[None]).logits[0].double()


def _our_logits(model, ids):
    with torch.no_grad():
        return model.logits(model(ids, torch.arange(ids.shape[0]), torch.tensor([0, ids.shape[0]])))


def _tiny_hf_config(**overrides):
    from transformers import BailingHybridConfig

    kw = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=8,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
              qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=4, num_local_experts=16, head_dim=16,
              layer_group_size=4, n_shared_experts=2, rope_theta=10000.0, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
    kw.update(overrides)
    return BailingHybridConfig(**kw)


def test_transformers_folder_loads_unchanged_and_matches(tmp_path, hf_torch_kernels):
    """Its defaults included: first_k_dense_replace=2, num_mtp_layers=1 (no MTP weights are saved), the
    shared expert sized moe_intermediate_size * n_shared_experts, no q_lora_rank key."""
    torch.manual_seed(0)
    hf = hf_torch_kernels.BailingHybridForCausalLM._from_config(
        _tiny_hf_config(), dtype=torch.float64, attn_implementation="eager", experts_implementation="eager").eval()
    _perturb(hf.named_parameters(), [m.mlp.gate.e_score_correction_bias for m in hf.model.layers
                                     if hasattr(m.mlp, "gate")])
    hf.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "q_lora_rank" not in written and written["head_dim"] == 8 and written["linear_head_dim"] == 16

    ours = load_pretrained(tmp_path)  # no overrides
    c = ours.config
    assert (c.head_dim, c.qk_rope_head_dim, c.q_lora_rank, c.n_group, c.num_experts_per_tok) == (16, 8, None, 4, 4)
    assert (c.first_k_dense_replace, c.num_shared_experts, c.moe_shared_expert_intermediate_size) == (2, 2, 32)
    assert c.layer_types() == written["layer_types"]
    stored = read_hf_tensors(tmp_path)
    mine = to_hf_state_dict(ours)
    assert len(mine) == len(stored)
    for k, v in mine.items():  # KDA's attention.o_proj is transformers' attention.dense
        src = k.replace("attention.o_proj", "attention.dense")
        assert v.dtype == stored[src].dtype and torch.equal(v, stored[src]), k

    T = 150  # > 2 KDA chunks of transformers' 64 and of ours
    ids = torch.randint(3, c.vocab_size, (T,), generator=torch.Generator().manual_seed(1))
    ref, got = _hf_logits(hf, ids), _our_logits(ours.double(), ids)
    assert ref.abs().max() > 0.1
    assert (ref - got).abs().max().item() <= TOL


def test_transformers_config_errors_name_the_problem():
    good = _tiny_hf_config().to_dict()
    assert LingConfig.from_hf_dict(good).n_group == 4
    with pytest.raises(ValueError, match=r"layer_types\[8\]='linear_attention' but HARTS builds 'full_attention'"):
        LingConfig.from_hf_dict(_tiny_hf_config(num_hidden_layers=10).to_dict())  # no ragged-tail rule there
    bad = dict(good, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ValueError, match=r"rope_parameters=.*yarn.*not supported"):
        LingConfig.from_hf_dict(bad)
    with pytest.raises(ValueError, match=r"linear_num_heads=8 but HARTS builds 4"):
        LingConfig.from_hf_dict(dict(good, linear_num_heads=8))


def test_transformers_loads_our_folder_and_matches(tmp_path, hf_torch_kernels):
    torch.manual_seed(0)
    cfg = LingConfig.preset("ling3-tiny-debug", q_lora_rank=None)
    ours = LingForCausalLM(cfg).double()
    _perturb(ours.named_parameters(), [m.gate.expert_bias for m in ours.moe_layers()])
    save_pretrained(ours, tmp_path)

    hf, info = hf_torch_kernels.BailingHybridForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    hf.eval()

    T = 150  # > 2 KDA chunks of transformers' 64 and of our 16
    ids = torch.randint(3, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(1))
    ref, mine = _hf_logits(hf, ids), _our_logits(ours, ids)
    assert ref.abs().max() > 0.1
    assert (ref - mine).abs().max().item() <= TOL
