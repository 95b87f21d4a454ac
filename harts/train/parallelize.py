"""Device mesh and parallelisms, applied from the outside in torchtitan's order: EP, TP, activation
checkpointing, compile, FSDP2.

The mesh is torchtitan 0.2.2's ``ParallelDims`` (dims pp / batch / cp / fsdp / tp / ep / efsdp, with the
``fake`` backend for size-1 dims). Its ``build_mesh`` takes the device type from a torchtitan module global
detected at import ("cuda" on a host without an accelerator), so ``_build_mesh`` builds the same meshes for the
trainer's device (gloo on CPU) and hands them to the ParallelDims. torch registers the ``fake`` backend itself
when its FSDP package is imported (torch.distributed.fsdp's FlatParameter module imports the fake process group).

Expert parallelism is a parallel style around each MoE layer's parallel-agnostic experts module
(``harts.train.expert_parallel``: dispatch before it, combine after it, as torchtitan's ``ExpertParallel``);
tensor parallelism a plan of styles per decoder layer (``harts.train.tensor_parallel``). EP borrows ranks
from dp_shard x cp x tp (torchtitan's rule); we require efsdp = 1 (ep = dp_shard x cp x tp), so expert
gradients are complete after the backward all-to-all and experts are left out of FSDP (``ignored_params``).

Context parallelism (cp) is folded into FSDP's dimension as torchtitan does (its ``fsdp`` mesh dim is
dp_shard x cp): a CP rank's parameter gradients are partial (its own rows, its own heads), and the FSDP
reduce-scatter over dp_shard x cp sums them in the same collective that sums DP gradients, while the
parameters and optimizer states are sharded over the CP ranks as well.

Both model families go through the same functions: the stacked expert weights are read through ``expert_weights``
(gate_up_proj / down_proj) and the token embeddings through ``embeddings`` (Ling's word_embeddings, Qwen3.5's
embed_tokens).
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from harts.models.ling.blocks import DecoderLayer

log = logging.getLogger("harts.train")

__all__ = ["build_parallel_dims", "apply_ep", "apply_tp", "apply_ac", "apply_compile", "apply_fsdp",
           "expert_weights", "embeddings"]


def build_parallel_dims(pcfg, world_size: int, device_type: str):
    """torchtitan ParallelDims from the [parallelism] section, usable on a CPU (gloo) host."""
    import torch.distributed.fsdp  # noqa: F401  (registers the "fake" backend of the size-1 mesh dims)

    dims = parallel_dims(pcfg, world_size)
    if world_size > 1 or dims.pp > 1:
        _build_mesh(dims, device_type)
    return dims


def parallel_dims(pcfg, world_size: int):
    """The [parallelism] section's degrees on ``world_size`` ranks, checked (torchtitan's ParallelDims, whose
    product must be the world size, and the trainer's expert-parallel rule) without building a mesh."""
    from torchtitan.distributed import ParallelDims

    cp = pcfg.context_parallel_degree
    if cp < 1:
        raise ValueError(f"parallelism.context_parallel_degree = {cp} must be >= 1")
    dims = ParallelDims(
        dp_replicate=pcfg.data_parallel_replicate_degree, dp_shard=pcfg.data_parallel_shard_degree, cp=cp,
        tp=pcfg.tensor_parallel_degree, pp=pcfg.pipeline_parallel_degree, ep=pcfg.expert_parallel_degree,
        etp=pcfg.expert_tensor_parallel_degree, world_size=world_size)
    if dims.ep > 1:
        # EP borrows every rank of one pipeline stage's dp_shard x cp x tp block (efsdp = 1); CP ranks hold
        # disjoint rows, so each dispatches its own rows like a DP rank
        if dims.ep != dims.dp_shard * dims.cp * dims.tp or dims.dp_replicate != 1:
            raise ValueError(f"expert_parallel_degree={dims.ep}: the HARTS trainer needs ep = dp_shard x cp x tp "
                             f"(= {dims.dp_shard * dims.cp * dims.tp}) and dp_replicate = 1 (no extra expert FSDP)")
        if dims.etp != 1:
            raise ValueError("expert_tensor_parallel_degree must be 1")
    return dims


