"""Which Triton kernels Inductor writes for a compiled, selectively checkpointed region on an sm90 GPU, without
a GPU: the region is traced and partitioned on CPU, then its forward and backward graphs are lowered by
Inductor for a CUDA device described by fixed properties (H100: 132 SMs, compute capability 9.0), on fake
tensors, and the generated code is read instead of run.

    python -m benchmarks.inductor_kernels --region gated_rms_norm --rows 65536
    python -m benchmarks.inductor_kernels --region gated_rms_norm --rows 65536 --recompute rsqrt   # the other policy
    python -m benchmarks.inductor_kernels --region ling_router --rows 65536 --out DIR

Why: kernel fusion decides much of the compiled step's elementwise time, and it follows from the graph and
the checkpoint policy, not from the device. Here one can see, on the CPU machine, how many passes a norm's
backward makes over its rows or whether a selection became a Triton sort, before spending GPU time on the
step. What it does not show: times, the autotuned launch configurations, code that branches on the device
(traced on CPU, the router's logits GEMM takes its upcast CPU form), and any difference between this
torch's Inductor and the GPU image's (the fusion rules move between releases: the table names the torch it
ran on).

Regions (Ling-3.0-tiny sizes, bf16, under ``harts.models.common.compile``'s selective policy):
``rms_norm`` (RMSNorm [rows, 1536] feeding a projection, as in the pre regions), ``gated_rms_norm`` (KDA's
output norm over [rows, 16, 128] with its sigmoid gate, feeding o_proj), ``ling_router`` (the router's
selection on [rows, 128] scores: ``harts.ops.moe.route``). ``--recompute OP`` takes an ATen op out of the
policy's saved set (``SAC_SAVE_OPS``) to compare.

The run patches torch's CUDA queries in its own process, so run it as its own command (the tests do).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile

import torch

__all__ = ["region_kernels", "main"]

# H100 SXM (the GPU tests' and the launcher tables' machine); the H200 has the same SM count and capability
SM90 = dict(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132, total_memory=80 << 30,
            warp_size=32, max_threads_per_multi_processor=2048, regs_per_multiprocessor=65536,
            max_threads_per_block=1024, shared_memory_per_block_optin=232448, L2_cache_size=50 << 20,
            gcnArchName="sm_90", is_integrated=False)


def _region(name: str, rows: int):
    """(function, example inputs) of one region at ``rows`` rows."""
    from harts.models.ling import LingConfig
    from harts.ops.norm.reference import gated_rms_norm_reference, rms_norm_reference

    cfg = LingConfig.preset("ling3-tiny")
    D, H, K, eps = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
    g = torch.Generator().manual_seed(0)

    def param(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.bfloat16).requires_grad_()

    if name == "rms_norm":
        def f(x, w, W):
            return rms_norm_reference(x, w, eps) @ W.t()
        return f, (param(rows, D), param(D), param(cfg.q_lora_rank, D))
    if name == "gated_rms_norm":
        def f(o, gate, w, W):
            return gated_rms_norm_reference(o, gate, w, eps).flatten(1) @ W.t()
        return f, (param(rows, H, K), param(rows, H, K), param(K), param(D, H * K))
    if name == "ling_router":
        from harts.ops.moe import route

        def f(x, W, bias):
            _, _, idx, w = route(x, W, bias, n_group=cfg.n_group, topk_group=cfg.topk_group,
                                 top_k=cfg.num_experts_per_tok, routed_scaling_factor=cfg.routed_scaling_factor)
            return w, idx
        return f, (param(rows, D), param(cfg.num_experts, D), torch.zeros(cfg.num_experts))
    raise ValueError(f"unknown region {name!r}; known: rms_norm, gated_rms_norm, ling_router")


def _trace(fn, inputs):
    """The region under the selective policy, compiled with AOTAutograd's partitioner and Inductor's
    decompositions on CPU: returns [("forward" | "backward", GraphModule, example inputs)]."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch.utils.checkpoint import checkpoint

    from harts.models.common import compile as hc

    graphs = []

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs.append((kind, gm, list(example_inputs)))
            return gm
        return compiler

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                           partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())

    def region(*args):
        return checkpoint(fn, *args, use_reentrant=False, context_fn=hc._sac_context)

    out = torch.compile(region, backend=backend, fullgraph=True, dynamic=False)(*inputs)
    first = out[0] if isinstance(out, tuple) else out
    first.float().sum().backward()
    return graphs


