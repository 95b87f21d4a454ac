"""Pipeline parallelism: contiguous layer stages run by torch.distributed.pipelining schedules.

All stages of one pipeline belong to the same DP replica, so they hold the same planned microbatches
in the same slot order and the same layouts (every rank packs its replica's microbatches itself). A
stage's forward therefore takes only the activation tensor and reads the microbatch's layout from a
per-step list with a cursor (schedules run each stage's forwards in microbatch order): ``Stage`` is
the pruned model's input/output preparation, a pair of forward hooks (torchtitan's
PrepareModuleInput/Output), not a second model. Activations are
sent padded to ``rows`` = the microbatch capacity (a HARTS microbatch has at most that many physical
rows, a baseline one at most that many tokens), which gives the schedules the static shapes they
preallocate buffers for; padding rows carry zeros and get zero gradients. The last stage computes the
microbatch's objective (already normalised by the step's global weights) and returns it as the stage
output; the schedule's loss function only sums it, and gradients are not rescaled (scale_grads=False).

A stage is the same ``LingForCausalLM`` or ``Qwen35ForCausalLM`` pruned (``prune_to_stage``): it keeps its
layers in a ModuleDict under their original indices and sets the embeddings / final norm / LM head it does
not own to None, so FQNs, and checkpoints, stay those of the full model. Both families prune the same way
(both take the previous stage's rows as ``hidden_PD``; Qwen3.5's embeddings are ``embed_tokens``).

Legend: R padded rows (= capacity), P physical rows of a microbatch, D hidden.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harts.models.ling import LingForCausalLM
from harts.models.ling.blocks import router_term
from harts.models.qwen35 import Qwen35ForCausalLM
from harts.rl.losses import token_losses
from harts.runtime.compact import logprobs as compact_logprobs

__all__ = ["stage_layers", "prune_to_stage", "Stage", "PipelineRunner"]


def stage_layers(num_layers: int, pp: int) -> list[list[int]]:
    """Contiguous, as even as possible, earlier stages take the remainder."""
    if num_layers < pp:
        raise ValueError(f"{num_layers} layers cannot fill {pp} pipeline stages")
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


class Stage:
    """A pruned model's pipeline-stage hooks: the stage input (a dummy on the first stage, the previous
    stage's padded rows otherwise) becomes the next microbatch's ``model(layout=..., router=...,
    hidden_PD=...)`` call; the output becomes the padded rows (the last stage: the microbatch's loss)."""

    def __init__(self, model: LingForCausalLM | Qwen35ForCausalLM, first: bool, last: bool):
        self.model, self.first, self.last = model, first, last
        self.rows = 0
        self.row_split = 1  # context / sequence parallelism: a stage passes on this CP and TP rank's rows
        self.recompute = False  # forward-only pass that records each microbatch's log-probs (PPO old_logprobs)
        self.begin_step([], None, None)
        model.register_forward_pre_hook(self._input, with_kwargs=True)
        model.register_forward_hook(self._output)

    def begin_step(self, mbs, router, loss_cfg, old_logp: dict | None = None):
        self._mbs, self._router, self._loss_cfg, self._cursor = mbs, router, loss_cfg, 0
        self._old = old_logp or {}  # microbatch index -> recomputed old log-probs (last stage)
        self.mb_records = []  # last stage, per microbatch: (index, logp, loss, pg, kl, clip), or (index, logp)
        self.mb_counts = None  # summed MoE counts of this stage's layers, [this stage's MoE layers, E]
        self.router_sum = 0.0  # logged value of this stage's router losses

    def moe_ids(self) -> list[int]:
        """Global MoE-layer indices of this stage's MoE layers (rows of the full counts / f tensors)."""
        return [m.moe_index for m in self.model.moe_layers()]

    def _input(self, model, args, kwargs):
        self._mb = mb = self._mbs[self._cursor]
        self._cursor += 1
        hidden = None if self.first else args[0][: mb.batch.num_phys // self.row_split]
        return (), dict(layout=mb.batch, router=self._router, hidden_PD=hidden)

    def _output(self, model, args, h):
        mb = self._mb
        stats = model.router_stats()
        if stats:
            cnt = torch.stack([s.counts_E for s in stats]).double().detach()
            self.mb_counts = cnt if self.mb_counts is None else self.mb_counts + cnt
            if self._router is not None:
                with torch.no_grad():
                    self.router_sum += sum(float(router_term(s, self._router, i))
                                           for s, i in zip(stats, self.moe_ids()))
        if not self.last:
            return F.pad(h, (0, 0, 0, self.rows - h.shape[0]))
        logp = mb.select(compact_logprobs(model, mb.batch, hidden_PD=h))  # this CP rank's positions
        if self.recompute:
            self.mb_records.append((mb.index, logp.detach()))
            return logp.new_zeros(1, dtype=torch.promote_types(logp.dtype, torch.float32))
        loss_S, pg_S, kl_S, clip_S = token_losses(logp, mb.adv, self._loss_cfg,
                                                  old_logp_S=self._old.get(mb.index, mb.old_logp),
                                                  ref_logp_S=mb.ref_logp)
        c = mb.coeff.to(loss_S.dtype)
        loss = (c * loss_S).sum()
        with torch.no_grad():
            self.mb_records.append((mb.index, logp.detach(), loss.detach(), (c * pg_S).sum(), (c * kl_S).sum(),
                                    (c * clip_S).sum()))
        return loss.reshape(1)


def prune_to_stage(model: LingForCausalLM | Qwen35ForCausalLM, stage: int, pp: int) -> Stage:
    """Keep this stage's layers (under their indices) and the ends it owns, in place; returns its hooks."""
    layers = model.decoder_layers()
    keep = stage_layers(len(layers), pp)[stage]
    model.model.layers = nn.ModuleDict({str(i): layers[i] for i in keep})
    first, last = stage == 0, stage == pp - 1
    if not first:
        setattr(model.model, model.model.embedding_attr, None)
    if not last:
        model.model.norm = None
        model.lm_head = None
    return Stage(model, first, last)


class PipelineRunner:
    """One pipeline schedule per slot count (plans may change K from step to step)."""

    def __init__(self, stage_io: Stage, *, stage: int, pp: int, group, device, schedule: str,
                 rows: int, hidden: int, act_dtype: torch.dtype, loss_dtype: torch.dtype, row_split: int = 1):
        if rows % row_split:
            raise ValueError(f"harts.capacity={rows} must be a multiple of {row_split} (context_parallel_degree x "
                             "tensor_parallel_degree with sequence parallelism) with pipeline parallelism")
        rows //= row_split
        self.io, self.model = stage_io, stage_io.model
        self.stage, self.pp, self.group, self.device = stage, pp, group, device
        self.schedule_name, self.rows, self.hidden = schedule, rows, hidden
        self.act_dtype, self.loss_dtype = act_dtype, loss_dtype
        stage_io.rows, stage_io.row_split = rows, row_split
        self._cache: dict[tuple[int, bool], object] = {}  # (microbatches, train) -> schedule

    def _schedule(self, n: int, train: bool = True):
        """Training schedules (forward + backward) and forward-only ones (PPO's old log-probs: GPipe, no
        loss, no gradients) are separate stage objects, since their static metadata differ."""
        if (n, train) not in self._cache:
            from torch.distributed.pipelining import PipelineStage
            from torch.distributed.pipelining.schedules import get_schedule_class

            m = self.io
            act = lambda: torch.empty(self.rows, self.hidden, dtype=self.act_dtype, device=self.device,
                                      requires_grad=train)  # static metadata: activations carry gradients
            inp = torch.empty(1, 1, device=self.device) if m.first else act()
            out = torch.empty(1, dtype=self.loss_dtype, device=self.device, requires_grad=train) if m.last else act()
            st = PipelineStage(self.model, self.stage, self.pp, self.device, input_args=inp, output_args=out,
                               group=self.group)
            name = self.schedule_name
            if (n < self.pp or not train) and name.lower() != "gpipe":
                # 1F1B-style schedules need at least one microbatch per stage; a step whose plan has fewer
                # slots runs GPipe (same math, the order of forwards and backwards differs)
                name = "GPipe"
            cls = get_schedule_class(name)
            loss_fn = (lambda o, t: o.sum()) if train else None
            self._cache[(n, train)] = cls(st, n_microbatches=n, loss_fn=loss_fn, scale_grads=False)
        return self._cache[(n, train)]

    def _step(self, n: int, train: bool) -> None:
        """One pass of the ``n``-microbatch schedule: the first stage feeds dummy inputs (the stage hooks read the
        microbatches), and a training pass gives the last stage's loss function a dummy target."""
        inputs = (torch.zeros(n, 1, device=self.device),) if self.io.first else ()
        target = torch.zeros(n, 1, device=self.device) if train and self.io.last else None
        self._schedule(n, train).step(*inputs, target=target)

    def old_logprobs(self, mbs) -> dict:
        """PPO ``old_logprobs = 'recompute'``: a forward-only pass over the step's microbatches before the
        update; returns {microbatch index: log-probs} on the last stage (where the loss is), {} elsewhere."""
        m = self.io
        m.begin_step(mbs, None, None)
        m.recompute = True
        try:
            with torch.no_grad():
                self._step(len(mbs), train=False)
        finally:
            m.recompute = False
        return dict(m.mb_records) if m.last else {}

    def run(self, mbs, router, loss_cfg, old_logp: dict | None = None) -> None:
        self.io.begin_step(mbs, router, loss_cfg, old_logp)
        self._step(len(mbs), train=True)