def _build_mesh(dims, device_type: str):
    """torchtitan 0.2.2's ``ParallelDims.build_mesh`` on ``device_type``: the world mesh unflattened into the
    dataloading (pp, batch, cp, tp), dense (pp, dp_replicate, fsdp, tp) and sparse (pp, dp_replicate, efsdp,
    ep, etp) meshes, the ``fake`` backend for dims that do not exist, and the loss mesh (batch x cp)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh(device_type, (dims.world_size,), mesh_dim_names=("world",))

    def unflatten(names: tuple[str, ...], degrees: tuple[int, ...]):
        fake = {n: "fake" for n, k in zip(names, degrees, strict=True) if not dims._mesh_exist(n, k)}
        return world._unflatten(0, degrees, names, backend_override=fake)

    fsdp = dims.dp_shard * dims.cp
    loading = unflatten(("pp", "batch", "cp", "tp"), (dims.pp, dims.dp_replicate * dims.dp_shard, dims.cp, dims.tp))
    dense = unflatten(("pp", "dp_replicate", "fsdp", "tp"), (dims.pp, dims.dp_replicate, fsdp, dims.tp))
    sparse = unflatten(("pp", "dp_replicate", "efsdp", "ep", "etp"),
                       (dims.pp, dims.dp_replicate, fsdp * dims.tp // (dims.etp * dims.ep), dims.ep, dims.etp))
    loss = loading["batch", "cp"]._flatten("loss_mesh")
    dims._world_mesh = world
    dims._global_meshes = {"dataloading": loading, "loss": loss, "dense": dense, "sparse": sparse}
    dims._meshes = {"pp": loading["pp"], "batch": loading["batch"], "loss": loss, "cp": loading["cp"],
                    "tp": loading["tp"], "dp_replicate": dense["dp_replicate"], "fsdp": dense["fsdp"],
                    "ep": sparse["ep"], "efsdp": sparse["efsdp"], "etp": sparse["etp"]}
    dims._validate_meshes()


# ------------------------------------------------------------------------------------------ family accessors
def expert_weights(experts: nn.Module) -> tuple[str, ...]:
    """Names of a MoE's stacked routed-expert parameters, all with the expert dim first: Qwen3.5's
    ``gate_up_proj`` [E, 2F, D] (gate rows first) and ``down_proj`` [E, D, F], or Ling's ``gate_up_proj``
    [E, 2, F, D] and ``down_proj`` [E, D, F]."""
    names = getattr(type(experts), "stacked_weights", None)
    if names is None:
        raise TypeError(f"{type(experts).__name__} does not declare its stacked expert weights (stacked_weights)")
    missing = [n for n in names if not isinstance(getattr(experts, n, None), torch.Tensor)]
    if missing:
        raise TypeError(f"{type(experts).__name__} has no stacked expert parameter(s) {missing}")
    return names


def embeddings(model) -> nn.Module | None:
    """The token embedding module of a causal LM (None on a pipeline stage that does not own it)."""
    inner = model.model
    name = getattr(type(inner), "embedding_attr", None)
    if name is None:
        raise TypeError(f"{type(inner).__name__} does not declare its token embedding (embedding_attr)")
    return getattr(inner, name)


# ------------------------------------------------------------------------------------------ EP
def apply_ep(model, ep_mesh, tp_mesh=None) -> set:
    """Expert parallelism (``harts.train.expert_parallel.ExpertParallel``) around every MoE layer's experts
    module: weights sharded over ``ep_mesh``, the all-to-all dispatch and combine as the style's hooks;
    ``tp_mesh`` when the layers will also be tensor parallel (each TP rank then dispatches a slice of the
    rows). Returns the expert parameters (left out of FSDP2)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from harts.train.expert_parallel import ExpertParallel

    ep = ep_mesh.size()
    for moe in model.moe_layers():
        if moe.cfg.num_experts % ep:
            raise ValueError(f"num_experts={moe.cfg.num_experts} is not divisible by expert_parallel_degree={ep}")
        parallelize_module(moe.experts, ep_mesh, ExpertParallel(tp_mesh=tp_mesh))
    return expert_params(model)


