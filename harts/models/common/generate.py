"""Incremental decoding of HARTS causal LMs (Ling-3.0, Qwen3.5-MoE): batched token steps, seeded sampling,
and forkable state.

This is the reference path: plain torch ops on any device and dtype (float64 on CPU is exact against
the training forward; float32 works too), one token per sequence per step, no fused decoding kernels.

State per sequence (``DecodeCache``): one ``LayerCache`` per decoder layer, of the kind its sequence mixer
asks for (``layer.empty_cache``): a recurrent mixer (Ling's KDA, Qwen3.5's Gated DeltaNet) keeps the last
W-1 pre-convolution rows of its convolved channels (the short convolution's window) and the delta-rule
state [H, K, Dv]; an attention mixer (Ling's MLA, Qwen3.5's gated attention) keeps its keys and values
so far. The cache also holds the position (tokens fed) and the next-token logits. Each layer advances its
own state (``layer.step``); this module never looks at the layer types. ``DecodeCache.fork(rows)`` copies
rows (a row may repeat: k branches of one sequence), so the branches of a rollout tree continue from a
shared prefix that was computed once. Forking copies no tensor data: every step replaces state tensors
instead of writing into them, so branches never see each other's tokens.

Sampling (``sample``): temperature and nucleus (top-p) with a seeded ``torch.Generator``, one uniform
draw per row and step whatever the distribution (inverse CDF), so two runs whose models agree to
rounding draw the same tokens; a logit of -inf masks a token. It returns the sampler's log-probs (of
the tempered, truncated distribution it drew from), the policy's log-probs at temperature 1 (PPO's old
log-probs when the sampler is the policy itself: temperature 1, top_p 1) and the policy's entropy.

Legend: N sequences of a cache, M rows fed in one call (a subset of N), V vocab, D hidden, H heads of a
layer's state, K its key dim, Dv its value dim, C its convolved channels, W short-convolution width,
t_n tokens of sequence n so far.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Sampling", "LayerCache", "DecodeCache", "feed", "feed_sequences", "sample", "generate", "Generation"]


@dataclass
class LayerCache:
    """One decoder layer's decoding state for N sequences: a recurrent mixer's (``conv``, ``state``) or an
    attention mixer's (``k``, ``v``). The mixer's ``empty_cache`` says which, and its shapes."""

    conv: tuple[torch.Tensor, ...] | None = None  # each [N, W-1, C]: rows before the convolution
    state: torch.Tensor | None = None  # [N, H, K, Dv] (float32+)
    k: list[torch.Tensor] | None = None  # N x [t_n, H, Dk]
    v: list[torch.Tensor] | None = None  # N x [t_n, H, Dv]

    def __post_init__(self):
        given = [f for f in ("conv", "state", "k", "v") if getattr(self, f) is not None]
        if given not in (["conv", "state"], ["k", "v"]):
            raise ValueError("LayerCache: give either conv and state (a recurrent mixer) or k and v (an attention "
                             f"mixer), got {given}")

    def take(self, rows_M: torch.Tensor, rows: list[int]) -> "LayerCache":
        if self.k is not None:
            return LayerCache(k=[self.k[i] for i in rows], v=[self.v[i] for i in rows])
        return LayerCache(conv=tuple(c.index_select(0, rows_M) for c in self.conv),
                          state=self.state.index_select(0, rows_M))

    def put(self, rows_M: torch.Tensor, rows: list[int], sub: "LayerCache") -> None:
        """Write ``sub`` (the state of ``rows``) back, as new tensors (forks sharing the old ones stay valid)."""
        if self.k is not None:
            k, v = list(self.k), list(self.v)
            for j, i in enumerate(rows):
                k[i], v[i] = sub.k[j], sub.v[j]
            self.k, self.v = k, v
        else:
            self.conv = tuple(c.index_copy(0, rows_M, s) for c, s in zip(self.conv, sub.conv))
            self.state = self.state.index_copy(0, rows_M, sub.state)


class DecodeCache:
    """Decoding state of N sequences of one model (see the module docstring)."""

    def __init__(self, layers: list[LayerCache], lengths_N: torch.Tensor, logits_NV: torch.Tensor):
        self.layers, self.lengths, self.logits = layers, lengths_N, logits_NV

    @classmethod
    def empty(cls, model, n: int) -> "DecodeCache":
        """N empty sequences for ``model`` (a whole causal LM), on its device; each layer's cache is the one
        its mixer asks for (``layer.empty_cache``), recurrent state in float32+."""
        _check_model(model)
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"DecodeCache.empty: n = {n!r} must be an integer >= 0")
        w = model.lm_head.weight
        cdt = torch.promote_types(w.dtype, torch.float32)
        layers = []
        for layer in model.decoder_layers():
            lc = layer.empty_cache(n, dtype=w.dtype, device=w.device)
            if not isinstance(lc, LayerCache):
                raise TypeError(f"layer {layer.layer_idx}: empty_cache returned {type(lc).__name__}, not a LayerCache")
            layers.append(lc)
        lengths = torch.zeros(n, dtype=torch.long, device=w.device)
        logits = torch.full((n, model.config.vocab_size), float("nan"), dtype=cdt, device=w.device)
        return cls(layers, lengths, logits)

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def _rows(self, rows) -> tuple[torch.Tensor, list[int]]:
        rows_M = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        n = len(self)
        if rows_M.numel() and (int(rows_M.min()) < 0 or int(rows_M.max()) >= n):
            bad = int(rows_M[(rows_M < 0) | (rows_M >= n)][0])
            raise ValueError(f"DecodeCache: row {bad} is out of range for a cache of {n} sequences")
        return rows_M.to(self.lengths.device), rows_M.tolist()

    def fork(self, rows) -> "DecodeCache":
        """A cache of the sequences ``rows`` (in that order; repeats allowed: ``[0, 0, 0]`` continues
        sequence 0 in three branches). Shares tensors with this cache; neither sees the other's steps."""
        rows_M, rl = self._rows(rows)
        return DecodeCache([c.take(rows_M, rl) for c in self.layers], self.lengths.index_select(0, rows_M),
                           self.logits.index_select(0, rows_M))

    def put(self, rows, sub: "DecodeCache") -> None:
        """Replace the state of ``rows`` (distinct) by ``sub``'s (``sub`` = a fork of those rows, advanced)."""
        rows_M, rl = self._rows(rows)
        if len(set(rl)) != len(rl) or len(sub) != len(rl):
            raise ValueError(f"DecodeCache.put: rows must be distinct and match the {len(sub)} sequences of sub")
        for c, s in zip(self.layers, sub.layers):
            c.put(rows_M, rl, s)
        self.lengths = self.lengths.index_copy(0, rows_M, sub.lengths)
        self.logits = self.logits.index_copy(0, rows_M, sub.logits)

    @staticmethod
    def cat(caches: list["DecodeCache"]) -> "DecodeCache":
        """The sequences of several caches of the same model, in order."""
        if not caches:
            raise ValueError("DecodeCache.cat: no caches")
        layers = []
        for parts in zip(*(c.layers for c in caches)):
            if parts[0].k is not None:
                layers.append(LayerCache(k=[t for p in parts for t in p.k], v=[t for p in parts for t in p.v]))
            else:
                layers.append(LayerCache(conv=tuple(torch.cat(cs) for cs in zip(*(p.conv for p in parts))),
                                         state=torch.cat([p.state for p in parts])))
        return DecodeCache(layers, torch.cat([c.lengths for c in caches]), torch.cat([c.logits for c in caches]))


