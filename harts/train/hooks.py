"""Optional observers of a training step, so that debugging output stays out of ``Trainer.train_step``.

A ``StepHooks`` is called at two points of every step: ``before_forward`` (the microbatches on the device,
before the first forward) and ``after_backward`` (the gradients complete and reduced, before clipping and
the optimizer step). The trainer takes one as ``Trainer(cfg, hooks=...)``; without it, ``[debug]``'s dump
settings build the ``DebugDumps`` below (the layout-fidelity benchmark and scripts/compare_grad_norms.py read
their files), and with none set the no-op base class runs.

Legend: P rows of the final norm's output in a microbatch, S predicted positions, D hidden.
"""
from __future__ import annotations

import json
import logging

import torch
import torch.distributed as dist

log = logging.getLogger("harts.train")

__all__ = ["StepHooks", "DebugDumps", "hooks_from_config"]


class StepHooks:
    """No-op hooks; subclass and override what you need. ``trainer`` is the running ``Trainer``, ``data`` the
    step's ``StepData``, ``mbs`` its microbatches on the device in slot order."""

    def before_forward(self, trainer, data, mbs) -> None:
        pass

    def after_backward(self, trainer, data, mbs) -> None:
        pass


class DebugDumps(StepHooks):
    """Step 1's debugging dumps (``[debug] dump_hidden`` / ``dump_hidden_stride`` / ``dump_grad_norms``).

    ``hidden``: the final hidden state (after the last norm: the LM head's input) at every predicted position
    this rank computed, keyed by (trajectory index in the step, position in the trajectory), with its target,
    to ``PATH.rank<R>.pt``, and the LM head weight to ``PATH.lm_head.pt`` (by the lowest rank holding it);
    positions with (trajectory + position) % ``stride`` == 0 only (the files are positions x hidden x 2 bytes).
    Compare two runs with ``python -m benchmarks.layout_fidelity``.
    ``grad_norms``: every parameter's gradient norm to ``PATH.rank<R>.json``; compare two runs with
    ``scripts/compare_grad_norms.py``."""

    def __init__(self, hidden: str = "", stride: int = 1, grad_norms: str = ""):
        if not isinstance(stride, int) or stride < 1:
            raise ValueError(f"DebugDumps: stride = {stride!r} must be an integer >= 1")
        self.hidden, self.stride, self.grad_norms = hidden, stride, grad_norms
        self._captured: list[torch.Tensor] = []
        self._handle = None

    def before_forward(self, trainer, data, mbs) -> None:
        norm = trainer.model.model.norm
        if self.hidden and data.step == 1 and norm is not None:  # the training forward's, before any update
            self._captured = []
            self._handle = norm.register_forward_hook(lambda m, a, out: self._captured.append(out.detach()))

    def after_backward(self, trainer, data, mbs) -> None:
        if data.step != 1:
            return
        if self.hidden:
            if self._handle is not None:
                self._handle.remove()
                self._handle = None
            self._dump_hidden(trainer, data, mbs, self._captured)
            self._captured = []
        if self.grad_norms:
            self._dump_grad_norms(trainer)

    def _dump_hidden(self, trainer, data, mbs, captured: list) -> None:
        from torch.distributed.tensor import DTensor

        path, stride = self.hidden, self.stride
        keys, hidden, targets = [], [], []
        for mb, h_PD in zip(mbs, captured):  # the final norm's outputs, one per microbatch in order
            batch = mb.batch
            traj = torch.as_tensor(data.plan.microbatches[mb.index], dtype=torch.long)
            off = torch.as_tensor(batch.logprob_offsets, dtype=torch.long)
            n_S = off[1:] - off[:-1]
            pos_S = torch.arange(int(off[-1])) - off[:-1].repeat_interleave(n_S)
            key_S2 = torch.stack([traj.repeat_interleave(n_S), pos_S], 1)
            rows_S = batch.logprob_rows.cpu()
            keep = (key_S2.sum(1) % stride) == 0
            if batch.cp is not None:  # this CP rank holds rows [lo, hi) only
                lo, hi = batch.cp.row_range
                keep &= (rows_S >= lo) & (rows_S < hi)
                rows_S = rows_S - lo
            idx = keep.nonzero().squeeze(1)
            keys.append(key_S2[idx])
            hidden.append(h_PD.index_select(0, rows_S[idx].to(h_PD.device)).cpu())
            targets.append(batch.logprob_targets.cpu()[idx])
        rank = trainer.rank
        out = {"keys": torch.cat(keys) if keys else torch.zeros(0, 2, dtype=torch.long),
               "hidden": torch.cat(hidden) if hidden else torch.zeros(0),
               "targets": torch.cat(targets) if targets else torch.zeros(0, dtype=torch.long),
               "harts": trainer.cfg.harts.enabled, "rank": rank, "stride": stride}
        torch.save(out, f"{path}.rank{rank}.pt")
        head = getattr(trainer.model, "lm_head", None)
        writer = torch.tensor([rank if head is not None else trainer.world_size], device=trainer.device)
        if trainer.distributed:  # the lowest rank holding the LM head writes it
            dist.all_reduce(writer, op=dist.ReduceOp.MIN)
        if head is not None:
            w = head.weight.full_tensor() if isinstance(head.weight, DTensor) else head.weight  # FSDP: collective
            if rank == int(writer):
                torch.save(w.detach().cpu(), f"{path}.lm_head.pt")
        log.info("wrote the final hidden states of %d positions to %s.rank%d.pt", out["keys"].shape[0], path, rank)

    def _dump_grad_norms(self, trainer) -> None:
        """DTensor gradients as full-tensor norms (a collective: every rank walks the same parameters in the
        same order), plain ones as this rank's (EP: its own experts)."""
        from torch.distributed.tensor import DTensor

        path, rank = self.grad_norms, trainer.rank
        names = {id(p): n for n, p in trainer.model.named_parameters()}
        if trainer.bf16_opt:
            pairs = []
            for o in trainer.optimizers:
                o.accumulate_grads()
                pairs += [(names.get(id(p), "?"), o._grad(p)) for g in o.param_groups for p in g["params"]]
        else:
            pairs = [(n, p.grad) for n, p in trainer.model.named_parameters()]
        out = {n: float((g.full_tensor() if isinstance(g, DTensor) else g).float().norm())
               for n, g in pairs if g is not None}
        with open(f"{path}.rank{rank}.json", "w") as f:
            json.dump(out, f, indent=0)
        log.info("wrote %d gradient norms to %s.rank%d.json", len(out), path, rank)


def hooks_from_config(debug) -> StepHooks:
    """``[debug]``'s dumps as a ``DebugDumps``, or the no-op ``StepHooks`` when none is set."""
    if debug.dump_hidden or debug.dump_grad_norms:
        return DebugDumps(debug.dump_hidden, debug.dump_hidden_stride, debug.dump_grad_norms)
    return StepHooks()
