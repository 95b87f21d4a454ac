"""What the model benchmarks share: the workload step, the model, the baseline's sub-batches and the
op families of a profile, so every bench measures the same thing the same way."""
from __future__ import annotations

import argparse
import dataclasses

import torch

# Op families of a profile, by substrings of CUDA kernel / aten op names (lower-case); first match wins.
FAMILIES = (
    ("kda_state_scan", ("kda_round", "chunk_gated_delta_rule_fwd_kernel_h", "chunk_gated_delta_rule_bwd_kernel_dhu")),
    ("kda_other", ("kda", "chunk_", "wy_", "recompute_w_u", "l2norm", "gla", "solve_tril", "intra")),
    ("attention", ("flash", "fmha", "attention", "varlen", "attn")),
    # CUTLASS sm90 grouped GEMM: ...GroupProblemShape...
    ("moe_grouped_gemm", ("grouped", "_grouped_mm", "groupproblem")),
    ("logprobs", ("logprobs",)),
    ("softmax_logsumexp", ("softmax", "logsumexp")),
    ("gather_scatter_routing", ("index_select", "index_copy", "index_add", "gather", "scatter", "indexing", "index",
                                "sort", "topk", "radix", "bincount")),
    ("conv", ("conv",)),
    ("gemm", ("gemm", "matmul", "mm", "cutlass", "sm90", "nvjet", "cublas", "splitk")),
    ("communication", ("nccl", "all_to_all", "allreduce", "reduce_scatter", "all_gather")),
    ("elementwise_norm", ("elementwise", "vectorized", "unrolled", "reduce", "norm", "sigmoid", "silu", "mul", "add",
                          "copy", "fill", "cast", "cat")),
)


def family(name: str) -> str:
    n = name.lower()
    for fam, keys in FAMILIES:
        if any(k in n for k in keys):
            return fam
    return "other"


def add_workload_args(ap: argparse.ArgumentParser, *, scale: float) -> None:
    """The arguments every model bench takes: model preset, synthetic step, capacity, precision, device."""
    ap.add_argument("--preset", default="ling3-tiny")
    ap.add_argument("--workload", default="swe-step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=scale)
    ap.add_argument("--capacity", type=int, default=65536)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def workload_step(args):
    """The synthetic step, its token ids drawn from the model's vocabulary (the debug preset's is smaller
    than the workload's)."""
    from harts.data.synthetic import PRESETS, generate
    from harts.models.ling import LingConfig

    spec = dataclasses.replace(PRESETS[args.workload], vocab_size=LingConfig.preset(args.preset).vocab_size)
    return generate(spec, seed=args.seed, scale=args.scale, metadata=False)


def fullest_microbatch(step, plan) -> list:
    """The trajectories of the plan's microbatch with the most compact work."""
    mb = max(range(len(plan.microbatches)), key=lambda j: plan.work[j])
    return [step[i] for i in plan.microbatches[mb]]


def subbatches(trajs, capacity: int) -> list[list[int]]:
    """The baseline's packing: trajectories in order, a new sub-batch whenever ``capacity`` raw tokens fill."""
    out, cur, n = [], [], 0
    for i, t in enumerate(trajs):
        if cur and n + len(t) > capacity:
            out.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += len(t)
    out.append(cur)
    return out


def build_model(preset, device, dtype, seed: int = 0, recompute: bool = True, **overrides):
    """A seeded Ling model on ``device``: materialised from meta, initialised in fp32, cast to ``dtype``
    (A_log, dt_bias and the expert bias stay fp32). ``preset`` is a preset name or a LingConfig."""
    from harts.models.ling import LingConfig, LingForCausalLM

    cfg = preset if isinstance(preset, LingConfig) else LingConfig.preset(preset, recompute=recompute, **overrides)
    with torch.device("meta"):
        model = LingForCausalLM(cfg)
    model = model.to_empty(device=device)
    torch.manual_seed(seed)
    model.init_weights(seed)
    return model.cast_(dtype)
