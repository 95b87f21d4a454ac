"""Forward FLOPs of one batch, the same count for the trajectory-wise baseline and for HARTS.

Row compression (raw tokens / compact rows) is not the speedup a perfect HARTS would reach: MLA
queries of a shared-prefix suffix still attend the whole prefix, so attention work shrinks less than the
rows do, and replay rows add KDA work. The ratio of these counts (baseline / HARTS) is the speedup of an
implementation whose every op runs at the baseline's efficiency; the benches report it next to the row
compression so "speedup / compression" can be split into "what the method allows" and "what the
implementation loses".

Counted (forward; a training step is ~3x, recomputation not counted):
- matmul: 2 x active matmul parameters per row (routed experts at top-k, shared expert, router, every
  projection, LM head; no embedding lookup, no short-conv weights);
- attention: per MLA layer 2 x H x (Dqk + Dv) per attended (query, key) pair; a view of Lq queries over
  Lk keys with bottom-right causal alignment attends Lq (Lk - Lq) + Lq (Lq + 1) / 2 pairs;
- kda: per KDA layer, per input position (compact rows plus replay rows) and head, 4CK + 3CV + 6KV
  (intra-chunk A_qk / A_kk, WY products, state update, output; C the chunk size);
- conv: per KDA layer and position, the three depthwise short convolutions.
"""
from __future__ import annotations

__all__ = ["active_matmul_params", "forward_flops", "batch_forward_flops", "causal_pairs"]


def active_matmul_params(model) -> int:
    cfg = model.config
    n_active = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or "word_embeddings" in name or "conv1d" in name:
            continue
        n = p.numel()
        if ".mlp.experts." in name:
            n = n // cfg.num_experts * cfg.num_experts_per_tok
        n_active += n
    return n_active


def causal_pairs(lq: int, lk: int) -> int:
    """Attended (query, key) pairs of a bottom-right aligned causal view (lq <= lk)."""
    if lq > lk:
        raise ValueError(f"a causal view needs at most as many queries as keys, got Lq={lq} > Lk={lk}")
    return lq * (lk - lq) + lq * (lq + 1) // 2


def forward_flops(model, *, rows: int, kda_positions: int, views, active_params: int | None = None) -> dict:
    """FLOPs of one forward over ``rows`` rows whose MLA views are ``views`` [(Lq, Lk), ...] and whose
    KDA calls process ``kda_positions`` input positions (rows + replay)."""
    cfg = model.config
    n_mla = sum(cfg.layer_type(i) == "mla" for i in range(cfg.num_hidden_layers))
    n_kda = cfg.num_hidden_layers - n_mla
    H, C, K = cfg.num_attention_heads, cfg.kda_chunk_size, cfg.head_dim
    act = active_matmul_params(model) if active_params is None else active_params
    pairs = sum(causal_pairs(int(a), int(b)) for a, b in views)
    out = {
        "matmul": 2.0 * act * rows,
        "attention": float(n_mla * 2 * H * (cfg.qk_head_dim + cfg.v_head_dim) * pairs),
        "kda": float(n_kda * kda_positions * H * (4 * C * K + 3 * C * K + 6 * K * K)),
        "conv": float(n_kda * kda_positions * 3 * 2 * H * K * cfg.short_conv_kernel_size),
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
