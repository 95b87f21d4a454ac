"""Expert parallelism as a parallel style around a MoE layer's experts module, applied from outside.

A model's experts module is parallel-agnostic: ``forward(x_MD, counts_E, weight_M)`` runs the SwiGLU of
expert-major rows (``harts.ops.moe.routed_experts`` sorts them; expert e takes ``counts_E[e]`` rows). The
``ExpertParallel`` style (the shape of torchtitan's: a dispatch before the module and a combine after it)
shards the stacked expert weights over the ``ep`` mesh dim (Shard(0) on the expert dim) and turns the
module's call into:

- dispatch (forward pre-hook): the counts all-to-all, the one host read of the split sizes, the rows and
  their routing weights all-to-all (with autograd), and the rank-major -> expert-major permutation of the
  received rows; the module then sees its own experts' rows and counts, and its weights as local shards
  (cast to the rows' dtype: the experts stay out of FSDP2's mixed precision);
- combine (forward hook): the reverse permutation and all-to-all, back to this rank's sorted rows.

Inside a tensor-parallel region (the MoE of a TP layer, ``tp_mesh``) every TP rank holds the same rows:
rank r dispatches only its contiguous slice of them, so no row reaches the experts twice, and its
zero-padded result is a partial sum that the region's exit sums.

EP borrows ranks from dp_shard x cp x tp (torchtitan's rule); the trainer requires efsdp = 1, so expert
gradients are complete after the backward all-to-all and the experts are left out of FSDP.

Legend: M routed rows (T tokens x K experts per token), E experts, El = E / ep local experts, D hidden.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["ExpertParallel", "is_expert_parallel", "expert_major_order"]

_WRAPPED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def is_expert_parallel(experts: nn.Module) -> bool:
    """Whether ``ExpertParallel`` wraps this experts module."""
    return experts in _WRAPPED


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group)


def expert_major_order(recv_counts: torch.Tensor, ep: int, El: int, total: int) -> torch.Tensor:
    """Received rows arrive rank-major (source rank r, then local expert j); the experts want them
    expert-major (j, then r), rank order kept within an expert. Built on the device, as a stable sort of
    each row's (expert, rank) key: a host-built index would be a pageable host-to-device copy per layer,
    and such a copy synchronises the stream. ``recv_counts``: [ep * El] rows per (r, j), on the device;
    ``total`` its sum, known on the host (no sync for the output size)."""
    seg_M = torch.repeat_interleave(torch.arange(ep * El, device=recv_counts.device), recv_counts,
                                    output_size=total)  # r * El + j per received row
    return torch.sort((seg_M % El) * ep + seg_M // El, stable=True).indices


def _slice_counts(counts_E: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Rows per expert among the expert-major rows [a, b)."""
    ends = counts_E.cumsum(0)
    return (torch.minimum(ends, ends.new_tensor(b)) - torch.maximum(ends - counts_E, ends.new_tensor(a))).clamp_min(0)


class ExpertParallel(ParallelStyle):
    """Routed experts over the mesh this style is applied with (module docstring). ``tp_mesh``: the
    tensor-parallel mesh when the experts sit inside a TP region."""

    def __init__(self, tp_mesh=None):
        super().__init__()
        self.tp_mesh = tp_mesh

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from harts.train.parallelize import expert_weights

        names = expert_weights(module)
        ep, group, tp_mesh = device_mesh.size(), device_mesh.get_group(), self.tp_mesh
        for name in names:
            p = getattr(module, name)
            if p.shape[0] % ep:
                raise ValueError(f"expert parallelism: {p.shape[0]} experts are not divisible by "
                                 f"expert_parallel_degree={ep}")
            module.register_parameter(name, nn.Parameter(distribute_tensor(p.data, device_mesh, [Shard(0)])))
        calls: list = []  # per call: (weights to restore, the combine's plan)

        def dispatch(mod, args, kwargs):
            x_MD, counts_E, *rest = args
            weight_M = rest[0] if rest else kwargs.get("weight_M")
            saved = [(n, mod._parameters[n]) for n in names]
            for n, p in saved:  # local shards in the rows' dtype (the experts are outside FSDP's casts)
                mod._parameters[n] = p.to_local().to(x_MD.dtype)
            M, span = x_MD.shape[0], None
            if tp_mesh is not None:
                tp, r = tp_mesh.size(), tp_mesh.get_local_rank()
                a, b = r * M // tp, (r + 1) * M // tp
                x_MD, counts_E, span = x_MD[a:b], _slice_counts(counts_E, a, b), (a, b)
                weight_M = None if weight_M is None else weight_M[a:b]
            El = counts_E.shape[0] // ep
            with torch.no_grad():  # counts: [rank r][local expert j] rows this rank receives
                recv = torch.empty_like(counts_E)
                dist.all_to_all_single(recv, counts_E, group=group)
                # the one host sync of the dispatch: the split sizes (both count tables in one copy)
                send_RE, recv_RE = torch.stack([counts_E, recv]).cpu().view(2, ep, El).unbind(0)
                perm = expert_major_order(recv, ep, El, int(recv_RE.sum()))
            in_splits, out_splits = send_RE.sum(1).tolist(), recv_RE.sum(1).tolist()
            x_local = _a2a(x_MD, out_splits, in_splits, group).index_select(0, perm)
            w_local = None
            if weight_M is not None:
                w_local = _a2a(weight_M[:, None], out_splits, in_splits, group)[:, 0].index_select(0, perm)
            calls.append((saved, (perm, in_splits, out_splits, M, span)))
            return (x_local, recv.view(ep, El).sum(0), w_local), {}

        def combine(mod, args, kwargs, y_local):
            saved, (perm, in_splits, out_splits, M, span) = calls.pop()
            for n, p in saved:
                mod._parameters[n] = p
            y_recv = torch.empty_like(y_local).index_copy(0, perm, y_local)  # back to rank-major order
            y_MD = _a2a(y_recv, in_splits, out_splits, group)
            if span is not None:  # this TP rank's slice; the others' rows are zero (a partial sum)
                y_MD = torch.cat((y_MD.new_zeros(span[0], y_MD.shape[1]), y_MD,
                                  y_MD.new_zeros(M - span[1], y_MD.shape[1])))
            return y_MD

        module.register_forward_pre_hook(dispatch, with_kwargs=True)
        module.register_forward_hook(combine, with_kwargs=True)
        _WRAPPED.add(module)
        return module
