"""Ling-3.0 blocks: RMSNorm, MLA, KDA, dense SwiGLU, MoE and the decoder layer, on packed token streams.

Legend: T packed tokens, D hidden, H heads, N sequences, E experts, K experts per token (MoE) or the
KDA key dim, P = H * head_dim (KDA width), Dqk = nope + rope (192), Dv value dim, R rope dim (64),
W short-convolution width.

Module and parameter names are the official checkpoint's (``attention.q_a_proj``, ``attention.dense``,
``mlp.gate.expert_bias``, ...) so the state dict maps onto the HF layout with one rule (experts are
stored stacked here and per expert in the checkpoint; see checkpoint.py).

Every block has one forward, and a sequence mixer's forward takes the batch description ``batch``:
``Packed`` trajectories (each its own varlen sequence) or a prefix-shared ``harts.CompactBatch``. The
mixer computes its per-row projections itself and runs its core on that layout: ``harts.ops`` for
packed trajectories, ``harts.runtime.compact`` (tree convolution, KDA rounds, MLA over ancestor rows,
context-parallel exchanges) for a compact batch. Row-wise parts (norms, projections, MoE) never look at
the layout. Router losses join the MoE output's backward (``AddRouterLoss``) and each call's router
statistics are kept on the MoE module.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from harts.models.common import init as common_init
from harts.models.ling.config import LingConfig
from harts.ops.attention import varlen_attention
from harts.ops.conv import short_conv
from harts.ops.kda import kda
from harts.ops.moe import RouterStats, grouped_experts_stacked, route, routed_experts, router_stats
from harts.ops.norm import gated_rms_norm, rms_norm


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass (e.g. a checkpoint recomputation)."""
    return torch._C._current_graph_task_id() != -1


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """Variance in fp32 (fp64 for fp64 input); the weight multiplies after the cast back, as in HF
    (the reference; the fast path is fla's fused kernel, see harts.ops.norm)."""

    def __init__(self, dim: int, eps: float, backend: str = "auto"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.backend)


