"""The policy module the trainer parallelises: Ling-3.0 driven layer by layer as modules.

``harts.runtime.compact_hidden`` calls each decoder layer's pieces as functions. Parallel wrappers
(FSDP2 unshard/reshard hooks, activation checkpointing, torch.compile, pipeline stages) attach to a
module's ``__call__``, so the trainer runs the same computation through module calls instead:
``HartsPolicy.forward(batch)`` embeds, calls every ``TrainDecoderLayer(h, batch, weight, router)``
(prefix-shared compact path or trajectory-wise packed path, chosen by the batch) and returns
``logprobs`` for every predicted position in original order. Parameter names are LingForCausalLM's, so
state dicts and the HF export are unchanged.

Router losses are attached to each layer's output with ``AddRouterLoss`` (an identity whose backward
also seeds d(loss)/d(router term) = 1): their gradient then flows inside the layer's own backward, which
FSDP2's per-layer reduce-scatter, activation checkpointing and pipeline stages all require.

Context parallelism (``batch.cp``, harts.runtime.cp): the policy embeds, normalises, routes and projects
only this CP rank's rows; the sequence mixers (``mla_mix``/``kda_mix``) exchange rows for heads around
their cores; the LM head scores only the positions whose rows this rank holds.

Legend: P rows of the batch (physical compact rows, or packed tokens for the baseline; this CP rank's
share under context parallelism), D hidden, S predicted positions.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from harts.models.ling import LingConfig, LingForCausalLM
from harts.models.ling.blocks import DecoderLayer, MoE
from harts.runtime.batch import CompactBatch
from harts.runtime.compact import kda_mix, mla_mix
from harts.runtime.compact import logprobs as compact_logprobs

__all__ = ["AddRouterLoss", "TrainDecoderLayer", "HartsPolicy", "build_policy", "DTYPES"]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def _completed(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


class Completed(torch.autograd.Function):
    """Identity whose output and input gradient are completed plain tensors.

    DTensor's redistribute runs torch's functional collectives, which hand back AsyncCollectiveTensor
    wrappers that wait only when a torch op touches them. Triton kernels read raw pointers and never
    trigger that wait, so a kernel reading a region's input, or a layer norm's backward reading the
    gradient that a region boundary's reduce-scatter may still be writing, could read a half-written
    buffer (tests/test_train_completed.py shows such a gradient arriving unwaited). Every TP/SP boundary
    passes through here both ways."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = _completed(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return _completed(g)


def redistribute(x: torch.Tensor, mesh, src: tuple, dst: tuple, grad_placements: tuple | None = None) -> torch.Tensor:
    """This rank's tensor placed as ``src`` on ``mesh``, moved to ``dst``, back as a local tensor: the one
    path of every TP/SP boundary, completed both ways (``Completed``)."""
    from torch.distributed.tensor import DTensor

    d = DTensor.from_local(Completed.apply(x), mesh, src)
    if dst != src:
        d = d.redistribute(mesh, dst)
    return Completed.apply(d.to_local(grad_placements=grad_placements))


class AddRouterLoss(torch.autograd.Function):
    """y -> y in forward; backward also returns ``scale`` for the scalar router term (so it joins the
    loss; scale = 1 / tp inside a tensor-parallel region, whose gradients are summed over tp)."""

    @staticmethod
    def forward(ctx, y, term, scale: float = 1.0):
        ctx.term_meta = (term.shape, term.dtype, term.device, scale)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad_y):
        shape, dtype, device, scale = ctx.term_meta
        return grad_y, torch.full(shape, scale, dtype=dtype, device=device), None


class TrainMoE(MoE):
    """The trainer's MoE type (``MoE.forward_with_stats`` gives each call's router statistics); expert
    parallelism subclasses it to override ``routed``."""


