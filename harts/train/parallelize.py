"""Device mesh and parallelisms, applied from the outside in torchtitan's order: EP, TP, activation
checkpointing, compile, FSDP2.

The mesh is torchtitan 0.2.2's ``ParallelDims`` (dims pp / batch / cp / fsdp / tp / ep / efsdp, with the
``fake`` backend for size-1 dims). Its ``build_mesh`` takes the device type from a torchtitan module global
detected at import ("cuda" on a host without an accelerator), so ``_build_mesh`` builds the same meshes for the
trainer's device (gloo on CPU) and hands them to the ParallelDims. torch registers the ``fake`` backend itself
when its FSDP package is imported (torch.distributed.fsdp's FlatParameter module imports the fake process group).

Expert parallelism has the shape of torchtitan's ``ExpertParallel`` style: dispatch (counts all-to-all,
token all-to-all with autograd, rank-major -> expert-major permutation), the model's own expert compute
(``harts.ops.moe.experts.grouped_experts``, as torchtitan runs its GroupedExperts), combine (the reverse,
then the router's fixed (token, k) weighted sum). It is a callable on the MoE rather than a style around
an experts module: our experts are stacked weights read by the MoE's forward, not a module with a
(tokens, counts) forward, and torchtitan's style pads every expert group through a Triton index kernel.
EP borrows ranks from dp_shard x cp x tp (torchtitan's rule); we require efsdp = 1 (ep = dp_shard x cp x
tp), so expert gradients are complete after the backward all-to-all and experts are left out of FSDP
(``ignored_params``).

Context parallelism (cp) is folded into FSDP's dimension as torchtitan does (its ``fsdp`` mesh dim is
dp_shard x cp): a CP rank's parameter gradients are partial (its own rows, its own heads), and the FSDP
reduce-scatter over dp_shard x cp sums them in the same collective that sums DP gradients, while the
parameters and optimizer states are sharded over the CP ranks as well.

Both model families go through the same functions: the stacked expert weights are read through
``expert_weights`` (Ling's gate_proj / up_proj / down_proj, Qwen3.5's gate_up_proj / down_proj) and the token
embeddings through ``embeddings`` (Ling's word_embeddings, Qwen3.5's embed_tokens). Tensor parallelism has a
plan for each family's layers (``harts.train.tensor_parallel``).

Legend: T tokens, K experts per token, M = T*K routed rows, E experts, El = E / ep local experts, D hidden,
F expert width.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from harts.models.ling.blocks import DecoderLayer
from harts.ops.moe.experts import _combine, grouped_experts

log = logging.getLogger("harts.train")

__all__ = ["build_parallel_dims", "apply_ep", "apply_tp", "apply_ac", "apply_compile", "apply_fsdp", "ExpertParallel",
           "expert_weights", "embeddings"]


def build_parallel_dims(pcfg, world_size: int, device_type: str):
    """torchtitan ParallelDims from the [parallelism] section, usable on a CPU (gloo) host."""
    import torch.distributed.fsdp  # noqa: F401  (registers the "fake" backend of the size-1 mesh dims)
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
    if world_size > 1 or dims.pp > 1:
        _build_mesh(dims, device_type)
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
    ``gate_up_proj`` [E, 2F, D] (gate rows first) and ``down_proj`` [E, D, F], or Ling's ``gate_proj`` /
    ``up_proj`` [E, F, D] and ``down_proj`` [E, D, F]."""
    names = getattr(type(experts), "stacked_weights", None)
    if names is None:
        raise TypeError(f"{type(experts).__name__} does not declare its stacked expert weights (stacked_weights)")
    missing = [n for n in names if not isinstance(getattr(experts, n, None), torch.Tensor)]
    if missing:
        raise TypeError(f"{type(experts).__name__} has no stacked expert parameter(s) {missing}")
    return names


def _swiglu_weights(experts: nn.Module, dtype: torch.dtype):
    """This rank's (gate [El, F, D], up [El, F, D], down [El, D, F]) expert weights in ``dtype``."""
    local = [getattr(experts, n).to_local().to(dtype) for n in expert_weights(experts)]
    if len(local) == 3:
        return tuple(local)
    gate_up, down = local
    F_ = gate_up.shape[1] // 2
    return gate_up[:, :F_], gate_up[:, F_:], down


