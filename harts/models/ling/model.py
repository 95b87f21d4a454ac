"""LingForCausalLM: Ling-3.0 over a packed token stream (trajectory-wise path: varlen, no padding).

Legend: T packed tokens, D hidden, V vocab, N sequences (trajectories), S selected rows.

``forward(input_ids_T, position_ids_T, cu_seqlens)`` returns the final-normed hidden states [T, D];
positions are an explicit input (never derived inside attention) and every sequence mixer resets at the
``cu_seqlens`` boundaries. ``forward(layout=batch)`` runs a ``harts.CompactBatch`` through the same
layers (prefix-shared or trajectory-wise), and ``logprobs(batch)`` scores it: the trainer, the
benchmarks and library users all run this forward. A pipeline stage is this model pruned
(``harts.train.pipeline``): absent embeddings take ``hidden_PD`` as input, an absent norm passes
the hidden states on. The LM head is separate: ``token_logprobs`` (fused blocked GEMMs with an online
log-sum-exp, or the chunked reference) never builds a 64K x 157K fp32 logits tensor. Construct on
``torch.device("meta")`` for deferred init, then ``to_empty`` + ``init_weights``. ``model.compile()``
(``harts.models.ling.compile_model``) makes torch.compile the execution engine of the decoder
layers, applied in place from outside the layers.

Activation checkpointing is applied from outside (``harts.train.parallelize.apply_ac``, the trainer's
``[activation_checkpoint] mode``), not configured in the model: "none" (the default) keeps every activation;
"full" recomputes each decoder layer in backward (a whole extra forward); "selective" keeps the
sequence-mixer cores' and the matrix products' outputs and recomputes the rest of each layer
(``harts.models.common.compile``, "Activation checkpointing").
"""
from __future__ import annotations

import torch
from torch import nn

from harts.models.common.causal_lm import CausalLM
from harts.models.common.stack import DecoderStack
from harts.models.ling.blocks import DecoderLayer, MoE, RMSNorm, init_module_weights
from harts.models.ling.config import LingConfig

__all__ = ["LingModel", "LingForCausalLM"]

# kept in float32 when the model is cast to bf16 (as the official checkpoints do)
FP32_PARAM_SUFFIXES = ("A_log", "dt_bias", "expert_bias")


class LingModel(DecoderStack):
    embedding_attr = "word_embeddings"

    def __init__(self, cfg: LingConfig):
        super().__init__(cfg)
        # No padding_idx: the official nn.Embedding(padding_idx=<|endoftext|>) would freeze that row's grad.
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.op_backend("norm"))


class LingForCausalLM(CausalLM):
    def __init__(self, cfg: LingConfig):
        super().__init__()
        self.config = cfg.validate()
        self.model = LingModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.compile_report = None  # set by harts.models.ling.compile_model
        if self.lm_head.weight.device.type != "meta":
            self.init_weights()

    # ------------------------------------------------------------------ setup
    def init_weights(self, seed: int | None = None) -> "LingForCausalLM":
        init_module_weights(self, self.config, seed)
        return self

    def cast_(self, dtype: torch.dtype) -> "LingForCausalLM":
        """Cast parameters to ``dtype`` keeping A_log, dt_bias and the expert bias in float32 (or float64
        when casting to float64)."""
        keep = torch.promote_types(dtype, torch.float32)
        for name, t in list(self.named_parameters()) + list(self.named_buffers()):
            t.data = t.data.to(keep if name.endswith(FP32_PARAM_SUFFIXES) else dtype)
        return self

    # ------------------------------------------------------------------ MoE
    def moe_layers(self) -> list[MoE]:
        return [l.mlp for l in self.decoder_layers() if isinstance(l.mlp, MoE)]

    @torch.no_grad()
    def update_expert_bias(self, rate: float, counts_LE: torch.Tensor | None = None) -> None:
        """Aux-loss-free balancing: bias += rate * sign(mean(count) - count), then re-centre to zero mean.
        ``counts_LE`` defaults to the last forward's counts (pass all-reduced counts under data parallel)."""
        layers = self.moe_layers()
        if counts_LE is None:
            counts_LE = self.moe_counts()  # the last forward's (an error naming the fix before any forward)
        if counts_LE.shape[0] != len(layers):
            raise ValueError(f"counts for {counts_LE.shape[0]} layers, model has {len(layers)} MoE layers")
        for m, c in zip(layers, counts_LE):
            b = m.gate.expert_bias
            b += rate * torch.sign(c.mean() - c).to(b.dtype)
            b -= b.mean()
