"""torch.compile as the execution engine of a Ling-3.0 or Qwen3.5-MoE model, applied from outside the model.

Legend: T rows (packed tokens or compact rows), D hidden.

``compile_model(model)`` compiles each decoder layer as two regions around its sequence mixer's core:

- ``pre``:  input_layernorm + the mixer's per-row projections (``MLA.project``: low-rank q / kv, their
  norms, RoPE, casts; ``KDA.project``: q / k / v / f, beta; Qwen3.5's ``GatedAttention.project``: q / gate /
  k / v, q / k norms, partial RoPE; ``GatedDeltaNet.project``: q|k|v, beta, the log decay).
- ``post``: the mixer's output (``output``: gate, gated norm, output projection) + residual +
  post_attention_layernorm + the MLP or MoE (``MoE.forward`` / ``SparseMoE.forward``: routing, routed
  experts, shared expert, combine) + residual.

A layer declares its region families (``DecoderLayer.region_kind``, a (pre, post) pair of names: Ling's
``("mla" | "kda", "moe" | "dense")``, Qwen3.5's ``("gated_attention" | "gdn", "sparse_moe")``); the regions
are the functions ``_pre_<pre>`` / ``_post_<post>`` below, so nothing here dispatches on module types. A
mixer's ``forward`` is ``output(core(*project(x, ...), batch), x)``; whatever ``core`` returns reaches
``output`` inside ``post`` (gated attention's core passes its gate on with its output).

Both families' layers run through the same regions; nothing here dispatches on a family's module types.

Between them the mixer's ``core`` runs eagerly on the batch description: the layout-specific parts
(``harts.runtime.compact.kda_tree`` / ``kda_rounds`` / ``mla_tree_attention`` and the tree convolution on a
CompactBatch, varlen attention, the short convolution and the chunked KDA / GDN on packed trajectories) read
host structures (planned rounds, cu_seqlens lists, data-dependent gathers), so tracing through them would
specialise on each microbatch's plan and recompile every step. Why not the whole core as one opaque custom
op so that a layer is one graph: the core's backward is the autograd of those loops (boundary states flowing
between rounds), which an op would have to recompute inside its own backward, and the batch description is
not a tensor. The split runs the same modules' code in the same order, so it is exact; it leaves the layout
code untouched, and a core can be replaced (e.g. by another attention implementation) without touching the
regions.

Inside the regions everything is traceable: the norms take their torch form under tracing (Inductor
generates the fused kernel, ``harts.ops.norm``), the grouped-GEMM MoE path is plain torch, and the MoE
reference (a host loop over the experts present) enters as the opaque op ``harts::moe_experts_reference``
(``harts.ops.moe.experts``). The router statistics leave ``post`` as outputs; ``MoE.finish`` records
them and joins the router loss to the layer output's backward eagerly (it reads the layer's index, which
would otherwise specialise the graph per layer).

Compilations. With ``dynamic=True`` the row dimension is symbolic: one graph per region serves every
row count. Layers share a region's code and enter its graphs with their parameters as inputs, so the
graphs are per layer *signature* (mixer kind, MLP kind, dtype, grad mode, with or without row
multiplicities), not per layer: a Ling model with dense and MoE layers of both mixer kinds compiles at
most 2 (pre) + 4 (post) graphs per (dtype, grad mode, multiplicities) whatever the number of layers and
steps; a Qwen3.5 model (GDN and gated attention, every layer MoE) at most 2 + 2. Each region has its own
code object per signature family (Qwen3.5's families too, though their code is Ling's), so torch's
per-code recompile limit (8) is never reached, even when one process compiles both families.
``CompileReport`` counts every graph handed to the backend (``compilations``, per region in ``by_region``)
and the seconds spent in the backend.

Order with the other parallelisms (torchtitan's): TP -> activation checkpointing -> compile -> FSDP2.
The regions call the layer's norms, its MLP / MoE and the mixer's projections as modules, so module hooks
there run inside them: tensor parallelism (``harts.train.tensor_parallel``) puts its region boundaries on
exactly those modules and its local parameter views on the layer, so a TP layer compiles and checkpoints
like a one-process one. Expert parallelism (``harts.train.expert_parallel``) is hooks on the MoE's experts
module; its all-to-all reads host split sizes, which Dynamo cannot trace, so with it the post regions are
compiled with ``fullgraph=False`` and break their graph around the experts (under selective checkpointing
the post regions then run eagerly: Dynamo does not break a checkpointed function's graph). Refused with
``ValueError``: hooks on the mixer module itself (bypassed: its ``project`` / ``core`` / ``output`` are
called).

Activation checkpointing (``LingModel.checkpoint_policy``) uses the same regions:

- ``"full"`` wraps each layer call (``LingModel.forward``) in ``torch.utils.checkpoint``, outside the
  compiled regions, whose forwards are rerun on recomputation: a whole extra forward per step.
- ``"selective"`` runs the layer as ``pre`` / core / ``post`` (``selective_layer_forward``) with the core
  outside any checkpoint and each region under an op-level policy (``SAC_SAVE_OPS``, torchtitan's selective
  AC): outputs of matrix products (``mm``, ``addmm``, ``bmm``, ``_grouped_mm``, the experts' fused
  SwiGLU-and-down-projection op ``harts::moe_swiglu_down``), of collectives, of the opaque MoE reference op
  and of ``topk`` (Qwen3.5's router: a selection kernel Inductor cannot fuse; its [T, K] output is small) and
  the norms' ``rsqrt`` (one number per row; ``_save_ops`` says why) are saved, every other op in the region
  (the norms' other ops, RoPE, gates, SwiGLU, casts, routing including Ling-3.0's selection sorts, which
  Inductor fuses, row gathers) is recomputed in backward. Why this split: the core is where the layout lives
  (host-side plans, Triton autograd Functions, which an op policy cannot see into: it would recompute a custom
  Function whole) and it is the expensive non-GEMM part of a layer (attention and the KDA chunk loop), so it
  is never recomputed; the GEMMs carry the FLOPs, so they are never recomputed either; what is recomputed is
  memory-bound elementwise work whose saved inputs would be the largest activations (fp32 norm and gate
  intermediates, the MoE's permuted rows and SwiGLU products). Recomputation reruns the same ops on the same
  saved inputs, so gradients are exact (bit-identical to no checkpointing in float64 on the reference ops,
  tested). Under ``compile_model`` the selective regions are compiled too (Dynamo traces the checkpoint as a
  higher-order op and the partitioner applies the same policy), with their own graphs (``pre_kda_sac``, ...),
  one code object per region family as above, so the counts are the same. The MoE region's router statistics
  leave its checkpoint as a tuple of tensors and become ``RouterStats`` outside it (``_sac_moe_region``):
  torch 2.11's Dynamo loses tensors that a compiled checkpointed function returns inside a dataclass ("Node
  output referenced nonexistent value"), a tuple it keeps, on 2.11 and 2.13 alike. Why not route outside the
  checkpoint: the statistics would then need the post-attention norm's output saved for the routing GEMM (a
  [T, D] activation per MoE layer that the policy recomputes), and the tuple crossing costs nothing. Hooks on
  the mixer module are refused for the same reason as for compile (``check_region_split``). The layer itself
  is still called as a module (``layer(..., selective=True)``), so hooks on it, FSDP2's parameter gathers, run
  as without checkpointing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import types
import weakref

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from harts.ops.moe import RouterStats

__all__ = ["CompileReport", "compile_model", "compiled_layer_forward", "selective_layer_forward", "SAC_SAVE_OPS",
           "check_region_split", "register_recompute_state"]

log = logging.getLogger("harts.models.common.compile")
_STATS_FIELDS = dataclasses.fields(RouterStats)


@dataclasses.dataclass
class CompileReport:
    """What ``compile_model`` did and what compiling has cost so far (updated as graphs compile).

    ``regions``: compiled region names (``model.layers.{i}.pre`` / ``.post``); ``compilations``: graphs
    compiled so far (all regions); ``by_region``: per region function (``pre_kda``, ``post_moe``, ...);
    ``compile_seconds``: seconds spent in the backend (graph lowering and code generation; Dynamo's
    tracing is not included)."""

    backend: str
    dynamic: bool | None
    regions: list[str] = dataclasses.field(default_factory=list)
    by_region: dict[str, int] = dataclasses.field(default_factory=dict)
    compile_seconds: float = 0.0

    @property
    def compilations(self) -> int:
        return sum(self.by_region.values())

    def summary(self, steps: int | None = None) -> str:
        over = f" over {steps} steps" if steps is not None else ""
        parts = ", ".join(f"{k} {v}" for k, v in sorted(self.by_region.items()))
        return (f"{self.compilations} compilations{over} ({parts or 'none yet'}), "
                f"{self.compile_seconds:.1f} s in the {self.backend} backend")


def _counting_backend(report: CompileReport, region: str, backend):
    """Wrap ``backend`` so every graph it compiles is counted against ``region``."""
    inner = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend

    def compile_graph(gm, example_inputs):
        t0 = time.perf_counter()
        out = inner(gm, example_inputs)
        report.compile_seconds += time.perf_counter() - t0
        report.by_region[region] = report.by_region.get(region, 0) + 1
        return out

    return compile_graph


# The regions: four bodies, each copied under its own code object per region family (``_REGIONS`` below),
# so each family has its own Dynamo code cache; the layer is an argument (its parameters become graph
# inputs), so every layer of a family shares the graphs.
def _pre_attention(layer: nn.Module, h_TD: torch.Tensor, position_ids_T: torch.Tensor):
    x_TD = layer.input_layernorm(h_TD)
    return x_TD, layer.attention.project(x_TD, position_ids_T)


def _pre_linear(layer: nn.Module, h_TD: torch.Tensor, position_ids_T: torch.Tensor):
    x_TD = layer.input_layernorm(h_TD)
    return x_TD, layer.attention.project(x_TD)


def _post_moe(layer: nn.Module, h_TD: torch.Tensor, x_TD: torch.Tensor, o: torch.Tensor,
              token_weight_T: torch.Tensor | None):
    h_TD = h_TD + layer.attention.output(o, x_TD)
    y_TD, stats = layer.mlp(layer.post_attention_layernorm(h_TD), token_weight_T)
    return h_TD + y_TD, stats


def _post_dense(layer: nn.Module, h_TD: torch.Tensor, x_TD: torch.Tensor, o: torch.Tensor,
                token_weight_T: torch.Tensor | None):
    h_TD = h_TD + layer.attention.output(o, x_TD)
    return h_TD + layer.mlp(layer.post_attention_layernorm(h_TD)), None


# The region families a layer can declare (``region_kind``): Ling-3.0's ``mla`` / ``kda`` and ``moe`` / ``dense``,
# Qwen3.5-MoE's ``gated_attention`` / ``gdn`` and ``sparse_moe``.
_PRE = {"mla": _pre_attention, "kda": _pre_linear, "gated_attention": _pre_attention, "gdn": _pre_linear}
_POST = {"moe": _post_moe, "dense": _post_dense, "sparse_moe": _post_moe}


def _own_code(fn, name: str):
    """``fn`` under a code object of its own, named ``name``: Dynamo keeps its graphs and guards per code
    object, so each region family compiles (and counts towards torch's recompile limit of 8 per code object)
    apart from the others, even where two families run the same body."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    out = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    out.__qualname__ = name
    return out


# Selective activation checkpointing of the regions (module docstring).
def _save_ops() -> frozenset:
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.topk.default,
           torch.ops.harts.grouped_experts_reference.default,
           # the norms' 1 / rms, one fp32 number per row: with it saved, a norm's backward row reduction (dx)
           # and column reduction (dw) no longer depend on each other (the dw pass read the sum of squares
           # that the dx pass recomputed), so Inductor may fuse them into one pass over x and dy
           # (mix-order reduction) instead of reading both twice
           aten.rsqrt.default}
    if hasattr(aten, "_grouped_mm"):
        ops.add(aten._grouped_mm.default)
    # tensor parallelism's region boundaries (harts.train.tensor_parallel): a collective's output is kept, so
    # a recomputation does not communicate again
    c10d = getattr(torch.ops, "_c10d_functional", None)
    for name in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor"):
        op = getattr(c10d, name, None) if c10d is not None else None
        if op is not None:
            ops.add(op.default)
    return frozenset(ops)