class _Captured(Exception):
    pass


@contextlib.contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _fake_sm90():
    """torch's CUDA queries answered for one SM90 device, and Inductor's module loading stopped at the
    generated source (kept), so that lowering and code generation run without a GPU."""
    import torch._dynamo.utils as dynamo_utils
    import torch._inductor.codecache as codecache
    import torch._inductor.scheduler as scheduler
    import torch.utils._triton as torch_triton
    from torch._inductor.runtime.hints import DeviceProperties

    props = type("Props", (), dict(SM90))()
    dev = DeviceProperties(type="cuda", index=0, multi_processor_count=SM90["multi_processor_count"], cc=90,
                           major=9, regs_per_multiprocessor=SM90["regs_per_multiprocessor"],
                           max_threads_per_multi_processor=SM90["max_threads_per_multi_processor"],
                           max_threads_per_block=SM90["max_threads_per_block"], warp_size=32)
    sources: list[str] = []

    def load_by_key_path(key, path, *args, **kwargs):
        sources.append(open(path).read())
        raise _Captured

    @contextlib.contextmanager
    def no_rng():
        yield

    patches = [
        (DeviceProperties, "create", classmethod(lambda cls, device: dev)),
        (torch.cuda, "is_available", lambda: True), (torch.cuda, "device_count", lambda: 1),
        (torch.cuda, "current_device", lambda: 0), (torch.cuda, "set_device", lambda *a, **k: None),
        (torch.cuda, "get_device_capability", lambda *a, **k: (9, 0)),
        (torch.cuda, "get_device_properties", lambda *a, **k: props),
        (torch.cuda, "_exchange_device", lambda idx: 0), (torch.cuda, "_maybe_exchange_device", lambda idx: 0),
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (torch.cuda, "get_rng_state", lambda *a, **k: torch.zeros(16, dtype=torch.uint8)),
        (torch.cuda, "set_rng_state", lambda *a, **k: None),
        (dynamo_utils, "preserve_rng_state", no_rng),
        (scheduler, "has_triton", lambda: True), (torch_triton, "has_triton", lambda: True),
        (torch_triton, "triton_hash_with_backend", lambda: "sm90-without-a-device"),
        (torch_triton, "triton_backend", lambda: None),
        (codecache.PyCodeCache, "load_by_key_path", staticmethod(load_by_key_path)),
    ]
    saved = [(obj, attr, obj.__dict__.get(attr, getattr(obj, attr))) for obj, attr, _ in patches]
    try:
        for obj, attr, value in patches:
            setattr(obj, attr, value)
        yield sources
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)


def _kernels(source: str) -> dict:
    """The generated module's Triton kernels (kind, size hints, loads, stores), in launch order, and its
    extern (cuBLAS) and ATen fallback calls."""
    defs = {}
    for m in re.finditer(r"^(triton_\w+) = async_compile\.triton\('\w+', '''(.*?)'''", source, re.S | re.M):
        src = m.group(2)

        def meta(pattern):
            hit = re.search(pattern, src)
            return hit.group(1) if hit else None

        name = m.group(1)
        grid = meta(r"'grid_type': '(\w+)'")
        kind = {"poi": "pointwise", "red": "reduction (loop)", "per": "reduction (persistent)"}.get(
            name.split("_")[1], name.split("_")[1])
        if grid == "MixOrderReductionGrid":
            kind = "mix-order reduction"
        defs[name] = dict(kernel=name, kind=kind, size_hints=meta(r"size_hints=(\{[^}]*\})"),
                          loads=int(meta(r"'num_load': (\d+)") or 0), stores=int(meta(r"'num_store': (\d+)") or 0))
    call = source[source.find("def call("):]
    launches = [defs[n] for n in re.findall(r"^\s+(triton_\w+)\.run\(", call, re.M) if n in defs]
    return dict(triton=launches,
                extern=re.findall(r"^\s+extern_kernels\.(\w+)\(", call, re.M),
                aten_fallbacks=re.findall(r"torch\.ops\.aten\.(\w+)\.\w+\(", call))


