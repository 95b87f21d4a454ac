"""What the model benchmarks share: the workload step, the model, the baseline's sub-batches and the
op families of a profile, so every bench measures the same thing the same way.

Model presets name their family: ``qwen3.5-*`` presets build a ``Qwen35ForCausalLM`` (Gated DeltaNet +
gated attention), every other name a ``LingForCausalLM`` (KDA + MLA). Both have the same surface
(``forward(layout=...)``, ``logprobs``, ``lm_head``, ``num_params``, ``cast_``, ``init_weights``), and a
compact batch is planned from the model's ``config.layout_geometry`` (``harts.pack(config=...)``), so the
benches need no model switch beyond ``model_config``."""
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
    ap.add_argument("--preset", default="ling3-tiny",
                    help="model preset: a LingConfig preset (ling3-tiny, ling3-tiny-debug, ...) or a Qwen35Config "
                         "one (qwen3.5-35b-a3b, qwen3.5-8l, qwen3.5-debug)")
    ap.add_argument("--workload", default="swe-step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=scale)
    ap.add_argument("--capacity", type=int, default=65536)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


QWEN35_PREFIX = "qwen3.5"


def model_config(preset, **overrides):
    """The model config of a preset name (``qwen3.5-*``: Qwen35Config, else LingConfig), or ``preset`` itself
    when it already is a config (then ``overrides`` must be empty)."""
    from harts.models.ling import LingConfig
    from harts.models.qwen35 import Qwen35Config

    if isinstance(preset, (LingConfig, Qwen35Config)):
        if overrides:
            raise TypeError(f"model_config: overrides {sorted(overrides)} given with a ready "
                            f"{type(preset).__name__}; apply them to the config instead")
        return preset
    if not isinstance(preset, str):
        raise TypeError(f"model preset must be a preset name or a LingConfig / Qwen35Config, got "
                        f"{type(preset).__name__}")
    if preset.startswith(QWEN35_PREFIX):
        return Qwen35Config.preset(preset, **overrides)
    return LingConfig.preset(preset, **overrides)


def model_class(cfg):
    """The causal-LM class of a config (LingForCausalLM or Qwen35ForCausalLM)."""
    from harts.models.ling import LingConfig, LingForCausalLM
    from harts.models.qwen35 import Qwen35Config, Qwen35ForCausalLM

    if isinstance(cfg, Qwen35Config):
        return Qwen35ForCausalLM
    if isinstance(cfg, LingConfig):
        return LingForCausalLM
    raise TypeError(f"no model class for a {type(cfg).__name__}; expected LingConfig or Qwen35Config")


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
    """A seeded model on ``device``: materialised from meta, initialised in fp32, cast to ``dtype`` (the
    decay parameters and Ling's expert bias stay fp32). ``preset`` is a preset name (``qwen3.5-*`` builds a
    Qwen35ForCausalLM, any other a LingForCausalLM) or a ready LingConfig / Qwen35Config."""
    if isinstance(preset, str):
        cfg = model_config(preset, recompute=recompute, **overrides)
    else:
        cfg = model_config(preset, **overrides)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    model = model.to_empty(device=device)
    torch.manual_seed(seed)
    model.init_weights(seed)
    return model.cast_(dtype)


def load_model(path, device, dtype, recompute: bool = False):
    """An HF checkpoint folder as a model of its family (config.json's ``model_type``: ``qwen3_5_moe*`` loads a
    Qwen35ForCausalLM, anything else goes to the Ling loader, which names what it cannot read)."""
    import json
    import os

    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"checkpoint {path}: no config.json")
    with open(cfg_file) as f:
        model_type = str(json.load(f).get("model_type", ""))
    if model_type.startswith("qwen3_5_moe"):
        from harts.models.qwen35.checkpoint import load_pretrained
    else:
        from harts.models.ling.checkpoint import load_pretrained
    return load_pretrained(path, device=device, dtype=dtype, recompute=recompute)