class TrainDecoderLayer(DecoderLayer):
    """A DecoderLayer whose forward takes the batch: same parameters, same math as the runtime."""

    moe_index: int = -1  # position among the MoE layers (set by HartsPolicy.adopt_layers)
    tp_mesh = None  # set by harts.train.parallelize.apply_tp: mixer and FFN become TP regions
    sequence_parallel: bool = False  # rows sharded over tp outside the regions

    def forward(self, h_PD: torch.Tensor, batch: CompactBatch, weight_P: torch.Tensor | None,
                router: tuple | None = None) -> torch.Tensor:
        x = self.tp_enter(self.input_layernorm(h_PD))
        if batch.prefix_sharing:
            a = (mla_mix if self.kind == "mla" else kda_mix)(self.attention, x, batch)
        else:
            a = self.attention(x, batch.position_ids, batch.cu_seqlens, batch.max_seqlen)
        h_PD = h_PD + self.tp_exit(a)
        x = self.tp_enter(self.post_attention_layernorm(h_PD))
        if not isinstance(self.mlp, MoE):
            return h_PD + self.tp_exit(self.mlp(x))
        y, stats = self.mlp.forward_with_stats(x, weight_P)
        if router is not None:
            scale = 1.0 if self.tp_mesh is None else 1.0 / self.tp_mesh.size()
            y = AddRouterLoss.apply(y, router_term(stats, router, self.moe_index), scale)
        return h_PD + self.tp_exit(y)

    def tp_enter(self, x: torch.Tensor) -> torch.Tensor:
        """Region input: identity (or all-gather of the row shards under SP) forward; the gradient, of
        which every rank produces a part, is all-reduced (or reduce-scattered)."""
        if self.tp_mesh is None:
            return x
        from torch.distributed.tensor import Partial, Replicate, Shard

        src = (Shard(0),) if self.sequence_parallel else (Replicate(),)
        return redistribute(x, self.tp_mesh, src, (Replicate(),), grad_placements=(Partial(),))

    def tp_exit(self, y: torch.Tensor) -> torch.Tensor:
        """Region output: all-reduce (or reduce-scatter into row shards under SP) of the partial sums."""
        if self.tp_mesh is None:
            return y
        from torch.distributed.tensor import Partial, Replicate, Shard

        dst = (Shard(0),) if self.sequence_parallel else (Replicate(),)
        return redistribute(y, self.tp_mesh, (Partial(),), dst)


def router_term(st, router: tuple, moe_index: int) -> torch.Tensor:
    """This microbatch's share of the step's router loss for one layer (see harts.rl.losses).

    router = (coef_2, f_LE): coef = (c_z, c_aux) / (W * MoE layers); f_LE the detached load fractions of
    the previous step's global counts. z: W_b * z_b. Balance: W_b * (f_prev . P_b), linear in the
    microbatch (P_b is a weighted mean over its rows), so the step's sum does not depend on the split.
    """
    coef, f_LE = router
    c = coef.to(st.z_loss.dtype)
    term = st.weight_sum * c[0] * st.z_loss
    if f_LE is not None:
        term = term + st.weight_sum * c[1] * (f_LE[moe_index].to(st.P_E.dtype) * st.P_E).sum()
    return term


class HartsPolicy(LingForCausalLM):
    """LingForCausalLM whose ``forward(batch)`` returns log-probs of every predicted position."""

    activation_checkpoint: bool = False
    # Early stop ends a recomputation once the saved tensors are back. Layers with collectives (TP
    # all-reduces, EP all-to-alls) must recompute whole, or ranks can stop at different collectives
    # (observed: wrong gradients with TP x PP); harts.train.parallelize.apply_ac turns it off for them.
    ac_early_stop: bool = True

    def adopt_layers(self) -> "HartsPolicy":
        i = 0
        for layer in self.model.layers:
            if type(layer) is DecoderLayer:
                layer.__class__ = TrainDecoderLayer
            if isinstance(layer.mlp, MoE):
                if type(layer.mlp) is MoE:
                    layer.mlp.__class__ = TrainMoE
                layer.moe_index, i = i, i + 1
        return self

    def decoder_layers(self) -> list:
        """This module's decoder layers (all of them, or a pipeline stage's, kept under their indices)."""
        layers = self.model.layers
        return list(layers.values()) if isinstance(layers, torch.nn.ModuleDict) else list(layers)

    def moe_layers(self) -> list[MoE]:
        return [l.mlp for l in self.decoder_layers() if isinstance(l.mlp, MoE)]

    sp_mesh = None  # sequence parallelism: the residual stream holds this TP rank's rows only

    def forward(self, batch: CompactBatch, router: tuple | None = None) -> torch.Tensor:
        """Log-probs [S]; ``router`` = (coef_2, f_LE or None) adds the router losses (see router_term)."""
        h = self.embed(batch)
        return self.head(self.run_layers(h, batch, router), batch)

    def sp_split(self, h_PD: torch.Tensor) -> torch.Tensor:
        """Keep this TP rank's rows (backward: all-gather the row gradients)."""
        if self.sp_mesh is None:
            return h_PD
        from torch.distributed.tensor import Replicate, Shard

        return redistribute(h_PD, self.sp_mesh, (Replicate(),), (Shard(0),))

    def sp_gather(self, h_PD: torch.Tensor) -> torch.Tensor:
        """All rows for the (replicated) LM head (backward: each rank keeps its rows' gradient)."""
        if self.sp_mesh is None:
            return h_PD
        from torch.distributed.tensor import Replicate, Shard

        return redistribute(h_PD, self.sp_mesh, (Shard(0),), (Replicate(),))

    def run_layers(self, h: torch.Tensor, batch: CompactBatch, router: tuple | None) -> torch.Tensor:
        weight = self.row_weight(batch, h.dtype)
        for layer in self.decoder_layers():
            if self.activation_checkpoint and torch.is_grad_enabled():
                # the plan is fixed: recomputation reruns the same views, nothing is replanned
                with torch.utils.checkpoint.set_checkpoint_early_stop(self.ac_early_stop):
                    h = checkpoint(layer, h, batch, weight, router, use_reentrant=False)
            else:
                h = layer(h, batch, weight, router)
        return h

    # pieces (pipeline stages call these on their own modules)
    def embed(self, batch: CompactBatch) -> torch.Tensor:
        """Embeddings of this rank's rows: under context parallelism the CP rank's share of the physical
        rows (``batch.local_rows``), then under sequence parallelism this TP rank's part of those."""
        return self.sp_split(self.model.word_embeddings(batch.local_rows(batch.input_ids)))

    @staticmethod
    def row_weight(batch: CompactBatch, dtype: torch.dtype) -> torch.Tensor:
        """Multiplicities weight the router statistics (compact rows: q_c; baseline tokens: 1; padding
        rows: 0), for the rows this CP rank holds (all rows without CP)."""
        return batch.local_rows(batch.multiplicity).to(torch.promote_types(dtype, torch.float32))

    head_capture: list | None = None  # set to a list: head() appends (batch, final hidden rows), for dumps

    def head(self, h_PD: torch.Tensor, batch: CompactBatch) -> torch.Tensor:
        """Log-probs [S] of every predicted position; under context parallelism a partial vector (the
        positions whose rows live on other CP ranks are zero; the trainer keeps only its own positions,
        see ``harts.train.data.Microbatch.select``)."""
        hidden_PD = self.model.norm(self.sp_gather(h_PD))
        if self.head_capture is not None:
            self.head_capture.append((batch, hidden_PD.detach()))
        return compact_logprobs(self, batch, hidden_PD=hidden_PD)


