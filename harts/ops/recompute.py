"""Recompute a pure-torch step in backward instead of keeping its graph, without torch.utils.checkpoint.

The reference ops loop over chunks; keeping every chunk's intermediates for backward would cost GBs (KDA's
[H, L, L, K] decay tensors, or one state per token). ``recompute_in_backward`` keeps only a step's tensor
inputs, runs the step without a graph, and reruns it under autograd in backward: the same operations in the
same order, so values equal those without recomputation (gradients: below). torch.utils.checkpoint gives the
same, but its first use imports torch._dynamo, which pulls in FSDP and torch.distributed.tensor (about a
second per process), a cost the CPU reference path has no use for.

The step must be deterministic (no RNG: its random state is not replayed) and take and return tensors only.
Autocast is replayed as it was in forward. Unused outputs get no gradient (not zeros), so the backward sums
the same terms as autograd without recomputation, in the same order where every input of the step feeds
nothing else (as in the chunk loops: slices, and a state handed from step to step), bit for bit. An input
that also feeds other ops gets the step's contributions summed first: the same terms in another order.
Double backward is not supported: the first-order gradients carry no graph (differentiating them again is
an error, ``once_differentiable``'s or autograd's).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable

__all__ = ["recompute_in_backward"]


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, *args):
        ctx.fn = fn
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*args)
        dev = args[0].device.type
        enabled = torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)
        ctx.autocast = (dev, torch.get_autocast_dtype(dev)) if enabled else None
        return fn(*args)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(need) for x, need in zip(ctx.saved_tensors, ctx.needs_input_grad[1:])]
        replay = torch.autocast(ctx.autocast[0], dtype=ctx.autocast[1]) if ctx.autocast else contextlib.nullcontext()
        with torch.enable_grad(), replay:
            outs = ctx.fn(*inputs)
        outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [x for x in inputs if x.requires_grad]
        if not pairs or not wanted:
            return (None,) * (1 + len(inputs))
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
        return (None, *(next(got) if x.requires_grad else None for x in inputs))


def recompute_in_backward(fn: Callable, *args: torch.Tensor):
    """``fn(*args)``, keeping only ``args`` for backward, which reruns ``fn`` (see the module docstring).

    Without grad mode, or when no input requires grad, this is a plain call."""
    name = getattr(fn, "__name__", repr(fn))
    if not args:
        raise TypeError(f"recompute_in_backward: {name} got no tensor arguments")
    bad = {i: type(x).__name__ for i, x in enumerate(args) if not isinstance(x, torch.Tensor)}
    if bad:
        raise TypeError(f"recompute_in_backward: {name} takes tensors only; argument(s) {bad} (position: type)")
    if not torch.is_grad_enabled() or not any(x.requires_grad for x in args):
        return fn(*args)
    return _Recompute.apply(fn, *args)
