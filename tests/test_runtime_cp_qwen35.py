"""Context parallelism (Ulysses style) for Qwen3.5-MoE on gloo, cp = 2, float64: log-probs and every gradient
equal the one-process HARTS run (<= 1e-12 relative).

Each rank embeds, routes and scores its half of the compact rows; the GDN mixer exchanges rows for heads before
its short convolution (q, k of the rank's key heads, v / g / beta of the value heads they serve, and the
conv weights of those channels), the gated attention before its tree attention (query heads with their
key/value heads), and both exchange back after their cores. The cases: both GDN round implementations on the
debug model (G = 2 key/value heads, one per rank), and G = 1 (cp > G: the one key/value head goes to both
ranks, and its gradient is summed from both). The one-process HARTS run is itself checked against
trajectory-wise execution in tests/test_qwen35_tree.py.
"""
import os
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.helpers import fork_tree, spawn_ranks

B = 4
CASES = {"kda_kernels": dict(gdn_round_impl="kda_kernels"), "fla_pieces": dict(gdn_round_impl="fla_pieces"),
         "one_kv_head": dict(gdn_round_impl="kda_kernels", num_key_value_heads=1)}


def _model(**overrides):
    from harts.models.qwen35 import Qwen35Config, Qwen35ForCausalLM

    cfg = Qwen35Config.preset("qwen3.5-debug", num_hidden_layers=4, backend="reference", gdn_chunk_size=B,
                              **overrides)
    model = Qwen35ForCausalLM(cfg).init_weights(seed=0).double()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # non-trivial norms and gates (the scratch init leaves them at identity)
        for n, p in model.named_parameters():
            if n.endswith(("norm.weight", "dt_bias", "shared_expert_gate.weight", "conv1d.weight")):
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _trajs():
    return fork_tree(B, np.random.default_rng(3))


def _loss(model, batch):
    from harts.runtime import logprobs

    lp = logprobs(model, batch)
    adv = torch.randn(lp.shape[0], generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (-(adv * lp).sum() / lp.shape[0]).backward()
    return lp.detach()


def _worker(rank, world, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from harts.runtime import pack

        out = {}
        for name, over in CASES.items():
            model = _model(**over)
            batch = pack(_trajs(), config=model.config, pad_to_multiple=world).context_parallel(dist.group.WORLD)
            lp = _loss(model, batch)
            dist.all_reduce(lp)  # partial sums over the CP group (other ranks' positions are zero)
            grads = {}
            for n, p in model.named_parameters():
                g = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                dist.all_reduce(g)  # partial per rank: own rows, own heads
                grads[n] = g
            out[name] = {"lp": lp, "grads": grads}
        if rank == 0:
            torch.save(out, os.path.join(out_dir, "cp.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # a spawned gloo process can abort in interpreter teardown; its work is saved by now


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


@pytest.mark.slow
def test_qwen35_cp2_equals_one_process(tmp_path):
    from harts.runtime import pack

    spawn_ranks(_worker, 2, str(tmp_path))
    got = torch.load(tmp_path / "cp.pt")
    for name, over in CASES.items():
        model = _model(**over)
        batch = pack(_trajs(), config=model.config, pad_to_multiple=2)
        assert batch.stats["boundary_states"] > 0 and batch.stats["replay_tokens"] > 0  # handoffs are exercised
        lp = _loss(model, batch)
        assert _rel(got[name]["lp"], lp) <= 1e-12, (name, _rel(got[name]["lp"], lp))
        assert got[name]["grads"].keys() == {n for n, _ in model.named_parameters()}
        for n, p in model.named_parameters():
            assert p.grad is not None and p.grad.abs().max() > 0, (name, n)
            assert _rel(got[name]["grads"][n], p.grad) <= 1e-12, (name, n, _rel(got[name]["grads"][n], p.grad))


def _fake_cp(batch, size):
    """A batch marked as sharded over ``size`` ranks (rank 0), without a process group: enough to reach the
    head-count checks, which run before any exchange."""
    from harts.runtime.cp import ContextParallel

    return replace(batch, cp=ContextParallel(group=None, rank=0, size=size, rows=batch.num_phys // size))


def test_head_counts_that_do_not_split_are_named():
    from harts.runtime import pack

    model = _model()
    batch = _fake_cp(pack(_trajs(), config=model.config, pad_to_multiple=3), 3)
    with pytest.raises(ValueError, match=r"Qwen3\.5 GDN.*cp=3.*linear_num_key_heads=2, linear_num_value_heads=4"):
        model(layout=batch)
    attn = model.model.layers[3].self_attn
    T, H, Dh = batch.cp.rows, attn.H, attn.Dh
    q = torch.zeros(T, H, Dh, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"Qwen3\.5 gated attention.*cp=3.*num_attention_heads=4 is not divisible"):
        attn.core(q, q, q, q.flatten(1), batch)
