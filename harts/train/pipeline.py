"""Pipeline parallelism: contiguous layer stages run by torch.distributed.pipelining schedules.

All stages of one pipeline belong to the same DP replica, so they hold the same planned microbatches
in the same slot order and the same layouts (every rank packs its replica's microbatches itself). A
stage's forward therefore takes only the activation tensor and reads the microbatch's layout from a
per-step list with a cursor (schedules run each stage's forwards in microbatch order). Activations are
sent padded to ``rows`` = the microbatch capacity (a HARTS microbatch has at most that many physical
rows, a baseline one at most that many tokens), which gives the schedules the static shapes they
preallocate buffers for; padding rows carry zeros and get zero gradients. The last stage computes the
microbatch's objective (already normalised by the step's global weights) and returns it as the stage
output; the schedule's loss function only sums it, and gradients are not rescaled (scale_grads=False).

FQNs stay those of the full model (the stage keeps its layers in a ModuleDict under their original
indices and drops the embeddings / final norm / LM head it does not own), so checkpoints line up.

Legend: R padded rows (= capacity), P physical rows of a microbatch, D hidden.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harts.rl.losses import token_losses
from harts.train.model import HartsPolicy, router_term

__all__ = ["stage_layers", "prune_to_stage", "HartsStage", "PipelineRunner"]


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


class HartsStage(HartsPolicy):
    """A pipeline stage of HartsPolicy; ``forward(x)`` processes the next microbatch of the step."""

    first: bool = True
    last: bool = True
    rows: int = 0
    row_split: int = 1  # context / sequence parallelism: a stage passes on this CP and TP rank's rows
    act_dtype: torch.dtype = torch.float32

    recompute: bool = False  # forward-only pass that records each microbatch's log-probs (PPO old_logprobs)

    def begin_step(self, mbs, router, loss_cfg, old_logp: dict | None = None):
        self._mbs, self._router, self._loss_cfg, self._cursor = mbs, router, loss_cfg, 0
        self._old = old_logp or {}  # microbatch index -> recomputed old log-probs (last stage)
        self.mb_records = []  # per microbatch: (loss, pg, kl, clip, positions) on the last stage
        self.mb_counts = None  # summed MoE counts of this stage's layers, [this stage's MoE layers, E]
        self.router_sum = 0.0  # logged value of this stage's router losses

    def moe_ids(self) -> list[int]:
        """Global MoE-layer indices of this stage's MoE layers (rows of the full counts / f tensors)."""
        return [l.moe_index for l in self.decoder_layers() if l.moe_index >= 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mb = self._mbs[self._cursor]
        self._cursor += 1
        batch = mb.batch
        h = self.embed(batch) if self.first else x[: batch.num_phys // self.row_split]
        h = self.run_layers(h, batch, self._router)
        stats = self.router_stats()
        if stats:
            cnt = torch.stack([s.counts_E for s in stats]).double().detach()
            self.mb_counts = cnt if self.mb_counts is None else self.mb_counts + cnt
            if self._router is not None:
                with torch.no_grad():
                    self.router_sum += sum(float(router_term(s, self._router, i))
                                           for s, i in zip(stats, self.moe_ids()))
        if not self.last:
            return F.pad(h, (0, 0, 0, self.rows - h.shape[0]))
        logp = mb.select(self.head(h, batch))  # this CP rank's positions (all without CP)
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


def prune_to_stage(model: HartsPolicy, stage: int, pp: int) -> HartsStage:
    keep = stage_layers(len(model.decoder_layers()), pp)[stage]
    layers = model.decoder_layers()
    model.model.layers = nn.ModuleDict({str(i): layers[i] for i in keep})
    model.__class__ = HartsStage
    model.first, model.last = stage == 0, stage == pp - 1
    if not model.first:
        model.model.word_embeddings = None
    if not model.last:
        model.model.norm = None
        model.lm_head = None
    return model


class PipelineRunner:
    """One pipeline schedule per slot count (plans may change K from step to step)."""

    def __init__(self, stage_model: HartsStage, *, stage: int, pp: int, group, device, schedule: str,
                 rows: int, hidden: int, act_dtype: torch.dtype, loss_dtype: torch.dtype, row_split: int = 1):
        if rows % row_split:
            raise ValueError(f"harts.capacity={rows} must be a multiple of {row_split} (context_parallel_degree x "
                             "tensor_parallel_degree with sequence parallelism) with pipeline parallelism")
        rows //= row_split
        self.model, self.stage, self.pp, self.group, self.device = stage_model, stage, pp, group, device
        self.schedule_name, self.rows, self.hidden = schedule, rows, hidden
        self.act_dtype, self.loss_dtype = act_dtype, loss_dtype
        stage_model.rows, stage_model.row_split = rows, row_split
        self._cache: dict[tuple[int, bool], object] = {}  # (microbatches, train) -> schedule

    def _schedule(self, n: int, train: bool = True):
        """Training schedules (forward + backward) and forward-only ones (PPO's old log-probs: GPipe, no
        loss, no gradients) are separate stage objects, since their static metadata differ."""
        if (n, train) not in self._cache:
            from torch.distributed.pipelining import PipelineStage
            from torch.distributed.pipelining.schedules import get_schedule_class

            m = self.model
            act = lambda: torch.empty(self.rows, self.hidden, dtype=self.act_dtype, device=self.device,
                                      requires_grad=train)  # static metadata: activations carry gradients
            inp = torch.empty(1, 1, device=self.device) if m.first else act()
            out = torch.empty(1, dtype=self.loss_dtype, device=self.device, requires_grad=train) if m.last else act()
            st = PipelineStage(m, self.stage, self.pp, self.device, input_args=inp, output_args=out,
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

    def _step(self, sched, n: int, with_target: bool) -> None:
        target = torch.zeros(n, 1, device=self.device) if with_target and self.model.last else None
        if self.model.first:
            sched.step(torch.zeros(n, 1, device=self.device), target=target)
        elif self.model.last:
            sched.step(target=target)
        else:
            sched.step()

    def old_logprobs(self, mbs) -> dict:
        """PPO ``old_logprobs = 'recompute'``: a forward-only pass over the step's microbatches before the
        update; returns {microbatch index: log-probs} on the last stage (where the loss is), {} elsewhere."""
        m = self.model
        m.begin_step(mbs, None, None)
        m.recompute = True
        try:
            with torch.no_grad():
                self._step(self._schedule(len(mbs), train=False), len(mbs), with_target=False)
        finally:
            m.recompute = False
        return dict(m.mb_records) if m.last else {}

    def run(self, mbs, router, loss_cfg, old_logp: dict | None = None) -> None:
        n = len(mbs)
        self.model.begin_step(mbs, router, loss_cfg, old_logp)
        self._step(self._schedule(n), n, with_target=True)