def expert_params(model) -> set:
    """The routed-expert parameters that expert parallelism distributes."""
    from harts.train.expert_parallel import is_expert_parallel

    return {getattr(m.experts, n) for m in model.moe_layers() if is_expert_parallel(m.experts)
            for n in expert_weights(m.experts)}


# ------------------------------------------------------------------------------------------ TP
def apply_tp(model, tp_mesh, sequence_parallel: bool = False) -> None:
    """Megatron-style tensor parallelism from outside the model (``harts.train.tensor_parallel``): per decoder
    layer the family's plan (``ling_plan`` / ``qwen35_plan``) distributes its parameters over ``tp_mesh``
    and runs the layer's own code on local views of them, with the two TP regions' boundaries (the layer
    norms' outputs in, the mixer's output projection and the FFN / MoE out) as parallel styles; nothing in
    the model is told that it is parallel (head counts are read off tensor shapes). Routed experts already
    sharded by expert parallelism (``apply_ep``, applied first, given the TP mesh) keep that sharding; each
    TP rank then dispatches a disjoint slice of the rows.

    Sequence parallelism: the residual stream and the layer norms hold this rank's rows (the rows are padded
    to a multiple of tp); the embeddings' output is split into row shards (``PrepareModuleOutput``) and the
    final norm's input all-gathered (``PrepareModuleInput``); embeddings and LM head stay whole."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module

    from harts.models.qwen35.blocks import DecoderLayer as Qwen35Layer
    from harts.train.expert_parallel import is_expert_parallel
    from harts.train.tensor_parallel import ling_plan, qwen35_plan

    tp = tp_mesh.size()
    for layer in model.decoder_layers():
        if isinstance(layer, DecoderLayer):
            plan_of = ling_plan
        elif isinstance(layer, Qwen35Layer):
            plan_of = qwen35_plan
        else:
            raise ValueError(f"tensor parallelism (tensor_parallel_degree={tp}) has no plan for "
                             f"{type(layer).__name__} layers; set parallelism.tensor_parallel_degree = 1")
        experts = getattr(layer.mlp, "experts", None)
        ep = experts is not None and is_expert_parallel(experts)
        plan = plan_of(layer, sequence_parallel=sequence_parallel, experts_sharded_elsewhere=ep, tp=tp)
        parallelize_module(layer, tp_mesh, plan.pop(""))
        parallelize_module(layer, tp_mesh, plan)
    if sequence_parallel:
        if embeddings(model) is not None:
            parallelize_module(embeddings(model), tp_mesh,
                               PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)))
        if model.model.norm is not None:
            parallelize_module(model.model.norm, tp_mesh, PrepareModuleInput(
                input_layouts=Shard(0), desired_input_layouts=Replicate(), use_local_output=True))


def clip_grad_norm_mixed_(params, max_norm: float, pp_group=None, grads=None) -> torch.Tensor:
    """Gradient clipping over parameters living on different meshes (TP DTensors, 2-D FSDP x TP
    DTensors, 1-D FSDP DTensors, plain replicated tensors), which ``get_total_norm`` cannot stack.
    Local squared norms are summed per (mesh, sharded dims) group and all-reduced once per group over
    the dims the gradients are sharded on; replicated dims count once. ``grads`` (instead of the
    parameters' ``.grad``): e.g. BF16AdamW's fp32 gradients, placed like their parameters."""
    from torch.distributed.tensor import DTensor, Replicate

    groups: dict = {}  # (mesh, sharded dims) -> [local tensors, mesh, dims]
    if grads is None:
        grads = [p.grad for p in params if p.grad is not None]
    for g in grads:
        if isinstance(g, DTensor):
            # Shard and FSDP's _StridedShard (not a Shard subclass) both split the tensor over that dim
            if any(pl.is_partial() for pl in g.placements):
                raise RuntimeError(f"unreduced (Partial) gradient on mesh {g.device_mesh}")
            dims = tuple(i for i, pl in enumerate(g.placements) if not isinstance(pl, Replicate))
            key, local, mesh = (id(g.device_mesh), dims), g.to_local(), g.device_mesh
        else:
            key, local, mesh, dims = (None, ()), g, None, ()
        groups.setdefault(key, [[], mesh, dims])[0].append(local)
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else None)
    for tensors, mesh, dims in groups.values():
        # multi-tensor norms accumulated in fp64 inside the kernel (no fp64 copies of the gradients)
        sq = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64)).square().sum()
        for d in dims:
            dist.all_reduce(sq, group=mesh.get_group(mesh_dim=d))
        total = total + sq
    if pp_group is not None:  # stages hold disjoint parameters
        dist.all_reduce(total, group=pp_group)
    norm = total.sqrt()
    coef = float(max_norm) / (float(norm) + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


# ------------------------------------------------------------------------------------------ AC / compile
def apply_ac(model, mode: str, collectives_in_layers: bool = False) -> None:
    """Activation checkpointing of the decoder layers, applied from outside (the decoder stack's policy,
    ``harts.models.common.stack.DecoderStack``; both families): "none", "selective" (keep the mixer cores' and
    matrix products' outputs, recompute norms, gates, RoPE, SwiGLU, routing; ``harts.models.common.compile``)
    or "full" (torchtitan's 'full': recompute every layer whole). Layers with collectives (TP all-reduces, EP
    all-to-alls, CP exchanges) recompute without early stop, or ranks can stop at different collectives
    (observed: wrong gradients with TP x PP). "selective" runs a layer as regions that call its norms, MLP /
    MoE and the mixer's projections as modules (the parallel styles on them run); hooks on a mixer module
    itself are refused with a ValueError naming the layer."""
    from harts.models.common.stack import AC_POLICIES

    if mode not in AC_POLICIES:
        raise ValueError(f"activation checkpointing: checkpoint_policy = {mode!r}; expected one of {AC_POLICIES}")
    if mode == "selective":
        from harts.models.common.compile import check_region_split

        for layer in model.decoder_layers():
            check_region_split(layer, "selective activation checkpointing")
    model.model.checkpoint_policy = mode
    model.model.checkpoint_early_stop = not collectives_in_layers


def apply_compile(model, backend: str = "inductor", fullgraph: bool = True) -> list[str]:
    """torch.compile each decoder layer (``harts.models.ling.compile_model``: compiled per-row regions around
    the eager sequence-mixer cores, row counts dynamic) and return the compiled region names; the running
    count of compilations is ``model.compile_report`` (``.summary(steps)``). Applied after TP and
    activation checkpointing, before FSDP2. ``fullgraph=False`` lets a region break its graph where a
    module runs what Dynamo cannot trace (expert parallelism's all-to-all with host split sizes)."""
    from harts.models.common.compile import compile_model

    return list(compile_model(model, backend=backend, dynamic=True, fullgraph=fullgraph).regions)


# ------------------------------------------------------------------------------------------ FSDP2
def apply_fsdp(model, dp_mesh, *, param_dtype=None, reduce_dtype=None, reshard_after_forward: bool = True,
               ignored: set | None = None) -> None:
    """fully_shard per decoder layer, the embeddings on their own, the root (norm + lm_head) last.

    Gradients are summed over DP (divide factor 1): the loss is already normalised by the step's global
    token count (harts.rl.losses), so averaging would divide by DP twice."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kw = dict(mesh=dp_mesh, mp_policy=mp)
    ign = ignored or set()
    emb = embeddings(model)
    if emb is not None:  # None on later pipeline stages
        fully_shard(emb, reshard_after_forward=reshard_after_forward, **kw)
    for layer in model.decoder_layers():
        fully_shard(layer, reshard_after_forward=reshard_after_forward,
                    ignored_params={p for p in layer.parameters() if p in ign} or None, **kw)
    fully_shard(model, reshard_after_forward=False, ignored_params=ign or None, **kw)
    register_fsdp_forward_method(model, "logprobs")  # the trainer's forward: the root's hooks run around it
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