SAC_SAVE_OPS = _save_ops()
# Ops registered on first use (so not in the set above), saved by name: the routed experts' weighted SwiGLU
# with the down projection (harts.kernels.moe_swiglu), whose output is a matrix product's.
SAC_SAVE_OP_NAMES = frozenset({"harts::moe_swiglu_down"})


def _sac_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    saved = func in SAC_SAVE_OPS or (getattr(func, "namespace", None) == "harts" and func.name() in SAC_SAVE_OP_NAMES)
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def _sac_context():
    return create_selective_checkpoint_contexts(_sac_policy)


# Module state a recomputation must see as the forward saw it, by layer: context-manager factories entered
# around each eager recomputation of the layer's selective regions (``register_recompute_state``).
_RECOMPUTE_STATE: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()


def register_recompute_state(layer: nn.Module, context_factory) -> None:
    """Run every eager recomputation of ``layer``'s selective regions under ``context_factory()``.

    A region reads the layer's parameters when it runs. Whoever changes what a forward of the layer sees
    from outside, in hooks around the layer's call (tensor parallelism's local parameter views,
    ``harts.train.tensor_parallel``), registers the same change here, since a recomputation in backward
    runs after those hooks are done. Compiled regions recompute inside their graphs and need none."""
    _RECOMPUTE_STATE.setdefault(layer, []).append(context_factory)


