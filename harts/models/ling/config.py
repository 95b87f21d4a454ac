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


# Keys that earlier exports wrote under "harts" in config.json and that are no model setting any more
# (activation checkpointing is applied from outside the model: harts.train.parallelize.apply_ac).
LEGACY_HARTS_KEYS = ("recompute",)


def refuse_execution_settings(overrides: dict) -> None:
    """Activation checkpointing is not a model setting: name where it is set instead."""
    if "recompute" in overrides:
        raise TypeError("recompute is not a model config field: activation checkpointing is applied to a built "
                        "model from outside, harts.train.parallelize.apply_ac(model, 'full' | 'selective' | 'none') "
                        "(the trainer's [activation_checkpoint] mode)")


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

    @property
    def layout_geometry(self) -> tuple[int, int]:
        """(chunk size, convolution width) that a compact batch must be planned with for this model
        (``harts.pack(config=...)`` reads it; any model whose linear mixers run the round kernels has it)."""
        return self.kda_chunk_size, self.short_conv_kernel_size

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
        refuse_execution_settings(overrides)
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
        elif name == "ling3-small":
            # the debug model's layer pattern, experts and vocab at GPU-kernel head sizes (KDA head dim 64,
            # chunk 64): small enough to learn the online lookup task on one GPU in minutes
            cfg = dataclasses.replace(
                cls.preset("ling3-tiny-debug"), hidden_size=256, head_dim=64, intermediate_size=512,
                moe_intermediate_size=128, moe_shared_expert_intermediate_size=128, q_lora_rank=64, kv_lora_rank=64,
                qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, kda_chunk_size=64)
        else:
            raise ValueError(f"unknown LingConfig preset {name!r}; known: 'ling3-tiny', 'ling3-small', "
                             "'ling3-tiny-debug'")
        return dataclasses.replace(cfg, **overrides).validate()

    # ---------------------------------------------------------------- HF config.json
    # Run-time knobs and the KDA chunk size: not part of the released config.json; written under "harts"
    # so that every field round-trips (the chunk size fixes the plan's chunk grid, see harts.pack).
    _HARTS_ONLY = ("backend", "attention_backend", "kda_backend", "conv_backend", "moe_backend",
                   "logprobs_backend", "norm_backend", "logprobs_chunk_size", "kda_chunk_size")

    def layer_types(self) -> list[str]:
        """transformers' ``layer_types``: 'full_attention' (MLA) or 'linear_attention' (KDA) per layer."""
        return ["full_attention" if self.layer_type(i) == "mla" else "linear_attention"
                for i in range(self.num_hidden_layers)]

    def mlp_layer_types(self) -> list[str]:
        return ["dense" if self.mlp_type(i) == "dense" else "sparse" for i in range(self.num_hidden_layers)]

    def to_hf_dict(self, torch_dtype: Any = None) -> dict[str, Any]:
        """The released config.json keys, the names transformers' ``BailingHybridConfig`` reads (so that
        ``BailingHybridForCausalLM.from_pretrained`` builds the same model), and the HARTS-only fields under
        ``"harts"``. ``torch_dtype`` (a torch.dtype or its name) states the saved tensors' dtype; without it
        the key is left out (a config alone does not know its tensors)."""
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
            attention_bias=False,
            num_nextn_predict_layers=0,
            mtp_loss_scaling_factor=0.0,
            layer_types=self.layer_types(),  # transformers derives them without the ragged-tail-is-MLA rule
            mlp_layer_types=self.mlp_layer_types(),
            harts={name: getattr(self, name) for name in self._HARTS_ONLY},
        )
        if torch_dtype is not None:
            name = str(torch_dtype).removeprefix("torch.")
            d.update(torch_dtype=name, dtype=name)  # transformers 4 reads torch_dtype, 5 reads dtype
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **overrides: Any) -> "LingConfig":
        """Read a config.json: ours, the released (remote-code ``BailingMoeV3Config``) one, or one written by
        transformers' ``bailing_hybrid`` (``BailingHybridConfig``). Keys a layout leaves out take the
        defaults of the config class that wrote it, never this class's Ling-3.0-tiny values; unsupported
        variants and inconsistent keys raise, naming the key, instead of silently changing the model."""
        if not isinstance(d, dict):
            raise TypeError(f"config.json must hold a JSON object, got {type(d).__name__}")
        d = dict(d)
        _check_supported(d)
        transformers_layout = any(k in d for k in _TRANSFORMERS_ONLY_KEYS)
        for alias, name in _ALIASES:
            if alias in d:
                if name in d and d[name] != d[alias] and not (alias == "linear_head_dim"):
                    raise ValueError(f"config.json: {alias}={d[alias]!r} and {name}={d[name]!r} disagree")
                d[name] = d.pop(alias)  # linear_head_dim wins: transformers overwrites head_dim with the rope dim
        if "rope_parameters" in d and d["rope_parameters"] is not None:
            rp = d.pop("rope_parameters")
            if rp.get("rope_type", "default") != "default":
                raise ValueError(f"config.json: rope_parameters={rp!r} is not supported (HARTS implements plain "
                                 "RoPE, rope_type='default')")
            if "rope_theta" in rp:
                d["rope_theta"] = rp["rope_theta"]
        names = {f.name for f in dataclasses.fields(cls)}
        kw = dict(_REFERENCE_DEFAULTS)
        if transformers_layout:  # BailingHybridConfig has no q_lora and sizes the shared expert like a routed one
            kw["q_lora_rank"] = None
            kw["moe_shared_expert_intermediate_size"] = d.get("moe_intermediate_size", kw["moe_intermediate_size"])
        kw.update({k: v for k, v in d.items() if k in names and k not in cls._HARTS_ONLY})
        if "q_lora_rank" in d and transformers_layout and d["q_lora_rank"] is not None:
            raise ValueError(f"config.json: q_lora_rank={d['q_lora_rank']} with transformers' bailing_hybrid keys: "
                             "transformers builds a direct q_proj (q_lora_rank=None); the checkpoint is ambiguous")
        harts = d.get("harts") or {}
        if not isinstance(harts, dict):
            raise TypeError(f"config.json: 'harts' must be an object, got {type(harts).__name__}")
        harts = {k: v for k, v in harts.items() if k not in LEGACY_HARTS_KEYS}
        refuse_execution_settings(overrides)
        unknown = sorted(set(harts) - set(cls._HARTS_ONLY))
        if unknown:
            raise ValueError(f"config.json: unknown 'harts' keys {unknown}; known: {list(cls._HARTS_ONLY)}")
        kw.update(harts)
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"unknown LingConfig field(s) {unknown}")
        kw.update(overrides)
        cfg = cls(**kw).validate()
        _check_derived(d, cfg)
        return cfg