class GatedRMSNorm(nn.Module):
    """KDA output norm: rmsnorm(o) * w * sigmoid(gate), all in fp32+, weight shared across heads."""

    def __init__(self, dim: int, eps: float, backend: str = "auto"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.backend = backend

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(o, gate, self.weight, self.eps, self.backend)


def rope_interleaved(x_THR: torch.Tensor, position_ids_T: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs (x_2i, x_2i+1) by pos * theta^(-2i/R), keeping the interleaved layout.

    The official code de-interleaves to [evens | odds] before rotating; applied to q and k alike, the
    permutation cancels in q.k, so attention is identical. Angles are computed in fp32 (fp64 for fp64).
    """
    R = x_THR.shape[-1]
    dt = _compute_dtype(x_THR.dtype)
    inv_freq = 1.0 / (theta ** (torch.arange(0, R, 2, device=x_THR.device, dtype=dt) / R))
    ang_TR2 = position_ids_T.to(dt)[:, None] * inv_freq[None, :]
    cos, sin = ang_TR2.cos()[:, None, :], ang_TR2.sin()[:, None, :]
    xf = x_THR.to(dt)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return out.to(x_THR.dtype)


class MLA(nn.Module):
    """Multi-head latent attention with q low-rank (or direct q_proj), interleaved RoPE on the rope
    slice, scale Dqk^-0.5, and a head-wise sigmoid output gate before ``dense``."""

    def __init__(self, cfg: LingConfig):
        super().__init__()
        self.cfg = cfg
        H, D = cfg.num_attention_heads, cfg.hidden_size
        self.H, self.nope, self.R, self.Dv = H, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.Dqk = cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * self.Dqk, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, cfg.op_backend("norm"))
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * self.Dqk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, cfg.kv_lora_rank + self.R, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, cfg.op_backend("norm"))
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (self.nope + self.Dv), bias=False)
        self.g_proj = nn.Linear(D, H, bias=False)
        self.dense = nn.Linear(H * self.Dv, D, bias=False)
        self.scale = self.Dqk ** -0.5

    def project(self, x_TD: torch.Tensor, position_ids_T: torch.Tensor):
        """Per-row q [T,H,Dqk], k [T,H,Dqk], v [T,H,Dv]; depends on the row and its position only. H is read off
        the projections' outputs (a tensor-parallel rank holds a share of the heads)."""
        T = x_TD.shape[0]
        if self.cfg.q_lora_rank is None:
            q = self.q_proj(x_TD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_TD)))
        q_THD = q.view(T, -1, self.Dqk)
        latent, k_rope = self.kv_a_proj_with_mqa(x_TD).split([self.cfg.kv_lora_rank, self.R], dim=-1)
        kv_THX = self.kv_b_proj(self.kv_a_layernorm(latent)).view(T, -1, self.nope + self.Dv)
        k_nope, v_THDv = kv_THX.split([self.nope, self.Dv], dim=-1)
        q_rope = rope_interleaved(q_THD[..., self.nope:], position_ids_T, self.cfg.rope_theta)
        k_rope = rope_interleaved(k_rope.view(T, 1, self.R), position_ids_T, self.cfg.rope_theta)
        q_THD = torch.cat((q_THD[..., : self.nope], q_rope), dim=-1)
        k_THD = torch.cat((k_nope, k_rope.expand(T, k_nope.shape[1], self.R)), dim=-1)
        return q_THD, k_THD, v_THDv

    def output(self, o_THDv: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
        gate_TH = torch.sigmoid(self.g_proj(x_TD).to(_compute_dtype(x_TD.dtype))).to(o_THDv.dtype)
        return self.dense((o_THDv * gate_TH[..., None]).flatten(1))

    def core(self, q, k, v, batch) -> torch.Tensor:
        """Attention over the layout (the only part that reads ``batch``): o [T, H, Dv]."""
        be = self.cfg.op_backend("attention")
        if batch.prefix_sharing:
            from harts.runtime.compact import mla_tree_attention

            return mla_tree_attention(q, k, v, batch, self.scale, be)
        return varlen_attention(q, k, v, batch.cu_seqlens, batch.cu_seqlens, self.scale, backend=be,
                                max_seqlen_q=batch.max_seqlen, max_seqlen_k=batch.max_seqlen,
                                cu_seqlens_cpu=batch.cu_seqlens_cpu)

    def forward(self, x_TD: torch.Tensor, batch) -> torch.Tensor:
        """``batch``: ``Packed`` trajectories or a ``harts.CompactBatch`` (rows = this rank's rows)."""
        proj = self.project(x_TD, batch.local_rows(batch.position_ids))
        return self.output(self.core(*proj, batch), x_TD)

    def empty_cache(self, n: int, dtype: torch.dtype, device=None):
        """Decoding state of n empty sequences (harts.models.common.generate): no keys and values yet."""
        from harts.models.common.generate import LayerCache

        return LayerCache(k=[torch.zeros(0, self.H, self.Dqk, dtype=dtype, device=device)] * n,
                          v=[torch.zeros(0, self.H, self.Dv, dtype=dtype, device=device)] * n)

    def step(self, x_ND: torch.Tensor, cache, position_ids_N: torch.Tensor) -> torch.Tensor:
        """One decoding step of N sequences (harts.models.common.generate): row n at ``position_ids_N[n]``
        attends to its cached keys and itself. ``cache.k`` / ``cache.v``: per-sequence lists of [t_n, H,
        Dqk] / [t_n, H, Dv]; the new row's key and value are appended by replacing the list entries (a
        forked cache that shares the old tensors is unaffected)."""
        q, k, v = self.project(x_ND, position_ids_N)
        cache.k = [torch.cat((kc, k[n:n + 1])) for n, kc in enumerate(cache.k)]
        cache.v = [torch.cat((vc, v[n:n + 1])) for n, vc in enumerate(cache.v)]
        lens = torch.tensor([0] + [kc.shape[0] for kc in cache.k], device=x_ND.device).cumsum(0)
        cu_q = torch.arange(len(cache.k) + 1, device=x_ND.device)
        o = varlen_attention(q, torch.cat(cache.k), torch.cat(cache.v), cu_q, lens, self.scale,
                             backend=self.cfg.op_backend("attention"))
        return self.output(o, x_ND)


class ShortConvWeight(nn.Module):
    """Holds a depthwise conv weight [P, 1, W] under the official name ``{q,k,v}_conv1d.weight``."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width))


class KDA(nn.Module):
    """Kimi Delta Attention with full-rank f/g projections and the safe (bounded) gate."""

    def __init__(self, cfg: LingConfig):
        super().__init__()
        self.cfg = cfg
        D, H, Kh = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        P = H * Kh
        self.H, self.Kh = H, Kh
        self.q_proj = nn.Linear(D, P, bias=False)
        self.k_proj = nn.Linear(D, P, bias=False)
        self.v_proj = nn.Linear(D, P, bias=False)
        self.q_conv1d = ShortConvWeight(P, cfg.short_conv_kernel_size)
        self.k_conv1d = ShortConvWeight(P, cfg.short_conv_kernel_size)
        self.v_conv1d = ShortConvWeight(P, cfg.short_conv_kernel_size)
        self.f_proj = nn.Linear(D, P, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        self.g_proj = nn.Linear(D, P, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(P))
        self.o_norm = GatedRMSNorm(Kh, cfg.rms_norm_eps, cfg.op_backend("norm"))
        self.o_proj = nn.Linear(P, D, bias=False)

    def project(self, x_TD: torch.Tensor):
        """Per-row q, k, v (before the short convolution), raw gate input f [T,H,Kh] and beta [T,H]
        (sigmoid applied, fp32+)."""
        q, k, v, f = (p(x_TD).view(x_TD.shape[0], -1, self.Kh)
                      for p in (self.q_proj, self.k_proj, self.v_proj, self.f_proj))
        return q, k, v, f, torch.sigmoid(self.b_proj(x_TD).to(_compute_dtype(x_TD.dtype)))

    def output(self, o_THV: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
        gate = self.g_proj(x_TD).view(o_THV.shape)
        return self.o_proj(self.o_norm(o_THV, gate).flatten(1))

    def core(self, q, k, v, f, beta, batch) -> torch.Tensor:
        """Short convolutions and the delta rule over the layout (the only part that reads ``batch``):
        o [T, H, Kh]."""
        conv_W = [c.weight.squeeze(1) for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]
        A_log, dt_bias = self.A_log, self.dt_bias
        if batch.prefix_sharing:
            from harts.runtime.compact import kda_tree

            return kda_tree(q, k, v, f, beta, conv_W, A_log, dt_bias, batch, self.cfg)
        be, cu, cu_cpu = self.cfg.op_backend("conv"), batch.cu_seqlens, batch.cu_seqlens_cpu
        q, k, v = (short_conv(t.flatten(1), w, cu, "silu", backend=be, cu_seqlens_cpu=cu_cpu).view(t.shape)
                   for t, w in zip((q, k, v), conv_W))
        o, _ = kda(q, k, v, f, beta, A_log, dt_bias, cu, lower_bound=self.cfg.kda_lower_bound,
                   chunk_size=self.cfg.kda_chunk_size, backend=self.cfg.op_backend("kda"), cu_seqlens_cpu=cu_cpu)
        return o

    def forward(self, x_TD: torch.Tensor, batch) -> torch.Tensor:
        """``batch``: ``Packed`` trajectories or a ``harts.CompactBatch`` (rows = this rank's rows)."""
        return self.output(self.core(*self.project(x_TD), batch), x_TD)

    def empty_cache(self, n: int, dtype: torch.dtype, device=None):
        """Decoding state of n empty sequences (harts.models.common.generate): zero convolution windows (the
        packed convolution's zero padding) and a zero delta-rule state in float32+."""
        from harts.models.common.generate import LayerCache

        P, W = self.H * self.Kh, self.cfg.short_conv_kernel_size
        conv = tuple(torch.zeros(n, W - 1, P, dtype=dtype, device=device) for _ in range(3))
        return LayerCache(conv=conv, state=torch.zeros(n, self.H, self.Kh, self.Kh, dtype=_compute_dtype(dtype),
                                                       device=device))

    def step(self, x_ND: torch.Tensor, cache, position_ids_N: torch.Tensor | None = None) -> torch.Tensor:
        """One decoding step of N sequences (harts.models.common.generate), the recurrent form of ``forward``
        in float32+ torch ops (positions are not read: the recurrence carries them). ``cache.conv``: the last
        W-1 pre-convolution q, k, v rows of each sequence ([N, W-1, P] each; zeros before its first token, as
        the packed convolution's zero padding);
        ``cache.state``: the delta-rule state [N, H, K, V]. Both are replaced, never written in place, so
        a forked cache that shares them is unaffected. Per head (harts.ops.kda):
        S <- diag(exp(g)) S;  S <- S + beta k (v - k^T S)^T;  o = q^T S."""
        q, k, v, f, beta = self.project(x_ND)
        N, dt = x_ND.shape[0], _compute_dtype(x_ND.dtype)
        convs, windows = (self.q_conv1d, self.k_conv1d, self.v_conv1d), []
        qkv = []
        for t, conv, prev_NWP in zip((q, k, v), convs, cache.conv):
            win_NWP = torch.cat((prev_NWP, t.reshape(N, 1, -1)), 1)
            y_NP = torch.einsum("nwp,pw->np", win_NWP, conv.weight.squeeze(1).to(win_NWP.dtype))
            qkv.append(F.silu(y_NP).view(t.shape))
            windows.append(win_NWP[:, 1:])
        cache.conv = tuple(windows)
        from harts.ops.kda.reference import kda_gate_reference, l2norm

        g_NHK = kda_gate_reference(f, self.A_log, self.dt_bias, self.cfg.kda_lower_bound)
        q_NHK = l2norm(qkv[0].to(dt)) * self.Kh ** -0.5
        k_NHK, v_NHV = l2norm(qkv[1].to(dt)), qkv[2].to(dt)
        S = cache.state.to(dt) * g_NHK.exp()[..., None]
        u_NHV = beta.to(dt)[..., None] * (v_NHV - torch.einsum("nhk,nhkv->nhv", k_NHK, S))
        S = S + k_NHK[..., None] * u_NHV[:, :, None, :]
        cache.state = S
        o = torch.einsum("nhk,nhkv->nhv", q_NHK, S).to(q.dtype)
        return self.output(o, x_ND)


class MLP(nn.Module):
    """SwiGLU (dense first layer and the shared expert)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Router weight [E, D] (a parameter) and the aux-loss-free expert bias (a persistent buffer, so it is
    saved and loaded but never seen by an optimizer)."""

    def __init__(self, cfg: LingConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32), persistent=True)


class Experts(nn.Module):
    """Routed experts, stacked: gate_up_proj [E, 2, F, D] (each expert's gate and up weights), down_proj
    [E, D, F]. ``forward`` is the SwiGLU of expert-major rows (``harts.ops.moe.grouped_experts_stacked``) and
    knows nothing of parallelism: expert parallelism wraps the module from outside
    (harts.train.expert_parallel), so its rows are then those its experts receive from every rank.

    Why gate and up in one parameter: the SwiGLU reads them as one grouped GEMM over [E, 2F, D] (the rows
    read once, N = 2F), faster than two under torch.compile (``python -m benchmarks.kernels --only
    experts``). Why on a dim of their own rather than as 2F rows (Qwen3.5's checkpoint layout): tensor
    parallelism then shards F of both with one ``Shard(2)``, each rank holding its slice of gate and of up."""

    stacked_weights = ("gate_up_proj", "down_proj")  # expert dim first (parallelisms shard it)

    def __init__(self, cfg: LingConfig):
        super().__init__()
        E, D, Fw = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2, Fw, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, Fw))
        self.backend = cfg.op_backend("moe")

    def forward(self, x_MD: torch.Tensor, counts_E: torch.Tensor, weight_M: torch.Tensor | None = None):
        """Expert e takes the ``counts_E[e]`` rows after those of the experts before it; ``weight_M`` (fp32+)
        scales each row's output."""
        return grouped_experts_stacked(x_MD, counts_E, self.gate_up_proj.flatten(1, 2), self.down_proj,
                                       self.backend, weight_M)


