"""Qwen35ForCausalLM: Qwen3.5-MoE (text) over a packed token stream or a compact HARTS batch.

Legend: T packed tokens (or compact rows), D hidden, V vocab.

The user surface is LingForCausalLM's: ``forward(input_ids_T, position_ids_T, cu_seqlens)`` or
``forward(layout=batch)`` returns the final-normed hidden states, ``logprobs(batch)`` scores a
``harts.CompactBatch`` (prefix-shared or trajectory-wise) without an [S, V] tensor, ``router_stats()`` /
``moe_counts()`` give the last forward's multiplicity-weighted router statistics, and
``from_pretrained`` / ``save_pretrained`` read and write HF folders (harts.models.qwen35.checkpoint), and
harts.models.ling.generate decodes it incrementally (each layer's ``empty_cache`` and ``step``).
``model.compile()`` (``harts.models.ling.compile_model``) compiles the decoder layers as Ling's are (per-row
regions around the eager mixer cores: ``DecoderLayer.region_kind``), and ``model.model.checkpoint_policy``
("none" | "selective" | "full") is LingModel's activation checkpointing policy over the same regions.
Construct on ``torch.device("meta")`` for deferred init, then ``to_empty`` + ``init_weights``.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from harts.models.causal_lm import CausalLM
from harts.models.ling.compile import compile_model
from harts.models.ling.model import LingModel, _check_packed, _check_token_ids
from harts.models.qwen35.blocks import DecoderLayer, Packed, RMSNorm, SparseMoE, init_module_weights
from harts.models.qwen35.config import Qwen35Config

__all__ = ["Qwen35Model", "Qwen35ForCausalLM"]

# kept in float32 (float64 for a float64 model) when the model is cast to a lower precision
FP32_PARAM_SUFFIXES = ("A_log", "dt_bias")


class Qwen35Model(nn.Module):
    embedding_attr = "embed_tokens"  # the token embedding's attribute (None on later pipeline stages)

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.checkpoint_policy, self.checkpoint_early_stop = ("full" if cfg.recompute else "none"), True

    # Activation checkpointing is LingModel's policy (``AC_POLICIES``, harts.train.parallelize.apply_ac sets it):
    # "none", "selective" (the layer's pre / core / post regions under the op-level save policy of
    # harts.models.ling.compile) or "full" (every layer recomputed whole); ``checkpoint_layers`` is "full" or not.
    checkpoint_policy = LingModel.checkpoint_policy
    checkpoint_layers = LingModel.checkpoint_layers
    run_layers = LingModel.run_layers

    def forward(self, input_ids_T=None, position_ids_T=None, cu_seqlens=None, token_weight_T=None, max_seqlen=None,
                *, layout=None, router: tuple | None = None, hidden_PD: torch.Tensor | None = None) -> torch.Tensor:
        """As LingModel.forward: a pipeline stage (harts.train.pipeline) without embeddings takes the previous
        stage's rows ``hidden_PD``, one without the final norm passes its hidden states on."""
        if layout is None and input_ids_T is not None and not isinstance(input_ids_T, torch.Tensor):
            layout, input_ids_T = input_ids_T, None
        if layout is not None:
            from harts.runtime.compact import check_batch

            check_batch(layout, self.cfg)
            batch, input_ids_T = layout, layout.local_rows(layout.input_ids)
            token_weight_T = layout.local_rows(layout.multiplicity)
            if self.embed_tokens is not None and (layout.vocab_size is None or layout.vocab_size > self.cfg.vocab_size):
                where, unit = "CompactBatch.input_ids", ("physical row" if layout.prefix_sharing else "position")
                _check_token_ids(input_ids_T, self.cfg.vocab_size, where=where, unit=unit)
        else:
            if input_ids_T is None or position_ids_T is None or cu_seqlens is None:
                raise TypeError("forward needs (input_ids_T, position_ids_T, cu_seqlens) or layout=CompactBatch")
            _check_packed(input_ids_T, position_ids_T, cu_seqlens)
            if self.embed_tokens is not None:
                _check_token_ids(input_ids_T, self.cfg.vocab_size, cu_seqlens)
            batch = Packed(position_ids_T, cu_seqlens, max_seqlen)
        if self.embed_tokens is not None:
            h_TD = self.embed_tokens(input_ids_T)
        elif hidden_PD is None:
            raise ValueError("this pipeline stage has no embeddings: pass the previous stage's hidden_PD")
        else:
            h_TD = hidden_PD
        return self.run_layers(h_TD, batch, token_weight_T, router)


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
    def compile(self, *, backend: str = "inductor", dynamic: bool | None = True, fullgraph: bool = True):
        """torch.compile every decoder layer in place (``harts.models.ling.compile.compile_model``: compiled
        per-row regions around the eager GDN / attention cores) and return its ``CompileReport``."""
        return compile_model(self, backend=backend, dynamic=dynamic, fullgraph=fullgraph)

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

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **kwargs) -> "Qwen35ForCausalLM":
        """An HF folder (ours, transformers' ``Qwen3_5MoeForCausalLM``, or the released multimodal layout's
        text part); keyword arguments: see ``harts.models.qwen35.checkpoint.load_pretrained``."""
        from harts.models.qwen35.checkpoint import load_pretrained

        return load_pretrained(path, **kwargs)

    def save_pretrained(self, path: str | os.PathLike, **kwargs) -> None:
        """config.json + safetensors shards that transformers' ``Qwen3_5MoeForCausalLM`` loads."""
        from harts.models.qwen35.checkpoint import save_pretrained

        save_pretrained(self, path, **kwargs)

    # ------------------------------------------------------------------ MoE
    def moe_layers(self) -> list[SparseMoE]:
        return [l.mlp for l in self.decoder_layers()]

    def update_expert_bias(self, rate: float, counts_LE: torch.Tensor | None = None) -> None:
        raise ValueError("Qwen3.5-MoE routes by softmax without an expert bias: aux-loss-free bias updates do not "
                         "apply (set the trainer's expert-bias rate to 0; use the balance loss instead)")
