"""Tensor (and sequence) parallelism applied from outside the model, with DTensor parallel styles.

Megatron-style TP has two regions per decoder layer, the sequence mixer and the FFN / MoE. Inside a region
every rank computes its share (its heads, its FFN width) on plain local tensors; the model's code is the
one-process code, with head counts read off tensor shapes, so it neither knows nor is told that it runs in
parallel. Three styles (``torch.distributed.tensor.parallel.ParallelStyle``), composed per layer by the
family's plan (``ling_plan`` / ``qwen35_plan``) with ``parallelize_module``:

- ``LocalParams`` on the decoder layer: distributes the layer's parameters over the tp mesh (they stay
  DTensors for FSDP2, the optimizer and checkpoints) and, around each call of the layer, swaps in local
  views for the layer's code: a ``Shard`` parameter's local shard (its gradient is the shard's), a
  ``Replicate`` parameter's full value whose gradient is partial (it is used on this rank's heads, width or
  rows) and is summed over tp in backward, or a ``Segments`` parameter (a fused projection whose output is
  several head-major tensors side by side: Qwen3.5's GDN q|k|v and its experts' gate|up), kept whole on
  every rank, whose view is this rank's slice of every segment. Why one boundary around the layer rather
  than per-Linear styles: the mixers' cores (Triton kernels, the compact layout's rounds) and the fused
  norms take plain tensors, and the compiled / selectively checkpointed regions of a layer
  (``harts.models.common.compile``) call its submodules' code, so a DTensor would reach code that does not
  take one; with local views the same code runs eager, compiled and checkpointed.
- ``RegionInput`` on the module whose output enters a region (the two layer norms): identity forward
  (sequence parallelism: all-gather of the row shards), and in backward the sum over tp of the partial
  gradients of the region's consumers (SP: reduce-scatter into row shards).
- ``RegionOutput`` on a region's last module (the mixer's output projection, the FFN or MoE, whose first
  output is taken): the sum over tp of the partial outputs (SP: reduce-scatter into row shards), identity
  backward (SP: all-gather).

The router of a MoE layer runs whole on every rank; its loss term is seeded once per rank, so the trainer
scales the router-loss coefficients by 1 / tp (the router's gradient is a sum over the ranks).

Legend: T rows, D hidden, tp the tensor-parallel degree.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["Segments", "LocalParams", "RegionInput", "RegionOutput", "ling_plan", "qwen35_plan", "PARTIAL",
           "check_heads"]


@dataclasses.dataclass(frozen=True)
class Segments:
    """A parameter whose dim ``dim`` is several head-major segments of ``sizes`` side by side: stored whole
    (Replicate), each rank's view is the concatenation of its 1/tp slice of every segment."""

    dim: int
    sizes: tuple[int, ...]


class _Partial:
    """Marker: a Replicate parameter used on this rank's share of the work (partial gradient)."""

    def __repr__(self) -> str:
        return "PARTIAL"


PARTIAL = _Partial()


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (root.get_submodule(path) if path else root), attr


def _replicated_view(p: torch.Tensor) -> torch.Tensor:
    """The full value of a Replicate DTensor, its gradient partial: summed over the mesh in backward."""

    if isinstance(p, nn.Parameter):  # a leaf: enter through from_local so the all-reduce lands in its backward
        p = DTensor.from_local(p.to_local(), p.device_mesh, p.placements, run_check=False)
    return p.to_local(grad_placements=[Partial()] * len(p.placements))


def _local_view(p: torch.Tensor, spec) -> torch.Tensor:

    if not isinstance(p, DTensor):
        raise TypeError(f"tensor parallelism: expected a DTensor parameter, got {type(p).__name__}")
    if spec is PARTIAL:
        return _replicated_view(p)
    if isinstance(spec, Segments):
        full = _replicated_view(p)
        mesh = p.device_mesh
        r, n = mesh.get_local_rank(), mesh.size()
        return torch.cat([seg.tensor_split(n, spec.dim)[r] for seg in full.split(list(spec.sizes), spec.dim)],
                         spec.dim)
    return p.to_local()  # Shard: the shard's gradient is its own


def _storage(spec):

    if spec is PARTIAL or isinstance(spec, Segments):
        return Replicate()
    if isinstance(spec, Shard):
        return spec
    raise TypeError(f"tensor parallelism: unknown placement {spec!r} (Shard(d), PARTIAL or Segments)")


