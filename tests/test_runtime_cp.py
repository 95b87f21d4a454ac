"""Context parallelism (Ulysses style) on gloo with cp = 2 and 4: log-probs and gradients equal cp = 1 (float64)."""
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.helpers import fork_tree, make_model, spawn_ranks

B = 4


def _losses(model, batch):
    lp = model.logprobs(batch)
    g = torch.Generator().manual_seed(5)
    adv = torch.randn(lp.shape[0], generator=g, dtype=torch.float64)
    return lp, -(adv * lp).sum() / lp.shape[0]


def _worker(rank, world, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        trajs = fork_tree(B, np.random.default_rng(11))
        model = make_model(B)
        from harts.runtime import pack

        batch = pack(trajs, chunk_size=B, pad_to_multiple=world).context_parallel(dist.group.WORLD)
        # the exchanges hand Triton kernels plain, completed tensors (not AsyncCollectiveTensors), and
        # heads_to_rows inverts rows_to_heads, in value and in gradient
        cp = batch.cp
        x = torch.randn(cp.rows, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank),
                        requires_grad=True)
        y = cp.rows_to_heads(x)
        back = cp.heads_to_rows(y)
        assert type(y) is torch.Tensor and type(back) is torch.Tensor, (type(y), type(back))
        assert y.shape == (cp.rows * world, 4 // world, 3) and torch.equal(back, x)
        (back * x.detach()).sum().backward()
        assert torch.equal(x.grad, x.detach())
        lp, loss = _losses(model, batch)
        loss.backward()
        full_lp = lp.detach().clone()
        dist.all_reduce(full_lp)  # partial sums over the CP group
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            g = g.detach().clone()
            dist.all_reduce(g)
            grads[n] = g
        counts = model.moe_counts().clone()
        dist.all_reduce(counts)
        if rank == 0:
            torch.save({"lp": full_lp, "grads": grads, "counts": counts}, os.path.join(out_dir, "cp.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # a spawned gloo process can abort in interpreter teardown; its work is saved by now


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_equals_cp1(tmp_path, cp):
    trajs = fork_tree(B, np.random.default_rng(11))
    model = make_model(B)
    from harts.runtime import pack

    batch = pack(trajs, chunk_size=B, pad_to_multiple=cp)
    assert batch.num_phys % cp == 0
    lp_ref, loss = _losses(model, batch)
    loss.backward()
    spawn_ranks(_worker, cp, str(tmp_path))
    got = torch.load(tmp_path / "cp.pt")
    assert ((got["lp"] - lp_ref.detach()).abs().max() / lp_ref.abs().max()).item() <= 1e-12
    for n, p in model.named_parameters():
        ref = p.grad if p.grad is not None else torch.zeros_like(p)
        err = (got["grads"][n] - ref).abs().max().item()
        assert err <= 1e-10 * max(ref.abs().max().item(), 1e-12), (n, err)
    assert torch.equal(got["counts"], model.moe_counts())
