"""Context parallelism for compact batches, DeepSpeed-Ulysses style (paper 4.3).

The P physical rows of a microbatch are split evenly over the CP group (``pack(...,
pad_to_multiple=cp)`` adds alignment rows, never counted as work). Token-wise ops (embeddings,
norms, projections, MoE, LM head) run on each rank's own rows. Before the sequence-mixer cores (Ling's
MLA and KDA, Qwen3.5's gated attention and Gated DeltaNet) one all-to-all turns the row partition into a
head partition (every rank then holds all P rows for H/cp heads), so the HARTS views (ancestor KV, delta-rule
rounds with boundary states, tree convolution) run unchanged on whole sequences; the inverse all-to-all
returns the outputs to their rows. Both are autograd-aware, so backward runs the mirror-image exchanges.

Gradients of parameters are partial per CP rank (own rows, own heads): sum them over the CP group
(in the trainer, the CP ranks are part of the gradient-reduction group, as torchtitan folds cp into
its FSDP dimension). Log-probs are returned as partial sums too: positions whose rows live on another
rank are zero, so summing over the group gives the full vector and per-rank losses add up.

Legend: P physical rows, p = P / cp rows per rank, H heads, h = H / cp heads per rank, X feature dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0. Its adjoint is the same exchange (rank r's chunk j goes to rank
    j's slot r and back), so backward runs it on the gradient. The outputs are plain, completed tensors:
    torch's functional collectives return AsyncCollectiveTensor wrappers that wait only when a torch op
    touches them, and Triton kernels read raw pointers: without completion, the first Triton kernel to read
    an exchanged tensor (fla's causal_conv1d) can fault on an illegal address, and NCCL reports unwaited
    functional collectives at exit."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


@dataclass(frozen=True, eq=False)
class ContextParallel:
    group: object
    rank: int
    size: int
    rows: int  # p, physical rows per rank

    @classmethod
    def create(cls, group, num_phys: int) -> "ContextParallel":
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if num_phys % size:
            raise ValueError(f"context parallel: {num_phys} physical rows do not split over cp={size}; "
                             f"pack the batch with pad_to_multiple={size}")
        return cls(group=group, rank=rank, size=size, rows=num_phys // size)

    @property
    def row_range(self) -> tuple[int, int]:
        return self.rank * self.rows, (self.rank + 1) * self.rows

    def own_rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous share of ``t``'s rows."""
        lo, hi = self.row_range
        return t[lo:hi]

    def check_heads(self, where: str, **heads: int) -> None:
        """Refuse head counts the CP group cannot split evenly, naming each offending count (``heads``: name
        -> count as this rank's mixer sees it, e.g. ``linear_num_key_heads=16``)."""
        bad = [f"{name}={n}" for name, n in heads.items() if n % self.size]
        if bad:
            raise ValueError(f"{where}: context parallelism splits heads over cp={self.size}, but "
                             f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not divisible by {self.size}")

    def head_slice(self, H: int) -> slice:
        if H % self.size:
            raise ValueError(f"context parallel needs heads divisible by cp: H={H}, cp={self.size}")
        h = H // self.size
        return slice(self.rank * h, (self.rank + 1) * h)

    def rows_to_heads(self, x_pHX: torch.Tensor) -> torch.Tensor:
        """[p, H, X] (own rows, all heads) -> [P, h, X] (all rows, own heads)."""
        p, H, X = x_pHX.shape
        if H % self.size:
            raise ValueError(f"context parallel needs heads divisible by cp: H={H}, cp={self.size}")
        h = H // self.size
        send = x_pHX.reshape(p, self.size, h, X).transpose(0, 1).contiguous()  # [cp(dest), p, h, X]
        recv = _AllToAll.apply(send.flatten(), self.group)
        return recv.view(self.size * p, h, X)  # source ranks in order = rows in order

    def heads_to_rows(self, y_PhX: torch.Tensor) -> torch.Tensor:
        """[P, h, X] (all rows, own heads) -> [p, H, X] (own rows, all heads)."""
        P, h, X = y_PhX.shape
        p = P // self.size
        recv = _AllToAll.apply(y_PhX.contiguous().flatten(), self.group)
        return recv.view(self.size, p, h, X).transpose(0, 1).reshape(p, self.size * h, X)