class AddRouterLoss(torch.autograd.Function):
    """y -> y in forward; backward also seeds the scalar router term (with ``seed``), so the term joins the
    loss inside the layer's own backward (which FSDP2's per-layer reduce-scatter, activation checkpointing
    and pipeline stages require). Under tensor parallelism every rank seeds the same term and the router's
    gradient is summed over the ranks, so the caller passes seed = 1 / tp (``router``'s third entry)."""

    @staticmethod
    def forward(ctx, y, term, seed: float = 1.0):
        ctx.term_meta = (term.shape, term.dtype, term.device, seed)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad_y):
        shape, dtype, device, seed = ctx.term_meta
        return grad_y, torch.full(shape, seed, dtype=dtype, device=device), None


def router_term(st: RouterStats, router: tuple, moe_index: int) -> torch.Tensor:
    """One MoE layer's share of the step's router loss for one microbatch (see harts.rl.losses).

    router = (coef_2, f_LE): coef = (c_z, c_aux) / (W * MoE layers); f_LE the detached load fractions of
    the previous step's global counts (or None: no balance term). z: W_b * z_b. Balance: W_b * (f_prev .
    P_b), linear in the microbatch (P_b is a weighted mean over its rows), so the step's sum does not
    depend on the split.
    """
    coef, f_LE = router[:2]
    c = coef.to(st.z_loss.dtype)
    term = st.weight_sum * c[0] * st.z_loss
    if f_LE is not None:
        term = term + st.weight_sum * c[1] * (f_LE[moe_index].to(st.P_E.dtype) * st.P_E).sum()
    return term


