"""The trainer's model: ``LingForCausalLM`` or ``Qwen35ForCausalLM`` itself, built with deterministic weights.

The ``[model]`` section's preset names the family (``harts.models.family.model_config``: ``qwen3.5-*`` presets
are Qwen3.5-MoE, ``ling3-*`` presets Ling-3.0). There is no trainer copy of the model: the trainer calls the
model's ``logprobs(batch, router)``, the same forward the benchmarks and library users run, and
harts.train.parallelize applies every parallelism from outside (TP/SP as DTensor parallel styles on Ling's
mixers, FFNs, embeddings and final norm; expert parallelism as the MoE's ``expert_parallel`` dispatch;
checkpointing; FSDP2). Pipeline stages are the same Ling model pruned (harts.train.pipeline). Router losses
(``harts.models.ling.blocks.router_term``) join each MoE layer's backward.
"""
from __future__ import annotations

import torch

from harts.models.ling import LingConfig, LingForCausalLM
from harts.models.ling.blocks import router_term
from harts.models.qwen35 import Qwen35Config, Qwen35ForCausalLM

__all__ = ["router_term", "build_policy", "init_sharded", "model_config", "is_qwen35", "state_dict_adapter", "DTYPES"]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def is_qwen35(cfg) -> bool:
    """True for a Qwen3.5-MoE config or model (Gated DeltaNet + gated attention), False for Ling-3.0."""
    return isinstance(getattr(cfg, "config", cfg), Qwen35Config)


def model_config(model) -> LingConfig | Qwen35Config:
    """The ``[model]`` section's model: the preset (``qwen3.5-*``: a Qwen35Config, ``ling3-*``: a LingConfig)
    with its backend and size overrides; ``model.kda_chunk_size`` sets the linear mixer's chunk size (KDA's, or
    GDN's ``gdn_chunk_size``). The trainer applies recomputation from outside (harts.train.parallelize.apply_ac)."""
    from harts.models.family import QWEN35, family_of
    from harts.models.family import model_config as preset_config

    if not isinstance(model.preset, str) or not model.preset:
        raise ValueError(f"model.preset = {model.preset!r} must name a model preset")
    qwen = family_of(model.preset) is QWEN35
    overrides = {"backend": model.backend}
    if model.num_hidden_layers:
        overrides["num_hidden_layers"] = model.num_hidden_layers
    if model.kda_chunk_size:
        overrides["gdn_chunk_size" if qwen else "kda_chunk_size"] = model.kda_chunk_size
    # Qwen3.5's linear mixer is GDN; 'kda' names it too (LingConfig-style settings keep working)
    ops = ("attention", "gdn", "kda", "conv", "moe", "logprobs", "norm") if qwen else \
        ("attention", "kda", "conv", "moe", "logprobs", "norm")
    for item in filter(None, (t.strip() for t in model.op_backends.split(","))):
        op, _, which = item.partition("=")
        op, which = op.strip(), which.strip()
        if op not in ops or not which:
            raise ValueError(f"model.op_backends: {item!r} is not op=backend with op one of {', '.join(ops)}")
        op = "gdn" if qwen and op == "kda" else op
        overrides[f"{op}_backend"] = which  # the model config checks the backend name
    return preset_config(model.preset, **overrides)


def state_dict_adapter(cfg: LingConfig | Qwen35Config, hf_assets_path: str | None = None):
    """The family's torchtitan state-dict adapter (HF layout <-> our names), reading the key layout of the HF
    folder ``hf_assets_path`` when given."""
    if is_qwen35(cfg):
        from harts.models.qwen35.checkpoint import Qwen35StateDictAdapter

        return Qwen35StateDictAdapter(cfg, hf_assets_path)
    from harts.models.ling.checkpoint import LingStateDictAdapter

    return LingStateDictAdapter(cfg, hf_assets_path)


def build_policy(cfg: LingConfig | Qwen35Config, *, device: torch.device, dtype: torch.dtype, seed: int,
                 on_meta: bool = False) -> LingForCausalLM | Qwen35ForCausalLM:
    """Build with deterministic weights: on the host (identical full tensors on every rank), or on the
    meta device (the caller shards, then ``init_sharded``)."""
    from harts.models.family import model_class

    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    if on_meta:
        return model.cast_(dtype)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    model.cast_(dtype)
    return model.to(device)


@torch.no_grad()
def init_sharded(model: LingForCausalLM | Qwen35ForCausalLM, device: torch.device, seed: int) -> None:
    """Materialise a meta-built, already parallelised model: each rank draws every tensor whole on
    ``device`` from that tensor's own generator (``param_seed``: model seed and qualified name) and keeps
    its shard. So replicated tensors agree across ranks (TP replicas, DP replicas), and every layout
    holds the weights of a one-process model initialised on the same device type (on one device:
    exactly ``init_weights(seed)``). Seeding each rank's shards with seed + rank instead would give TP
    ranks different replicas of the embeddings, LM head and router, and TP2 training would diverge from
    one process."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if is_qwen35(model):
        from harts.models.qwen35.blocks import initial_tensors
    else:
        from harts.models.ling.blocks import initial_tensors

    model.to_empty(device=device)
    for t, full in initial_tensors(model, model.config, seed):  # a DTensor's shape is global
        if isinstance(t, DTensor):  # no communication: every rank slices its own shard of the same tensor
            shard = distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None)
            t._local_tensor.copy_(shard._local_tensor)
        else:
            t.copy_(full)