def region_kernels(region: str, rows: int, recompute: tuple[str, ...] = ()) -> dict:
    """Forward and backward kernels of ``region`` at ``rows`` rows (module docstring)."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harts.models.common import compile as hc

    removed = set()
    for op in recompute:
        overload = getattr(getattr(torch.ops.aten, op, None), "default", None)
        if overload not in hc.SAC_SAVE_OPS:
            saved = sorted(str(o) for o in hc.SAC_SAVE_OPS)
            raise ValueError(f"--recompute {op!r}: aten.{op}.default is not one of the selective policy's saved ops "
                             f"({', '.join(saved)})")
        removed.add(overload)
    saved_ops, hc.SAC_SAVE_OPS = hc.SAC_SAVE_OPS, hc.SAC_SAVE_OPS - removed
    try:
        graphs = _trace(*_region(region, rows))
    finally:
        hc.SAC_SAVE_OPS = saved_ops
    out = dict(region=region, rows=rows, recompute=list(recompute), torch=torch.__version__,
               device=SM90["name"] + " (described, not present)", graphs={})
    # a cache of its own: no graph of an earlier run is reused, and nothing is left in the user's cache
    with tempfile.TemporaryDirectory() as cache, _env(TORCHINDUCTOR_CACHE_DIR=cache), _fake_sm90() as sources:
        for kind, gm, example_inputs in graphs:
            with FakeTensorMode(allow_non_fake_inputs=True):
                fake = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
                        if isinstance(t, torch.Tensor) else t for t in example_inputs]
            for node in gm.graph.nodes:  # factory calls traced on CPU
                if node.kwargs.get("device") == torch.device("cpu"):
                    node.kwargs = {**node.kwargs, "device": torch.device("cuda", 0)}
            gm.recompile()
            n = len(sources)
            try:
                compile_fx_inner(gm, fake, is_backward=kind == "backward")
            except Exception:  # the capture ends code generation by raising (Inductor may wrap it)
                if len(sources) == n:  # raised before any module was generated: a real error
                    raise
            if len(sources) != n + 1:
                raise RuntimeError(f"{region} {kind}: Inductor generated {len(sources) - n} modules, expected 1")
            out["graphs"][kind] = _kernels(sources[-1])
    return out


def print_table(r: dict) -> None:
    policy = "selective" + (f", recomputing {', '.join(r['recompute'])}" if r["recompute"] else "")
    print(f"{r['region']} at {r['rows']:,} rows ({policy}); Inductor of torch {r['torch']} for {r['device']}")
    for kind, g in r["graphs"].items():
        print(f"  {kind}: {len(g['triton'])} Triton kernels, extern {g['extern']}, ATen fallbacks "
              f"{g['aten_fallbacks'] or 'none'}")
        for k in g["triton"]:
            print(f"    {k['kind']:<24} loads {k['loads']:>2} stores {k['stores']:>2}  {k['size_hints']:<28} "
                  f"{k['kernel']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--region", required=True, choices=("rms_norm", "gated_rms_norm", "ling_router"))
    ap.add_argument("--rows", type=int, default=65536, help="rows of the region's input (default 65,536)")
    ap.add_argument("--recompute", action="append", default=[], metavar="OP",
                    help="an ATen op (e.g. rsqrt) taken out of the selective policy's saved set; repeatable")
    ap.add_argument("--out", help="folder for inductor_kernels.json")
    args = ap.parse_args(argv)
    if args.rows < 1:
        ap.error(f"--rows must be positive, got {args.rows}")
    r = region_kernels(args.region, args.rows, tuple(args.recompute))
    print_table(r)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "inductor_kernels.json"), "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
