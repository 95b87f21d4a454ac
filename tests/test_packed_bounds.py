"""Packed (trajectory-wise) inputs hand the fast kernels one int64 ``cu_seqlens`` and its host copy: fla's chunk
plans are cached per tensor object and planned from the host copy (no host sync per kernel call), the cuDNN
attention reads its per-sequence bounds from it. The values are checked against the device tensor's, the
plumbing by recording what the kernels receive, and the fast path with host bounds against the reference ops,
forward and backward (fla's kernels under the Triton interpreter on a CPU)."""
import numpy as np
import torch

from harts.models.ling import LingConfig, LingForCausalLM
from harts.runtime import pack
from tests.helpers import fork_tree


def test_packed_forward_hands_every_kernel_one_int64_cu_seqlens_and_its_host_copy(monkeypatch):
    import harts.models.ling.blocks as blocks

    seen = []

    def spy(fn, cu_pos):
        def wrapped(*a, **kw):
            seen.append((fn.__name__, a[cu_pos], kw.get("cu_seqlens_cpu")))
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(blocks, "short_conv", spy(blocks.short_conv, 2))
    monkeypatch.setattr(blocks, "kda", spy(blocks.kda, 7))
    monkeypatch.setattr(blocks, "varlen_attention", spy(blocks.varlen_attention, 3))
    cfg = LingConfig.preset("ling3-tiny-debug", backend="reference")
    torch.manual_seed(0)
    model = LingForCausalLM(cfg)
    lens = [7, 12, 5]
    ids = torch.randint(0, cfg.vocab_size, (sum(lens),))
    pos = torch.cat([torch.arange(n) for n in lens])
    cu32 = torch.tensor([0, 7, 19, 24], dtype=torch.int32)  # flash-attn's convention
    model(ids, pos, cu32).sum().backward()
    names = {n for n, _, _ in seen}
    assert names == {"short_conv", "kda", "varlen_attention"}, names
    assert len({id(cu) for _, cu, _ in seen}) == 1, "one cu_seqlens tensor for every kernel call"
    cu, host = seen[0][1], seen[0][2]
    assert cu.dtype == torch.long and torch.equal(cu, cu32.long())
    assert all(h is host for _, _, h in seen) and host.device.type == "cpu" and torch.equal(host, cu32.long())


def test_trajectory_wise_batch_keeps_its_host_bounds_on_the_host():
    batch = pack(fork_tree(4, np.random.default_rng(0)), chunk_size=4, prefix_sharing=False)
    assert torch.equal(batch.cu_seqlens_cpu, batch.cu_seqlens)
    moved = batch.to("meta")
    assert moved.cu_seqlens.device.type == "meta" and moved.cu_seqlens_cpu.device.type == "cpu"

    from harts.train.data import pad_rows

    padded = pad_rows(batch, 16)
    assert padded.num_phys % 16 == 0 and torch.equal(padded.cu_seqlens_cpu, padded.cu_seqlens)


def test_packed_fast_kernels_with_host_bounds_equal_the_reference(fla_interpreter_patches):
    """fla's conv and KDA (one KDA and one MLA layer) on a trajectory-wise batch, forward and backward, with the
    host copy of the bounds, against the reference ops on the same weights (float32)."""
    B = 32  # fla's intra-chunk kernels support 32 and 64
    shape = dict(kda_chunk_size=B, num_hidden_layers=2, layer_group_size=2, num_attention_heads=2, head_dim=32,
                 hidden_size=64)
    ref = LingConfig.preset("ling3-tiny-debug", backend="reference", **shape)
    fast = LingConfig.preset("ling3-tiny-debug", backend="reference", **shape, kda_backend="fast", conv_backend="fast")
    torch.manual_seed(0)
    batch = pack(fork_tree(B, np.random.default_rng(0))[:3], chunk_size=B, prefix_sharing=False)
    out = []
    for cfg in (ref, fast):
        torch.manual_seed(0)
        model = LingForCausalLM(cfg).float()
        lp = model.logprobs(batch)
        lp.sum().backward()
        out.append((lp.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (lp_ref, g_ref), (lp, g) = out
    assert (lp - lp_ref).abs().max().item() <= 1e-5 * lp_ref.abs().max().item()
    assert g.keys() == g_ref.keys()
    for n in g_ref:
        assert (g[n] - g_ref[n]).abs().max().item() <= 1e-4 * max(g_ref[n].abs().max().item(), 1e-6), n
