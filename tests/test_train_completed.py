"""The TP/SP boundary's ``Completed``: what leaves a region boundary, forward and backward, is a plain,
completed tensor, never an AsyncCollectiveTensor (Triton kernels read raw pointers and would not wait)."""
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from harts.train.model import Completed


class _ReduceInBackward(torch.autograd.Function):
    """Identity whose backward all-reduces the gradient through a functional collective (as DTensor's
    redistribute does at a region boundary), so the gradient it hands back is an AsyncCollectiveTensor."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        out = funcol.all_reduce(g, "sum", dist.group.WORLD)
        assert isinstance(out, AsyncCollectiveTensor)
        return out


def test_completed_waits_forward_and_backward(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        x = torch.randn(5, 3, dtype=torch.float64)
        act = funcol.all_reduce(x, "sum", dist.group.WORLD)
        assert isinstance(act, AsyncCollectiveTensor)
        y = Completed.apply(act)
        assert type(y) is torch.Tensor and torch.equal(y, x)

        def grad_type_at_input(boundary):
            """Type of the gradient reaching the tensor fed to ``boundary`` (what a Triton backward
            upstream, e.g. a layer norm's, would read), when the gradient coming down is a pending
            collective's output."""
            seen = []
            leaf = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
            a = leaf * 2.0
            a.register_hook(lambda g: seen.append(type(g)))
            c = _ReduceInBackward.apply(boundary(a))
            (c * torch.arange(15.0, dtype=torch.float64).view(5, 3)).sum().backward()
            torch.testing.assert_close(leaf.grad, 2 * torch.arange(15.0, dtype=torch.float64).view(5, 3))
            return seen[0]

        assert grad_type_at_input(lambda t: t) is AsyncCollectiveTensor  # the hazard, without the boundary
        assert grad_type_at_input(Completed.apply) is torch.Tensor
    finally:
        dist.destroy_process_group()
