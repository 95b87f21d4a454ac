"""HARTS compact execution on the GPU fast paths (Triton KDA rounds, varlen attention, grouped MoE,
fused log-probs) against the trajectory-wise fast path in bf16."""
import numpy as np
import pytest
import torch

from harts.models.ling import LingConfig, LingForCausalLM
from harts.runtime import hidden_states, pack

pytestmark = pytest.mark.gpu


def _fork_trajs(B, rng, vocab):
    root = rng.integers(0, vocab, 4 * B + 9).tolist()

    def br(p, n):
        return root[:p] + [(root[p] + 1) % vocab] + rng.integers(0, vocab, n - 1).tolist()

    return [root, br(B - 1, 70), br(B, 90), br(B + 1, 2 * B + 3), br(2 * B + 5, 40), br(B + 1, 33), root[: B + 7],
            rng.integers(0, vocab, 150).tolist()]


# bf16 only: fp32 inputs still run fla's Triton dots in TF32 (max |dlogp| 4e-3 between the paths on the
# H200), so an fp32 GPU run proves no more than bf16 and compiles every fla kernel again (~3 minutes).
# Exactness is the CPU float64 tests' job (tests/test_runtime_equivalence.py).
def test_compact_matches_trajectory_wise_on_gpu():
    dtype = torch.bfloat16
    # ling3-tiny head shapes (K = V = 128, chunk 64) so the compiled and autotuned kernels are shared
    cfg = LingConfig.preset("ling3-tiny-debug", kda_chunk_size=64, head_dim=128, num_attention_heads=16,
                            hidden_size=256)
    torch.manual_seed(0)
    model = LingForCausalLM(cfg).cuda().cast_(dtype)
    trajs = _fork_trajs(64, np.random.default_rng(0), cfg.vocab_size)
    hb = pack(trajs, chunk_size=64).to("cuda")
    bb = pack(trajs, chunk_size=64, prefix_sharing=False).to("cuda")
    assert hb.stats["replay_tokens"] > 0 and hb.stats["boundary_states"] > 0
    lp_h, lp_b = model.logprobs(hb), model.logprobs(bb)
    (lp_h.sum()).backward()
    g_h = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    (lp_b.sum()).backward()
    with torch.no_grad():
        W = model.lm_head.weight
        zh = (hidden_states(model, hb)[hb.logprob_rows] @ W.T).float()
        zb = (hidden_states(model, bb)[bb.logprob_rows] @ W.T).float()
        cos = torch.nn.functional.cosine_similarity(zh, zb, dim=-1).mean().item()
    assert (lp_h - lp_b).abs().max().item() < 0.2
    # bf16: the two paths round differently (other matmul shapes, other KDA chunk grids), so their
    # agreement is bounded by rounding. The real property: HARTS is no further from exact arithmetic
    # than the baseline. Truth = the baseline in fp32 with the same (bf16-rounded) weights, reference
    # kernels (no new Triton compiles).
    truth = LingForCausalLM(LingConfig.preset("ling3-tiny-debug", kda_chunk_size=64, head_dim=128,
                                              num_attention_heads=16, hidden_size=256, backend="reference"))
    truth = truth.cuda().cast_(torch.float32)
    with torch.no_grad():
        for pt, pb in zip(list(truth.parameters()) + list(truth.buffers()),
                          list(model.parameters()) + list(model.buffers())):
            pt.copy_(pb)
        zt = hidden_states(truth, bb)[bb.logprob_rows] @ truth.lm_head.weight.T
    err_h = 1 - torch.nn.functional.cosine_similarity(zh, zt, dim=-1).mean().item()
    err_b = 1 - torch.nn.functional.cosine_similarity(zb, zt, dim=-1).mean().item()
    print(f"bf16: HARTS vs baseline cosine {cos:.6f}; 1 - cosine to fp32 truth: HARTS {err_h:.2e}, "
          f"baseline {err_b:.2e}")
    assert err_h <= 2 * err_b + 1e-6, (err_h, err_b)
    assert cos > 0.999, cos
    # gradients, per parameter, against the truth's: HARTS no further from it than the baseline (factor 2,
    # plus a floor for parameters whose bf16 gradients are all rounding, e.g. near-tied router scores)
    truth.logprobs(bb).sum().backward()
    g_t = dict(truth.named_parameters())
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        gt = g_t[n].grad.float()
        rel_h = ((g_h[n] - gt).norm() / gt.norm().clamp_min(1e-12)).item()
        rel_b = ((p.grad.float() - gt).norm() / gt.norm().clamp_min(1e-12)).item()
        assert rel_h <= 2 * rel_b + 2e-2, (n, rel_h, rel_b)


