"""What every HARTS causal LM shares above its decoder stack (Ling-3.0, Qwen3.5-MoE): parameter counts, the
forward to final hidden states, logits and chunked token log-probs, HARTS log-probs of a batch, and access to
the decoder layers and their MoE router statistics.

A model subclasses ``CausalLM`` and sets ``config``, ``model`` (its decoder stack, whose class declares
``embedding_attr``: the token embedding's attribute) and ``lm_head``, and defines ``moe_layers()``.

Legend: T packed tokens, P compact rows, D hidden, S semantic positions, L MoE layers, E experts.
"""
from __future__ import annotations

import torch
from torch import nn

from harts.ops.backend import resolve

__all__ = ["CausalLM"]


class CausalLM(nn.Module):
    def num_params(self, active: bool = False, embeddings: bool = True) -> int:
        """Total (or per-token active) parameter count; buffers (e.g. a router's expert bias) do not count."""
        c, emb = self.config, self.model.embedding_attr
        total = 0
        for name, p in self.named_parameters():
            if not embeddings and (emb in name or name.startswith("lm_head")):
                continue
            n = p.numel()
            if active and ".mlp.experts." in name:
                n = n // c.num_experts * c.num_experts_per_tok
            total += n
        return total

    def compile(self, *, backend: str = "inductor", dynamic: bool | None = True, fullgraph: bool = True):
        """torch.compile every decoder layer in place (``harts.models.common.compile.compile_model``: compiled
        per-row regions around the eager sequence-mixer cores) and return its ``CompileReport``."""
        from harts.models.common.compile import compile_model

        return compile_model(self, backend=backend, dynamic=dynamic, fullgraph=fullgraph)

    # ------------------------------------------------------------------ HF checkpoints
    @classmethod
    def from_pretrained(cls, path, **kwargs) -> "CausalLM":
        """A model of this class's family from an HF folder (``harts.models.family``: the family's
        ``load_pretrained``, e.g. ``device``, ``dtype``; Ling-3.0's official / transformers' bailing_hybrid
        layouts, Qwen3.5-MoE's transformers and released layouts)."""
        from harts.models.family import FAMILIES

        fam = next((f for f in FAMILIES.values() if issubclass(cls, f.model_class)), None)
        if fam is None:
            raise TypeError(f"{cls.__name__} belongs to no model family (harts.models.family.FAMILIES)")
        return fam.load_pretrained(path, **kwargs)

    def save_pretrained(self, path, **kwargs) -> None:
        """config.json + safetensors shards in the family's HF layout (what transformers loads)."""
        from harts.models.family import family_of

        family_of(self).save_pretrained(self, path, **kwargs)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids_T: torch.Tensor | None = None, position_ids_T: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, token_weight_T: torch.Tensor | None = None,
                max_seqlen: int | None = None, *, layout=None, router: tuple | None = None,
                hidden_PD: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states [T, D] of a packed stream, or [P, D] of a ``layout`` (a CompactBatch).
        ``token_weight_T`` (multiplicity per row, default ones) only weights the router statistics;
        ``max_seqlen`` (optional) avoids a host sync in the fast attention path; ``router`` adds the
        router losses to the backward (see the model's MoE); ``hidden_PD``: see the decoder stack's forward."""
        return self.model(input_ids_T, position_ids_T, cu_seqlens, token_weight_T, max_seqlen, layout=layout,
                          router=router, hidden_PD=hidden_PD)

    def logits(self, hidden_TD: torch.Tensor) -> torch.Tensor:
        """Full logits in fp32+ (small inputs / tests only)."""
        return self.lm_head(hidden_TD).to(torch.promote_types(hidden_TD.dtype, torch.float32))

    def token_logprobs(self, hidden_TD: torch.Tensor, targets_S: torch.Tensor,
                       rows_S: torch.Tensor | None = None) -> torch.Tensor:
        """log p(targets_S[s] | row rows_S[s]) in fp32+; no [S, V] fp32 tensor is kept.

        The one log-prob path of the library (trainer, benchmarks, HARTS batches): the fused
        ``harts.ops.compact_logprobs`` (blocked GEMMs with an online log-sum-exp, one log-sum-exp per
        row) where the ``logprobs`` op backend resolves to fast, else the chunked, checkpointed torch
        reference (``logprobs_chunk_size`` rows at a time)."""
        from harts.models.common.logprobs import compact_logprobs_reference  # (harts.models.ling imports this module)

        if rows_S is None:
            rows_S = torch.arange(hidden_TD.shape[0], device=hidden_TD.device)
        weight_VD = self.lm_head.weight
        if (hidden_TD.dtype != weight_VD.dtype and not torch.is_autocast_enabled(hidden_TD.device.type)):
            raise TypeError(f"token_logprobs: hidden states are {hidden_TD.dtype} but lm_head.weight is "
                            f"{weight_VD.dtype}: run the model in one dtype (model.to(dtype)) or under torch.autocast")
        if rows_S.shape[0] == 0:
            # No positions: an empty result that is still on the graph (a zero-sized product with the hidden
            # states and the head), so a loss over it backpropagates, giving zero gradients
            empty = hidden_TD[:0] @ weight_VD[:1].t()
            return empty.view(0).to(torch.promote_types(hidden_TD.dtype, torch.float32))
        if resolve("logprobs", self.config.op_backend("logprobs"), hidden_TD.device, hidden_TD.dtype) == "fast":
            from harts.ops.logprobs import compact_logprobs

            return compact_logprobs(hidden_TD, weight_VD, rows_S, targets_S)
        return compact_logprobs_reference(hidden_TD, weight_VD, rows_S, targets_S,
                                          chunk_size=self.config.logprobs_chunk_size)

    def token_logprobs_and_entropies(self, hidden_TD: torch.Tensor, targets_S: torch.Tensor,
                                     rows_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log p(targets_S[s] | row rows_S[s]), entropy of that row's next-token distribution), both [S] in
        fp32+, from one LM-head product per chunk of ``logprobs_chunk_size`` positions, each chunk checkpointed
        (its [B, V] logits are rebuilt in backward), so no [S, V] fp32 tensor is kept. Both are differentiable."""
        from harts.ops.recompute import recompute_in_backward

        weight_VD = self.lm_head.weight
        if (hidden_TD.dtype != weight_VD.dtype and not torch.is_autocast_enabled(hidden_TD.device.type)):
            raise TypeError(f"token_logprobs_and_entropies: hidden states are {hidden_TD.dtype} but lm_head.weight "
                            f"is {weight_VD.dtype}: run the model in one dtype (model.to(dtype)) or under "
                            "torch.autocast")
        V = weight_VD.shape[0]
        if targets_S.numel() and (int(targets_S.min()) < 0 or int(targets_S.max()) >= V):
            raise ValueError(f"token_logprobs_and_entropies: targets out of range [0, {V}): min "
                             f"{int(targets_S.min())}, max {int(targets_S.max())}")
        dt = torch.promote_types(hidden_TD.dtype, torch.float32)
        if rows_S.shape[0] == 0:  # still on the graph, so a loss over it backpropagates zeros
            empty = (hidden_TD[:0] @ weight_VD[:1].t()).view(0).to(dt)
            return empty, empty.clone()
        need_grad = torch.is_grad_enabled() and (hidden_TD.requires_grad or weight_VD.requires_grad)
        B = self.config.logprobs_chunk_size
        lps, ents = [], []
        for s0 in range(0, rows_S.numel(), B):
            h, t = hidden_TD[rows_S[s0:s0 + B]], targets_S[s0:s0 + B]
            lp, ent = (recompute_in_backward(_chunk_logprobs_entropy, h, weight_VD, t) if need_grad
                       else _chunk_logprobs_entropy(h, weight_VD, t))
            lps.append(lp), ents.append(ent)
        return torch.cat(lps), torch.cat(ents)

    # ------------------------------------------------------------------ HARTS batches
    def logprobs(self, batch, router: tuple | None = None, *, return_entropies: bool = False,
                 return_router_stats: bool = False, temperature: float = 1.0):
        """Log-probs of every nonterminal semantic position of a ``harts.CompactBatch`` in original
        order (use ``batch.split`` for per-trajectory tensors; under context parallelism the positions of
        other ranks' rows are zero). Runs the compact path for a HARTS batch and the packed path for a
        trajectory-wise one; no [S, V] tensor is built. ``router``: see the model's MoE.

        ``return_entropies=True``: (log-probs, entropies) from the same forward, both from the same chunked fp32
        logits of the scored rows (``token_logprobs_and_entropies``; this replaces the fused log-prob kernel).
        ``return_router_stats=True`` appends that forward's ``router_stats()`` list: (log-probs, stats) or
        (log-probs, entropies, stats). ``temperature``: of the distribution the values are of, softmax(logits / T)
        (the LM head has no bias, so the hidden states are divided by T)."""
        from harts.runtime.compact import hidden_states, logprobs

        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"logprobs: temperature={temperature!r} must be a number > 0")
        if not return_entropies and temperature == 1:
            lp = logprobs(self, batch, router=router)
            return (lp, self.router_stats()) if return_router_stats else lp
        h = hidden_states(self, batch, router)
        if temperature != 1:
            h = h / temperature
        if not return_entropies:
            lp = logprobs(self, batch, hidden_PD=h)
            return (lp, self.router_stats()) if return_router_stats else lp
        pair_of = batch.logprob_pair_of
        rows, targets = ((batch.logprob_rows, batch.logprob_targets) if pair_of is None
                         else (batch.logprob_pair_rows, batch.logprob_pair_targets))
        cp = batch.cp
        if cp is not None:  # own rows only; other ranks' positions are zero (sum over the CP group)
            lo, hi = cp.row_range
            idx = ((rows >= lo) & (rows < hi)).nonzero().squeeze(1)
            lp_own, ent_own = self.token_logprobs_and_entropies(h, targets[idx], rows[idx] - lo)
            lp = lp_own.new_zeros(rows.shape[0]).index_copy(0, idx, lp_own)
            ent = ent_own.new_zeros(rows.shape[0]).index_copy(0, idx, ent_own)
        else:
            lp, ent = self.token_logprobs_and_entropies(h, targets, rows)
        if pair_of is not None:
            lp, ent = lp.index_select(0, pair_of), ent.index_select(0, pair_of)
        return (lp, ent, self.router_stats()) if return_router_stats else (lp, ent)

    # ------------------------------------------------------------------ layers and MoE
    def decoder_layers(self) -> list[nn.Module]:
        """The decoder layers this module holds (all, or a pipeline stage's, kept under their indices)."""
        layers = self.model.layers
        return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)

    def moe_layers(self) -> list[nn.Module]:
        """The MoE blocks of this module's layers, in layer order: each model family defines which they are."""
        raise NotImplementedError(f"{type(self).__name__} does not define moe_layers()")

    def router_stats(self, *, require_grad: bool = False) -> list:
        """Router statistics of the last forward, one ``RouterStats`` per MoE layer (in layer order; [] for a
        model without MoE layers), weighted by the rows' multiplicities.

        "The last forward" is the last call of this module's forward, whatever its grad mode: a forward under
        ``torch.no_grad()`` or ``torch.inference_mode()`` (old or reference log-probs, evaluation, each
        decoding step of ``harts.models.common.generate``) replaces the statistics like any other, and its
        ``z_loss`` / ``P_E`` carry no graph. So read them right after the forward they belong to (before its
        backward, as the trainer does per microbatch); ``moe_counts`` and ``update_expert_bias`` read the same
        statistics. A recomputation inside backward (activation checkpointing) keeps the forward's.
        ``require_grad=True`` raises if the statistics have no graph (they came from a forward without grad),
        for code that adds ``z_loss`` or ``P_E`` to a loss. Before any forward this raises."""
        stats = [m.last_stats for m in self.moe_layers()]
        if any(s is None for s in stats):
            raise RuntimeError(f"{type(self).__name__}.router_stats(): no forward has run yet; call the model "
                               "(model(...) or model.logprobs(batch)) first")
        if require_grad and stats and not stats[0].z_loss.requires_grad:
            raise RuntimeError(f"{type(self).__name__}.router_stats(require_grad=True): the last forward ran "
                               "without grad (torch.no_grad / inference_mode); run the forward with grad enabled")
        return stats

    def moe_counts(self) -> torch.Tensor:
        """[MoE layers, E] multiplicity-weighted expert assignment counts of the last forward, whatever its
        grad mode (see ``router_stats``; what the expert-bias update consumes; all-reduce over DP before using
        them). [0, E] for a model without MoE layers; raises before any forward."""
        stats = self.router_stats()
        if not stats:
            return torch.zeros(0, self.config.num_experts)
        return torch.stack([s.counts_E for s in stats])


def _chunk_logprobs_entropy(h_BD: torch.Tensor, weight_VD: torch.Tensor, targets_B: torch.Tensor):
    """log-probs of the targets and entropies of B rows from their fp32+ logits."""
    logits_BV = torch.nn.functional.linear(h_BD, weight_VD).to(torch.promote_types(h_BD.dtype, torch.float32))
    lse_B = torch.logsumexp(logits_BV, dim=-1)
    logp_BV = logits_BV - lse_B[:, None]
    entropy_B = -(logp_BV.exp() * logp_BV).sum(-1)
    return logp_BV.gather(1, targets_B[:, None]).squeeze(1), entropy_B