def _embeddings(model):
    return getattr(model.model, model.model.embedding_attr, None)


def _check_model(model) -> None:
    from harts.models.common.causal_lm import CausalLM

    if not isinstance(model, CausalLM):
        raise TypeError("generation needs a causal LM (LingForCausalLM, Qwen35ForCausalLM), got "
                        f"{type(model).__name__}")
    if _embeddings(model) is None or model.model.norm is None or getattr(model, "lm_head", None) is None:
        raise ValueError("generation needs the whole model (embeddings, every layer, final norm and LM head), "
                         "not a pipeline stage")


@torch.no_grad()
def _step(model, cache: DecodeCache, tokens_N: torch.Tensor) -> None:
    """Feed one token to every sequence of ``cache``."""
    h_ND = _embeddings(model)(tokens_N)
    pos_N = cache.lengths
    for layer, lc in zip(model.decoder_layers(), cache.layers):
        h_ND = layer.step(h_ND, lc, pos_N)
    cache.logits = model.logits(model.model.norm(h_ND))
    cache.lengths = cache.lengths + 1


def feed(model, cache: DecodeCache, tokens_M, rows=None) -> None:
    """Feed ``tokens_M[j]`` to sequence ``rows[j]`` (default: one token to every sequence, in order); the
    other sequences do not move. Afterwards ``cache.logits[rows]`` predict each row's next token."""
    _check_model(model)
    dev = cache.lengths.device
    tokens_M = torch.as_tensor(tokens_M, dtype=torch.long).reshape(-1).to(dev)
    V = model.config.vocab_size
    if tokens_M.numel() and (int(tokens_M.min()) < 0 or int(tokens_M.max()) >= V):
        bad = int(tokens_M[(tokens_M < 0) | (tokens_M >= V)][0])
        raise ValueError(f"feed: token id {bad} is out of range for vocab_size={V}")
    if rows is None:
        if tokens_M.numel() != len(cache):
            raise ValueError(f"feed: {tokens_M.numel()} tokens for a cache of {len(cache)} sequences (pass rows)")
        _step(model, cache, tokens_M)
        return
    rows_M, rl = cache._rows(rows)
    if len(rl) != tokens_M.numel():
        raise ValueError(f"feed: {tokens_M.numel()} tokens for {len(rl)} rows")
    if len(rl) == len(cache) and rl == list(range(len(cache))):
        _step(model, cache, tokens_M)
        return
    sub = cache.fork(rows_M)
    _step(model, sub, tokens_M)
    cache.put(rows_M, sub)


