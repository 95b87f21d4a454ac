"""What the model benchmarks share: the workload step, the model, the baseline's sub-batches and the
op families of a profile, so every bench measures the same thing the same way.

Model presets name their family (``harts.models.family``): ``qwen3.5-*`` presets build a ``Qwen35ForCausalLM``
(Gated DeltaNet + gated attention), ``ling3-*`` presets a ``LingForCausalLM`` (KDA + MLA). Both have the same
surface (``forward(layout=...)``, ``logprobs``, ``lm_head``, ``num_params``, ``cast_``, ``init_weights``), and a
compact batch is planned from the model's ``config.layout_geometry`` (``harts.pack(config=...)``), so the
benches need no model switch beyond ``harts.models.family.model_config``. The baseline's sub-batches are the
trainer's trajectory-wise grouping (``harts.train.data.plan_trajectory_wise``)."""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from harts.models.family import all_presets, model_class, model_config

# Op families of a profile, by substrings of CUDA kernel / aten op names (lower-case); first match wins.
FAMILIES = (
    ("kda_state_scan", ("kda_round", "chunk_gated_delta_rule_fwd_kernel_h", "chunk_gated_delta_rule_bwd_kernel_dhu")),
    ("kda_other", ("kda", "chunk_", "wy_", "recompute_w_u", "l2norm", "gla", "solve_tril", "intra")),
    # cuDNN's SDPA runs helper kernels beside its fprop/bprop (cudnn::fusion::compute_dot_do_o_specialized,
    # convert_dq_to_16bits); this codebase uses cuDNN only for attention
    ("attention", ("flash", "fmha", "attention", "varlen", "attn", "sdpa", "cudnn::fusion")),
    # CUTLASS sm90 grouped GEMM: ...GroupProblemShape...
    ("moe_grouped_gemm", ("grouped", "_grouped_mm", "groupproblem")),
    ("logprobs", ("logprobs",)),
    ("softmax_logsumexp", ("softmax", "logsumexp")),
    ("gather_scatter_routing", ("index_select", "index_copy", "index_add", "gather", "scatter", "indexing", "index",
                                "sort", "topk", "radix", "bincount")),
    ("conv", ("conv",)),
    ("gemm", ("gemm", "matmul", "mm", "cutlass", "sm90", "nvjet", "cublas", "splitk")),
    ("communication", ("nccl", "all_to_all", "allreduce", "reduce_scatter", "all_gather")),
    ("elementwise_norm", ("swiglu", "elementwise", "vectorized", "unrolled", "reduce", "norm", "sigmoid", "silu", "mul",
                          "add", "copy", "fill", "cast", "cat")),
)


def family(name: str) -> str:
    n = name.lower()
    for fam, keys in FAMILIES:
        if any(k in n for k in keys):
            return fam
    return "other"


def add_workload_args(ap: argparse.ArgumentParser, *, scale: float) -> None:
    """The arguments every model bench takes: model preset, synthetic step, capacity, precision, device."""
    ap.add_argument("--preset", default="ling3-tiny",
                    help=f"model preset (harts.models.family): {', '.join(all_presets())}")
    ap.add_argument("--workload", default="swe-step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=scale)
    ap.add_argument("--capacity", type=int, default=65536)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def chunk_size_of(cfg) -> int:
    """The chunk size of the linear mixer's rounds (KDA or GDN): the first entry of ``layout_geometry``."""
    return int(cfg.layout_geometry[0])


def workload_step(args, vocab_size: int | None = None):
    """The synthetic step, its token ids drawn from the model's vocabulary (``vocab_size``, default the
    preset's: the debug presets' is smaller than the workload's)."""
    from harts.data.synthetic import PRESETS, generate

    if args.workload not in PRESETS:
        raise ValueError(f"unknown workload {args.workload!r}; known: {sorted(PRESETS)}")
    if vocab_size is None:
        vocab_size = model_config(args.preset).vocab_size
    spec = dataclasses.replace(PRESETS[args.workload], vocab_size=vocab_size)
    return generate(spec, seed=args.seed, scale=args.scale, metadata=False)


def fullest_microbatch(step, plan) -> list:
    """The trajectories of the plan's microbatch with the most compact work."""
    mb = max(range(len(plan.microbatches)), key=lambda j: plan.work[j])
    return [step[i] for i in plan.microbatches[mb]]


def subbatches(trajs, capacity: int) -> list[list[int]]:
    """The baseline's sub-batches of ``trajs`` (index lists): the trainer's trajectory-wise grouping at DP 1
    (``harts.train.data.plan_trajectory_wise``: the fewest groups of <= ``capacity`` raw tokens by longest-first
    assignment), so the benchmarks' baseline is the one ``harts.enabled = false`` trains."""
    from harts.train.data import plan_trajectory_wise

    return plan_trajectory_wise([len(t) for t in trajs], dp_degree=1, capacity=capacity).microbatches


def in_subbatch_order(trajs, capacity: int) -> tuple[list, list[list[int]]]:
    """``trajs`` reordered so that each baseline sub-batch is a contiguous run, and the sub-batches as index lists
    into the reordered list: positions of the baseline's sub-batches, concatenated, are then in trajectory
    order, as HARTS's log-prob positions are."""
    order = [i for sb in subbatches(trajs, capacity) for i in sb]
    out, groups, n = [trajs[i] for i in order], [], 0
    for sb in subbatches(trajs, capacity):
        groups.append(list(range(n, n + len(sb))))
        n += len(sb)
    return out, groups


def build_model(preset, device, dtype, seed: int = 0, recompute: bool = True, **overrides):
    """A seeded model on ``device``: materialised from meta, initialised in fp32, cast to ``dtype`` (the
    decay parameters and Ling's expert bias stay fp32). ``preset`` is a preset name (its family's model,
    ``harts.models.family``) or a ready LingConfig / Qwen35Config."""
    from harts.train.parallelize import apply_ac

    cfg = model_config(preset, **overrides)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    model = model.to_empty(device=device)
    torch.manual_seed(seed)
    model.init_weights(seed)
    apply_ac(model, "full" if recompute else "none")
    return model.cast_(dtype)


def load_model(path, device, dtype, recompute: bool = False):
    """An HF checkpoint folder as a model of its family (config.json's ``model_type``, one of a family's
    ``hf_model_types``; any other goes to the Ling-3.0 loader, which names what it cannot read)."""
    import json
    import os

    from harts.models.family import FAMILIES as MODEL_FAMILIES

    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"checkpoint {path}: no config.json")
    with open(cfg_file) as f:
        model_type = str(json.load(f).get("model_type", ""))
    fam = next((f for f in MODEL_FAMILIES.values() if model_type in f.hf_model_types), MODEL_FAMILIES["ling3"])
    from harts.train.parallelize import apply_ac

    model = fam.load_pretrained(path, device=device, dtype=dtype)
    apply_ac(model, "full" if recompute else "none")
    return model


def time_ms(fn, warmup=2, reps=5, device="cuda"):
    """Median milliseconds of ``reps`` calls after ``warmup``: CUDA events on the GPU, wall clock on CPU."""
    if torch.device(device).type != "cuda":
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]