def embeddings(model) -> nn.Module | None:
    """The token embedding module of a causal LM (None on a pipeline stage that does not own it)."""
    inner = model.model
    name = getattr(type(inner), "embedding_attr", None)
    if name is None:
        raise TypeError(f"{type(inner).__name__} does not declare its token embedding (embedding_attr)")
    return getattr(inner, name)


# ------------------------------------------------------------------------------------------ EP
def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group)


def _expert_major_order(recv_counts: torch.Tensor, ep: int, El: int, total: int) -> torch.Tensor:
    """Received rows arrive rank-major (source rank r, then local expert j); the experts want them
    expert-major (j, then r), rank order kept within an expert. Built on the device, as a stable sort of
    each row's (expert, rank) key: a host-built index would be a pageable host-to-device copy per layer,
    and such a copy synchronises the stream. ``recv_counts``: [ep * El] rows per (r, j), on the device;
    ``total`` its sum, known on the host (no sync for the output size)."""
    seg_M = torch.repeat_interleave(torch.arange(ep * El, device=recv_counts.device), recv_counts,
                                    output_size=total)  # r * El + j per received row
    return torch.sort((seg_M % El) * ep + seg_M // El, stable=True).indices


class ExpertParallel:
    """A MoE layer's routed experts over the ``ep`` mesh dim (weights Shard(0) on the expert dim): the
    callable ``MoE.expert_parallel`` (x_TD, idx_TK, w_TK, experts) -> y_TD, set by ``apply_ep``."""

    def __init__(self, ep_group, ep_size: int, num_experts: int, backend: str):
        self.ep_group, self.ep_size, self.num_experts, self.backend = ep_group, ep_size, num_experts, backend
        self.tp_mesh = None  # with TP, each TP rank dispatches a disjoint slice of the (replicated) rows

    def __call__(self, x_TD, idx_TK, w_TK, experts):
        if self.tp_mesh is None:
            return self._dispatch(x_TD, idx_TK, w_TK, experts)
        # inside a TP region: rank r of the TP group sends only its contiguous slice of rows, so no
        # token reaches the experts twice; the zero-padded result is a partial sum that the region's
        # exit all-reduces
        tp, r = self.tp_mesh.size(), self.tp_mesh.get_local_rank()
        rows = torch.tensor_split(torch.arange(x_TD.shape[0], device=x_TD.device), tp)[r]
        y = self._dispatch(x_TD.index_select(0, rows), idx_TK.index_select(0, rows), w_TK.index_select(0, rows),
                           experts)
        return x_TD.new_zeros(x_TD.shape[0], y.shape[1]).index_copy(0, rows, y)

    def _dispatch(self, x_TD, idx_TK, w_TK, experts):
        ep, group = self.ep_size, self.ep_group
        wg, wu, wd = _swiglu_weights(experts, x_TD.dtype)
        E, El = self.num_experts, wg.shape[0]
        T, K = idx_TK.shape
        flat_M = idx_TK.reshape(-1)
        order_M = torch.sort(flat_M, stable=True).indices  # expert-major == destination-rank-major
        counts_E = torch.bincount(flat_M, minlength=E)
        x_MD = x_TD.unsqueeze(1).expand(T, K, x_TD.shape[1]).reshape(T * K, -1)[order_M]
        with torch.no_grad():  # counts: [rank r][local expert j] rows this rank receives
            recv = torch.empty_like(counts_E)
            dist.all_to_all_single(recv, counts_E, group=group)
            # the one host sync of the dispatch: the split sizes (both count tables in one copy)
            send_RE, recv_RE = torch.stack([counts_E, recv]).cpu().view(2, ep, El).unbind(0)
            perm = _expert_major_order(recv, ep, El, int(recv_RE.sum()))
        in_splits, out_splits = send_RE.sum(1).tolist(), recv_RE.sum(1).tolist()
        x_recv = _a2a(x_MD, out_splits, in_splits, group)
        # the model's expert compute on the received rows; the fast path's group offsets come from the
        # counts already on the device (a host list would be a pageable copy, which synchronises the stream)
        offs_El = recv.view(ep, El).sum(0).cumsum(0).to(torch.int32)
        y_sorted = grouped_experts(x_recv.index_select(0, perm), recv_RE.sum(0).tolist(), wg, wu, wd, self.backend,
                                   offs_El)
        y_recv = torch.empty_like(y_sorted).index_copy(0, perm, y_sorted)
        y_back = _a2a(y_recv, in_splits, out_splits, group)
        y_MD = torch.empty_like(y_back).index_copy(0, order_M, y_back)
        return _combine(y_MD, w_TK, T, K)


def apply_ep(model, ep_mesh) -> None:
    """Shard every MoE layer's routed experts over ``ep_mesh`` and give it the all-to-all dispatch."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep = ep_mesh.size()
    for moe in model.moe_layers():
        if moe.cfg.num_experts % ep:
            raise ValueError(f"num_experts={moe.cfg.num_experts} is not divisible by expert_parallel_degree={ep}")
        ex = moe.experts
        for name in expert_weights(ex):
            p = getattr(ex, name)
            ex.register_parameter(name, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)])))
        moe.expert_parallel = ExpertParallel(ep_mesh.get_group(), ep, moe.cfg.num_experts, moe.cfg.op_backend("moe"))


def expert_params(model) -> set:
    return {getattr(m.experts, n) for m in model.moe_layers() if m.expert_parallel is not None
            for n in expert_weights(m.experts)}


# ------------------------------------------------------------------------------------------ TP
def apply_tp(model, tp_mesh, sequence_parallel: bool = False) -> None:
    """Megatron-style tensor parallelism from outside the model (``harts.train.tensor_parallel``): per decoder
    layer the family's plan (``ling_plan`` / ``qwen35_plan``) distributes its parameters over ``tp_mesh``
    and runs the layer's own code on local views of them, with the two TP regions' boundaries (the layer
    norms' outputs in, the mixer's output projection and the FFN / MoE out) as parallel styles; nothing in
    the model is told that it is parallel (head counts are read off tensor shapes). Routed experts already
    sharded by expert parallelism (``apply_ep``, applied first) keep that sharding; each TP rank then
    dispatches a disjoint slice of the rows.

    Sequence parallelism: the residual stream and the layer norms hold this rank's rows (the rows are padded
    to a multiple of tp); the embeddings' output is split into row shards (``PrepareModuleOutput``) and the
    final norm's input all-gathered (``PrepareModuleInput``); embeddings and LM head stay whole."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module

    from harts.models.qwen35.blocks import DecoderLayer as Qwen35Layer
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
        ep = getattr(layer.mlp, "expert_parallel", None)
        plan = plan_of(layer, sequence_parallel=sequence_parallel, experts_sharded_elsewhere=ep is not None, tp=tp)
        parallelize_module(layer, tp_mesh, plan.pop(""))
        parallelize_module(layer, tp_mesh, plan)
        if ep is not None:  # inside a TP region: rank r of the TP group dispatches only its slice of the rows
            ep.tp_mesh = tp_mesh
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
    """Activation checkpointing policy of the decoder layers (``LingModel.checkpoint_policy``; Qwen3.5's is the
    same): "none", "selective" (keep the mixer cores' and matrix products' outputs, recompute norms, gates,
    RoPE, SwiGLU, routing; ``harts.models.ling.compile``) or "full" (torchtitan's 'full': recompute every layer whole).
    Layers with collectives (TP all-reduces, EP all-to-alls, CP exchanges) recompute without early stop, or
    ranks can stop at different collectives (observed: wrong gradients with TP x PP). "selective" runs a
    layer as regions that call its submodules directly, so TP hooks and expert parallelism are refused
    with a ValueError naming the layer."""
    from harts.models.ling.model import AC_POLICIES

    if mode not in AC_POLICIES:
        raise ValueError(f"activation checkpointing: checkpoint_policy = {mode!r}; expected one of {AC_POLICIES}")
    if mode == "selective":
        from harts.models.ling.compile import check_region_split

        for layer in model.decoder_layers():
            check_region_split(layer, "selective activation checkpointing")
    model.model.checkpoint_policy = mode
    model.model.checkpoint_early_stop = not collectives_in_layers


def apply_compile(model, backend: str = "inductor") -> list[str]:
    """torch.compile each decoder layer (``harts.models.ling.compile_model``: compiled per-row regions around
    the eager sequence-mixer cores, row counts dynamic) and return the compiled region names; the running
    count of compilations is ``model.compile_report`` (``.summary(steps)``). Applied after TP and
    activation checkpointing, before FSDP2. Tensor-parallel regions (hooks on the mixers and MLPs) and
    expert parallelism are refused with a ValueError naming the layer."""
    from harts.models.ling.compile import compile_model

    return list(compile_model(model, backend=backend, dynamic=True).regions)


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