@contextlib.contextmanager
def _recompute_under(factories, recompute):
    with contextlib.ExitStack() as stack:
        for f in factories:
            stack.enter_context(f())
        with recompute:
            yield


def _sac_context_for(layer: nn.Module):
    fwd, recompute = create_selective_checkpoint_contexts(_sac_policy)
    factories = _RECOMPUTE_STATE.get(layer)
    return (fwd, _recompute_under(factories, recompute)) if factories else (fwd, recompute)


def _sac(fn, layer, *args):
    if torch.compiler.is_compiling():
        return checkpoint(fn, layer, *args, use_reentrant=False, context_fn=_sac_context)
    return checkpoint(fn, layer, *args, use_reentrant=False, context_fn=lambda: _sac_context_for(layer))


def _sac_region(fn):
    def region(layer, *args):
        return _sac(fn, layer, *args)

    return region


def _sac_moe_region(fn):
    # The statistics cross the checkpoint as a tuple of tensors and become RouterStats outside it: torch 2.11's
    # Dynamo loses tensors a checkpointed function returns inside a dataclass ("Node output referenced
    # nonexistent value") when the region is compiled; a tuple it keeps.
    def fields(layer, *args):
        out_TD, stats = fn(layer, *args)
        return out_TD, tuple(getattr(stats, f.name) for f in _STATS_FIELDS)

    def region(layer, *args):
        out_TD, values = _sac(fields, layer, *args)
        return out_TD, RouterStats(*values)

    return region


