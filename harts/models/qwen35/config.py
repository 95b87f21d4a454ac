"""Qwen3.5-MoE (HF ``qwen3_5_moe``, text part) configuration.

Field names follow transformers' ``Qwen3_5MoeTextConfig`` so that a config.json round-trips through
``to_hf_dict`` / ``from_hf_dict``, and the field defaults are that class's defaults (the Qwen3.5-35B-A3B
shape: 40 layers of 3 Gated DeltaNet + 1 gated full attention, GQA 16/2 heads of 256 with partial RoPE,
GDN 16 key / 32 value heads of 128, 256 experts top-8 plus a gated shared expert, vocab 248,320). A
checkpoint's own config.json (rope_theta, context length, token ids) always wins over these defaults.

Presets: ``qwen3.5-35b-a3b`` (the full shape: 34.66e9 parameters, 3.45e9 active per token), ``qwen3.5-8l``
(8 layers = 2 x (3 GDN + 1 attention), 64 experts top-8: 2.91e9 parameters, 1.50e9 active per token of which
1.02e9 are the embedding and LM head: about 47 GB of weights, gradients and fp32 optimizer state at 16
bytes per parameter, leaving an H200 room for activations) and
``qwen3.5-debug`` (every structural feature at sizes a 2-core CPU runs in seconds, with a 16-token GDN chunk
so tests cross chunk boundaries).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from harts.models.ling.config import LEGACY_HARTS_KEYS, refuse_execution_settings

__all__ = ["Qwen35Config"]

_BACKEND_OPS = ("attention", "gdn", "conv", "moe", "logprobs", "norm")
GDN_ROUND_IMPLS = ("kda_kernels", "fla_pieces")


@dataclass
class Qwen35Config:
    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    full_attention_interval: int = 4  # layer i is full attention iff (i + 1) % interval == 0
    layer_types: tuple[str, ...] | None = None  # 'linear_attention' | 'full_attention' per layer (None: interval)
    # gated full attention
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    partial_rotary_factor: float = 0.25  # RoPE on the first head_dim * factor channels of each head
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    # Gated DeltaNet
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # MoE (every layer)
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True
    # misc
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # HARTS-only knobs (written under "harts" in config.json)
    gdn_chunk_size: int = 64  # chunk grid of the GDN rounds (harts.pack plans with it)
    # The fast GDN core, trajectory-wise and HARTS rounds alike: "kda_kernels" runs KDA's round kernels with
    # the decay broadcast over K and q/k repeated to the value heads; "fla_pieces" runs fla's Gated DeltaNet
    # pieces with our boundary-state scans (harts.ops.gdn_round: scalar gate, q/k at the key heads). The
    # default: on the H200 its rounds run fwd+bwd 2.4x faster than the KDA-kernel rounds at the same float64
    # error, and its gate gradients stay exact at fast decays (python -m benchmarks.gdn_round, gdn_gate_grad).
    gdn_round_impl: Literal["kda_kernels", "fla_pieces"] = "fla_pieces"
    backend: str = "auto"  # "auto" | "reference" | "fast"; see harts.ops.backend
    attention_backend: str | None = None
    gdn_backend: str | None = None
    conv_backend: str | None = None
    moe_backend: str | None = None
    logprobs_backend: str | None = None
    norm_backend: str | None = None
    logprobs_chunk_size: int = 4096

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = tuple("full_attention" if (i + 1) % self.full_attention_interval == 0
                                     else "linear_attention" for i in range(self.num_hidden_layers))
        else:
            self.layer_types = tuple(self.layer_types)

    # ---------------------------------------------------------------- derived
    @property
    def layout_geometry(self) -> tuple[int, int]:
        """(chunk size, convolution width) that a compact batch must be planned with for this model
        (``harts.pack(config=...)`` and ``harts.runtime.compact.check_batch`` read it)."""
        return self.gdn_chunk_size, self.linear_conv_kernel_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def op_backend(self, op: str) -> str:
        """Requested backend for op in ('attention', 'gdn', 'conv', 'moe', 'logprobs', 'norm'); 'kda' reads
        the GDN setting (code written for Ling asks for the linear mixer's backend under that name)."""
        op = "gdn" if op == "kda" else op
        if op not in _BACKEND_OPS:
            raise ValueError(f"unknown op {op!r}; known: {_BACKEND_OPS}")
        v = getattr(self, f"{op}_backend")
        return self.backend if v is None else v

    def layer_type(self, i: int) -> str:
        """'attention' or 'gdn' for 0-based layer i."""
        return "attention" if self.layer_types[i] == "full_attention" else "gdn"

    def validate(self) -> "Qwen35Config":
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for num_hidden_layers="
                             f"{self.num_hidden_layers}")
        for i, t in enumerate(self.layer_types):
            if t not in ("linear_attention", "full_attention"):
                raise ValueError(f"layer_types[{i}]={t!r}: expected 'linear_attention' or 'full_attention'")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                             f"linear_num_key_heads={self.linear_num_key_heads}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} gives rotary_dim={self.rotary_dim}"
                             f" for head_dim={self.head_dim}: need an even width in (0, head_dim]")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must lie in [1, num_experts="
                             f"{self.num_experts}]")
        if self.gdn_round_impl not in GDN_ROUND_IMPLS:
            raise ValueError(f"gdn_round_impl={self.gdn_round_impl!r}: expected one of {GDN_ROUND_IMPLS}")
        for name in ("gdn_chunk_size", "linear_conv_kernel_dim", "logprobs_chunk_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings=True is not supported (Qwen3.5-MoE has a separate lm_head)")
        for name in ("backend",) + tuple(f"{op}_backend" for op in _BACKEND_OPS):
            v = getattr(self, name)
            if v not in ("auto", "reference", "fast") and not (v is None and name != "backend"):
                raise ValueError(f"{name}={v!r}: expected 'auto', 'reference' or 'fast'")
        return self

    # ---------------------------------------------------------------- presets
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "Qwen35Config":
        refuse_execution_settings(overrides)
        if name == "qwen3.5-35b-a3b":
            cfg = cls()
        elif name == "qwen3.5-8l":
            cfg = cls(num_hidden_layers=8, num_experts=64)
        elif name == "qwen3.5-debug":
            cfg = cls(
                vocab_size=512, hidden_size=64, num_hidden_layers=8,  # 2 groups of (3 GDN + 1 attention)
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,  # rotary_dim 4
                max_position_embeddings=4096,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                gdn_chunk_size=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, logprobs_chunk_size=64,
            )
        else:
            raise ValueError(f"unknown Qwen35Config preset {name!r}; known: 'qwen3.5-35b-a3b', 'qwen3.5-8l', "
                             "'qwen3.5-debug'")
        if "num_hidden_layers" in overrides and "layer_types" not in overrides:
            overrides["layer_types"] = None  # re-derive from the interval
        cfg = dataclasses.replace(cfg, **overrides)
        return cfg.validate()

    # ---------------------------------------------------------------- HF config.json
    _HARTS_ONLY = ("gdn_chunk_size", "gdn_round_impl", "backend", "attention_backend", "gdn_backend",
                   "conv_backend", "moe_backend", "logprobs_backend", "norm_backend", "logprobs_chunk_size")
    _NOT_HF = _HARTS_ONLY + ("full_attention_interval", "partial_rotary_factor", "rope_theta", "norm_topk_prob")

    def to_hf_dict(self, torch_dtype: Any = None) -> dict[str, Any]:
        """The keys transformers' ``Qwen3_5MoeTextConfig`` reads (``Qwen3_5MoeForCausalLM.from_pretrained``
        builds the same model) and the HARTS-only fields under ``"harts"``. ``torch_dtype`` (a torch.dtype
        or its name) states the saved tensors' dtype."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in self._NOT_HF}
        d.update(
            architectures=["Qwen3_5MoeForCausalLM"],
            model_type="qwen3_5_moe_text",
            hidden_act="silu",
            attention_bias=False,
            layer_types=list(self.layer_types),
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                             "partial_rotary_factor": self.partial_rotary_factor},
            harts={name: getattr(self, name) for name in self._HARTS_ONLY},
        )
        if not self.norm_topk_prob:
            d["norm_topk_prob"] = False
        if torch_dtype is not None:
            name = str(torch_dtype).removeprefix("torch.")
            d.update(torch_dtype=name, dtype=name)
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **overrides: Any) -> "Qwen35Config":
        """Read a config.json: ours, transformers' ``qwen3_5_moe_text``, or a released multimodal
        ``qwen3_5_moe`` one (its ``text_config`` is read). Keys a file leaves out take transformers' defaults
        (this class's); unsupported variants raise, naming the key."""
        if not isinstance(d, dict):
            raise TypeError(f"config.json must hold a JSON object, got {type(d).__name__}")
        d = dict(d)
        if isinstance(d.get("text_config"), dict):
            harts = d.get("harts")
            d = dict(d["text_config"]) | ({"harts": harts} if harts is not None else {})
        mt = d.get("model_type")
        if mt is not None and mt not in ("qwen3_5_moe_text", "qwen3_5_moe"):
            raise ValueError(f"config.json: model_type={mt!r} is not Qwen3.5-MoE ('qwen3_5_moe_text' or 'qwen3_5_moe')")
        checks = {"hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
                  "mlp_only_layers": [], "decoder_sparse_step": 1}
        for k, want in checks.items():
            if k in d and d[k] != want:
                raise ValueError(f"config.json: {k}={d[k]!r} is not supported (HARTS implements {k}={want!r})")
        rp = d.pop("rope_parameters", None) or {}
        if not isinstance(rp, dict):
            raise TypeError(f"config.json: rope_parameters must be an object, got {type(rp).__name__}")
        if rp.get("rope_type", "default") != "default":
            raise ValueError(f"config.json: rope_parameters.rope_type={rp['rope_type']!r} is not supported "
                             "(HARTS implements plain RoPE, rope_type='default')")
        # Text tokens carry the same position on all three multimodal RoPE axes, so mrope_section and
        # mrope_interleaved leave the text model's rotation unchanged: plain RoPE.
        for k in ("rope_theta", "partial_rotary_factor"):
            if k in rp:
                d[k] = rp[k]
        harts = d.pop("harts", None) or {}
        refuse_execution_settings(overrides)
        if not isinstance(harts, dict):
            raise TypeError(f"config.json: 'harts' must be an object, got {type(harts).__name__}")
        harts = {k: v for k, v in harts.items() if k not in LEGACY_HARTS_KEYS}
        unknown = sorted(set(harts) - set(cls._HARTS_ONLY))
        if unknown:
            raise ValueError(f"config.json: unknown 'harts' keys {unknown}; known: {list(cls._HARTS_ONLY)}")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names and k not in cls._HARTS_ONLY}
        kw.update(harts)
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"unknown Qwen35Config field(s) {unknown}")
        kw.update(overrides)
        return cls(**kw).validate()
