"""Qwen35ForCausalLM: Qwen3.5-MoE (text) over a packed token stream or a compact HARTS batch.

Legend: T packed tokens (or compact rows), D hidden, V vocab.

The user surface is LingForCausalLM's: ``forward(input_ids_T, position_ids_T, cu_seqlens)`` or
``forward(layout=batch)`` returns the final-normed hidden states, ``logprobs(batch)`` scores a
``harts.CompactBatch`` (prefix-shared or trajectory-wise) without an [S, V] tensor, ``router_stats()`` /
``moe_counts()`` give the last forward's multiplicity-weighted router statistics, and
``from_pretrained`` / ``save_pretrained`` read and write HF folders (harts.models.qwen35.checkpoint), and
harts.models.common.generate decodes it incrementally (each layer's ``empty_cache`` and ``step``).
``model.compile()`` (``harts.models.ling.compile_model``) compiles the decoder layers as Ling's are (per-row
regions around the eager mixer cores: ``DecoderLayer.region_kind``), and ``model.model.checkpoint_policy``
("none" | "selective" | "full") is LingModel's activation checkpointing policy over the same regions.
Construct on ``torch.device("meta")`` for deferred init, then ``to_empty`` + ``init_weights``.
"""
from __future__ import annotations

import torch
from torch import nn

from harts.models.common.causal_lm import CausalLM
from harts.models.common.stack import DecoderStack
from harts.models.qwen35.blocks import DecoderLayer, RMSNorm, SparseMoE, init_module_weights
from harts.models.qwen35.config import Qwen35Config

__all__ = ["Qwen35Model", "Qwen35ForCausalLM"]

# kept in float32 (float64 for a float64 model) when the model is cast to a lower precision
FP32_PARAM_SUFFIXES = ("A_log", "dt_bias")


class Qwen35Model(DecoderStack):
    """The decoder stack; its forward, layer loop and activation checkpointing policy ("none" | "selective" |
    "full", over the pre / core / post regions of harts.models.common.compile) are DecoderStack's."""

    embedding_attr = "embed_tokens"

    def __init__(self, cfg: Qwen35Config):
        super().__init__(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen35ForCausalLM(CausalLM):
    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        if not isinstance(cfg, Qwen35Config):
            raise TypeError(f"Qwen35ForCausalLM needs a Qwen35Config, got {type(cfg).__name__}")
        self.config = cfg.validate()
        self.model = Qwen35Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.compile_report = None  # set by harts.models.ling.compile_model
        if self.lm_head.weight.device.type != "meta":
            self.init_weights()

    # ------------------------------------------------------------------ setup and I/O
    def init_weights(self, seed: int | None = None) -> "Qwen35ForCausalLM":
        """Scratch init (harts.models.qwen35.blocks.initial_value); with a seed every parameter draws from
        its own generator, so the result depends neither on module order nor on sharding."""
        init_module_weights(self, self.config, seed)
        return self

    def cast_(self, dtype: torch.dtype) -> "Qwen35ForCausalLM":
        """Cast parameters to ``dtype`` keeping A_log and dt_bias in float32 (float64 for float64)."""
        keep = torch.promote_types(dtype, torch.float32)
        for name, t in self.named_parameters():
            t.data = t.data.to(keep if name.endswith(FP32_PARAM_SUFFIXES) else dtype)
        return self

    # ------------------------------------------------------------------ MoE
    def moe_layers(self) -> list[SparseMoE]:
        return [l.mlp for l in self.decoder_layers()]

    def update_expert_bias(self, rate: float, counts_LE: torch.Tensor | None = None) -> None:
        raise ValueError("Qwen3.5-MoE routes by softmax without an expert bias: aux-loss-free bias updates do not "
                         "apply (set the trainer's expert-bias rate to 0; use the balance loss instead)")