# Defaults of the reference config classes (the released remote-code BailingMoeV3Config and transformers'
# BailingHybridConfig 5.23 agree: the Ling-3.0-flash values) for keys a config.json leaves out.
_REFERENCE_DEFAULTS: dict[str, Any] = dict(
    vocab_size=157184, hidden_size=2560, intermediate_size=6144, num_hidden_layers=42, num_attention_heads=32,
    rms_norm_eps=1e-6, initializer_range=0.02, max_position_embeddings=262144, rope_theta=6_000_000.0,
    tie_word_embeddings=False, pad_token_id=156892, bos_token_id=None, eos_token_id=156895, q_lora_rank=None,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, layer_group_size=6, head_dim=128,
    short_conv_kernel_size=4, kda_lower_bound=-5.0, num_experts=512, num_experts_per_tok=8, num_shared_experts=1,
    moe_intermediate_size=768, moe_shared_expert_intermediate_size=768, first_k_dense_replace=2, n_group=8,
    topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5, kda_chunk_size=64,
)

# (key as transformers' BailingHybridConfig writes it, or an older alias) -> our field
_ALIASES = (
    ("num_experts_per_token", "num_experts_per_tok"),
    ("num_expert_group", "n_group"),
    ("num_local_experts", "num_experts"),
    ("n_shared_experts", "num_shared_experts"),
    ("model_max_length", "max_position_embeddings"),
    ("moe_renormalize", "norm_topk_prob"),
    ("linear_head_dim", "head_dim"),
    ("linear_conv_kernel_dim", "short_conv_kernel_size"),
    ("num_mtp_layers", "num_nextn_predict_layers"),
)
# keys only transformers' BailingHybridConfig writes: their presence selects its defaults for absent keys
_TRANSFORMERS_ONLY_KEYS = ("linear_head_dim", "num_experts_per_token", "num_expert_group", "model_max_length",
                           "moe_renormalize", "linear_num_heads", "rope_parameters")


def _check_supported(d: dict[str, Any]) -> None:
    checks = {
        "kda_safe_gate": True,
        "rope_interleave": True,
        "rope_scaling": None,
        "use_qkv_bias": False,
        "attention_bias": False,
        "use_bias": False,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "gated_attention_proj_granularity_type": "head_wise",
        "num_kv_heads_for_linear_attn": 0,
    }
    for k, want in checks.items():
        if k in d and d[k] != want:
            raise ValueError(f"config.json: {k}={d[k]!r} is not supported (HARTS implements {k}={want!r})")
    if d.get("no_kda_lora", True) is not True or d.get("use_kda_lora", False):
        raise ValueError("config.json: low-rank KDA f/g projections (no_kda_lora=false / use_kda_lora=true) are "
                         "not supported")


def _check_derived(d: dict[str, Any], cfg: LingConfig) -> None:
    """Keys that restate what the other keys imply must agree with the model HARTS builds."""
    same = {
        "num_key_value_heads": (cfg.num_attention_heads, "MLA has one KV head per query head"),
        "linear_num_heads": (cfg.num_attention_heads, "KDA has num_attention_heads heads"),
        "qk_head_dim": (cfg.qk_head_dim, "qk_nope_head_dim + qk_rope_head_dim"),
        "layer_types": (cfg.layer_types(), "the last layer of every layer_group_size group and the ragged tail "
                                           "are MLA ('full_attention')"),
        "mlp_layer_types": (cfg.mlp_layer_types(), "the first first_k_dense_replace layers are dense"),
    }
    for k, (want, rule) in same.items():
        if k in d and d[k] is not None and d[k] != want:
            have = d[k]
            if isinstance(want, list) and isinstance(have, list) and len(have) == len(want):
                i = next(i for i, (a, b) in enumerate(zip(have, want)) if a != b)
                raise ValueError(f"config.json: {k}[{i}]={have[i]!r} but HARTS builds {want[i]!r} there ({rule})")
            raise ValueError(f"config.json: {k}={have!r} but HARTS builds {want!r} ({rule})")
