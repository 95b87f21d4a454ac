"""The GPU fast path of the compact runtime, end to end: Triton KDA rounds with boundary states (fla's
safe-gate intra-chunk kernels + our state scans), fla's varlen conv with ancestor windows and the fused
compact log-probs, against the reference path on the same model and batch. On CPU the Triton kernels run
under the interpreter in float32 (CI executes the kernel code); on a GPU they run compiled."""
import numpy as np
import torch

from harts.models.ling import LingConfig, LingForCausalLM
from harts.runtime import pack
from tests.helpers import fork_tree


def _run(model, batch):
    model.zero_grad(set_to_none=True)
    lp = model.logprobs(batch)
    lp.sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_fast_kernels_through_the_compact_runtime(fla_interpreter_patches):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    B = 32  # fla's intra-chunk kernels support 32 and 64
    # one KDA and one MLA layer (layer groups of 2), the second one MoE
    shape = dict(kda_chunk_size=B, num_hidden_layers=2, layer_group_size=2, num_attention_heads=2, head_dim=32,
                 hidden_size=64)
    cfg = LingConfig.preset("ling3-tiny-debug", backend="reference", **shape)
    fast = LingConfig.preset("ling3-tiny-debug", backend="reference", **shape, kda_backend="fast", conv_backend="fast",
                             logprobs_backend="fast")
    torch.manual_seed(0)
    model = LingForCausalLM(cfg).float().to(dev)
    batch = pack(fork_tree(B, np.random.default_rng(0)), chunk_size=B).to(dev)
    assert batch.stats["replay_tokens"] > 0 and batch.stats["boundary_states"] > 0
    lp_ref, g_ref = _run(model, batch)
    model.config = fast  # same weights, fast kernels
    for m in model.modules():
        if hasattr(m, "cfg"):
            m.cfg = fast
    lp, g = _run(model, batch)
    assert (lp - lp_ref).abs().max().item() <= 1e-5 * lp_ref.abs().max().item()
    for n in g_ref:
        rel = ((g[n] - g_ref[n]).norm() / g_ref[n].norm().clamp_min(1e-30)).item()
        assert rel <= 1e-4, (n, rel)