def test_grpo_gradient_over_shared_prefixes_on_gpu():
    """bf16 gradient norms of HARTS and the baseline can lie 13 % apart at step 1 (one-GPU trainer run) on
    four trajectories sharing long prefixes under zero-mean GRPO advantages, where the
    prefix contributions cancel. At small scale: the gradient of sum(adv * logp) with advantages +1/-1
    alternating over trajectories that share prefixes, each path in bf16 against the fp32 truth (baseline
    layout, reference kernels, the same bf16-rounded weights). HARTS must be no further from the truth
    than the baseline; the errors are printed for the record."""
    dtype = torch.bfloat16
    shape = dict(kda_chunk_size=64, head_dim=128, num_attention_heads=16, hidden_size=256)
    torch.manual_seed(0)
    model = LingForCausalLM(LingConfig.preset("ling3-tiny-debug", **shape)).cuda().cast_(dtype)
    truth = LingForCausalLM(LingConfig.preset("ling3-tiny-debug", backend="reference", **shape)).cuda()
    truth = truth.cast_(torch.float32)
    with torch.no_grad():
        for pt, pb in zip(list(truth.parameters()) + list(truth.buffers()),
                          list(model.parameters()) + list(model.buffers())):
            pt.copy_(pb)
    trajs = _fork_trajs(64, np.random.default_rng(1), model.config.vocab_size)[:6]  # the forked ones
    adv = torch.tensor([1.0, -1.0] * 3, device="cuda")
    hb = pack(trajs, chunk_size=64).to("cuda")
    bb = pack(trajs, chunk_size=64, prefix_sharing=False).to("cuda")

    def grads(m, batch):
        m.zero_grad()
        lp = m.logprobs(batch)
        coef = torch.cat([a.expand(len(x)) for a, x in zip(adv, batch.split(lp))])
        (coef * lp.float()).sum().backward()
        return torch.cat([p.grad.float().flatten() for p in m.parameters() if p.grad is not None])

    g_t, g_h, g_b = grads(truth, bb), grads(model, hb), grads(model, bb)
    err_h = ((g_h - g_t).norm() / g_t.norm()).item()
    err_b = ((g_b - g_t).norm() / g_t.norm()).item()
    print(f"GRPO over shared prefixes, rel. gradient error vs fp32 truth: HARTS {err_h:.3e}, baseline "
          f"{err_b:.3e}; grad norms truth {g_t.norm():.4e}, HARTS {g_h.norm():.4e}, baseline {g_b.norm():.4e}")
    assert err_h <= 1.5 * err_b + 1e-4, (err_h, err_b)


def test_compact_gives_trajectory_wise_bits_on_the_same_attention_kernel_gpu():
    """HARTS's compact execution in bf16 gives the trajectory-wise baseline's hidden states bit for bit when
    both run their attention on the same kernel (HARTS's views and the baseline's packed calls on the varlen
    kernel): the rounds with replay restore the baseline's chunk grid, the handoffs carry the boundary states,
    the tree convolution reads the true ancestors, and every row-wise op rounds a row the same whichever rows
    share its call. On the default split (cuDNN pieces merged by log-sum-exp) the rows past a fork round
    differently; ``python -m benchmarks.fidelity`` holds that drift to a change of attention kernel
    (baseline D). Qwen3.5-8l's head shapes, 4 layers (3 GDN + 1 gated attention), forks on and off the chunk
    grid, nested forks."""
    from harts.models.qwen35 import Qwen35Config, Qwen35ForCausalLM
    from harts.ops import use_kernel_choices

    cfg = Qwen35Config.preset("qwen3.5-8l", num_hidden_layers=4, num_experts=16, vocab_size=1024)
    model = Qwen35ForCausalLM(cfg).init_weights(seed=0).cuda().cast_(torch.bfloat16)
    rng = np.random.default_rng(3)

    def tokens(n):
        return rng.integers(3, cfg.vocab_size, n).tolist()

    root = tokens(2500)
    a = root + tokens(900)
    trajs = [a, root[:1700] + tokens(800), root[:1701] + tokens(650), root[:1664] + tokens(700),
             a[:3000] + tokens(500), a[:2900] + tokens(300), tokens(1200)]
    hb = pack(trajs, config=cfg).to("cuda")
    bb = pack(trajs, config=cfg, prefix_sharing=False).to("cuda")
    assert hb.stats["replay_tokens"] > 0 and hb.stats["boundary_states"] > 0
    with torch.no_grad(), use_kernel_choices(view_attention="varlen", packed_attention="varlen"):
        h_h = hidden_states(model, hb)[hb.logprob_rows]
        h_b = hidden_states(model, bb)[bb.logprob_rows]
        nb = pack(trajs, config=cfg, replay=False).to("cuda")
        h_n = hidden_states(model, nb)[nb.logprob_rows]
    differ = (h_h != h_b).any(dim=-1)
    assert not differ.any(), (f"{int(differ.sum())} of {differ.numel()} positions differ, max |dh| "
                              f"{(h_h.float() - h_b.float()).abs().max().item():.3e}")
    # the check sees a rounding change: without replay the branches' chunk grids restart at the fork
    assert (h_n != h_b).any(dim=-1).any()
