"""Ling-3.0 (BailingMoeV3, HF model_type ``bailing_hybrid``) configuration.

Field names follow the released ``config.json`` so that a checkpoint's config round-trips through
``to_hf_dict`` / ``from_hf_dict``. Values of the ``ling3-tiny`` preset are the public Ling-3.0-tiny ones
(see ../shared/notes/ling3-architecture.md section 1); ``ling3-tiny-debug`` keeps every structural
feature (3 KDA + 1 MLA groups, dense first layer, q_lora, grouped sigmoid router with expert bias,
shared expert) at sizes a 2-core CPU runs in seconds, with a 16-token KDA chunk so tests cross chunk
boundaries.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["LingConfig"]


@dataclass
class LingConfig:
    vocab_size: int = 157184
    hidden_size: int = 1536
    num_hidden_layers: int = 24
    num_attention_heads: int = 16  # MLA heads and KDA heads
    head_dim: int = 128  # KDA head dim (q/k/v width = heads * head_dim)
    layer_group_size: int = 4  # last layer of every group is MLA; ragged tail is MLA
    intermediate_size: int = 4608  # dense SwiGLU width (first_k_dense_replace layers)
    first_k_dense_replace: int = 1
    # MoE
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    num_shared_experts: int = 1
    moe_shared_expert_intermediate_size: int = 512
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    # MLA
    q_lora_rank: int | None = 256
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 6_000_000.0
    max_position_embeddings: int = 131072
    # KDA
    short_conv_kernel_size: int = 4
    kda_lower_bound: float = -5.0
    kda_chunk_size: int = 64
    # misc
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    pad_token_id: int | None = 156892
    bos_token_id: int | None = 156891
    eos_token_id: int | None = 156895
    # HARTS-only knobs (not written to config.json)
    recompute: bool = False  # full activation recomputation per block (torch.utils.checkpoint)
    backend: str = "auto"  # "auto" | "reference" | "fast"; see harts.ops.backend
    # per-op overrides of ``backend`` (None = use ``backend``)
    attention_backend: str | None = None
    kda_backend: str | None = None
    conv_backend: str | None = None
    moe_backend: str | None = None
    logprobs_backend: str | None = None  # fused Triton compact log-probs vs the chunked torch reference
    norm_backend: str | None = None  # fla's fused Triton RMSNorm / gated RMSNorm vs torch ops
    logprobs_chunk_size: int = 4096

    # ---------------------------------------------------------------- derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def op_backend(self, op: str) -> str:
        """Requested backend for op in ('attention', 'kda', 'conv', 'moe', 'logprobs', 'norm')."""
        v = getattr(self, f"{op}_backend")
        return self.backend if v is None else v

    def layer_type(self, i: int) -> str:
        """'mla' or 'kda' for 0-based layer i (official rule, incl. the ragged-tail-is-MLA clause)."""
        g, n = self.layer_group_size, self.num_hidden_layers
        return "mla" if (i + 1) % g == 0 or i >= n // g * g else "kda"

    def mlp_type(self, i: int) -> str:
        return "dense" if i < self.first_k_dense_replace else "moe"

    def validate(self) -> "LingConfig":
        if self.num_experts % self.n_group:
            raise ValueError(f"num_experts={self.num_experts} not divisible by n_group={self.n_group}")
        per_group = self.num_experts // self.n_group
        if per_group < 2:
            raise ValueError("group score uses the top-2 experts of each group: need >= 2 experts per group")
        if self.topk_group * per_group < self.num_experts_per_tok:
            raise ValueError("topk_group groups hold fewer experts than num_experts_per_tok")
        if self.kda_chunk_size <= 0:
            raise ValueError(f"kda_chunk_size={self.kda_chunk_size}")
        if not (-5.0 <= self.kda_lower_bound < 0):
            raise ValueError(f"kda_lower_bound={self.kda_lower_bound} must lie in [-5, 0)")
        if self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even (interleaved RoPE pairs)")
        for name in ("backend", "attention_backend", "kda_backend", "conv_backend", "moe_backend", "logprobs_backend",
                     "norm_backend"):
            v = getattr(self, name)
            if v not in ("auto", "reference", "fast") and not (v is None and name != "backend"):
                raise ValueError(f"{name}={v!r}: expected 'auto', 'reference' or 'fast'")
        return self

    # ---------------------------------------------------------------- presets
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "LingConfig":
        if name == "ling3-tiny":
            cfg = cls()
        elif name == "ling3-tiny-debug":
            cfg = cls(
                vocab_size=512,
                hidden_size=64,
                num_hidden_layers=8,  # 2 groups of (3 KDA + 1 MLA)
                num_attention_heads=4,
                head_dim=16,
                intermediate_size=128,
                num_experts=16,
                num_experts_per_tok=4,
                moe_intermediate_size=32,
                moe_shared_expert_intermediate_size=32,
                n_group=4,
                topk_group=2,
                q_lora_rank=32,
                kv_lora_rank=32,
                qk_nope_head_dim=16,
                qk_rope_head_dim=8,
                v_head_dim=16,
                rope_theta=10000.0,
                max_position_embeddings=4096,
                kda_chunk_size=16,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
                logprobs_chunk_size=64,
            )
        else:
            raise ValueError(f"unknown LingConfig preset {name!r}; known: 'ling3-tiny', 'ling3-tiny-debug'")
        return dataclasses.replace(cfg, **overrides).validate()

    # ---------------------------------------------------------------- HF config.json
    _HARTS_ONLY = ("recompute", "backend", "attention_backend", "kda_backend", "conv_backend", "moe_backend",
                   "logprobs_backend", "norm_backend", "logprobs_chunk_size", "kda_chunk_size")

    def to_hf_dict(self) -> dict[str, Any]:
        """The released config.json keys (plus the aliases transformers' BailingHybridConfig reads)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in self._HARTS_ONLY}
        d.update(
            architectures=["BailingMoeV3ForCausalLM"],
            model_type="bailing_hybrid",
            hidden_act="silu",
            num_key_value_heads=self.num_attention_heads,
            n_shared_experts=self.num_shared_experts,
            num_local_experts=self.num_experts,
            score_function="sigmoid",
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            moe_router_enable_expert_bias=True,
            router_dtype="fp32",
            gated_attention_proj_granularity_type="head_wise",
            rope_interleave=True,
            rope_scaling=None,
            no_kda_lora=True,
            use_kda_lora=False,
            kda_safe_gate=True,
            num_kv_heads_for_linear_attn=0,
            use_bias=False,
            use_qkv_bias=False,
            num_nextn_predict_layers=0,
            mtp_loss_scaling_factor=0.0,
            torch_dtype="bfloat16",
        )
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **overrides: Any) -> "LingConfig":
        """Read a released config.json; unsupported variants raise instead of silently changing the model."""
        checks = {
            "kda_safe_gate": True,
            "rope_interleave": True,
            "rope_scaling": None,
            "use_qkv_bias": False,
            "use_bias": False,
            "tie_word_embeddings": False,
        }
        for k, want in checks.items():
            if k in d and d[k] != want:
                raise ValueError(f"config.json: {k}={d[k]!r} is not supported (HARTS implements {k}={want!r})")
        if d.get("gated_attention_proj_granularity_type", "head_wise") != "head_wise":
            raise ValueError("config.json: only gated_attention_proj_granularity_type='head_wise' is supported")
        if d.get("no_kda_lora", True) is not True and d.get("use_kda_lora", False):
            raise ValueError("config.json: low-rank KDA f/g projections (use_kda_lora) are not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act={d['hidden_act']!r} is not supported")
        if d.get("num_nextn_predict_layers", 0):
            raise ValueError("config.json: MTP layers (num_nextn_predict_layers > 0) are not supported")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names and k not in cls._HARTS_ONLY}
        if "num_experts" not in d and "num_local_experts" in d:
            kw["num_experts"] = d["num_local_experts"]
        if "num_shared_experts" not in d and "n_shared_experts" in d:
            kw["num_shared_experts"] = d["n_shared_experts"]
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        kw.update(overrides)
        return cls(**kw).validate()