class MoE(nn.Module):
    """Routed experts + shared experts. ``moe_index`` is the layer's position among the model's MoE
    layers (its row of the router-loss and count tensors). ``forward`` returns the output and the call's
    router statistics; ``finish`` (called by the decoder layer on the residual sum) keeps the statistics
    and joins the router loss to the backward. The routed experts run as the module ``experts`` on
    expert-major rows (``harts.ops.moe.routed_experts``), which expert parallelism wraps from outside."""

    def __init__(self, cfg: LingConfig, moe_index: int = 0):
        super().__init__()
        self.cfg = cfg
        self.moe_index = moe_index
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size * cfg.num_shared_experts)
        self.last_stats: RouterStats | None = None

    def finish(self, y: torch.Tensor, stats: RouterStats, router: tuple | None) -> torch.Tensor:
        """Keep ``stats`` as ``last_stats`` (outside backward) and, with ``router`` = (coef_2, f_LE or None[,
        seed]), join this call's router loss (``router_term``, its backward seeded with ``seed``, default 1) to
        ``y``'s backward. ``y`` may be any tensor whose
        gradient is the MoE output's (e.g. the residual sum after it). Inside backward a checkpointing
        recomputation keeps the forward's statistics (same values) so as not to pin the recomputed graph
        (one layer's activations per MoE layer, ~100 GB at 64K tokens)."""
        if not _in_backward():
            self.last_stats = stats
        if router is not None:
            seed = router[2] if len(router) > 2 else 1.0
            y = AddRouterLoss.apply(y, router_term(stats, router, self.moe_index), seed)
        return y

    def forward(self, x_TD: torch.Tensor, token_weight_T: torch.Tensor | None = None):
        """Routing, routed and shared experts: (y_TD, router statistics weighted by ``token_weight_T``, the
        rows' multiplicities); no module state is written."""
        c = self.cfg
        logits, scores, idx_TK, w_TK = route(
            x_TD, self.gate.weight, self.gate.expert_bias, n_group=c.n_group, topk_group=c.topk_group,
            top_k=c.num_experts_per_tok, routed_scaling_factor=c.routed_scaling_factor,
            norm_topk_prob=c.norm_topk_prob)
        stats = router_stats(logits, scores, idx_TK, token_weight_T)
        y = routed_experts(x_TD, idx_TK, w_TK, self.experts, c.num_experts, c.op_backend("moe"))
        return y + self.shared_experts(x_TD), stats


