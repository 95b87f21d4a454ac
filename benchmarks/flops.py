"""Forward FLOPs of one batch, the same count for the trajectory-wise baseline and for HARTS.

Row compression (raw tokens / compact rows) is not the speedup a perfect HARTS would reach: MLA
queries of a shared-prefix suffix still attend the whole prefix, so attention work shrinks less than the
rows do, and replay rows add KDA work. The ratio of these counts (baseline / HARTS) is the speedup of an
implementation whose every op runs at the baseline's efficiency; the benches report it next to the row
compression so "speedup / compression" can be split into "what the method allows" and "what the
implementation loses".

Counted (forward; a training step is ~3x, recomputation not counted), for both model families
(Ling-3.0: KDA + MLA; Qwen3.5: Gated DeltaNet + gated attention):
- matmul: 2 x active matmul parameters per row (routed experts at top-k, shared expert and its gate, router,
  every projection, LM head; no embedding lookup, no short-conv weights);
- attention: per full-attention layer (MLA, or Qwen3.5's gated attention) 2 x H x (Dqk + Dv) per attended
  (query, key) pair, H the query heads (GQA's shared key/value heads do not reduce the score and value
  products); a view of Lq queries over Lk keys with bottom-right causal alignment attends
  Lq (Lk - Lq) + Lq (Lq + 1) / 2 pairs, L (L + 1) / 2 for a whole trajectory;
- kda (the linear mixer's chunked delta-rule core: KDA, or GDN): per linear layer, per input position
  (compact rows plus replay rows) and value head, 4CK + 3CV + 6KV (intra-chunk A_qk / A_kk, WY products,
  state update, output; C the chunk size). GDN counts its HV value heads (each key head serves HV / Hk of
  them, and the decay, beta and state are per value head), as its round kernels and fla's both compute;
- conv: per linear layer and position, 2 W FLOPs per convolved channel (Ling: q, k, v of H x K each;
  Qwen3.5: the 2 Hk Dk + HV Dv channels of q|k|v), W the convolution width.

Legend: C chunk size, K/V key/value head dims, H heads, Hk/HV GDN key/value heads, W conv width.
"""
from __future__ import annotations

__all__ = ["active_matmul_params", "mixer_geometry", "forward_flops", "batch_forward_flops", "causal_pairs"]


def active_matmul_params(model) -> int:
    cfg = model.config
    n_active = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or "word_embeddings" in name or "embed_tokens" in name or "conv1d" in name:
            continue
        n = p.numel()
        if ".mlp.experts." in name:
            n = n // cfg.num_experts * cfg.num_experts_per_tok
        n_active += n
    return n_active


def mixer_geometry(cfg) -> dict:
    """Per-layer FLOP coefficients of a model config's sequence mixers: ``attention_layers`` and the FLOPs per
    attended pair (``pair_flops``); ``linear_layers`` with their ``heads``, key / value dims, ``chunk`` size
    (``linear_flops``: per position, all heads) and the convolution's FLOPs per position (``conv_flops``)."""
    from harts.models.ling import LingConfig
    from harts.models.qwen35 import Qwen35Config

    types = [cfg.layer_type(i) for i in range(cfg.num_hidden_layers)]
    if isinstance(cfg, Qwen35Config):
        n_attn = types.count("attention")
        H, Dh = cfg.num_attention_heads, cfg.head_dim
        HV, K, V = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        C, W = cfg.gdn_chunk_size, cfg.linear_conv_kernel_dim
        channels = 2 * cfg.linear_num_key_heads * K + HV * V
        pair = 2 * H * (Dh + Dh)
    elif isinstance(cfg, LingConfig):
        n_attn = types.count("mla")
        H = HV = cfg.num_attention_heads
        K = V = cfg.head_dim
        C, W = cfg.kda_chunk_size, cfg.short_conv_kernel_size
        channels = 3 * H * K
        pair = 2 * H * (cfg.qk_head_dim + cfg.v_head_dim)
    else:
        raise TypeError(f"FLOP count: unknown model config {type(cfg).__name__} (LingConfig or Qwen35Config)")
    return {"attention_layers": n_attn, "pair_flops": pair, "linear_layers": len(types) - n_attn, "heads": HV,
            "key_dim": K, "value_dim": V, "chunk": C,
            "linear_flops": HV * (4 * C * K + 3 * C * V + 6 * K * V), "conv_flops": 2 * channels * W}


def causal_pairs(lq: int, lk: int) -> int:
    """Attended (query, key) pairs of a bottom-right aligned causal view (lq <= lk)."""
    if lq > lk:
        raise ValueError(f"a causal view needs at most as many queries as keys, got Lq={lq} > Lk={lk}")
    return lq * (lk - lq) + lq * (lq + 1) // 2


def forward_flops(model, *, rows: int, kda_positions: int, views, active_params: int | None = None) -> dict:
    """FLOPs of one forward over ``rows`` rows whose full-attention views are ``views`` [(Lq, Lk), ...] and
    whose linear-mixer (KDA / GDN) calls process ``kda_positions`` input positions (rows + replay). Keys:
    matmul, attention, kda (the linear mixer's core, GDN for Qwen3.5), conv, total."""
    geo = mixer_geometry(model.config)
    act = active_matmul_params(model) if active_params is None else active_params
    pairs = sum(causal_pairs(int(a), int(b)) for a, b in views)
    out = {
        "matmul": 2.0 * act * rows,
        "attention": float(geo["attention_layers"] * geo["pair_flops"] * pairs),
        "kda": float(geo["linear_layers"] * kda_positions * geo["linear_flops"]),
        "conv": float(geo["linear_layers"] * kda_positions * geo["conv_flops"]),
    }
    out["total"] = sum(out.values())
    return out


def batch_forward_flops(model, batch, active_params: int | None = None) -> dict:
    """``forward_flops`` of a ``harts.runtime.CompactBatch``: HARTS (its MLA views and KDA rounds) or the
    trajectory-wise baseline (``prefix_sharing=False``: every trajectory is one causal view)."""
    if batch.prefix_sharing:
        cq = batch.cu_seqlens_q.tolist()
        ck = batch.cu_seqlens_k.tolist()
        views = [(cq[i + 1] - cq[i], ck[i + 1] - ck[i]) for i in range(len(cq) - 1)]
        kda_positions = sum(int(r.cu_seqlens_cpu[-1]) for r in batch.rounds)
        rows = batch.num_rows
    else:
        cu = batch.cu_seqlens.tolist()
        views = [(cu[i + 1] - cu[i],) * 2 for i in range(len(cu) - 1)]
        rows = kda_positions = batch.num_rows
    return forward_flops(model, rows=rows, kda_positions=kda_positions, views=views, active_params=active_params)