def feed_sequences(model, cache: DecodeCache, sequences, rows=None) -> list[torch.Tensor]:
    """Teacher-forced: feed ``sequences[j]`` (token ids) to sequence ``rows[j]`` (default row j), all rows
    in one batch per position. Returns per row the log-probs [len] (float32+) of each fed token given
    everything before it; a token fed to an empty sequence has no prediction (NaN)."""
    rl = list(range(len(sequences))) if rows is None else list(rows)
    if len(rl) != len(sequences):
        raise ValueError(f"feed_sequences: {len(sequences)} sequences for {len(rl)} rows")
    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
    out = [torch.full((s.numel(),), float("nan"), dtype=cache.logits.dtype) for s in seqs]
    for i in range(max((s.numel() for s in seqs), default=0)):
        live = [j for j, s in enumerate(seqs) if s.numel() > i]
        r = [rl[j] for j in live]
        toks = torch.stack([seqs[j][i] for j in live])
        rows_M, _ = cache._rows(r)
        logp_MV = torch.log_softmax(cache.logits.index_select(0, rows_M), -1).cpu()
        for m, j in enumerate(live):
            out[j][i] = logp_MV[m, toks[m]]
        feed(model, cache, toks, r)
    return out


@dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (argmax); top_p 1: no truncation."""

    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"Sampling.temperature = {self.temperature!r} must be a finite number >= 0")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"Sampling.top_p = {self.top_p!r} must lie in (0, 1]")


def sample(logits_NV: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None):
    """Draw one token per row: (tokens_N, sampler_logp_N, policy_logp_N, entropy_N), log-probs and entropy
    in float32+. Greedy rows have sampler log-prob 0 (a deterministic choice). One uniform per row is
    drawn from ``generator`` in every case, so the random stream does not depend on the logits."""
    if logits_NV.dim() != 2:
        raise ValueError(f"sample: logits must be [N, V], got {tuple(logits_NV.shape)}")
    if torch.isnan(logits_NV).any() or (logits_NV == float("inf")).any() or (logits_NV == float("-inf")).all(-1).any():
        raise ValueError("sample: logits hold NaN, +inf or a row of -inf (was a token fed to every sequence first?)")
    dt = torch.promote_types(logits_NV.dtype, torch.float32)
    logits = logits_NV.to(dt)
    logp_NV = torch.log_softmax(logits, -1)
    entropy_N = -torch.where(logp_NV > float("-inf"), logp_NV.exp() * logp_NV, 0.0).sum(-1)
    u_N = torch.rand(logits.shape[0], dtype=torch.float64, generator=generator,
                     device=generator.device if generator is not None else logits.device).to(logits.device)
    if sampling.temperature == 0:
        tok_N = logits.argmax(-1)
        return tok_N, torch.zeros_like(entropy_N), logp_NV.gather(1, tok_N[:, None]).squeeze(1), entropy_N
    slogp_NV = torch.log_softmax(logits / sampling.temperature, -1)
    if sampling.top_p < 1:
        p_sorted, order = slogp_NV.exp().sort(dim=-1, descending=True, stable=True)
        keep_sorted = (p_sorted.cumsum(-1) - p_sorted) < sampling.top_p  # the smallest prefix reaching top_p
        keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
        slogp_NV = torch.log_softmax(slogp_NV.masked_fill(~keep, float("-inf")), -1)
    cdf_NV = slogp_NV.exp().to(torch.float64).cumsum(-1)
    tok_N = torch.searchsorted(cdf_NV, (u_N * cdf_NV[:, -1])[:, None]).squeeze(1)
    tok_N = torch.minimum(tok_N, torch.tensor(logits.shape[1] - 1, device=tok_N.device))
    tok_N = torch.where(slogp_NV.gather(1, tok_N[:, None]).squeeze(1) > float("-inf"), tok_N,
                        slogp_NV.argmax(-1))  # a draw on a zero-width bucket edge (u = 0) picks the mode
    return (tok_N, slogp_NV.gather(1, tok_N[:, None]).squeeze(1), logp_NV.gather(1, tok_N[:, None]).squeeze(1),
            entropy_N)


@dataclass
class Generation:
    """Per sequence: the new tokens, the sampler's and the policy's log-probs of each, and the entropy."""

    tokens: list[torch.Tensor]
    sampler_logprobs: list[torch.Tensor]
    logprobs: list[torch.Tensor]
    entropy: list[torch.Tensor]


def generate(model, prompts, max_new_tokens: int, sampling: Sampling = Sampling(),
             generator: torch.Generator | None = None, stop_ids=(), cache: DecodeCache | None = None) -> Generation:
    """Batched sampling: feed every prompt (into ``cache`` if given, else a new one, one row per prompt),
    then draw up to ``max_new_tokens`` per sequence; a sequence stops after drawing one of ``stop_ids``
    (kept in its output). The cache ends holding every fed token (the last drawn token is not fed)."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens = {max_new_tokens!r} must be an integer >= 0")
    if cache is None:
        cache = DecodeCache.empty(model, len(prompts))
    if len(cache) != len(prompts):
        raise ValueError(f"generate: {len(prompts)} prompts for a cache of {len(cache)} sequences")
    model_training = model.training
    model.eval()
    try:
        feed_sequences(model, cache, prompts)
        stops = set(int(s) for s in stop_ids)
        outs = [[[] for _ in prompts] for _ in range(4)]
        live = list(range(len(prompts)))
        for i in range(max_new_tokens):
            rows_M, _ = cache._rows(live)
            tok, slp, lp, ent = sample(cache.logits.index_select(0, rows_M), sampling, generator)
            for m, j in enumerate(live):
                for o, val in zip(outs, (tok, slp, lp, ent)):
                    o[j].append(val[m])
            live_next = [j for m, j in enumerate(live) if int(tok[m]) not in stops]
            if i + 1 < max_new_tokens and live_next:
                keep = [m for m, j in enumerate(live) if int(tok[m]) not in stops]
                feed(model, cache, tok[keep], live_next)
            live = live_next
            if not live:
                break
    finally:
        model.train(model_training)
    stack = lambda xs, dt: torch.stack(xs).cpu() if xs else torch.zeros(0, dtype=dt)
    fdt = cache.logits.dtype
    return Generation([stack(x, torch.long) for x in outs[0]], [stack(x, fdt) for x in outs[1]],
                      [stack(x, fdt) for x in outs[2]], [stack(x, fdt) for x in outs[3]])
