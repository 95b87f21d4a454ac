"""Qwen3.5-MoE blocks: zero-centred RMSNorm, Gated DeltaNet, gated full attention, softmax-routed MoE with a
gated shared expert, and the decoder layer, on packed token streams or compact HARTS batches.

Legend: T tokens (packed tokens or this rank's compact rows), D hidden, H attention query heads, G key/value
heads, Dh attention head dim, R rotary dim, Hk GDN key heads, HV GDN value heads, Dk / Dv GDN head dims,
C = 2 Hk Dk + HV Dv convolved channels, W conv width, E experts, K experts per token, F expert width,
N sequences of one decoding step; under context parallelism (harts.runtime.cp) P all physical rows of the
microbatch, hk = Hk / cp, hv = HV / cp one rank's GDN heads, c = C / cp their channels.

Module and parameter names are transformers' ``qwen3_5_moe`` ones (``linear_attn.in_proj_qkv``,
``self_attn.q_norm``, ``mlp.experts.gate_up_proj``, ``mlp.shared_expert_gate``, ...), so a state dict maps
onto the HF layout unchanged (routed experts are stacked in both).

Each mixer's ``forward`` is ``output(core(*project(x, ...), batch), x)`` and the MoE's
``finish(*compute(x), router)``, as Ling's: ``project`` / ``output`` / ``compute`` are row-wise (the compiled
and selectively checkpointed regions of harts.models.common.compile, named by ``DecoderLayer.region_kind``),
``core`` is the part that reads the layout, ``finish`` the part that writes module state.

As in harts.models.ling.blocks, a sequence mixer has one ``forward(x, batch)``: ``batch`` is ``Packed``
trajectories or a ``harts.CompactBatch``. The GDN mixer runs its short convolution and core through
``harts.ops`` (packed) or over the rows' true ancestors and the planned rounds (compact:
``tree_short_conv`` and ``harts.runtime.compact.kda_rounds``; with ``gdn_round_impl="kda_kernels"`` the
precomputed per-head log decay is broadcast over K and q, k repeated to the value heads (KDA's round kernels),
with ``"fla_pieces"`` the scalar decay [T, HV] and key-head q, k go to fla's GDN pieces with our boundary-state
scans; the trajectory-wise core makes the same choice); the attention mixer runs varlen attention (packed) or
``harts.runtime.compact.mla_tree_attention`` (each branch over its ancestors + own rows). Row-wise parts
never look at the layout. For incremental decoding (harts.models.common.generate) each mixer also has
``empty_cache`` (the state it keeps per sequence) and ``step`` (one token per sequence, plain torch).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from harts.models.common import init as common_init
from harts.models.ling.blocks import MLP, MoE, ShortConvWeight
from harts.models.qwen35.config import Qwen35Config
from harts.ops.attention import repeat_heads, varlen_attention
from harts.ops.conv import short_conv
from harts.ops.gdn import gated_delta_rule
from harts.ops.moe import grouped_experts_stacked, routed_experts, router_logits, router_stats

__all__ = ["RMSNorm", "GatedRMSNorm", "GatedDeltaNet", "GatedAttention", "SparseMoE", "DecoderLayer",
           "init_module_weights", "initial_tensors"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: x / rms(x) * (1 + w), in fp32+ and cast back once (w = 0 is the identity
    scale, as the checkpoints store it)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(_compute_dtype(x.dtype))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.to(xf.dtype))).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """GDN output norm per value head: w * rmsnorm(o) * silu(z) (plain weight, SiLU gate), the norm in
    fp32+ cast back before the weight, the gate product in fp32+, cast back once."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dt = _compute_dtype(o.dtype)
        of = o.to(dt)
        normed = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)).to(o.dtype)
        return ((self.weight * normed).to(dt) * F.silu(z.to(dt))).to(o.dtype)