class DecoderLayer(nn.Module):
    """Pre-norm block: h + mixer(norm(h), batch), then h + mlp(norm(h)). Every row-wise part runs
    unchanged on packed tokens or compact rows; only the mixer reads ``batch``. Parallel wrappers (FSDP2,
    checkpointing, compile, TP hooks on ``attention`` and ``mlp``) attach to the module calls."""

    def __init__(self, cfg: LingConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.kind = cfg.layer_type(layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.op_backend("norm"))
        self.attention = MLA(cfg) if self.kind == "mla" else KDA(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.op_backend("norm"))
        if cfg.mlp_type(layer_idx) == "moe":
            self.mlp = MoE(cfg, sum(cfg.mlp_type(i) == "moe" for i in range(layer_idx)))
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    @property
    def region_kind(self) -> tuple[str, str]:
        """The (pre, post) region families that run this layer compiled or under selective checkpointing
        (harts.models.common.compile): ``pre_mla`` / ``pre_kda``, ``post_moe`` / ``post_dense``."""
        return self.kind, ("moe" if isinstance(self.mlp, MoE) else "dense")

    def forward(self, h_TD: torch.Tensor, batch, token_weight_T: torch.Tensor | None = None,
                router: tuple | None = None, *, selective: bool = False) -> torch.Tensor:
        """``batch``: ``Packed`` or a ``harts.CompactBatch``; ``token_weight_T`` and ``router``: see MoE;
        ``selective``: run as selectively checkpointed regions (harts.models.common.compile)."""
        if selective:
            from harts.models.common.compile import selective_layer_forward

            return selective_layer_forward(self)(h_TD, batch, token_weight_T, router)
        h_TD = h_TD + self.attention(self.input_layernorm(h_TD), batch)
        x = self.post_attention_layernorm(h_TD)
        if isinstance(self.mlp, MoE):
            y, stats = self.mlp(x, token_weight_T)
            return self.mlp.finish(h_TD + y, stats, router)
        return h_TD + self.mlp(x)

    def empty_cache(self, n: int, dtype: torch.dtype, device=None):
        """The decoding state this layer's mixer keeps for n empty sequences (harts.models.common.generate)."""
        return self.attention.empty_cache(n, dtype, device)

    def step(self, h_ND: torch.Tensor, cache, position_ids_N: torch.Tensor) -> torch.Tensor:
        """One decoding step of N sequences: ``forward`` with the mixer's ``step`` on its ``cache``."""
        h_ND = h_ND + self.attention.step(self.input_layernorm(h_ND), cache, position_ids_N)
        x = self.post_attention_layernorm(h_ND)
        return h_ND + (self.mlp(x)[0] if isinstance(self.mlp, MoE) else self.mlp(x))


def initial_value(module: nn.Module, attr: str, shape, cfg: LingConfig, generator: torch.Generator | None,
                  device=None) -> torch.Tensor:
    """The whole float32 initial tensor of ``module``'s parameter or buffer ``attr`` (``shape`` is the
    full, unsharded shape). Scratch-training init (transformers' BailingHybrid choices; official code
    leaves some unspecified): Linear/Embedding/router/experts N(0, initializer_range), norms 1, expert
    bias 0, A_log = log U(1, 16), dt_bias = inverse-softplus of dt ~ logU(1e-3, 1e-1), conv U(+-1/sqrt(W))
    (nn.Conv1d's default bound)."""
    t = torch.empty(tuple(shape), dtype=torch.float32, device=device)
    std = cfg.initializer_range
    if attr == "weight" and isinstance(module, (nn.Linear, nn.Embedding, Router)):
        return t.normal_(0.0, std, generator=generator)
    if attr in ("gate_up_proj", "down_proj") and isinstance(module, Experts):
        return t.normal_(0.0, std, generator=generator)
    if attr == "weight" and isinstance(module, (RMSNorm, GatedRMSNorm)):
        return t.fill_(1.0)
    if attr == "expert_bias" and isinstance(module, Router):
        return t.zero_()
    if attr == "weight" and isinstance(module, ShortConvWeight):
        bound = 1.0 / math.sqrt(t.shape[-1])
        return t.uniform_(-bound, bound, generator=generator)
    if attr == "A_log" and isinstance(module, KDA):
        return t.uniform_(1.0, 16.0, generator=generator).log()
    if attr == "dt_bias" and isinstance(module, KDA):
        dt = t.uniform_(math.log(1e-3), math.log(1e-1), generator=generator).exp().clamp_min(1e-4)
        return dt + torch.log(-torch.expm1(-dt))
    raise ValueError(f"no initial value defined for {type(module).__name__}.{attr}")


def initial_tensors(model: nn.Module, cfg: LingConfig, seed: int | None = None):
    """Ling-3.0's initial values (``initial_value``) of every parameter and buffer of ``model``
    (``harts.models.common.init.initial_tensors``)."""
    return common_init.initial_tensors(model, cfg, seed, initial_value)


def init_module_weights(model: nn.Module, cfg: LingConfig, seed: int | None = None) -> None:
    """Initialise every parameter and buffer of ``model`` in place with Ling-3.0's initial values."""
    common_init.init_module_weights(model, cfg, seed, initial_value)