def model_config(ling) -> LingConfig:
    """The ``[ling]`` section's model: the preset with its backend and size overrides; the trainer applies
    recomputation from outside (harts.train.parallelize.apply_ac)."""
    overrides = {"backend": ling.backend, "recompute": False}
    if ling.num_hidden_layers:
        overrides["num_hidden_layers"] = ling.num_hidden_layers
    if ling.kda_chunk_size:
        overrides["kda_chunk_size"] = ling.kda_chunk_size
    ops = ("attention", "kda", "conv", "moe", "logprobs", "norm")
    for item in filter(None, (t.strip() for t in ling.op_backends.split(","))):
        op, _, which = item.partition("=")
        if op not in ops or not which:
            raise ValueError(f"ling.op_backends: {item!r} is not op=backend with op one of {', '.join(ops)}")
        overrides[f"{op}_backend"] = which  # LingConfig checks the backend name
    return LingConfig.preset(ling.preset, **overrides)


def build_policy(cfg: LingConfig, *, device: torch.device, dtype: torch.dtype, seed: int,
                 on_meta: bool = False) -> HartsPolicy:
    """Build with deterministic weights: on the host (identical full tensors on every rank), or on the
    meta device (the caller shards, then ``init_sharded``)."""
    with torch.device("meta"):
        model = HartsPolicy(cfg)
    model.adopt_layers()
    if on_meta:
        return model.cast_(dtype)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    model.cast_(dtype)
    return model.to(device)


@torch.no_grad()
def init_sharded(model: HartsPolicy, device: torch.device, seed: int) -> None:
    """Materialise a meta-built, already parallelised model: each rank draws every tensor whole on
    ``device`` from that tensor's own generator (``param_seed``: model seed and qualified name) and keeps
    its shard. So replicated tensors agree across ranks (TP replicas, DP replicas), and every layout
    holds the weights of a one-process model initialised on the same device type (on one device:
    exactly ``init_weights(seed)``). Seeding each rank's shards with seed + rank instead would give TP
    ranks different replicas of the embeddings, LM head and router, and TP2 training would diverge from
    one process."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from harts.models.ling.blocks import initial_tensors

    model.to_empty(device=device)
    for t, full in initial_tensors(model, model.config, seed):  # a DTensor's shape is global
        if isinstance(t, DTensor):  # no communication: every rank slices its own shard of the same tensor
            shard = distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None)
            t._local_tensor.copy_(shard._local_tensor)
        else:
            t.copy_(full)