def _regions() -> dict:
    """Every region function by name: ``pre_<family>`` / ``post_<family>`` and their selectively checkpointed
    ``..._sac`` forms, each under its own code object."""
    out = {}
    for kind, families in (("pre", _PRE), ("post", _POST)):
        for family, body in families.items():
            name = f"{kind}_{family}"
            sac = _sac_moe_region(body) if body is _post_moe else _sac_region(body)
            out[name], out[f"{name}_sac"] = _own_code(body, name), _own_code(sac, f"{name}_sac")
    return out


_REGIONS = _regions()


def _region_names(layer: nn.Module, suffix: str = "") -> tuple[str, str]:
    """The layer's (pre, post) region names from its declared ``region_kind`` (``DecoderLayer.region_kind`` of
    harts.models.ling.blocks / harts.models.qwen35.blocks); an unknown family is refused, naming the layer."""
    kind = getattr(layer, "region_kind", None)
    if not (isinstance(kind, tuple) and len(kind) == 2 and all(isinstance(k, str) for k in kind)):
        raise TypeError(f"{type(layer).__name__} declares no region_kind (a (pre, post) pair of family names), "
                        f"got {kind!r}: only decoder layers with a pre / core / post split can run as regions")
    names = f"pre_{kind[0]}{suffix}", f"post_{kind[1]}{suffix}"
    for name in names:
        if name not in _REGIONS:
            known = sorted(n for n in _REGIONS if not n.endswith("_sac"))
            raise ValueError(f"layer {getattr(layer, 'layer_idx', '?')}: region_kind {kind!r} names region "
                             f"{name!r}, which does not exist (regions: {known})")
    return names


def _layer_regions(layer: nn.Module, fns: dict, suffix: str = ""):
    pre, post = _region_names(layer, suffix)
    return fns[pre], fns[post]


def selective_layer_forward(layer: nn.Module):
    """The layer's forward under selective activation checkpointing (module docstring): its compiled
    selective regions if ``compile_model`` compiled it, else the eager ones."""
    fwd = layer.__dict__.get("selective_forward")
    if fwd is None:
        check_region_split(layer, "selective activation checkpointing")
        fwd = compiled_layer_forward(layer, *_layer_regions(layer, _REGIONS, "_sac"))
    return fwd