def _check_divisible(name: str, p: torch.Tensor, spec, tp: int) -> None:

    if isinstance(spec, Shard) and p.shape[spec.dim] % tp:
        raise ValueError(f"tensor parallelism: {name} has {p.shape[spec.dim]} rows on dim {spec.dim}, not divisible "
                         f"by tensor_parallel_degree={tp}")
    if isinstance(spec, Segments):
        for s in spec.sizes:
            if s % tp:
                raise ValueError(f"tensor parallelism: {name} has a segment of {s} on dim {spec.dim}, not divisible "
                                 f"by tensor_parallel_degree={tp}")


class LocalParams(ParallelStyle):
    """Distribute ``placements`` ({dotted parameter name: Shard(d) | PARTIAL | Segments}) of the module over
    the mesh and run the module's code on local views of them (module docstring)."""

    def __init__(self, placements: dict):
        super().__init__()
        self.placements = dict(placements)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:

        tp = device_mesh.size()
        targets = []
        for name, spec in self.placements.items():
            owner, attr = _owner(module, name)
            p = owner._parameters.get(attr)
            if p is None:
                raise ValueError(f"tensor parallelism: {type(module).__name__} has no parameter {name!r}")
            _check_divisible(name, p, spec, tp)
            dp = distribute_tensor(p.data, device_mesh, [_storage(spec)])
            owner.register_parameter(attr, nn.Parameter(dp, requires_grad=p.requires_grad))
            targets.append((owner, attr, spec))
        stack: list = []

        def swap_in(*_):
            saved = [(owner, attr, owner._parameters[attr]) for owner, attr, _ in targets]
            for (owner, attr, spec), (_, _, p) in zip(targets, saved):
                owner._parameters[attr] = _local_view(p, spec)
            stack.append(saved)

        def swap_out(*_):
            for owner, attr, p in stack.pop():
                owner._parameters[attr] = p

        @contextlib.contextmanager
        def local_views():
            swap_in()
            try:
                yield
            finally:
                swap_out()

        module.register_forward_pre_hook(swap_in)
        module.register_forward_hook(swap_out, always_call=True)
        # a selective checkpoint's recomputation in backward runs after these hooks: it gets the same views
        from harts.models.common.compile import register_recompute_state

        register_recompute_state(module, local_views)
        return module


def _region_in(x: torch.Tensor, mesh, sequence_parallel: bool) -> torch.Tensor:

    d = DTensor.from_local(x, mesh, [Shard(0) if sequence_parallel else Replicate()], run_check=False)
    if sequence_parallel:
        d = d.redistribute(mesh, [Replicate()])
    return d.to_local(grad_placements=[Partial()])


def _region_out(y: torch.Tensor, mesh, sequence_parallel: bool) -> torch.Tensor:

    d = DTensor.from_local(y, mesh, [Partial()], run_check=False)
    return d.redistribute(mesh, [Shard(0) if sequence_parallel else Replicate()]).to_local()


def _map_first(out, fn):
    if isinstance(out, tuple):
        return (fn(out[0]), *out[1:])
    return fn(out)