def rope_half(x_THD: torch.Tensor, position_ids_T: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    """Partial RoPE in the half-split layout: the first ``rotary_dim`` channels are rotated as pairs
    (x_i, x_{i+R/2}) by pos * theta^(-2i/R); the rest pass through. Angles in fp32 (fp64 for fp64)."""
    R = rotary_dim
    dt = _compute_dtype(x_THD.dtype)
    inv_freq = 1.0 / (theta ** (torch.arange(0, R, 2, device=x_THD.device, dtype=dt) / R))
    ang = position_ids_T.to(dt)[:, None] * inv_freq[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    xr = x_THD[..., :R].to(dt)
    x1, x2 = xr[..., : R // 2], xr[..., R // 2:]
    rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x_THD.dtype)
    return torch.cat((rot, x_THD[..., R:]), dim=-1)


class GatedAttention(nn.Module):
    """Full attention with an output gate: q_proj emits each head's query and gate, per-head q/k RMSNorm,
    partial RoPE, GQA (G key/value heads, each serving H / G consecutive query heads; the attention ops read
    them unrepeated), scale Dh^-0.5, o * sigmoid(gate)."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.cfg = cfg
        D, H, G, Dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.H, self.G, self.Dh = H, G, Dh
        self.q_proj = nn.Linear(D, H * Dh * 2, bias=False)
        self.k_proj = nn.Linear(D, G * Dh, bias=False)
        self.v_proj = nn.Linear(D, G * Dh, bias=False)
        self.o_proj = nn.Linear(H * Dh, D, bias=False)
        self.q_norm = RMSNorm(Dh, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(Dh, cfg.rms_norm_eps)
        self.scale = Dh ** -0.5

    def project(self, x_TD: torch.Tensor, position_ids_T: torch.Tensor):
        """Per-row q [T, H, Dh], k, v [T, G, Dh] and the gate [T, H * Dh]; H and G are read off the projections'
        outputs (a tensor-parallel rank holds a share of the heads)."""
        T, c = x_TD.shape[0], self.cfg
        q_THD, gate_THD = self.q_proj(x_TD).view(T, -1, 2 * self.Dh).chunk(2, dim=-1)
        q_THD = rope_half(self.q_norm(q_THD), position_ids_T, c.rope_theta, c.rotary_dim)
        k_TGD = rope_half(self.k_norm(self.k_proj(x_TD).view(T, -1, self.Dh)), position_ids_T, c.rope_theta,
                          c.rotary_dim)
        v_TGD = self.v_proj(x_TD).view(T, -1, self.Dh)
        return q_THD, k_TGD, v_TGD, gate_THD.flatten(1)

    def core(self, q, k, v, gate, batch):
        """Attention over the layout (the only part that reads ``batch``): (o [T, H, Dh], the gate passed
        through untouched for ``output``: it is row-wise, so it stays on this rank's rows under context
        parallelism while q, k, v are exchanged for heads)."""
        be = self.cfg.op_backend("attention")
        if batch.prefix_sharing:
            from harts.runtime.compact import mla_tree_attention

            cp = batch.cp
            if cp is not None:
                # Rows -> heads inside mla_tree_attention. k, v cross it at lcm(G, cp) heads: each rank gets the
                # key/value heads its query heads read (repeated only where cp > G), and the repeat's backward
                # sums the copies' gradients into the key/value head.
                cp.check_heads("Qwen3.5 gated attention", num_attention_heads=q.shape[1])
                k, v = (repeat_heads(t, math.lcm(k.shape[1], cp.size)) for t in (k, v))
            o = mla_tree_attention(q, k, v, batch, self.scale, be)
        else:
            o = varlen_attention(q, k, v, batch.cu_seqlens, batch.cu_seqlens, self.scale, backend=be,
                                 max_seqlen_q=batch.max_seqlen, max_seqlen_k=batch.max_seqlen,
                                 cu_seqlens_cpu=batch.cu_seqlens_cpu)
        return o, gate

    def output(self, o_gate: tuple, x_TD: torch.Tensor) -> torch.Tensor:
        """o * sigmoid(gate) (``core``'s pair), then ``o_proj``."""
        o, gate = o_gate
        gate = torch.sigmoid(gate.to(_compute_dtype(gate.dtype))).to(o.dtype)
        return self.o_proj(o.flatten(1) * gate)

    def forward(self, x_TD: torch.Tensor, batch) -> torch.Tensor:
        """``batch``: ``Packed`` trajectories or a ``harts.CompactBatch`` (rows = this rank's rows)."""
        return self.output(self.core(*self.project(x_TD, batch.local_rows(batch.position_ids)), batch), x_TD)

    def empty_cache(self, n: int, dtype: torch.dtype, device=None):
        """Decoding state of n empty sequences (harts.models.common.generate): no keys and values yet, kept per
        key/value head ([t_n, G, Dh]; repeated to the query heads when attended)."""
        from harts.models.common.generate import LayerCache

        empty = torch.zeros(0, self.G, self.Dh, dtype=dtype, device=device)
        return LayerCache(k=[empty] * n, v=[empty] * n)

    def step(self, x_ND: torch.Tensor, cache, position_ids_N: torch.Tensor) -> torch.Tensor:
        """One decoding step of N sequences (harts.models.common.generate): row n at ``position_ids_N[n]``
        attends to its cached keys and itself. ``cache.k`` / ``cache.v``: per-sequence lists of [t_n, G, Dh];
        the new row's key and value are appended by replacing the list entries (a forked cache that shares
        the old tensors is unaffected)."""
        q_NHD, k_NGD, v_NGD, gate_NHD = self.project(x_ND, position_ids_N)
        cache.k = [torch.cat((kc, k_NGD[n:n + 1])) for n, kc in enumerate(cache.k)]
        cache.v = [torch.cat((vc, v_NGD[n:n + 1])) for n, vc in enumerate(cache.v)]
        lens = torch.tensor([0] + [kc.shape[0] for kc in cache.k], device=x_ND.device).cumsum(0)
        cu_q = torch.arange(len(cache.k) + 1, device=x_ND.device)
        o = varlen_attention(q_NHD, torch.cat(cache.k), torch.cat(cache.v), cu_q, lens, self.scale,
                             backend=self.cfg.op_backend("attention"))
        gate_NHD = torch.sigmoid(gate_NHD.to(_compute_dtype(gate_NHD.dtype))).to(o.dtype)
        return self.o_proj(o.flatten(1) * gate_NHD)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet: q|k|v from one projection, a width-W causal depthwise convolution with SiLU over the
    C concatenated channels, the per-head scalar log decay g = -exp(A_log) * softplus(a + dt_bias),
    beta = sigmoid(b), the delta-rule core (q, k L2-normed, scale Dk^-0.5, GVA: each key head serves HV/Hk
    value heads) and a SiLU-gated RMSNorm per value head before ``out_proj``."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.cfg = cfg
        D = cfg.hidden_size
        self.Hk, self.HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.Dk, self.Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.Hk * self.Dk, self.HV * self.Dv
        C = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = nn.Linear(D, C, bias=False)
        self.in_proj_z = nn.Linear(D, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(D, self.HV, bias=False)
        self.in_proj_a = nn.Linear(D, self.HV, bias=False)
        self.conv1d = ShortConvWeight(C, cfg.linear_conv_kernel_dim)  # depthwise [C, 1, W] (an nn.Conv1d in HF)
        self.dt_bias = nn.Parameter(torch.ones(self.HV))
        self.A_log = nn.Parameter(torch.empty(self.HV))
        self.norm = GatedRMSNorm(self.Dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, D, bias=False)

    def gates(self, x_TD: torch.Tensor):
        """Per-row log decay g [T, HV] and beta [T, HV], both fp32+."""
        dt = _compute_dtype(x_TD.dtype)
        a_TH = self.in_proj_a(x_TD).to(dt)
        g_TH = -self.A_log.to(dt).exp() * F.softplus(a_TH + self.dt_bias.to(dt))
        return g_TH, torch.sigmoid(self.in_proj_b(x_TD).to(dt))

    def heads(self, channels: int) -> tuple[int, int]:
        """(key heads, value heads) of q|k|v rows with ``channels`` channels: all of them, or a share (a
        tensor-parallel rank's, a context-parallel rank's); each key head serves HV / Hk value heads."""
        rep = self.HV // self.Hk
        hk = channels // (2 * self.Dk + rep * self.Dv)
        return hk, hk * rep

    def split(self, qkv_TC: torch.Tensor):
        """q|k|v [T, C] -> q, k [T, Hk, Dk], v [T, HV, Dv], the head counts read off the channels (``heads``)."""
        T, (hk, hv) = qkv_TC.shape[0], self.heads(qkv_TC.shape[-1])
        q, k, v = qkv_TC.split([hk * self.Dk, hk * self.Dk, hv * self.Dv], dim=-1)
        return q.view(T, hk, self.Dk), k.view(T, hk, self.Dk), v.view(T, hv, self.Dv)

    def _rows_to_heads(self, qkv_TC, conv_CW, g_TH, beta_TH, cp):
        """Context parallelism (harts.runtime.cp): this rank's rows and all heads -> all rows and this rank's
        heads, before the short convolution (it reads whole ancestor paths). Key heads [r hk, (r+1) hk) of rank
        r serve value heads [r hv, (r+1) hv) (value head j reads key head j // (HV / Hk)), so the rank gets q, k
        of its key heads and v, g, beta of its value heads, and the depthwise conv weights of those channels.
        Three exchanges: q|k per key head, v, g|beta per value head (the gates stay in their fp32+ dtype).
        Returns q|k|v [P, c] with c = C / cp, conv weights [c, W], g and beta [P, hv]."""
        q, k, v = self.split(qkv_TC)
        cp.check_heads("Qwen3.5 GDN", linear_num_key_heads=q.shape[1], linear_num_value_heads=v.shape[1])
        qk_PhX = cp.rows_to_heads(torch.cat((q, k), dim=-1))
        v_PhV = cp.rows_to_heads(v)
        gb_Ph2 = cp.rows_to_heads(torch.stack((g_TH, beta_TH), dim=-1))
        P, hk, hv = v_PhV.shape[0], qk_PhX.shape[1], v_PhV.shape[1]
        qkv_Pc = torch.cat((qk_PhX[..., :self.Dk].reshape(P, -1), qk_PhX[..., self.Dk:].reshape(P, -1),
                            v_PhV.reshape(P, -1)), dim=-1)
        ks, vs = cp.rank * hk * self.Dk, cp.rank * hv * self.Dv
        kd, vd = hk * self.Dk, hv * self.Dv
        key_dim = q.shape[1] * self.Dk  # this rank's key channels before the exchange (all, or a TP share)
        conv_cW = torch.cat((conv_CW[ks:ks + kd], conv_CW[key_dim + ks:key_dim + ks + kd],
                             conv_CW[2 * key_dim + vs:2 * key_dim + vs + vd]), dim=0)
        return qkv_Pc, conv_cW, gb_Ph2[..., 0], gb_Ph2[..., 1]

    def project(self, x_TD: torch.Tensor):
        """Per-row q|k|v before the short convolution [T, C], log decay g [T, HV] and beta [T, HV] (``gates``)."""
        qkv_TC = self.in_proj_qkv(x_TD)
        g_TH, beta_TH = self.gates(x_TD)
        return qkv_TC, g_TH, beta_TH

    def core(self, qkv_TC: torch.Tensor, g_TH: torch.Tensor, beta_TH: torch.Tensor, batch) -> torch.Tensor:
        """The short convolution and the delta rule over the layout (the only part that reads ``batch``):
        o [T, HV, Dv]. A context-parallel CompactBatch exchanges rows for heads before the convolution
        (``_rows_to_heads``) and back after the rounds, as Ling's KDA does (harts.runtime.compact.kda_tree)."""
        c = self.cfg
        conv_CW = self.conv1d.weight.squeeze(1)
        if batch.prefix_sharing:
            from harts.ops.tree_conv import tree_short_conv
            from harts.runtime.compact import kda_rounds

            cp = batch.cp
            if cp is not None:
                qkv_TC, conv_CW, g_TH, beta_TH = self._rows_to_heads(qkv_TC, conv_CW, g_TH, beta_TH, cp)
            qkv_TC = tree_short_conv(qkv_TC, conv_CW, batch.conv_pred, "silu", seq_cu=batch.conv_cu_seqlens,
                                     context=batch.conv_context, num_rows=batch.num_rows,
                                     backend=c.op_backend("conv"))
            q, k, v = self.split(qkv_TC)
            if c.gdn_round_impl == "fla_pieces":  # the scalar gate [T, HV], q and k at the key heads
                g = g_TH
            else:
                # KDA's round kernels: q, k repeated to the value heads and the scalar decay broadcast over K
                # is the per-channel gate form with equal channels.
                rep = self.HV // self.Hk
                q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
                g = g_TH[..., None].expand(*g_TH.shape, self.Dk)
            o = kda_rounds(q, k, v, g, beta_TH, batch, chunk_size=c.gdn_chunk_size, backend=c.op_backend("gdn"))
            if cp is not None:
                o = cp.heads_to_rows(o)
        else:
            qkv_TC = short_conv(qkv_TC, conv_CW, batch.cu_seqlens, "silu", backend=c.op_backend("conv"),
                                cu_seqlens_cpu=batch.cu_seqlens_cpu)
            q, k, v = self.split(qkv_TC)
            o, _ = gated_delta_rule(q, k, v, g_TH, beta_TH, batch.cu_seqlens, backend=c.op_backend("gdn"),
                                    chunk_size=c.gdn_chunk_size, round_impl=c.gdn_round_impl,
                                    cu_seqlens_cpu=batch.cu_seqlens_cpu)
        return o

    def output(self, o: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
        """The SiLU-gated norm per value head (gate ``in_proj_z``), then ``out_proj``."""
        z = self.in_proj_z(x_TD).view(o.shape)
        return self.out_proj(self.norm(o, z).flatten(1))

    def forward(self, x_TD: torch.Tensor, batch) -> torch.Tensor:
        """``batch``: ``Packed`` trajectories or a ``harts.CompactBatch``."""
        return self.output(self.core(*self.project(x_TD), batch), x_TD)

    def empty_cache(self, n: int, dtype: torch.dtype, device=None):
        """Decoding state of n empty sequences (harts.models.common.generate): a zero window of W-1
        pre-convolution q|k|v rows [n, W-1, C] (the packed convolution's zero padding) and a zero delta-rule
        state [n, HV, Dk, Dv] in float32+."""
        from harts.models.common.generate import LayerCache

        W, C = self.cfg.linear_conv_kernel_dim, self.in_proj_qkv.out_features
        return LayerCache(conv=(torch.zeros(n, W - 1, C, dtype=dtype, device=device),),
                          state=torch.zeros(n, self.HV, self.Dk, self.Dv, dtype=_compute_dtype(dtype), device=device))

    def step(self, x_ND: torch.Tensor, cache, position_ids_N: torch.Tensor | None = None) -> torch.Tensor:
        """One decoding step of N sequences (harts.models.common.generate), the recurrent form of ``forward`` in
        float32+ torch ops (positions are not read: the recurrence carries them). ``cache.conv``: the last W-1
        pre-convolution q|k|v rows of each sequence (one [N, W-1, C] tensor); ``cache.state``: [N, HV, Dk, Dv].
        Both are replaced, never written in place, so a forked cache that shares them is unaffected. Per value
        head (harts.ops.gdn, q and k of its key head, L2-normed, q scaled by Dk^-0.5):
        S <- exp(g) S;  S <- S + beta k (v - k^T S)^T;  o = q^T S."""
        from harts.ops.gdn.reference import l2norm

        dt = _compute_dtype(x_ND.dtype)
        win_NWC = torch.cat((cache.conv[0], self.in_proj_qkv(x_ND)[:, None]), 1)
        conv_CW = self.conv1d.weight.squeeze(1).to(win_NWC.dtype)
        q, k, v = self.split(F.silu(torch.einsum("nwc,cw->nc", win_NWC, conv_CW)))
        cache.conv = (win_NWC[:, 1:],)
        g_NH, beta_NH = self.gates(x_ND)
        rep = self.HV // self.Hk
        q_NHK = l2norm(q.to(dt)).repeat_interleave(rep, dim=1) * self.Dk ** -0.5
        k_NHK = l2norm(k.to(dt)).repeat_interleave(rep, dim=1)
        S = cache.state.to(dt) * g_NH.to(dt).exp()[..., None, None]
        u_NHV = beta_NH.to(dt)[..., None] * (v.to(dt) - torch.einsum("nhk,nhkv->nhv", k_NHK, S))
        S = S + k_NHK[..., None] * u_NHV[:, :, None, :]
        cache.state = S
        o_NHV = torch.einsum("nhk,nhkv->nhv", q_NHK, S).to(x_ND.dtype)
        z_NHV = self.in_proj_z(x_ND).view(o_NHV.shape)
        return self.out_proj(self.norm(o_NHV, z_NHV).flatten(1))


class Router(nn.Module):
    """Router weight [E, D] under transformers' name ``mlp.gate.weight``."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))


class Experts(nn.Module):
    """Routed experts, stacked as in the checkpoint: gate_up_proj [E, 2F, D] (gate rows first), down_proj
    [E, D, F]; ``forward`` as Ling's ``Experts`` (expert-major rows, parallel-agnostic)."""

    stacked_weights = ("gate_up_proj", "down_proj")  # expert dim first (parallelisms shard it)

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        E, D, Fw = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * Fw, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, Fw))
        self.backend = cfg.op_backend("moe")

    def forward(self, x_MD: torch.Tensor, counts_E: torch.Tensor, weight_M: torch.Tensor | None = None):
        return grouped_experts_stacked(x_MD, counts_E, self.gate_up_proj, self.down_proj, self.backend, weight_M)


def softmax_route(x_TD: torch.Tensor, weight_ED: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """Softmax over all experts in fp32+, top-k, optionally renormalised over the k. Returns (logits_TE,
    probs_TE, topk_idx_TK, topk_w_TK); the k slots are ordered by expert id so the combine order does not
    depend on ties in topk."""
    logits_TE = router_logits(x_TD, weight_ED)
    probs_TE = logits_TE.softmax(-1)
    with torch.no_grad():
        idx_TK = probs_TE.topk(top_k, dim=-1).indices.sort(dim=-1).values
    w_TK = probs_TE.gather(1, idx_TK)
    if norm_topk_prob:
        w_TK = w_TK / w_TK.sum(-1, keepdim=True)
    return logits_TE, probs_TE, idx_TK, w_TK


class SparseMoE(nn.Module):
    """Softmax-routed experts + a shared expert scaled by sigmoid(shared_expert_gate(x)). ``moe_index``,
    the ``experts`` module, ``forward``'s (output, router statistics weighted by the rows' multiplicities), and
    ``finish`` (``last_stats`` and the router loss in backward) are as in Ling's MoE."""

    def __init__(self, cfg: Qwen35Config, moe_index: int = 0):
        super().__init__()
        self.cfg = cfg
        self.moe_index = moe_index
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.last_stats = None

    # keep the statistics (outside backward) and join the router term to the output's backward, as Ling's MoE
    finish = MoE.finish

    def forward(self, x_TD: torch.Tensor, token_weight_T: torch.Tensor | None = None):
        """Routing, routed experts and the gated shared expert: (y_TD, router statistics); no module state is
        written (the part a compiled region runs; ``finish`` does the rest eagerly)."""
        c = self.cfg
        logits, probs, idx_TK, w_TK = softmax_route(x_TD, self.gate.weight, c.num_experts_per_tok, c.norm_topk_prob)
        stats = router_stats(logits, probs, idx_TK, token_weight_T)
        y = routed_experts(x_TD, idx_TK, w_TK, self.experts, c.num_experts, c.op_backend("moe"))
        gate_T1 = torch.sigmoid(self.shared_expert_gate(x_TD).to(_compute_dtype(x_TD.dtype))).to(x_TD.dtype)
        return y + gate_T1 * self.shared_expert(x_TD), stats


class DecoderLayer(nn.Module):
    """Pre-norm block: h + mixer(norm(h), batch), then h + moe(norm(h)). The mixer is ``linear_attn``
    (GDN) or ``self_attn`` (gated attention), transformers' names; ``attention`` refers to it either way."""

    def __init__(self, cfg: Qwen35Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.kind = cfg.layer_type(layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.kind == "gdn":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg, layer_idx)

    @property
    def attention(self) -> nn.Module:
        return self.linear_attn if self.kind == "gdn" else self.self_attn

    @property
    def region_kind(self) -> tuple[str, str]:
        """The (pre, post) region families that run this layer compiled or under selective checkpointing
        (harts.models.common.compile): ``pre_gdn`` / ``pre_gated_attention`` (norm + the mixer's ``project``),
        ``post_sparse_moe`` (the mixer's ``output`` + residual + norm + ``SparseMoE.forward`` + residual)."""
        return ("gdn" if self.kind == "gdn" else "gated_attention"), "sparse_moe"

    def forward(self, h_TD: torch.Tensor, batch, token_weight_T: torch.Tensor | None = None,
                router: tuple | None = None, *, selective: bool = False) -> torch.Tensor:
        """As Ling's ``DecoderLayer.forward`` (``selective``: the selectively checkpointed regions)."""
        if selective:
            from harts.models.common.compile import selective_layer_forward

            return selective_layer_forward(self)(h_TD, batch, token_weight_T, router)
        h_TD = h_TD + self.attention(self.input_layernorm(h_TD), batch)
        y, stats = self.mlp(self.post_attention_layernorm(h_TD), token_weight_T)
        return self.mlp.finish(h_TD + y, stats, router)

    def empty_cache(self, n: int, dtype: torch.dtype, device=None):
        """The decoding state this layer's mixer keeps for n empty sequences (harts.models.common.generate)."""
        return self.attention.empty_cache(n, dtype, device)

    def step(self, h_ND: torch.Tensor, cache, position_ids_N: torch.Tensor) -> torch.Tensor:
        """One decoding step of N sequences: ``forward`` with the mixer's ``step`` on its ``cache``."""
        h_ND = h_ND + self.attention.step(self.input_layernorm(h_ND), cache, position_ids_N)
        return h_ND + self.mlp(self.post_attention_layernorm(h_ND))[0]


# ------------------------------------------------------------------------------------------ init
def initial_value(module: nn.Module, attr: str, shape, cfg: Qwen35Config, generator: torch.Generator | None,
                  device=None) -> torch.Tensor:
    """The whole float32 initial tensor of ``module``'s parameter ``attr`` (transformers' scratch init):
    Linear/Embedding/router/experts N(0, initializer_range), zero-centred norms 0, the gated norm 1,
    A_log = log U(0.01, 16), dt_bias 1, conv U(+-1/sqrt(W)) (nn.Conv1d's default bound)."""
    t = torch.empty(tuple(shape), dtype=torch.float32, device=device)
    if attr == "weight" and isinstance(module, (nn.Linear, nn.Embedding, Router)):
        return t.normal_(0.0, cfg.initializer_range, generator=generator)
    if attr in ("gate_up_proj", "down_proj") and isinstance(module, Experts):
        return t.normal_(0.0, cfg.initializer_range, generator=generator)
    if attr == "weight" and isinstance(module, RMSNorm):
        return t.zero_()
    if attr == "weight" and isinstance(module, GatedRMSNorm):
        return t.fill_(1.0)
    if isinstance(module, GatedDeltaNet) and attr == "A_log":
        return t.uniform_(0.01, 16.0, generator=generator).log_()
    if isinstance(module, GatedDeltaNet) and attr == "dt_bias":
        return t.fill_(1.0)
    if attr == "weight" and isinstance(module, ShortConvWeight):
        bound = 1.0 / math.sqrt(t.shape[-1])
        return t.uniform_(-bound, bound, generator=generator)
    raise ValueError(f"no initial value defined for {type(module).__name__}.{attr}")


def initial_tensors(model: nn.Module, cfg: Qwen35Config, seed: int | None = None):
    """(tensor, its whole initial value) for every parameter and buffer of ``model``, each drawn from its own
    generator (``param_seed`` of the qualified name) when a seed is given (as Ling's, with Qwen's values)."""
    return common_init.initial_tensors(model, cfg, seed, initial_value)


def init_module_weights(model: nn.Module, cfg: Qwen35Config, seed: int | None = None) -> None:
    common_init.init_module_weights(model, cfg, seed, initial_value)