def compiled_layer_forward(layer: nn.Module, pre, post):
    """The layer's forward as compiled ``pre`` -> eager mixer core -> compiled ``post`` (the same
    computation as ``DecoderLayer.forward``)."""

    def forward(h_TD: torch.Tensor, batch, token_weight_T: torch.Tensor | None = None,
                router: tuple | None = None) -> torch.Tensor:
        x_TD, proj = pre(layer, h_TD, batch.local_rows(batch.position_ids))
        o = layer.attention.core(*proj, batch)
        out_TD, stats = post(layer, h_TD, x_TD, o, token_weight_T)
        return layer.mlp.finish(out_TD, stats, router) if stats is not None else out_TD

    return forward


def _with_selective(forward, selective_forward):
    """A compiled layer's forward with the ``selective`` switch of ``DecoderLayer.forward``: the layer is still
    called as a module under selective checkpointing, so hooks on the layer itself (FSDP2's) run."""

    def layer_forward(h_TD, batch, token_weight_T=None, router=None, *, selective: bool = False):
        return (selective_forward if selective else forward)(h_TD, batch, token_weight_T, router)

    return layer_forward


def check_region_split(layer: nn.Module, what: str = "compile_model") -> None:
    """Refuse (naming the layer) what running ``layer`` as pre / core / post regions would get wrong. The
    regions call the layer's norms, its MLP / MoE and the mixer's projections as modules, so hooks on those
    (tensor parallelism's region boundaries) run; the mixer module itself is never called (its ``project``,
    ``core`` and ``output`` are), so hooks on it would be bypassed."""
    _region_names(layer)
    mixer = layer.attention
    if mixer._forward_hooks or mixer._forward_pre_hooks:
        raise ValueError(f"layer {layer.layer_idx}: the sequence mixer module has forward hooks; {what} calls its "
                         "project / core / output directly and would bypass them: put such hooks on its "
                         "submodules, or run without it")


def compile_model(model: nn.Module, *, backend: str = "inductor", dynamic: bool | None = True,
                  fullgraph: bool = True) -> CompileReport:
    """Compile every decoder layer of ``model`` (a ``LingForCausalLM`` or ``Qwen35ForCausalLM``, whole or a pipeline
    stage) in place, as ``pre`` / eager core / ``post`` regions (module docstring), and return the report (also
    kept as ``model.compile_report``). ``backend``: a torch.compile backend name ("inductor", "eager",
    "aot_eager", ...); ``dynamic``: as torch.compile's (True: row counts symbolic from the first call);
    ``fullgraph``: refuse graph breaks inside a region. Compiling twice raises."""
    if not isinstance(backend, str) or not backend:
        raise TypeError(f"backend must be a torch.compile backend name, got {backend!r}")
    if dynamic not in (True, False, None):
        raise TypeError(f"dynamic must be True, False or None, got {dynamic!r}")
    if getattr(model, "compile_report", None) is not None:
        raise ValueError("model is already compiled (model.compile_report is set)")
    layers = model.decoder_layers()
    for layer in layers:
        check_region_split(layer)
    report = CompileReport(backend=backend, dynamic=dynamic)
    # torch.compile is lazy: the selective regions' graphs are built only if that policy runs
    fns = {name: torch.compile(fn, backend=_counting_backend(report, name, backend), dynamic=dynamic,
                               fullgraph=fullgraph) for name, fn in _REGIONS.items()}
    # Dynamo cannot break the graph of a checkpointed function: where a region may break (fullgraph=False, e.g.
    # expert parallelism's all-to-all in the MoE), the selectively checkpointed post region runs eagerly
    sac_fns = fns if fullgraph else {**fns, **{n: f for n, f in _REGIONS.items() if n.startswith("post_")}}
    for layer in layers:
        layer.selective_forward = compiled_layer_forward(layer, *_layer_regions(layer, sac_fns, "_sac"))
        layer.forward = _with_selective(compiled_layer_forward(layer, *_layer_regions(layer, fns)),
                                        layer.selective_forward)
        report.regions += [f"model.layers.{layer.layer_idx}.pre", f"model.layers.{layer.layer_idx}.post"]
    model.compile_report = report
    log.info("compiled %d decoder layers as pre/post regions (backend %s, dynamic=%s)", len(layers), backend,
             dynamic)
    return report