class _RegionBoundary(ParallelStyle):
    """A forward hook converting the module's (first) output at a TP region boundary (``_convert``)."""

    _convert = None  # (tensor, mesh, sequence_parallel) -> tensor

    def __init__(self, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        convert, sp = type(self)._convert, self.sequence_parallel
        module.register_forward_hook(lambda mod, args, out: _map_first(out, lambda t: convert(t, device_mesh, sp)))
        return module


class RegionInput(_RegionBoundary):
    """The module's output enters a TP region: forward identity (SP: all-gather rows), backward all-reduce
    of the partial gradient (SP: reduce-scatter)."""

    _convert = staticmethod(_region_in)


class RegionOutput(_RegionBoundary):
    """The module's (first) output leaves a TP region: forward all-reduce of the partial sums (SP:
    reduce-scatter into row shards), backward identity (SP: all-gather)."""

    _convert = staticmethod(_region_out)


# ------------------------------------------------------------------------------------------ plans
def _ffn(prefix: str) -> dict:

    return {f"{prefix}.gate_proj.weight": Shard(0), f"{prefix}.up_proj.weight": Shard(0),
            f"{prefix}.down_proj.weight": Shard(1)}


def _norms(layer: nn.Module, sequence_parallel: bool) -> dict:
    # under SP the layer norms run on row shards: their weights' gradients are partial
    return ({"input_layernorm.weight": PARTIAL, "post_attention_layernorm.weight": PARTIAL}
            if sequence_parallel else {})


def check_heads(family: str, tp: int, **heads: int) -> None:
    """Each rank holds whole heads: refuse (naming them) head counts that ``tp`` does not divide."""
    bad = [f"{k}={v}" for k, v in heads.items() if v % tp]
    if bad:
        raise ValueError(f"tensor parallelism: {family} {', '.join(bad)} must be divisible by "
                         f"tensor_parallel_degree={tp}")


def ling_plan(layer: nn.Module, *, sequence_parallel: bool, experts_sharded_elsewhere: bool, tp: int) -> dict:
    """{module path: style} of one Ling-3.0 decoder layer (KDA or MLA mixer, dense FFN or MoE).
    ``experts_sharded_elsewhere``: the routed experts are already distributed (expert parallelism)."""

    from harts.models.ling.blocks import MoE

    c = layer.attention.cfg
    check_heads("Ling-3.0", tp, num_attention_heads=c.num_attention_heads)
    sp = sequence_parallel
    params = _norms(layer, sp)
    a = layer.attention
    if layer.kind == "kda":
        params |= {f"attention.{n}.weight": Shard(0) for n in ("q_proj", "k_proj", "v_proj", "f_proj", "b_proj",
                                                               "g_proj", "q_conv1d", "k_conv1d", "v_conv1d")}
        params |= {"attention.A_log": Shard(0), "attention.dt_bias": Shard(0), "attention.o_norm.weight": PARTIAL,
                   "attention.o_proj.weight": Shard(1)}
        out = "attention.o_proj"
    else:
        params |= {"attention.kv_a_proj_with_mqa.weight": PARTIAL, "attention.kv_a_layernorm.weight": PARTIAL,
                   "attention.kv_b_proj.weight": Shard(0), "attention.g_proj.weight": Shard(0),
                   "attention.dense.weight": Shard(1)}
        if hasattr(a, "q_proj"):
            params["attention.q_proj.weight"] = Shard(0)
        else:
            params |= {"attention.q_a_proj.weight": PARTIAL, "attention.q_a_layernorm.weight": PARTIAL,
                       "attention.q_b_proj.weight": Shard(0)}
        out = "attention.dense"
    if isinstance(layer.mlp, MoE):
        params |= _ffn("mlp.shared_experts") | {"mlp.gate.weight": PARTIAL}
        if not experts_sharded_elsewhere:
            params |= {"mlp.experts.gate_up_proj": Shard(2), "mlp.experts.down_proj": Shard(2)}
    else:
        params |= _ffn("mlp")
    return {"": LocalParams(params), "input_layernorm": RegionInput(sp), "post_attention_layernorm": RegionInput(sp),
            out: RegionOutput(sp), "mlp": RegionOutput(sp)}


def qwen35_plan(layer: nn.Module, *, sequence_parallel: bool, experts_sharded_elsewhere: bool, tp: int) -> dict:
    """{module path: style} of one Qwen3.5-MoE decoder layer (GDN or gated attention, sparse MoE)."""

    c = layer.attention.cfg
    check_heads("Qwen3.5-MoE", tp, num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.num_key_value_heads, linear_num_key_heads=c.linear_num_key_heads,
                linear_num_value_heads=c.linear_num_value_heads)
    sp = sequence_parallel
    params = _norms(layer, sp)
    if layer.kind == "gdn":
        g = layer.linear_attn
        qkv = Segments(0, (g.key_dim, g.key_dim, g.value_dim))
        params |= {"linear_attn.in_proj_qkv.weight": qkv, "linear_attn.conv1d.weight": qkv,
                   "linear_attn.in_proj_z.weight": Shard(0), "linear_attn.in_proj_b.weight": Shard(0),
                   "linear_attn.in_proj_a.weight": Shard(0), "linear_attn.dt_bias": Shard(0),
                   "linear_attn.A_log": Shard(0), "linear_attn.norm.weight": PARTIAL,
                   "linear_attn.out_proj.weight": Shard(1)}
        out = "linear_attn.out_proj"
    else:
        params |= {"self_attn.q_proj.weight": Shard(0), "self_attn.k_proj.weight": Shard(0),
                   "self_attn.v_proj.weight": Shard(0), "self_attn.q_norm.weight": PARTIAL,
                   "self_attn.k_norm.weight": PARTIAL, "self_attn.o_proj.weight": Shard(1)}
        out = "self_attn.o_proj"
    moe = layer.mlp
    params |= _ffn("mlp.shared_expert") | {"mlp.gate.weight": PARTIAL, "mlp.shared_expert_gate.weight": PARTIAL}
    if not experts_sharded_elsewhere:
        Fw = moe.experts.down_proj.shape[-1]
        params |= {"mlp.experts.gate_up_proj": Segments(1, (Fw, Fw)), "mlp.experts.down_proj": Shard(2)}
    return {"": LocalParams(params), "input_layernorm": RegionInput(sp), "post_attention_layernorm": RegionInput(sp),
            out: RegionOutput(sp), "mlp": RegionOutput(sp)}
