"""External reference: transformers' own BailingHybridForCausalLM loads our saved checkpoint and its
logits match ours in float32 on CPU.

transformers 5.23 supports only the direct ``q_proj`` (q_lora_rank=None, the Flash layout), so the config
drops q_lora. Its KDA/conv functions prefer fla when importable; we point them at transformers' own
pure-torch implementations so the reference shares no kernel code with us.
"""
import pytest
import torch

from harts.models.ling import LingConfig, LingForCausalLM
from harts.models.ling.checkpoint import save_pretrained

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


def test_transformers_logits_match(tmp_path, hf_torch_kernels):
    torch.manual_seed(0)
    cfg = LingConfig.preset("ling3-tiny-debug", q_lora_rank=None)
    ours = LingForCausalLM(cfg).float()
    with torch.no_grad():  # make every norm and the expert bias non-trivial so naming mistakes show
        for n, p in ours.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
        for m in ours.moe_layers():
            m.gate.expert_bias.copy_(0.05 * torch.randn_like(m.gate.expert_bias))
    save_pretrained(ours, tmp_path)

    hf, info = hf_torch_kernels.BailingHybridForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    hf.eval()

    T = 150  # > 2 KDA chunks of transformers' 64 and of our 16
    ids = torch.randint(3, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits[0].float()
        mine = ours.logits(ours(ids[0], torch.arange(T), torch.tensor([0, T])))
    assert ref.abs().max() > 0.1
    assert (ref - mine).abs().max().item() <= 1e-4
